"""The one record a D-Cut runner publishes: what the Python API, the CLI benchmarks, the Serve replica's
report, its metrics and the controller read. It crosses vLLM's RPC as JSON (``model_dump(mode="json")``)
and is validated back on the other side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dcut.cost_table import Fingerprint
from dcut.learned import LearnedState
from dcut.settings import DCutSettings

# Where the cost table came from: not loaded yet, handed in (a path), the fingerprint's cache (a path),
# profiled at start, or none at all (the fallback keep ratio decides).
CostSource = Literal["pending", "given", "cache", "profiled", "fallback"]


@dataclass(frozen=True)
class ThroughputEstimate:
    """Predicted steady state at one batch size (``dcut.telemetry.throughput_by_batch_size``)."""

    batch_size: int
    tokens_per_step: float
    step_ms: float
    tokens_per_s: float
    request_tokens_per_s: float  # per request: the latency side


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WindowSummary(_Record):
    """`dcut.telemetry.StepWindow.summary`: the recent steps."""

    steps: int = 0
    mean_keep_ratio: float | None = None
    mean_accepted_length: float | None = None
    keep_ratio_histogram: list[int] = Field(default_factory=list)
    position_acceptance: list[float | None] = Field(default_factory=list)
    acceptance_curve: list[float] = Field(default_factory=list)
    batch_size_histogram: dict[int, int] = Field(default_factory=dict)
    mean_step_ms: dict[int, float] = Field(default_factory=dict)
    fallback_steps: int = 0
    width_histogram: dict[int, int] = Field(default_factory=dict)
    probe_steps: int = 0
    mean_verify_ms: float | None = None
    mean_draft_ms: float | None = None


class Totals(_Record):
    """`dcut.telemetry.StepTotals`: counts over every step since start (or the last reset). Two readings give
    the mean accepted length and keep ratio of what ran between them (``loadtest``: one load point)."""

    steps: int = 0
    request_steps: int = 0
    proposed: int = 0
    kept: int = 0
    accepted: int = 0
    keep_ratio_sum: float = 0.0
    keep_ratio_steps: int = 0


class Overhead(_Record):
    """`dcut.overhead.EngineOverhead`: the engine's time outside the model, ``a + b x tokens``."""

    per_step_ms: float
    per_token_ms: float


class DCutSnapshot(_Record):
    settings: DCutSettings
    fingerprint: Fingerprint
    cost_source: CostSource
    cost_path: str | None = Field(None, description="The table's file when given or from the cache.")
    steps: int = Field(description="Steps recorded since start (or the last reset).")
    window: WindowSummary
    totals: Totals = Field(default_factory=Totals)
    selection_us_median: float | None = None
    estimates: list[ThroughputEstimate] = Field(default_factory=list)
    overhead: Overhead
    cost_table: dict[str, Any] | None = Field(None, description="`CostTable.to_json` of the live table.")
    width_realized: dict[str, dict[str, float]] | None = Field(
        None, description="Mode joint: measured tokens/s per 'bucket/width' (`RealizedRates.summary`).")
    speed_shifts: dict[int, int] | None = Field(
        None, description="Mode joint: changes of the machine's speed noticed per batch-size bucket "
                          "(`RealizedRates.shifts`); each sent the bucket's other widths back to be measured.")
    width_observations: dict[int, int] | None = None
    width_survival: dict[int, list[float]] | None = None
    request_history: dict[str, float | int | bool | None] | None = Field(
        None, description="Mode joint: `RequestHistory.summary`: whether each request's recent blocks steer D-Cut.")
    calibration: dict[int, dict[str, Any]] | None = Field(
        None, description="Per drafted width: `Calibrator.reliability`.")
    learned: LearnedState | None = Field(None, description="Mode joint: what a replica starting after this one "
                                         "can start from (`dcut.learned`).")
    cost_table_s: float | None = Field(None, description="Seconds the engine took to load or profile its cost "
                                       "table at start (None before it did).")
    compile_s: float | None = Field(None, description="Seconds vLLM reported compiling the target and drafter at start "
                                    "(its CompilationTimes; None where it did not say).")

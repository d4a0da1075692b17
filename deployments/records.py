"""Records that cross deployment boundaries (replica -> controller -> ingress/autoscaler)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from dcut.snapshot import DCutSnapshot

# Keys of record_autoscaling_stats(); the autoscaling policy reads them back.
CAPACITY_KEY = "capacity_tokens_per_s"
DEMAND_KEY = "demand_tokens_per_s"


class EngineLoad(BaseModel):
    """What the replica sees of its own engine."""

    ongoing_requests: int = 0  # in the replica (rendering, queued or inside the engine)
    engine_requests: int = 0  # inside vLLM's engine
    generated_tokens_total: int = 0
    aborted_total: int = 0
    failed_total: int = 0
    tokens_per_s: float = 0.0


class ReplicaReport(BaseModel):
    """One replica's telemetry, sent to the controller every ``telemetry_interval_s``."""

    replica_id: str
    served_model_name: str
    fingerprint: str = Field(description="dcut.cost_table.Fingerprint.key() of the engine.")
    start_seconds: float
    sent_at: float
    load: EngineLoad
    capacity_tokens_per_s: float
    capacity_from: Literal["estimates", "default"]
    demand_tokens_per_s: float
    dcut: DCutSnapshot | None = Field(None, description="The engine's D-Cut snapshot; None with D-Cut off.")


class CostTableOffer(BaseModel):
    """The controller's answer to a starting replica."""

    action: Literal["use", "profile", "wait"]
    table: dict | None = None

"""Records that cross deployment boundaries (replica -> controller -> ingress/autoscaler)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from dcut.snapshot import DCutSnapshot
from dcut.speculation import AcceptanceHistogram

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
    continued_total: int = 0  # requests taken over from a replica that died (deployments.continuation)
    tokens_per_s: float = 0.0


class SpecExitStats(BaseModel):
    """What SpecExit did in an engine since it started (``dcut.vllm.specexit.RunnerSpecExit.stats``)."""

    settings: dict
    requests: int = 0  # requests SpecExit watched
    exits: int = 0  # thinking sections it ended
    reasoning_tokens: int = 0  # generated while thinking, by those requests
    predicted_saved_tokens: float = 0.0  # the head's remaining-tokens estimate at each exit, summed
    thinking_now: int = 0


# Where a replica's cost table came from: the controller's offer (another replica's, merged), or the engine's
# own choice (``dcut.snapshot.CostSource``: a configured file, the fingerprint's cache, a profile, none).
CostTableFrom = Literal["controller", "given", "cache", "profiled", "fallback"]


class StartupPhases(BaseModel):
    """How long one replica took to start, in consecutive wall-clock phases that sum to ``total_s``:

    process created -> replica constructor entered (``process_s``) -> engine library imported (``import_s``)
    -> engine fingerprint resolved (``fingerprint_s``) -> the controller's cost-table offer (``cost_offer_s``)
    -> engine ready: built and its first health check passed (``engine_init_s``) -> first report accepted by
    the controller (``first_report_s``). ``compile_s`` and ``cost_table_s`` are parts of ``engine_init_s``
    where the engine says them (None where it does not)."""

    model_config = ConfigDict(frozen=True)

    process_started_at: float = Field(description="Unix time the replica's process was created.")
    process_s: float = Field(ge=0.0, description="Process created -> replica constructor: Ray's worker start, "
                             "Serve's replica set-up, the deployment's own imports (and a pre-started worker's "
                             "idle wait, where Ray reused one).")
    import_s: float = Field(ge=0.0, description="The engine's library imported (vLLM), `Engine.import_library`.")
    fingerprint_s: float = Field(ge=0.0, description="The engine's fingerprint: vLLM's config of the engine, "
                                 "built before the engine to ask the controller for its cost table.")
    cost_offer_s: float = Field(ge=0.0, description="Asking the controller for the fingerprint's cost table, "
                                "including any wait for another replica's profile (0 with D-Cut off).")
    engine_init_s: float = Field(ge=0.0, description="Engine built (weights, KV cache, compile, warm-up, D-Cut's "
                                 "cost table) until its first health check passed.")
    first_report_s: float | None = Field(None, ge=0.0, description="Engine ready -> the first report accepted by "
                                         "the controller; None until then (or with no controller).")
    total_s: float | None = Field(None, ge=0.0, description="Process created -> first report accepted; "
                                  "None until then.")
    compile_s: float | None = Field(None, ge=0.0, description="Of engine_init_s: the engine's compilation, "
                                    "where it says (None otherwise).")
    cost_table_s: float | None = Field(None, ge=0.0, description="Of engine_init_s: D-Cut loading or profiling "
                                       "its cost table, where the plugin says (None otherwise).")
    cost_table_source: CostTableFrom | None = Field(None, description="None with D-Cut off.")

    def ready_s(self) -> float:
        """Process created -> engine ready."""
        return self.process_s + self.import_s + self.fingerprint_s + self.cost_offer_s + self.engine_init_s

    def line(self) -> str:
        """The phases in one line of a log."""
        def s(x: float | None) -> str:
            return "?" if x is None else f"{x:.1f} s"

        source = self.cost_table_source or "D-Cut off"
        return (f"process {s(self.process_s)}, import {s(self.import_s)}, fingerprint {s(self.fingerprint_s)}, "
                f"cost table offer {s(self.cost_offer_s)}, engine {s(self.engine_init_s)} (compile "
                f"{s(self.compile_s)}, cost table {s(self.cost_table_s)}; table from {source}), first report "
                f"{s(self.first_report_s)}")


class ReplicaReport(BaseModel):
    """One replica's telemetry, sent to the controller every ``telemetry_interval_s``."""

    replica_id: str
    served_model_name: str
    node_id: str | None = Field(None, description="The Ray node the replica runs on (None outside Ray).")
    pid: int | None = Field(None, description="The replica's process id on its node.")
    fingerprint: str = Field(description="dcut.cost_table.Fingerprint.key() of the engine.")
    start_seconds: float
    sent_at: float
    interval_s: float = Field(gt=0.0, description="How often this replica reports: the controller forgets it "
                              "after ControllerSettings.stale_after_reports of these without a report.")
    load: EngineLoad
    capacity_tokens_per_s: float = Field(description="Objective tokens/s it can serve: the latency objective x the "
                                         "most requests it runs at once at that rate (dcut.telemetry.capacity).")
    capacity_from: Literal["estimates", "default"]
    demand_tokens_per_s: float
    dcut: DCutSnapshot | None = Field(None, description="The engine's D-Cut snapshot; None with D-Cut off.")
    specexit: SpecExitStats | None = Field(None, description="SpecExit's counters; None with SpecExit off.")
    startup: StartupPhases | None = Field(None, description="How the replica started; complete (first_report_s "
                                          "and total_s set) from the report after its first accepted one.")
    acceptance: AcceptanceHistogram | None = Field(None, description="Per-request acceptance rates of the "
                                                   "responses it served, by route (dcut.speculation).")


class CostTableOffer(BaseModel):
    """The controller's answer to a starting replica."""

    action: Literal["use", "profile", "wait"]
    table: dict | None = None
    learned: dict | None = None  # `dcut.learned.LearnedState` merged over the fingerprint's replicas, with "use"


ScalingRule = Literal["no_estimates", "cold", "up", "down", "floor", "hold"]


class ScalingDecision(BaseModel):
    """One evaluation of `deployments.autoscaling.DCutPolicy`: the count it asked for and why. Serve then
    applies min/max replicas (``bounded``) and the up/down delays."""

    model_config = ConfigDict(frozen=True)

    at: float = Field(description="Unix time of the evaluation.")
    replicas: int = Field(description="Serve's target replica count when the policy ran.")
    desired: int
    bounded: int = Field(description="``desired`` within min/max replicas.")
    rule: ScalingRule
    demand_tokens_per_s: float = 0.0
    capacity_per_replica: float = 0.0
    utilization: float = 0.0
    target_utilization: float
    hysteresis: float
    queued_requests: float = 0.0

    @computed_field
    @property
    def reason(self) -> str:
        """The rule in words, with the figures it compared."""
        low = self.target_utilization * (1 - self.hysteresis)
        u, t, n = f"{self.utilization:.0%}", f"{self.target_utilization:.0%}", self.desired
        text = {
            "no_estimates": f"no capacity estimate yet: hold {n}",
            "cold": f"no replica running, {self.demand_tokens_per_s:.0f} tok/s asked: start {n}",
            "up": f"utilisation {u} above the {t} target: up to {n}",
            "down": f"utilisation {u} below {low:.0%}: down to {n}",
            "floor": f"utilisation {u} below {low:.0%}, but {n} is the fewest that serve the demand",
            "hold": f"utilisation {u} within {low:.0%}..{t}: hold {n}",
        }[self.rule]
        return text if self.bounded == self.desired else f"{text} (bounds keep {self.bounded})"


class ScalingLog(BaseModel):
    """What the policy publishes for the controller: its latest evaluation and its recent changes of mind."""

    latest: ScalingDecision | None = None
    changes: list[ScalingDecision] = Field(default_factory=list)

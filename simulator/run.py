"""One simulated run: replicas that report what a real one would (capacity from a committed cost table and
acceptance curve, demand from the requests they hold), the real `DCutPolicy` called every control tick with a
real `AutoscalingContext`, and the scores of how Serve's target followed the demand."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict
from ray.serve._private.common import ReplicaID
from ray.serve._private.constants import CONTROL_LOOP_INTERVAL_S
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from dcut import telemetry
from dcut.cost_table import CostTable, StepCost
from dcut.settings import DCutSettings
from deployments.autoscaling import DCutPolicy, replicas_needed
from deployments.records import CAPACITY_KEY, DEMAND_KEY
from deployments.settings import AutoscalingSettings, EngineReplicaSettings
from simulator.serve import DEPLOYMENT, Cohort, Fleet, MetricStream, metric_intervals, serve_decision
from simulator.traces import Trace, TraceName

# engine start-up of the deep pair, measured (docs/experiments/2026-12-01-sweep-deep/sweep.json: engine_startup_s)
STARTUP_S = 45.4
WITHIN = 0.10  # "reached": within 10% of the replicas the demand needs
QUEUED, TOTAL = "queued", "total"  # the handle's series: requests it queues, and all it holds


class ReplicaModel(BaseModel):
    """What one simulated replica reports, and how long it takes to start."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    capacity_tokens_per_s: float
    default_capacity_tokens_per_s: float
    estimates_after_s: float  # reports the default until then: the first telemetry read finds no steps yet
    request_tokens_per_s: float
    max_ongoing_requests: int
    max_num_seqs: int
    startup_s: float = STARTUP_S


def replica_capacity(table: CostTable, acceptance: Sequence[float], max_num_seqs: int,
                     request_tokens_per_s: float) -> float:
    """Tokens/s a replica reports at the latency objective, as `EngineReplica.capacity()` computes it from
    ``RunnerDCut.estimates()`` (its non-joint branch, in mode ``reference``: D-Cut's default when the committed
    simulations were made): such a replica profiles no batch size over max_num_seqs."""
    sizes = [b for b in sorted(table.points) if b <= max_num_seqs]
    estimates = telemetry.throughput_by_batch_size(sizes, acceptance, DCutSettings(mode="reference"),
                                                   StepCost(table, table.fingerprint.k))
    if not estimates:
        raise ValueError(f"the cost table has no batch size <= max_num_seqs ({max_num_seqs})")
    return telemetry.capacity(estimates, request_tokens_per_s, max_num_seqs)


def full_mode_acceptance(sweep: dict, batch_size: int) -> list[float]:
    """The acceptance curve (P(a prefix of t + 1 drafts is accepted), non-increasing) measured in mode full at the
    batch size nearest ``batch_size``: with every draft verified, position acceptance is that curve."""
    rows = [r for r in sweep.get("results", []) if r.get("mode") == "full" and r.get("per_position_acceptance")]
    if not rows:
        raise ValueError("the sweep has no mode=full row with per_position_acceptance")
    row = min(rows, key=lambda r: abs(r["bs"] - batch_size))
    curve, low = [], 1.0
    for rate in row["per_position_acceptance"]:
        low = min(low, rate or 0.0)
        curve.append(low)
    return curve


def load_settings(config: Path) -> tuple[EngineReplicaSettings, int]:
    """The engine replica's settings and the engine's max_num_seqs from an app config's first application."""
    args = yaml.safe_load(config.read_text())["applications"][0]["args"]
    return EngineReplicaSettings.model_validate(args.get("engine_replica", {})), int(args["engine"]["max_num_seqs"])


class Scores(BaseModel):
    """How one run followed the demand (definitions: docs/experiments/2026-12-01-autoscaling/README.md)."""

    decision_period_s: float  # Serve's metric push interval: new evidence to decide on comes this often
    reaction_s: float | None = None  # step: Serve's target within 10% of the replicas the demand needs
    ready_reaction_s: float | None = None  # step: the ready replicas within 10% of those needed
    over_provisioning_pct: float
    under_provisioning_pct: float
    unserved_pct: float
    cost_vs_minimum: float
    direction_changes: int
    ideal_direction_changes: int
    flaps: int
    hours: float


class Series(BaseModel):
    """The run sampled for plots."""

    t_s: list[int]
    ideal: list[int]
    target: list[int]
    ready: list[int]


class RunResult(BaseModel):
    trace: TraceName
    fleet: int
    knobs: dict[str, float]
    phase_s: int
    scores: Scores
    series: Series | None = None


def knobs_of(settings: AutoscalingSettings) -> dict[str, float]:
    return {k: float(getattr(settings, k)) for k in ("target_utilization", "hysteresis", "upscale_delay_s",
                                                     "downscale_delay_s")}


class _Demand:
    """What the handle and a replica record at time ``t``: the trace's requests, spread evenly over the serving
    replicas up to ``max_ongoing_requests`` each, the rest queued at the handle."""

    def __init__(self, requests: np.ndarray, replica: ReplicaModel):
        self.requests, self.replica = requests, replica
        self.serving = 0

    def _total(self, t: float) -> float:
        return float(self.requests[min(max(int(t), 0), len(self.requests) - 1)])

    def _ongoing(self, t: float) -> float:
        return min(self._total(t) / self.serving, self.replica.max_ongoing_requests) if self.serving else 0.0

    def handle(self, t: float) -> dict[str, float]:
        total = self._total(t)
        return {QUEUED: total - self._ongoing(t) * self.serving, TOTAL: total}

    def replica_since(self, ready_at: float) -> Callable[[float], dict[str, float]]:
        """`EngineReplica.record_autoscaling_stats()` of a replica ready at ``ready_at``."""
        def sample(t: float) -> dict[str, float]:
            ongoing = self._ongoing(t)
            running = min(ongoing, self.replica.max_num_seqs)
            fresh = t - ready_at <= self.replica.estimates_after_s
            capacity = self.replica.default_capacity_tokens_per_s if fresh else self.replica.capacity_tokens_per_s
            return {CAPACITY_KEY: capacity,
                    DEMAND_KEY: telemetry.demand(running, ongoing - running, self.replica.request_tokens_per_s)}
        return sample


def simulate(trace: Trace, fleet: int, settings: AutoscalingSettings, replica: ReplicaModel,
             reference_utilization: float, control_period_s: float = CONTROL_LOOP_INTERVAL_S, phase_s: int = 1,
             keep_series: bool = False) -> RunResult:
    """Replay ``trace`` for a fleet that needs ``fleet`` replicas at the trace's 1.0 and the
    ``reference_utilization`` (fixed across knob settings: every setting faces the same demand). ``phase_s``: the
    handle's metric push falls ``phase_s`` seconds before each multiple of the push interval."""
    config = AutoscalingConfig(**settings.serve_config())
    policy = DCutPolicy(**config.policy.policy_kwargs)
    cap = replica.capacity_tokens_per_s
    demand_at_full = fleet * cap * reference_utilization
    demand = _Demand(trace.fraction * demand_at_full / replica.request_tokens_per_s, replica)
    _, push_s, _ = metric_intervals(config)
    replicas = Fleet(config, replica.startup_s, replica.estimates_after_s)
    initial = int(ideal_replicas(trace.fraction[:1], demand_at_full, cap, settings)[0])
    sizes = np.diff(np.linspace(0, initial, min(initial, 8) + 1).round().astype(int))
    for k, size in enumerate(sizes):  # a fleet that has run for a while: its metric tasks in every phase
        replicas.start(int(size), -push_s * (k + 1) / len(sizes), startup_s=0.0)
    handle = MetricStream(-float(phase_s), *metric_intervals(config))
    target, policy_state = initial, {}
    rows: list[tuple[int, int, int]] = []  # each second: target, alive, ready
    for tick in range(round(trace.duration_s / control_period_s)):
        now = tick * control_period_s
        ready = replicas.ready(now)
        demand.serving = sum(len(c.ids) for c in ready)
        handle.advance(now, demand.handle)
        for c in ready:
            c.stream.advance(now, demand.replica_since(c.ready_at))
        ctx = controller_context(config, ready, handle, target, policy_state, now)
        target, policy_state = serve_decision(policy, ctx)
        if target > replicas.alive:
            replicas.start(target - replicas.alive, now)
        elif target < replicas.alive:
            replicas.stop(replicas.alive - target)
        while len(rows) <= now:  # one row a second, whatever the tick
            rows.append((target, replicas.alive, demand.serving))
        replicas.merge_settled(now)
    return RunResult(trace=trace.name, fleet=fleet, knobs=knobs_of(settings), phase_s=phase_s,
                     scores=score(trace, np.array(rows), settings, cap, demand_at_full, push_s),
                     series=_series(trace, np.array(rows), settings, cap, demand_at_full) if keep_series else None)


def controller_context(config: AutoscalingConfig, ready: list[Cohort], handle: MetricStream, target: int,
                       policy_state: dict, now: float) -> AutoscalingContext:
    """The `AutoscalingContext` ``DeploymentAutoscalingState.get_autoscaling_context`` builds: per-replica
    aggregates and raw series of the replicas that have pushed, the handle's queued and total requests."""
    aggregated: dict[str, dict[ReplicaID, float]] = {CAPACITY_KEY: {}, DEMAND_KEY: {}}
    raw: dict[str, dict[ReplicaID, list]] = {CAPACITY_KEY: {}, DEMAND_KEY: {}}
    for c in ready:
        if CAPACITY_KEY not in c.stream.pushed:
            continue
        for key in aggregated:
            aggregated[key].update(c.per_replica(c.stream.value(key, now)))
            raw[key].update(c.per_replica(c.stream.pushed[key]))
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name=DEPLOYMENT.name, app_name=DEPLOYMENT.app_name,
        current_num_replicas=sum(len(c.ids) for c in ready), target_num_replicas=target,
        running_replicas=[i for c in ready for i in c.ids], total_num_requests=handle.value(TOTAL, now) or 0.0,
        total_queued_requests=handle.value(QUEUED, now) or 0.0, aggregated_metrics=aggregated, raw_metrics=raw,
        capacity_adjusted_min_replicas=config.min_replicas, capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=policy_state, last_scale_up_time=None, last_scale_down_time=None, current_time=now,
        config=config)


def ideal_replicas(fraction: np.ndarray, demand_at_full: float, capacity: float, settings: AutoscalingSettings
                   ) -> np.ndarray:
    """The replicas the demand needs at the target utilisation, within min/max: the policy's own formula fed the
    true demand and capacity, with no lag."""
    return np.array([min(max(replicas_needed(f * demand_at_full, capacity, settings.target_utilization),
                             settings.min_replicas), settings.max_replicas) for f in fraction])


def direction_changes(counts: np.ndarray) -> int:
    """Reversals of a replica count: up then down, or down then up (holds in between do not count)."""
    steps = np.sign(np.diff(counts))
    steps = steps[steps != 0]
    return int(np.count_nonzero(steps[1:] != steps[:-1]))


def reaction_time(counts: np.ndarray, needed: int, since_s: int) -> float | None:
    """Seconds after ``since_s`` until ``counts`` (one a second) first comes within 10% of ``needed``."""
    close = np.flatnonzero(np.abs(counts[since_s:] - needed) <= WITHIN * needed)
    return float(close[0]) if len(close) else None


def score(trace: Trace, rows: np.ndarray, settings: AutoscalingSettings, capacity: float, demand_at_full: float,
          decision_period_s: float) -> Scores:
    """``rows``: target, alive and ready replicas each second."""
    n = min(len(rows), trace.duration_s)
    target, alive, ready = rows[:n, 0], rows[:n, 1], rows[:n, 2]
    ideal = ideal_replicas(trace.fraction[:n], demand_at_full, capacity, settings)
    demand = trace.fraction[:n] * demand_at_full
    changes = direction_changes(target)
    ideal_changes = direction_changes(ideal_replicas(trace.smooth[:n], demand_at_full, capacity, settings))
    scores = Scores(
        decision_period_s=decision_period_s,
        over_provisioning_pct=100 * np.maximum(alive - ideal, 0).sum() / ideal.sum(),
        under_provisioning_pct=100 * np.maximum(ideal - ready, 0).sum() / ideal.sum(),
        unserved_pct=100 * np.maximum(demand - ready * capacity, 0).sum() / max(demand.sum(), 1e-9),
        cost_vs_minimum=alive.sum() / max((demand / capacity).sum(), 1e-9),
        direction_changes=changes, ideal_direction_changes=ideal_changes, flaps=max(changes - ideal_changes, 0),
        hours=n / 3600)
    if trace.step_at_s is not None:
        needed = int(ideal[trace.step_at_s])
        scores.reaction_s = reaction_time(target, needed, trace.step_at_s)
        scores.ready_reaction_s = reaction_time(ready, needed, trace.step_at_s)
    return scores


def _series(trace: Trace, rows: np.ndarray, settings: AutoscalingSettings, capacity: float,
            demand_at_full: float) -> Series:
    n = min(len(rows), trace.duration_s)
    every = max(1, n // 1000)
    ideal = ideal_replicas(trace.fraction[:n:every], demand_at_full, capacity, settings)
    return Series(t_s=list(range(0, n, every)), ideal=ideal.tolist(), target=rows[:n:every, 0].tolist(),
                  ready=rows[:n:every, 2].tolist())

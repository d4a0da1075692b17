"""Ray Serve 2.60's side of autoscaling, on a simulated clock: how metrics reach the controller, how the target
follows from a custom policy, which replicas start and stop. Ray's own pieces where they are pure, composed as Ray
composes them; each reproduction names the Ray function it mirrors."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve._private.constants import RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR
from ray.serve._private.metrics_utils import (
    InMemoryMetricsStore,
    TimeStampedValue,
    aggregate_timeseries,
    merge_instantaneous_total,
)
from ray.serve.autoscaling_policy import (
    _apply_delay_logic,
    _apply_scaling_factors,
    _extract_internal_policy_state,
    _get_cold_start_scale_up_replicas,
)
from ray.serve.config import AggregationFunction, AutoscalingConfig, AutoscalingContext

T = TypeVar("T")
DEPLOYMENT = DeploymentID(name="EngineReplica", app_name="dcut")
STARTUP_SPREAD = 0.15  # measured engine start-ups range 39.1-45.7 s: one scale-up's replicas get ready over +-15%
START_GROUPS = 8  # a scale-up's replicas get ready in this many groups, spread over STARTUP_SPREAD


class MetricStream:
    """One metric source (a replica or a handle) as Serve moves its samples: recorded into Ray's
    `InMemoryMetricsStore` every ``record_s``, pushed every ``push_s`` after pruning the store to ``look_back_s``
    (``ReplicaMetricsManager._push_autoscaling_metrics``), and read by the controller as the time-weighted average
    of the pushed series with its last sample carried to now
    (``DeploymentAutoscalingState._merge_and_aggregate_timeseries``). Both tasks start with the source, the push
    first (``MetricsPusher`` runs a task at once, then every interval; the push task is registered first)."""

    def __init__(self, start: float, record_s: float, push_s: float, look_back_s: float):
        self.store = InMemoryMetricsStore()
        self.record_s, self.push_s, self.look_back_s = record_s, push_s, look_back_s
        self.next_record, self.next_push = start, start
        self.pushed: dict[str, list[TimeStampedValue]] = {}

    def advance(self, now: float, sample: Callable[[float], dict[str, float]]) -> None:
        """Run the record and push tasks due by ``now``, in time order."""
        while min(self.next_record, self.next_push) <= now:
            if self.next_push <= self.next_record:
                self.store.prune_keys_and_compact_data(self.next_push - self.look_back_s)
                self.pushed = {k: merge_instantaneous_total([list(v)]) for k, v in self.store.data.items() if v}
                self.next_push += self.push_s
            else:
                self.store.add_metrics_point(sample(self.next_record), self.next_record)
                self.next_record += self.record_s

    def value(self, key: str, now: float) -> float | None:
        """The controller's aggregate of ``key`` at ``now``; None before the first push carrying it."""
        series = self.pushed.get(key)
        if not series:
            return None
        last_window_s = now - series[-1].timestamp
        return aggregate_timeseries(series, AggregationFunction.MEAN, last_window_s if last_window_s > 0 else 1e-3)


def metric_intervals(config: AutoscalingConfig) -> tuple[float, float, float]:
    """(record, push, look-back) seconds of every metric source, as ``ReplicaMetricsManager.start_metrics_pusher``
    and the router's pusher set them (``metrics_interval_s`` is the push interval: the
    ``RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S`` variables are read by nothing in Ray 2.60)."""
    look_back = config.look_back_period_s
    record = min(look_back * RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR, config.metrics_interval_s)
    return record, config.metrics_interval_s, look_back


def serve_decision(policy: Callable, ctx: AutoscalingContext) -> tuple[int, dict]:
    """The target Serve sets from a custom policy: ``_apply_autoscaling_config``'s wrapper (cold start, scaling
    factors, delays) and ``DeploymentAutoscalingState.get_decision_num_replicas`` (float ceiling, ``apply_bounds``).
    Ray's own pieces composed as Ray does, except that the delay logic is handed the simulated clock (Ray's
    ``_apply_default_params`` lets it read ``time.time()``)."""
    cold = _get_cold_start_scale_up_replicas(ctx)
    if cold is not None:
        final, state = cold, ctx.policy_state
    else:
        internal = _extract_internal_policy_state(ctx.policy_state)
        desired, state = policy(ctx)
        desired = _apply_scaling_factors(desired, ctx.current_num_replicas, ctx.config)
        if ctx.current_num_replicas == 0 and desired > 0:
            final = desired
        else:
            final, internal = _apply_delay_logic(max(0, desired), ctx.target_num_replicas, ctx.config, internal,
                                                 _now=ctx.current_time)
        state.update(internal)
    final = math.ceil(final) if isinstance(final, float) else final
    return max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, final)), state


@dataclass
class Cohort:
    """Replicas that got ready at the same second: same metric phase, same history, so the same reports."""

    ids: list[ReplicaID]
    ready_at: float
    stream: MetricStream
    _keys: dict[ReplicaID, None] = field(default_factory=dict)

    def per_replica(self, value: T) -> dict[ReplicaID, T]:
        """``value`` for each replica, keyed as the controller keys its metrics. Built from a cached dict of the ids:
        ``dict.fromkeys`` of a dict reuses the stored hashes (``ReplicaID.__hash__`` is Python code)."""
        if not self._keys:
            self._keys = dict.fromkeys(self.ids)
        return dict.fromkeys(self._keys, value)

    def shrink(self, n: int) -> None:
        """Stop the newest ``n`` of these replicas."""
        del self.ids[len(self.ids) - n:]
        self._keys = {}

    def absorb(self, other: Cohort) -> None:
        self.ids.extend(other.ids)
        self._keys = {}


@dataclass
class Fleet:
    """The deployment's replicas as Serve's deployment state holds them; a started replica is ready (running,
    serving, reporting) ``startup_s`` later."""

    config: AutoscalingConfig
    startup_s: float
    warm_up_s: float  # how long a fresh replica's reports differ from the others'
    cohorts: list[Cohort] = field(default_factory=list)
    _ids: itertools.count = field(default_factory=itertools.count)

    @property
    def alive(self) -> int:
        return sum(len(c.ids) for c in self.cohorts)

    def ready(self, now: float) -> list[Cohort]:
        return [c for c in self.cohorts if c.ready_at <= now]

    def start(self, n: int, now: float, startup_s: float | None = None) -> None:
        """Start ``n`` replicas, ready over the measured spread of start-ups, at whole seconds (so that replicas
        whose metric tasks share a phase can be folded together by `merge_settled`)."""
        groups = min(n, START_GROUPS)
        sizes = np.diff(np.linspace(0, n, groups + 1).round().astype(int))
        for i, size in enumerate(sizes):
            delay = self.startup_s * (1 + STARTUP_SPREAD * (2 * (i + 0.5) / groups - 1)) if startup_s is None \
                else startup_s
            ready_at = float(math.ceil(now + delay))
            ids = [ReplicaID(unique_id=f"r{next(self._ids)}", deployment_id=DEPLOYMENT) for _ in range(size)]
            self.cohorts.append(Cohort(ids, ready_at, MetricStream(ready_at, *metric_intervals(self.config))))

    def stop(self, n: int) -> None:
        """Stop ``n`` replicas as ``DeploymentScheduler._get_replicas_to_stop`` chooses: those not running first,
        then the newest."""
        for cohort in sorted(self.cohorts, key=lambda c: c.ready_at, reverse=True):
            take = min(n, len(cohort.ids))
            cohort.shrink(take)
            n -= take
            if n == 0:
                break
        self.cohorts = [c for c in self.cohorts if c.ids]

    def merge_settled(self, now: float) -> None:
        """Fold together cohorts of one metric phase whose stores hold only samples taken after their warm-up:
        they record and push the same values at the same times, so a 500-replica fleet costs a few cohorts per
        control tick, not 500 streams."""
        _, push, look_back = metric_intervals(self.config)
        settled = now - self.warm_up_s - 2 * look_back - push
        first_of_phase: dict[float, Cohort] = {}
        kept = []
        for c in self.cohorts:
            phase = c.ready_at % push
            if c.ready_at <= settled and phase in first_of_phase:
                first_of_phase[phase].absorb(c)
                continue
            if c.ready_at <= settled:
                first_of_phase[phase] = c
            kept.append(c)
        self.cohorts = kept

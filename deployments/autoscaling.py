"""Replicas from D-Cut throughput estimates, not queue length alone.

Each replica's ``record_autoscaling_stats()`` reports its capacity (tokens/s it can deliver at the
latency objective, from its cost table and live acceptance) and its demand (tokens/s asked of it now).
Requests still queued at the handles add ``queued x request rate`` to the demand. Then

    desired = ceil(demand / (capacity per replica x target_utilization))

scaling up as soon as utilisation passes the target, down only once it falls below
``target x (1 - hysteresis)``, and then to the count nearest the middle of that dead band (never fewer than
``desired``), so that demand has room to move both ways before the next change. Serve's wrapper applies
min/max replicas and the up/down delays.

Each evaluation is a `ScalingDecision` with its rule; the policy publishes the latest one and its recent
changes of mind (`publish`) for the D-Cut controller's status page (`read_log`).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

# Private API, kept on purpose: Ray 2.60 has no public way for an autoscaling policy, which Serve calls inside its
# controller actor, to hand data to another actor. What the policy returns beside the replica count
# (`policy_state`) stays in Serve's controller: neither `serve.status()` nor the REST details show it.
# `DeploymentDetails.autoscaling_detail` (`ray.serve.schema`, alpha) is declared, but nothing in 2.60 fills it
# or lets a policy write it. `serve.get_deployment_actor` works only inside a replica, not in the controller. A
# `DeploymentHandle` made inside Serve's controller would learn its replicas by long-polling that same controller.
# A named actor owned by the D-Cut controller would work with public calls, but costs a worker process for a log
# of a few KB, needs its own lifetime across controller restarts, and its lookup is a GCS call like this put.
# Ray core has no public key-value store. `internal_kv` is the GCS store Serve itself keeps its checkpoints in;
# only `publish` and `read_log` below use it, and `publish` never raises (a failed put costs the status page
# its log, never autoscaling).
from ray.experimental import internal_kv

from deployments.records import CAPACITY_KEY, DEMAND_KEY, ScalingDecision, ScalingLog, ScalingRule

logger = logging.getLogger("ray.serve")


class DCutPolicy:
    """Ray Serve 2.60 class-callable policy; ``policy_kwargs`` from the config reach ``__init__``."""

    def __init__(self, target_utilization: float = 0.7, hysteresis: float = 0.3):
        if not 0 < target_utilization <= 1 or not 0 <= hysteresis < 1:
            raise ValueError("need 0 < target_utilization <= 1 and 0 <= hysteresis < 1")
        self.target_utilization = target_utilization
        self.hysteresis = hysteresis
        self._log = DecisionLog()

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        current = max(ctx.target_num_replicas, 0)
        metrics = ctx.aggregated_metrics or {}
        capacities = [c for c in latest_capacities(ctx.raw_metrics, metrics) if c and c > 0]
        demands = metrics.get(DEMAND_KEY) or {}
        per_replica = sum(capacities) / len(capacities) if capacities else 0.0
        reported = float(sum(demands.values()))
        demand = reported
        queued = float(ctx.total_queued_requests or 0.0)
        if queued > 0:  # queued requests are owed the per-request rate the replicas plan with
            running = max(float(ctx.total_num_requests or 0.0) - queued, 1.0)
            demand += queued * (reported / running if reported else per_replica * self.target_utilization)
        desired, rule = decide(current, demand, per_replica, self.target_utilization, self.hysteresis)
        decision = ScalingDecision(
            at=ctx.current_time, replicas=current, desired=desired,
            bounded=min(max(desired, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas),
            rule=rule, demand_tokens_per_s=demand, capacity_per_replica=per_replica,
            utilization=demand / (per_replica * max(current, 1)) if per_replica else 0.0,
            target_utilization=self.target_utilization, hysteresis=self.hysteresis, queued_requests=queued)
        if self._log.add(decision):
            publish(ctx.app_name, self._log.record())
        return desired, decision.model_dump()


def latest_capacities(raw_metrics: dict | None, aggregated: dict) -> list[float]:
    """Each replica's last reported capacity (``raw_metrics``: the samples of its last push), else its look-back
    mean. A replica reports a default capacity until its first estimates; averaged over the look-back, that default
    understates every freshly started replica for a whole window, so after a large scale-up the policy asked for up
    to a third more replicas than needed (docs/experiments/2026-12-01-autoscaling/). Capacity moves slowly (a cost
    table and a window of steps): the latest figure is the best one; demand keeps the look-back mean, which smooths
    its noise."""
    series = (raw_metrics or {}).get(CAPACITY_KEY)
    if series:
        return [s[-1].value for s in series.values() if s]
    return list((aggregated.get(CAPACITY_KEY) or {}).values())


def replicas_needed(demand: float, capacity_per_replica: float, target_utilization: float) -> int:
    """Replicas that serve ``demand`` tokens/s at the target utilisation (the float slack keeps an exact
    multiple, e.g. 0.1 x 100 / 10, from rounding up to one replica too many)."""
    return math.ceil(demand / (capacity_per_replica * target_utilization) - 1e-9)


def decide(current: int, demand: float, capacity_per_replica: float, target_utilization: float,
           hysteresis: float) -> tuple[int, ScalingRule]:
    """The replica count for ``demand`` tokens/s, with a dead band below the target utilisation, and the
    rule that chose it (the status page shows it as the decision's reason)."""
    if capacity_per_replica <= 0:
        return current, "no_estimates"
    needed = replicas_needed(demand, capacity_per_replica, target_utilization)
    if current <= 0:
        return (max(needed, 1) if demand > 0 else 0), "cold"
    utilization = demand / (capacity_per_replica * current)
    if utilization > target_utilization:
        return max(needed, current), "up"
    low = target_utilization * (1 - hysteresis)
    if utilization < low:
        # Land on the count nearest the middle of the dead band, never below what the target needs: landing on its
        # upper edge (`needed`) let the next upward wiggle of the demand undo the downscale
        # (docs/experiments/2026-12-01-autoscaling/).
        middle = (demand / (capacity_per_replica * target_utilization) + demand / (capacity_per_replica * low)) / 2
        fewer = min(max(math.floor(middle + 0.5), needed, 1), current)
        return fewer, ("down" if fewer < current else "floor")
    return current, "hold"


class DecisionLog:
    """The policy's latest evaluation and its last ``keep`` changes of mind. The policy runs every 0.1 s in
    Serve's controller, so it publishes only a change, or a fresh evaluation every ``refresh_s``."""

    def __init__(self, keep: int = 20, refresh_s: float = 2.0):
        self.changes: deque[ScalingDecision] = deque(maxlen=keep)
        self.latest: ScalingDecision | None = None
        self.refresh_s = refresh_s
        self._published_at = -math.inf

    def add(self, decision: ScalingDecision) -> bool:
        """Keep ``decision``; True when it should be published."""
        self.latest = decision
        last = self.changes[-1] if self.changes else None
        changed = last is None or (last.replicas, last.desired, last.rule) != (
            decision.replicas, decision.desired, decision.rule)
        if changed:
            self.changes.append(decision)
        if changed or decision.at - self._published_at >= self.refresh_s:
            self._published_at = decision.at
            return True
        return False

    def record(self) -> ScalingLog:
        return ScalingLog(latest=self.latest, changes=list(self.changes))


# The policy runs inside Serve's controller, the D-Cut controller in its own replica: Ray's internal key-value
# store (GCS) is the one place both reach without a call between them that could stall Serve's control loop.
_KV_NAMESPACE = "dcut-serve"


def _kv_key(app_name: str) -> str:
    return f"autoscaling/{app_name}"


def publish(app_name: str, log: ScalingLog) -> None:
    """Store ``log`` for ``read_log(app_name)``; a no-op outside a Ray worker (unit tests)."""
    if not internal_kv._internal_kv_initialized():
        return
    try:
        internal_kv._internal_kv_put(_kv_key(app_name), log.model_dump_json(), overwrite=True,
                                     namespace=_KV_NAMESPACE)
    except Exception as e:  # noqa: BLE001 - the status page must never stop autoscaling
        logger.warning("autoscaling decision not published: %s", e)


def read_log(app_name: str) -> ScalingLog:
    """The policy's last published log for ``app_name`` (empty before its first evaluation)."""
    raw = internal_kv._internal_kv_get(_kv_key(app_name), namespace=_KV_NAMESPACE) \
        if internal_kv._internal_kv_initialized() else None
    return ScalingLog.model_validate_json(raw) if raw else ScalingLog()


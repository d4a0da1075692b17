"""Replicas from D-Cut throughput estimates, not queue length alone.

Each replica's ``record_autoscaling_stats()`` reports its capacity (tokens/s it can deliver at the
latency objective, from its cost table and live acceptance) and its demand (tokens/s asked of it now).
Requests still queued at the handles add ``queued x request rate`` to the demand. Then

    desired = ceil(demand / (capacity per replica x target_utilization))

scaling up as soon as utilisation passes the target, down only once it falls below
``target x (1 - hysteresis)``. Serve's wrapper applies min/max replicas and the up/down delays.
"""

from __future__ import annotations

import math
from typing import Any

from deployments.records import CAPACITY_KEY, DEMAND_KEY


class DCutPolicy:
    """Ray Serve 2.60 class-callable policy; ``policy_kwargs`` from the config reach ``__init__``."""

    def __init__(self, target_utilization: float = 0.7, hysteresis: float = 0.2,
                 queued_request_tokens_per_s: float | None = None):
        if not 0 < target_utilization <= 1 or not 0 <= hysteresis < 1:
            raise ValueError("need 0 < target_utilization <= 1 and 0 <= hysteresis < 1")
        self.target_utilization = target_utilization
        self.hysteresis = hysteresis
        self.queued_request_tokens_per_s = queued_request_tokens_per_s

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        current = max(ctx.target_num_replicas, 0)
        metrics = ctx.aggregated_metrics or {}
        capacities = [c for c in (metrics.get(CAPACITY_KEY) or {}).values() if c and c > 0]
        demands = metrics.get(DEMAND_KEY) or {}
        if not capacities:  # no estimates yet: hold
            return current, {"reason": "no estimates"}
        per_replica = sum(capacities) / len(capacities)
        reported = float(sum(demands.values()))
        demand = reported
        queued = float(ctx.total_queued_requests or 0.0)
        if queued > 0:
            rate = self.queued_request_tokens_per_s
            if rate is None:  # the per-request rate the replicas plan with, from their own reports
                running = max(float(ctx.total_num_requests or 0.0) - queued, 1.0)
                rate = reported / running if reported else per_replica * self.target_utilization
            demand += queued * rate
        desired = decide(current, demand, per_replica, self.target_utilization, self.hysteresis)
        state = {"demand_tokens_per_s": demand, "capacity_per_replica": per_replica,
                 "utilization": demand / (per_replica * max(current, 1)), "desired": desired}
        return desired, state


def decide(current: int, demand: float, capacity_per_replica: float, target_utilization: float,
           hysteresis: float) -> int:
    """The replica count for ``demand`` tokens/s, with a dead band below the target utilisation."""
    if capacity_per_replica <= 0:
        return current
    needed = math.ceil(demand / (capacity_per_replica * target_utilization) - 1e-9)
    if current <= 0:
        return max(needed, 1) if demand > 0 else 0
    utilization = demand / (capacity_per_replica * current)
    if utilization > target_utilization:
        return max(needed, current)
    if utilization < target_utilization * (1 - hysteresis):
        return min(max(needed, 1), current)
    return current


_default = DCutPolicy()


def dcut_policy(ctx) -> tuple[int, dict[str, Any]]:
    """Function form with default knobs (target utilisation 0.7, hysteresis 0.2)."""
    return _default(ctx)

"""The D-Cut autoscaling policy under synthetic Serve contexts (no Ray instance)."""

from __future__ import annotations

import time

import pytest
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.autoscaling import DCutPolicy, decide
from deployments.records import CAPACITY_KEY, DEMAND_KEY


def ctx(current: int, capacity: list[float], demand: list[float], queued: float = 0.0, total: float = 0.0,
        config: AutoscalingConfig | None = None, state: dict | None = None) -> AutoscalingContext:
    ids = [f"r{i}" for i in range(len(capacity))]
    return AutoscalingContext(
        deployment_id=None, deployment_name="EngineReplica", app_name="dcut",
        current_num_replicas=current, target_num_replicas=current, running_replicas=ids,
        total_num_requests=total, total_queued_requests=queued,
        aggregated_metrics={CAPACITY_KEY: dict(zip(ids, capacity, strict=True)),
                            DEMAND_KEY: dict(zip(ids, demand, strict=True))},
        raw_metrics=None, capacity_adjusted_min_replicas=(config.min_replicas if config else 1),
        capacity_adjusted_max_replicas=(config.max_replicas if config else 10),
        policy_state=state or {}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=time.time(), config=config or AutoscalingConfig(min_replicas=1, max_replicas=10))


@pytest.mark.parametrize("current,demand,expected", [
    (2, 0.0, 1),      # idle: down to the floor of 1
    (2, 100.0, 2),    # 50%, under the band, but 2 is what 100 tok/s needs at 70%
    (2, 139.0, 2),    # 69.5%: hold
    (2, 141.0, 3),    # 70.5% > target: up to ceil(141 / 70) = 3
    (2, 400.0, 6),    # far over: straight to what the demand needs
    (4, 100.0, 2),    # 25%: down to ceil(100 / 70) = 2
    (3, 130.0, 2),    # 43% < 56%: down to 2 (which runs at 65%, under target)
])
def test_decide(current, demand, expected):
    assert decide(current, demand, capacity_per_replica=100.0, target_utilization=0.7, hysteresis=0.2)[0] \
        == expected


def test_decide_is_stable_at_its_own_answer():
    """Hysteresis: the count chosen for a demand is not undone by the same demand."""
    for demand in range(0, 1000, 7):
        n, _ = decide(1, float(demand), 100.0, 0.7, 0.2)
        assert decide(n, float(demand), 100.0, 0.7, 0.2)[0] == n


def test_policy_uses_dcut_capacity_not_queue_length():
    policy = DCutPolicy(target_utilization=0.5, hysteresis=0.2)
    # Same ongoing requests, different D-Cut capacity: the faster replicas need fewer copies.
    slow, _ = policy(ctx(2, [100.0, 100.0], [200.0, 200.0], total=8))
    fast, _ = policy(ctx(2, [800.0, 800.0], [200.0, 200.0], total=8))
    assert slow == 8 and fast == 1


def test_policy_counts_requests_queued_at_handles():
    policy = DCutPolicy(target_utilization=1.0, hysteresis=0.0)
    desired, state = policy(ctx(1, [100.0], [100.0], queued=4, total=5))  # 1 running at 100 tok/s, 4 queued
    assert state["demand_tokens_per_s"] == pytest.approx(500.0)
    assert desired == 5


def test_policy_holds_without_estimates():
    c = ctx(3, [], [])
    assert DCutPolicy()(c)[0] == 3


def test_serve_wrapper_applies_bounds_and_delays():
    config = AutoscalingConfig(min_replicas=1, max_replicas=3, upscale_delay_s=0, downscale_delay_s=60)
    wrapped = _apply_autoscaling_config(DCutPolicy())
    up, _ = wrapped(ctx(1, [100.0], [1000.0], config=config))
    assert up == 15  # Serve applies min/max_replicas after the wrapper (apply_bounds)
    down, state = wrapped(ctx(3, [100.0] * 3, [0.0] * 3, config=config))
    assert down == 3  # the downscale delay has not passed yet
    assert state["desired"] == 1


def test_bad_knobs_rejected():
    with pytest.raises(ValueError):
        DCutPolicy(target_utilization=0.0)
    with pytest.raises(ValueError):
        DCutPolicy(hysteresis=1.0)

"""The autoscaling simulator (simulator/) and the policy rules it led to: small fleets, short traces."""

from __future__ import annotations

import numpy as np
import pytest
from ray.serve._private.metrics_utils import TimeStampedValue
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.autoscaling import DCutPolicy, decide, latest_capacities, replicas_needed
from deployments.records import CAPACITY_KEY, DEMAND_KEY
from deployments.settings import AutoscalingSettings
from simulator.__main__ import main, parse_args
from simulator.report import Summary, choose
from simulator.run import (
    ReplicaModel,
    direction_changes,
    ideal_replicas,
    reaction_time,
    simulate,
)
from simulator.serve import MetricStream, metric_intervals, serve_decision
from simulator.traces import Trace, make_trace

REPLICA = ReplicaModel(capacity_tokens_per_s=1000.0, default_capacity_tokens_per_s=100.0, estimates_after_s=2.0,
                       request_tokens_per_s=10.0, max_ongoing_requests=16, max_num_seqs=16)


def knobs(fleet: int, **update) -> AutoscalingSettings:
    return AutoscalingSettings(min_replicas=1, max_replicas=2 * fleet, request_tokens_per_s=10.0, **update)


def test_ideal_is_the_policy_formula_within_bounds():
    settings = knobs(10)  # 1..20 replicas
    at_full = 10 * 1000.0 * 0.7  # 10 replicas at 70%
    fractions = np.array([0.0, 0.1, 0.55, 1.0, 5.0])
    expected = [1, 1, replicas_needed(0.55 * at_full, 1000.0, 0.7), 10, 20]
    assert ideal_replicas(fractions, at_full, 1000.0, settings).tolist() == expected


def test_direction_changes_and_reaction_time():
    assert direction_changes(np.array([1, 2, 3, 3, 2, 2, 3])) == 2
    assert direction_changes(np.array([5, 5, 6, 9, 9])) == 0
    counts = np.array([10, 10, 30, 85, 95, 100])
    assert reaction_time(counts, 100, since_s=1) == 3.0  # 95 is the first within 10% of 100
    assert reaction_time(counts, 1000, since_s=0) is None


def test_metric_stream_reports_only_what_was_pushed():
    """The controller sees a change only after the next push, fully once the look-back holds only new samples."""
    record, push, look_back = 2.0, 10.0, 10.0
    stream = MetricStream(0.0, record, push, look_back)
    value = {"x": 1.0}
    for t in np.arange(0.0, 25.0, 0.5):  # the source's value jumps to 5 at t = 11
        value["x"] = 5.0 if t >= 11 else 1.0
        stream.advance(t, lambda _t: dict(value))
        seen = stream.value("x", t)
        if t < push:
            assert seen is None  # the first push (at 0) carried nothing
        elif t < 20:
            assert seen == pytest.approx(1.0)  # the push at 10 holds samples taken before the jump
    assert stream.value("x", 24.5) == pytest.approx(5.0)  # the push at 20: samples of 12..18 only


def _ctx(target: int, capacity: float, demand: float, now: float, config: AutoscalingConfig, state: dict
         ) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=None, deployment_name="EngineReplica", app_name="dcut", current_num_replicas=target,
        target_num_replicas=target, running_replicas=["r0"], total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics={CAPACITY_KEY: {"r0": capacity}, DEMAND_KEY: {"r0": demand}}, raw_metrics=None,
        capacity_adjusted_min_replicas=config.min_replicas, capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=state, last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=config)


def test_serve_decision_waits_the_upscale_delay_on_the_simulated_clock_and_bounds():
    config = AutoscalingConfig(**knobs(2, upscale_delay_s=10.0).serve_config())  # max 4 replicas
    policy, state, target = DCutPolicy(), {}, 1
    for now in np.arange(1000.0, 1012.0, 0.5):  # far from the wall clock: Ray's time.time() would not do
        target, state = serve_decision(policy, _ctx(target, 100.0, 1000.0, now, config, state))
        assert target == (1 if now < 1010.0 else 4)  # 1000 tok/s needs 15 replicas; max_replicas is 4


def test_constant_demand_never_changes_its_mind():
    fraction = np.full(1800, 0.6)
    trace = Trace("ramp", fraction, fraction)
    run = simulate(trace, 20, knobs(20), REPLICA, 0.7, control_period_s=1.0, keep_series=True)
    assert run.scores.direction_changes == 0 and run.scores.flaps == 0
    assert run.series.target == run.series.ideal  # it started right and stayed there


def test_step_at_a_small_fleet_reaches_what_it_needs():
    settings = knobs(10)
    run = simulate(make_trace("step"), 10, settings, REPLICA, 0.7, control_period_s=1.0, phase_s=5, keep_series=True)
    record_s, push_s, _ = metric_intervals(AutoscalingConfig(**settings.serve_config()))
    # The bar: within 2 decision periods (Serve's metric push interval). Evidence reaches the controller
    # within a push and a record, the first push after the step may carry only part of it, then the upscale delay.
    assert run.scores.reaction_s is not None
    assert record_s + settings.upscale_delay_s <= run.scores.reaction_s <= 2 * push_s
    assert run.scores.ready_reaction_s >= REPLICA.startup_s * 0.85  # capacity comes only with started replicas
    needed = run.series.ideal[-1]
    assert needed == 10 and needed <= run.series.ready[-1] <= 1.1 * needed


def test_downscale_lands_inside_the_dead_band():
    """From far above, the count lands near the middle of [target x (1 - hysteresis), target], so that demand can
    rise by more than a few percent before an upscale undoes it, and the same demand holds it there."""
    capacity, target_utilization, hysteresis = 100.0, 0.7, 0.2
    for demand in (3_000.0, 10_000.0, 33_333.0):
        n, rule = decide(1_000, demand, capacity, target_utilization, hysteresis)
        assert rule == "down"
        utilization = demand / (capacity * n)
        assert target_utilization * (1 - hysteresis) < utilization < target_utilization * (1 - hysteresis / 4)
        assert decide(n, demand * 1.05, capacity, target_utilization, hysteresis)[1] == "hold"
        assert decide(n, demand, capacity, target_utilization, hysteresis)[0] == n


def test_capacity_is_each_replicas_latest_report():
    """A replica's default figure from before its first estimates must not outlive the push that carried it."""
    fresh = [TimeStampedValue(0.0, 100.0), TimeStampedValue(2.0, 1000.0), TimeStampedValue(4.0, 1000.0)]
    aggregated = {CAPACITY_KEY: {"a": 700.0, "b": 1000.0}}
    raw = {CAPACITY_KEY: {"a": fresh, "b": [TimeStampedValue(4.0, 1000.0)]}}
    assert latest_capacities(raw, aggregated) == [1000.0, 1000.0]
    assert sorted(latest_capacities(None, aggregated)) == [700.0, 1000.0]  # no raw series: the look-back mean


def _summary(trace: str, knobs: dict, reaction: float | None = None, flaps: int = 0, unserved: float = 0.0,
             cost: float = 1.5) -> Summary:
    return Summary(trace=trace, fleet=500, knobs=knobs, runs=1, decision_period_s=10.0, reaction_s_worst=reaction,
                   reaction_s_median=reaction, ready_reaction_s_worst=None, over_provisioning_pct=0.0,
                   under_provisioning_pct=0.0, unserved_pct=unserved, cost_vs_minimum=cost,
                   direction_changes_per_h=0.0, ideal_direction_changes_per_h=0.0, flaps=flaps)


def test_choice_is_the_cheapest_setting_that_passes_every_bar():
    base, fast, cheap, flappy = ({"upscale_delay_s": d} for d in (10.0, 5.0, 4.0, 3.0))
    sweep = [
        _summary("step", base, reaction=21.0), _summary("bursty", base, unserved=4.0, cost=1.6),
        _summary("step", fast, reaction=18.0), _summary("bursty", fast, unserved=3.9, cost=1.6),
        _summary("step", cheap, reaction=18.0), _summary("bursty", cheap, unserved=5.0, cost=1.2),  # worse bursts
        _summary("step", flappy, reaction=15.0, flaps=1), _summary("bursty", flappy, unserved=1.0, cost=1.1),
    ]
    choice = choose(sweep, base)
    assert choice.passed and choice.knobs == fast and choice.bursty_unserved_pct == 4.0


@pytest.mark.parametrize("argv", [
    ["--fleets", "0"], ["--fleets", "ten"], ["--traces", "sawtooth"], ["--delays", "5"], ["--delays", "5:-1"],
    ["--long-tick", "0"], ["--cost-table", "does/not/exist.json"], [],
])
def test_bad_command_line_exits_non_zero(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(([] if argv == [] else ["--out", str(tmp_path)]) + argv)
    assert exit_.value.code != 0
    assert capsys.readouterr().err


def test_acceptance_without_full_mode_rows_is_refused(tmp_path, capsys):
    sweep = tmp_path / "sweep.json"
    sweep.write_text('{"results": [{"mode": "none", "bs": 1}]}')
    assert main(["--out", str(tmp_path / "out"), "--acceptance", str(sweep), "--sweep-fleet", "0"]) == 2
    assert "mode=full" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

"""D-Cut's host work in replay (`dcut.replay.host`): fitted from a live breakdown or a warm bench, carried by a cost
model, charged to the policies that decide with D-Cut on every step and to no other engine's rule."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dcut.cli import main
from dcut.replay.costs import CostModel
from dcut.replay.host import HOOKS, HostWork, from_bench, from_compare
from dcut.replay.policy import FixedWidth
from dcut.replay.simulate import Pools, RunnerPolicy, SimClock, run_cell
from dcut.settings import DCutSettings
from tests.unit.test_replay import K, linear_cost, trace


def _cell(mode: str, bs: int, hooks_ms: float) -> dict:
    return {"mode": mode, "bs": bs, "step_ms": {"engine step": 20.0, **{h: hooks_ms / len(HOOKS) for h in HOOKS}}}


def test_a_live_breakdown_gives_joints_hooks_over_dynamics_as_a_line_in_bs():
    report = {"machine": {"cpu": "test"}, "cells": [
        *(_cell("joint", b, 0.5 + 0.01 * b + 0.3) for b in (1, 8, 32)),
        *(_cell("dynamic", b, 0.3) for b in (1, 8, 32)),
        _cell("none", 1, 0.0) | {"step_ms": {"engine step": 9.0}},  # no hooks: not read
    ]}
    host = from_compare(report)
    assert host.drafting == pytest.approx((0.5, 0.01)) and host.zero == (0.0, 0.0)
    assert host.ms(16, 3) == pytest.approx(0.66) and host.ms(16, 0) == 0.0
    assert "joint's D-Cut hooks less dynamic's" in host.source
    with pytest.raises(ValueError, match="--breakdown"):
        from_compare({"cells": [_cell("joint", 1, 1.0)]})


def test_a_warm_bench_gives_drafting_and_width_0_lines():
    rows = [{"mode": "joint", "bs": b, "width": w, "cold": False, "mean_us": us}
            for b, w, us in ((1, 0, 10.0), (64, 0, 16.3), (1, 7, 200.0), (1, 15, 220.0), (64, 5, 462.0))]
    rows += [{"mode": "joint", "bs": 1, "width": 7, "cold": True, "mean_us": 900.0},  # a cold run: not read
             {"mode": "reference", "bs": 1, "width": 15, "cold": False, "mean_us": 150.0}]
    host = from_bench({"results": rows})
    assert host.drafting == pytest.approx((0.21 - 0.004, 0.004))
    assert host.zero == pytest.approx((0.01 - 0.0001, 0.0001))
    with pytest.raises(ValueError, match="bench-policy --step"):
        from_bench({"results": rows[:2]})


def test_a_cost_model_carries_its_host_work_through_json():
    cost = dataclasses.replace(linear_cost(), host=HostWork((0.4, 0.01), (0.02, 0.0), "measured"))
    again = CostModel.from_json(json.loads(json.dumps(cost.to_json())))
    assert again.host == cost.host and again.host_ms(10, 3) == pytest.approx(0.5)
    assert again.for_policies().host == cost.host
    assert CostModel.from_json(linear_cost().to_json()).host_ms(10, 3) == 0.0


@pytest.mark.parametrize("mode", ("joint", "reference"))
def test_a_deciding_policy_pays_the_host_work_of_every_step_and_its_clock_reads_it(mode):
    """Each step of a policy that decides with D-Cut costs ``host(bs, width)`` more, and the runner measures it (its
    clock); ``full`` and other engines' fixed widths pay nothing."""
    free, pools, bs = linear_cost(), Pools(trace()), 4
    host = HostWork((0.5, 0.05), (0.1, 0.0))
    charged = dataclasses.replace(free, host=host)

    def run(cost: CostModel, mode: str) -> tuple[float, dict[int, int], float]:
        clock = SimClock()
        settings = DCutSettings(mode=mode, **({"widths": [0, 1, 2, 4]} if mode == "joint" else {}))
        cell = run_cell(RunnerPolicy(mode, settings, cost, K, clock), bs, pools, cost, 40, 0, clock)
        return cell.ms, cell.widths, clock.t * 1000.0

    ms, widths, clock_ms = run(charged, mode)
    assert clock_ms == pytest.approx(ms)
    if mode == "reference":  # its widths do not depend on its costs: the difference is the charge, step by step
        plain_ms, plain_widths, _ = run(free, mode)
        assert widths == plain_widths
        assert ms - plain_ms == pytest.approx(sum(n * host.ms(bs, w) for w, n in widths.items()))
    for fixed in (FixedWidth(2), FixedWidth(0)):
        assert run_cell(fixed, bs, pools, charged, 40, 0).ms == run_cell(fixed, bs, pools, free, 40, 0).ms
    assert run(charged, "full")[0] == run(free, "full")[0]


def test_replay_can_leave_the_host_work_out(tmp_path, capsys):
    data = "tests/data/replay"
    costs = json.loads(open(f"{data}/deep-small-costs.json").read())
    costs["host"] = HostWork((2.0, 0.0), source="test").to_json()
    (tmp_path / "costs.json").write_text(json.dumps(costs))
    argv = ["replay", "--trace", f"{data}/deep-small.npz", "--costs", str(tmp_path / "costs.json"), "--bs", "4",
            "--steps", "20", "--warmup", "0", "--starts", "1", "--json"]
    rows = []
    for extra, out in (([], "charged"), (["--no-host-work"], "free")):
        assert main([*argv, *extra, "--out", str(tmp_path / out)]) == 0
        case = json.loads(capsys.readouterr().out)["cases"]["deep-small"]
        rows.append({r["policy"]: r for r in case["rows"]})
    assert "host" in json.loads((tmp_path / "charged" / "replay.json").read_text())["cases"]["deep-small"]["cost_model"]
    assert rows[0]["joint"]["step_ms"] > rows[1]["joint"]["step_ms"]
    assert rows[0]["dynamic"]["step_ms"] == rows[1]["dynamic"]["step_ms"]
    assert "D-Cut's host work, charged to the policies that decide with it: 2.000 ms" in \
        (tmp_path / "charged" / "replay.md").read_text()

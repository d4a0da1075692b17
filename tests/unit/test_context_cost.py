"""The verify cost's context term (`dcut.context_cost`): the fit, the profile, lookups, JSON and old tables, merge,
refinement net of the term, the decisions it changes, and replay priced with it."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dcut.cli import main
from dcut.context_cost import ContextCost, default_lengths, fit_slopes, profile_context
from dcut.cost_table import CostTable, Fingerprint, StepCost
from dcut.replay.costs import CostModel
from dcut.replay.policy import FixedWidth
from dcut.replay.simulate import Pools, SimClock, run_cell
from dcut.selection import select
from dcut.settings import DCutSettings
from dcut.trace import from_rows
from dcut.vllm.state import RunnerDCut
from dcut.width import choose_width, width_utilities

K = 15
FP = Fingerprint(hardware="cpu x2", model="deep", drafter="dflash", k=K)
C0 = 128


def base_table(context: ContextCost | None = None) -> CostTable:
    """Verify ``20 + 0.3 * tokens`` ms at C0 for bs 1, 16 and 64; the drafter 1 ms + 0.1 ms per position."""
    points = {b: [(b * (1 + d), 20.0 + 0.3 * b * (1 + d), 3) for d in (0, 4, 8, 12, K)] for b in (1, 16, 64)}
    draft = {b: {w: (1.0 + 0.1 * b * w, 1) for w in (0, 1, 2, 3, 5, 7, 11, 15)} for b in (1, 16, 64)}
    return CostTable(FP, points, draft=draft, context=context)


def context(slope: float = 5e-4, step_slope: float = 0.0) -> ContextCost:
    sizes = (1, 16, 64)
    return ContextCost(C0, [256, 512, 1007], dict.fromkeys(sizes, slope), dict.fromkeys(sizes, step_slope),
                       dict.fromkeys(sizes, 4))


# -- the fit and the profile ----------------------------------------------------------------------------------

def test_the_fit_recovers_both_slopes_and_the_per_token_one_alone():
    rng = np.random.default_rng(0)
    bs, a, b = 16, 2e-3, 4e-4
    tokens = np.asarray([bs * (K + 1)] * 3 + [bs], dtype=np.float64)
    delta = np.asarray([128, 384, 879, 879], dtype=np.float64)
    extra = delta * (a + b * tokens) * (1 + 0.01 * rng.standard_normal(4))
    step, slope = fit_slopes(tokens, delta, extra)
    assert step == pytest.approx(a, rel=0.1) and slope == pytest.approx(b, rel=0.05)
    # Full width only: one token count, the whole growth goes on the tokens (the terms cannot be told apart).
    step, slope = fit_slopes(tokens[:3], delta[:3], delta[:3] * b * tokens[:3])
    assert step == 0.0 and slope == pytest.approx(b)


@pytest.mark.parametrize("extra", [[0.0, 0.0, 0.0, 0.0], [-1.0, -2.0, -3.0, -0.5], [-5.0, 0.1, -3.0, 0.0]])
def test_no_growth_or_a_cheaper_long_context_fits_zero(extra):
    tokens = np.asarray([256, 256, 256, 16], dtype=np.float64)
    assert fit_slopes(tokens, np.asarray([128.0, 384.0, 879.0, 879.0]), np.asarray(extra)) == (0.0, 0.0)


def test_only_the_per_request_term_when_the_step_grows_alike_at_every_width():
    tokens = np.asarray([256, 256, 256, 16], dtype=np.float64)
    delta = np.asarray([128.0, 384.0, 879.0, 879.0])
    step, slope = fit_slopes(tokens, delta, 0.01 * delta)
    assert step == pytest.approx(0.01) and slope == pytest.approx(0.0, abs=1e-12)


def test_default_lengths():
    assert default_lengths(1024, 15, 128) == [256, 512, 1007]
    assert default_lengths(256, 7, 128) == [64, 247]  # the table's own context is not profiled again


def test_profile_context_times_full_width_steps_and_one_plain_step_per_batch_size():
    table, clock, calls = base_table(), [0.0], []
    a, b = 1e-3, 4e-4

    def run_step(bs: int, tokens: int, ctx: int) -> None:
        calls.append((bs, tokens, ctx))
        clock[0] += (table.lookup(bs, tokens) + (ctx - C0) * (a + b * tokens)) / 1000.0

    fitted = profile_context(run_step, table.lookup, [1, 16], K, C0, [256, 512, 1007], warmups=1, repeats=3,
                             timer=lambda: clock[0], progress=False)
    shapes = {(bs, bs * (K + 1), c) for bs in (1, 16) for c in (256, 512, 1007)} | {(1, 1, 1007), (16, 16, 1007)}
    assert set(calls) == shapes and len(calls) == len(shapes) * 4
    for bs in (1, 16):
        assert fitted.step_slope[bs] == pytest.approx(a, rel=1e-6) and fitted.slope[bs] == pytest.approx(b, rel=1e-6)
    assert fitted.profiled_at == C0 and fitted.lengths == [256, 512, 1007] and fitted.samples == {1: 4, 16: 4}
    assert fitted.measured[16][-1] == (16, 1007, pytest.approx(table.lookup(16, 16) + 879 * (a + b * 16)))


# -- lookups, JSON, merge, refinement ------------------------------------------------------------------------

def test_lookups_add_the_term_of_the_covering_batch_size_and_floor_below_the_profiled_context():
    t = base_table(context(slope=5e-4, step_slope=1e-3))
    plain = base_table()
    for bs, tokens, c in [(16, 256, 1000), (10, 160, 600), (64, 64, 2000), (1, 16, 128.0)]:
        expected = plain.lookup(bs, tokens) + (c - C0) * (1e-3 + 5e-4 * tokens)
        assert t.lookup(bs, tokens, c) == pytest.approx(expected)
    assert t.lookup(16, 256) == plain.lookup(16, 256)  # no context given: the profiled one
    tokens = np.arange(16, 257)
    assert t.costs(16, tokens, 900.0).tolist() == pytest.approx(t.lookup_many(16, tokens, 900.0).tolist())
    steep = base_table(context(slope=0.05))  # far below the profiled context the line would go below zero
    assert steep.lookup(16, 256, 0) == pytest.approx(0.5 * plain.lookup(16, 256))
    assert steep.costs(16, np.array([256]), 0).tolist() == pytest.approx([0.5 * plain.lookup(16, 256)])


def test_json_round_trip_and_tables_without_the_section_behave_as_before():
    t = base_table(context(slope=5e-4, step_slope=1e-3))
    data = json.loads(json.dumps(t.to_json()))
    assert data["context"] == {"profiled_at": C0, "lengths": [256, 512, 1007],
                               "slope_ms": {"1": 5e-4, "16": 5e-4, "64": 5e-4},
                               "step_slope_ms": {"1": 1e-3, "16": 1e-3, "64": 1e-3},
                               "samples": {"1": 4, "16": 4, "64": 4}, "measured": {}}
    back = CostTable.from_json(data)
    assert back.lookup(16, 200, 700) == pytest.approx(t.lookup(16, 200, 700))
    old = base_table().to_json()
    assert "context" not in old  # an old table's JSON, byte for byte what it was
    loaded = CostTable.from_json(json.loads(json.dumps(old)))
    assert loaded.context is None and loaded.to_json() == old
    assert loaded.lookup(16, 200, 5000) == loaded.lookup(16, 200) == base_table().lookup(16, 200)
    assert json.loads(json.dumps(ContextCost.from_json({"profiled_at": 64, "slope_ms": {"4": 1e-3}}).to_json()))[
        "step_slope_ms"] == {}  # the section's minimal form: slopes per token only
    assert back.fingerprint.key() == loaded.fingerprint.key() == FP.key()  # the section is not in the fingerprint


def test_merge_weighs_slopes_by_samples_and_keeps_tables_without_the_section_out():
    a = base_table(ContextCost(C0, [256], {16: 1e-3}, {16: 0.0}, {16: 4}, {16: [(256, 256, 90.0)]}))
    b = base_table(ContextCost(C0, [512], {16: 4e-3, 64: 2e-3}, {16: 1e-2}, {16: 2, 64: 4}, {16: [(16, 512, 9.0)]}))
    merged = CostTable.merge([a, b, base_table()])
    assert merged.context is not None and merged.context.lengths == [256, 512]
    assert merged.context.slope[16] == pytest.approx((4 * 1e-3 + 2 * 4e-3) / 6)
    assert merged.context.step_slope[16] == pytest.approx(2 * 1e-2 / 6)
    assert merged.context.slope[64] == 2e-3 and merged.context.samples == {16: 6, 64: 4}
    assert merged.context.measured == {16: [(256, 256, 90.0), (16, 512, 9.0)]}
    assert CostTable.from_json(json.loads(json.dumps(merged.to_json()))).context.measured == merged.context.measured
    assert CostTable.merge([base_table(), base_table()]).context is None


def test_refine_takes_the_context_term_off_before_correcting_the_row():
    truth = base_table(context())
    for with_context in (True, False):
        t = base_table(context())
        for step in range(200):
            tokens = [16, 80, 256][step % 3]
            c = 900.0 + step  # long contexts: every live step costs well above the profiled row
            t.refine(16, tokens, truth.lookup(16, tokens, c), context=c if with_context else None)
        if with_context:
            assert t.offset(16) == pytest.approx(0.0, abs=1e-9) and t.lookup(16, 256) == truth.lookup(16, 256)
        else:
            assert t.lookup(16, 256) > truth.lookup(16, 256) + 20.0  # a context-blind refinement inflates the row


def test_the_runner_refines_and_prices_at_the_batch_context():
    now = [0.0]
    runner = RunnerDCut(DCutSettings(mode="continuous", calibrate=False), FP, K, clock=lambda: now[0])
    runner.cost_table, runner.cost_source = base_table(context()), "given"
    reqs = [f"r{i}" for i in range(16)]
    for step in range(20):
        runner.context = 1000.0
        drafts = 0 if step == 0 else 4
        runner.begin_step({r: 1 + drafts for r in reqs}, {r: [0] * drafts for r in reqs})
        now[0] += base_table(context()).lookup(16, 16 * (1 + drafts), 1000.0) / 1000.0
        runner.choose_width(16, K)
        runner.on_drafted(reqs, torch.full((16, K), -0.05), None, None)
        runner.cut(reqs, [[0] * K for _ in reqs])
    runner.settle()  # the steps still held refine the table too
    assert runner.cost_table.offsets[16][1] >= 18  # every step after the first two verified drafts and refined
    assert runner.cost_table.offset(16) == pytest.approx(0.0, abs=1e-6)  # the live steps cost what it predicted


# -- the decisions it changes --------------------------------------------------------------------------------

def _confidences(bs: int) -> torch.Tensor:
    """Drafter log-confidences falling along the block, a little different per request (deterministic)."""
    g = torch.Generator().manual_seed(bs)
    return torch.log(torch.rand(bs, K, generator=g) * 0.25 + 0.74)


@pytest.mark.parametrize("bs", [1, 16, 64])
def test_a_longer_context_verifies_and_drafts_no_more(bs):
    t = base_table(context(slope=5e-4))
    settings = DCutSettings(mode="continuous")
    survival = np.cumprod(np.asarray([[0.9, 0.7, 0.7, 0.65, 0.65] + [0.7] * 10] * 8), axis=1)
    widths = [0, 1, 2, 3, 5, 7, 11, 15]
    budgets, chosen = [], []
    for c in (64, 256, 1000, 4000):
        _, decision = select(_confidences(bs), settings, StepCost(t, K, 1.0, c))
        budgets.append(int(decision.budget))
        verify = functools.partial(t.lookup_many, context=c)
        best = choose_width(width_utilities(bs, widths, survival, verify, t.draft_costs, lambda x: 0.5 + 0 * x),
                            None, 0.0)
        assert best is not None
        chosen.append(best.width)
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1], budgets
    assert chosen == sorted(chosen, reverse=True), chosen


# -- replay --------------------------------------------------------------------------------------------------

def _trace(ctx: int):
    rng = np.random.default_rng(1)
    conf = np.sort(rng.uniform(0.5, 1.0, size=(32, 4)), axis=1)[:, ::-1]
    steps = [{"bs": 32, "width": 4, "log_conf": np.log(conf), "accepted": np.full(32, 2), "ctx_len": np.full(32, ctx)}]
    return from_rows(4, steps)


def test_replay_prices_verify_steps_at_the_traced_or_the_given_context():
    points = {b: [(t, 10.0 + t, 1) for t in range(b, 5 * b + 1)] for b in (1, 2, 4, 8)}
    draft = {b: {w: (0.5, 1) for w in range(5)} for b in (1, 2, 4, 8)}
    slope = ContextCost(C0, [512], dict.fromkeys((1, 2, 4, 8), 1e-3))
    fp = Fingerprint(hardware="test", model="m", drafter="d", k=4)

    def ms(table: CostTable, pools: Pools, none: bool = False) -> float:
        cost = CostModel("c", table)
        return run_cell(FixedWidth(0 if none else 4), 4, pools, cost, 10, 2, SimClock(), none=none).ms

    flat, sloped = CostTable(fp, points, draft=draft), CostTable(fp, points, draft=draft, context=slope)
    at_c0, long = Pools(_trace(C0)), Pools(_trace(1128))
    assert ms(sloped, at_c0) == ms(flat, at_c0) == ms(sloped, Pools(_trace(0)))  # 0: not recorded
    assert ms(flat, long) == ms(flat, at_c0)
    # 10 steps verifying 4 requests x (1 + 4 drafts): 1000 context tokens over C0 add 1 ms per 1000 tokens each.
    assert ms(sloped, long) == pytest.approx(ms(flat, long) + 10 * 1000 * 1e-3 * 20)
    assert ms(sloped, Pools(_trace(C0), context=1128.0)) == pytest.approx(ms(sloped, long))
    assert ms(sloped, long, none=True) == pytest.approx(ms(flat, long, none=True) + 10 * 1000 * 1e-3 * 4)
    assert math.isclose(Pools(_trace(300)).walk(4).context() or 0.0, 300.0)


def test_dcut_replay_at_a_given_context_decides_with_the_context_term(tmp_path: Path, capsys):
    data = json.loads(Path("tests/data/replay/deep-small-costs.json").read_text())
    sizes = [int(b) for b in data["points"]]
    data["context"] = data["policy_table"]["context"] = ContextCost(C0, [512], dict.fromkeys(sizes, 2e-3)).to_json()
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(data))
    joint = {}
    for c in (64, 2000):
        assert main(["replay", "--trace", "tests/data/replay/deep-small.npz", "--costs", str(costs), "--bs", "8",
                     "--steps", "30", "--warmup", "10", "--context", str(c), "--out", str(tmp_path / str(c)),
                     "--json"]) == 0
        case = json.loads(capsys.readouterr().out)["cases"]["deep-small"]
        assert case["context"] == c
        joint[c] = next(r for r in case["rows"] if r["policy"] == "joint")
    assert joint[2000]["step_ms"] > joint[64]["step_ms"]
    drafts = {c: sum(int(w) * n for w, n in r["widths"].items()) for c, r in joint.items()}
    assert drafts[2000] < drafts[64], joint

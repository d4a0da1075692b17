"""Cost tables: lookup, vectorised costs, smoothing, refinement bounds, merge, JSON, fingerprints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dcut.context_cost import ContextCost
from dcut.cost_table import (
    CostTable,
    Fingerprint,
    FingerprintMismatch,
    current_hardware,
    profile_cost_table,
    profile_token_points,
)

FP = Fingerprint(hardware="cpu x2", model="dense", drafter="dflash", k=15)


def table() -> CostTable:
    return CostTable(FP, {4: [(4, 10.0, 3), (16, 16.0, 3), (64, 40.0, 3)], 16: [(16, 20.0, 3), (256, 140.0, 3)]})


def test_lookup_uses_next_profiled_batch_size_and_interpolates() -> None:
    t = table()
    assert t.lookup(1, 4) == 10.0  # bs 1 -> profiled bs 4
    assert t.lookup(4, 10) == pytest.approx(13.0)  # halfway 4..16
    assert t.lookup(4, 1) == 10.0 and t.lookup(4, 1000) == 40.0  # flat outside
    assert t.lookup(5, 136) == pytest.approx(80.0)  # bs 5 -> 16
    assert t.lookup(17, 20) is None  # beyond the table


def test_costs_vectorised_matches_lookup() -> None:
    t = table()
    tokens = np.array([0, 4, 10, 16, 40, 64, 500])
    costs = t.costs(3, tokens)
    assert costs is not None and costs.dtype == np.float32
    assert costs.tolist() == pytest.approx([t.lookup(3, int(x)) for x in tokens])
    assert t.costs(100, tokens) is None


def test_lookup_of_one_count_is_lookup_many_to_the_last_bit() -> None:
    """The step's single lookups skip numpy; replay's figures rest on their being the same numbers."""
    rng = np.random.default_rng(7)
    for trial in range(50):
        points = {bs: [(int(t), float(ms), 1) for t, ms in zip(
            np.unique(rng.integers(bs, bs * 16 + 1, size=5)), np.sort(rng.uniform(5, 90, size=5)), strict=False)]
            for bs in (1, 8, 32)}
        context = ContextCost(128, [256, 1007], {8: 1e-4, 32: -2e-4}, {8: 3e-3, 32: -1e-2}) if trial % 2 else None
        t = CostTable(FP, points, offsets={8: (0.7, 3)}, plain_offsets={8: (-1.3, 2), 32: (2.5, 1)}, context=context)
        for bs in (1, 5, 8, 20, 32, 40):
            tokens = np.concatenate([np.arange(bs * 17), [bs * 100]])
            for ctx in (None, 40.0, 700.0):
                many = t.lookup_many(bs, tokens, ctx)
                single = [t.lookup(bs, int(x), ctx) for x in tokens]
                assert (many is None and all(v is None for v in single)) or many.tolist() == single


def test_smoothed_is_monotone_in_tokens() -> None:
    t = CostTable(FP, {8: [(8, 12.0, 1), (16, 11.0, 1), (32, 20.0, 1), (64, 18.0, 1)]}).smoothed()
    assert [p[1] for p in t.points[8]] == [12.0, 12.0, 20.0, 20.0]


def test_refine_is_bounded_and_keeps_monotone() -> None:
    t = table()
    row_before = [t.lookup(4, p[0]) for p in t.points[4]]
    before = t.lookup(4, 17)
    t.costs(4, torch.tensor([16]))  # fill the cache, refine must invalidate it
    t.refine(4, 17, 10_000.0)  # absurd first sample: clipped to 2x the prediction
    assert t.lookup(4, 17) == pytest.approx(2 * before)
    shift = t.lookup(4, 17) - before
    row_after = [t.lookup(4, p[0]) for p in t.points[4]]
    # The row's verify points move together (still monotone); the plain point (4 tokens) is corrected apart.
    assert row_after[1:] == pytest.approx([ms + shift for ms in row_before[1:]]) and row_after[0] == row_before[0]
    assert t.costs(4, torch.tensor([16])).tolist() == pytest.approx([t.lookup(4, 16)])
    t.refine(4, 17, 0.0)  # clipped to 0.5x; running mean of two samples
    assert t.lookup(4, 17) == pytest.approx(before + shift - 0.25 * (before + shift))  # mean of +shift, -half
    t.refine(1000, 64, 41.0)  # nothing covers: ignored
    assert 1000 not in t.offsets


def test_refine_learns_the_constant_a_dummy_profile_leaves_out() -> None:
    t, truth = table(), table()
    for step in range(200):
        tokens = [4, 16, 32, 64][step % 4]
        t.refine(4, tokens, truth.lookup(4, tokens) + 7.0)
    assert t.offset(4) == pytest.approx(7.0, abs=0.05)
    back = CostTable.from_json(t.to_json())
    assert back.lookup(4, 16) == pytest.approx(t.lookup(4, 16))
    merged = CostTable.merge([t, truth])
    assert merged.offset(4) == pytest.approx(7.0, abs=0.05)  # truth has no live samples: no weight


def test_refine_learns_a_per_token_cost_the_profile_underestimates() -> None:
    """Live steps cost 1.4x the profiled rise above a plain step, plus a constant: the line is learned, so costs
    at token counts the live steps never visited are right too; it survives JSON, and merges by samples."""
    t, truth = table(), table()
    first = truth.points[4][0][1]
    live = {n: truth.lookup(4, n) + 3.0 + 0.4 * (truth.lookup(4, n) - first) for n in (8, 16, 24, 32, 48, 64)}
    for step in range(400):
        tokens = [8, 16, 24][step % 3]  # only the small budgets are ever verified
        t.refine(4, tokens, live[tokens])
    assert t.gain(4) == pytest.approx(0.4, abs=0.02) and t.offset(4) == pytest.approx(3.0, abs=0.1)
    assert t.lookup(4, 64) == pytest.approx(live[64], rel=0.01)  # never visited, priced right
    assert t.costs(4, torch.tensor([64])).item() == pytest.approx(t.lookup(4, 64), rel=1e-5)  # every path alike
    assert t.lookup_many(4, np.array([48, 64])).tolist() == pytest.approx([live[48], live[64]], rel=0.01)
    back = CostTable.from_json(json.loads(json.dumps(t.to_json())))
    assert back.gain(4) == t.gain(4) and back.lookup(4, 64) == pytest.approx(t.lookup(4, 64))
    back.refine(4, 16, live[16])  # a loaded table goes on from its line, not from scratch
    assert back.gain(4) == pytest.approx(t.gain(4), abs=0.02)
    assert CostTable.merge([t, truth]).gain(4) == pytest.approx(t.gain(4))  # truth has no live samples: no weight


def test_one_shape_says_nothing_of_the_slope() -> None:
    """Steps all at one token count move the level, not the gain (its prior, 0, stays)."""
    t = table()
    for _ in range(100):
        t.refine(4, 16, 20.0)
    assert t.gain(4) == 0.0 and t.lookup(4, 16) == pytest.approx(20.0)


def test_merge_weights_by_samples_and_unions_points() -> None:
    a = CostTable(FP, {4: [(4, 10.0, 1), (16, 20.0, 1)]})
    b = CostTable(FP, {4: [(4, 14.0, 3), (64, 50.0, 2)], 8: [(8, 12.0, 1)]})
    m = CostTable.merge([a, b])
    assert m.points[4] == [(4, pytest.approx(13.0), 4), (16, 20.0, 1), (64, 50.0, 2)]
    assert m.points[8] == [(8, 12.0, 1)]
    other = CostTable(FP.model_copy(update={"hardware": "gpu"}), {4: [(4, 1.0, 1)]})
    with pytest.raises(ValueError, match="hardware"):
        CostTable.merge([a, other])


def test_json_round_trip(tmp_path: Path) -> None:
    t = table()
    data = json.loads(json.dumps(t.to_json()))
    assert set(data) == {"fingerprint", "points", "offsets", "plain_offsets", "draft", "gains"}
    assert data["points"]["4"][0] == [4, 10.0, 3]
    back = CostTable.from_json(data)
    assert back.points == t.points and back.fingerprint == t.fingerprint
    path = tmp_path / "tables" / f"{FP.key()}.json"
    t.save(path)
    assert CostTable.load(path).points == t.points
    assert CostTable.load_for(path, FP).fingerprint == FP


def test_load_for_refuses_other_fingerprint(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    table().save(path)
    other = FP.model_copy(update={"model": "moe", "k": 7})
    with pytest.raises(FingerprintMismatch, match="model: wanted 'moe'.*k: wanted 7"):
        CostTable.load_for(path, other)


def test_fingerprint_key_is_stable_and_distinct() -> None:
    assert FP.key() == Fingerprint(**FP.model_dump()).key()
    assert FP.key() != FP.model_copy(update={"dtype": "bfloat16"}).key()
    assert len(FP.key()) == 16
    assert current_hardware()


def test_profile_token_points() -> None:
    assert profile_token_points(4, 15) == [4, 16, 32, 48, 64]
    assert profile_token_points(1, 1) == [1, 2]  # ratios 0, 0.25 and 0.5 collapse onto 1 token


def test_profile_cost_table_with_fake_step() -> None:
    calls: list[tuple[int, int]] = []
    clock = [0.0]

    def run_step(bs: int, tokens: int) -> None:
        calls.append((bs, tokens))
        noise = 0.05 if len(calls) % 3 == 0 else 0.0  # one noisy repeat per shape: the median ignores it
        clock[0] += (1.0 + 0.01 * tokens + noise) / 1000.0  # seconds

    t = profile_cost_table(run_step, [1, 4], k=15, fingerprint=FP, warmups=2, repeats=3,
                           timer=lambda: clock[0], progress=False)
    shapes = [(bs, x) for bs in (1, 4) for x in profile_token_points(bs, 15)]
    assert len(calls) == len(shapes) * 5
    assert sorted(set(calls)) == sorted(shapes)
    assert t.fingerprint == FP
    for bs in (1, 4):
        for tokens, ms, n in t.points[bs]:
            assert ms == pytest.approx(1.0 + 0.01 * tokens) and n == 3
    assert t.lookup(4, 64) == pytest.approx(1.64)


def test_draft_costs_interpolate_refine_and_survive_json_and_merge() -> None:
    t = CostTable(FP, {4: [(4, 10.0, 3), (64, 40.0, 3)]}, draft={4: {0: (0.5, 1), 15: (15.5, 1)}})
    assert t.draft_cost(2, 0) == 0.5 and t.draft_cost(4, 5) == pytest.approx(5.5)  # linear in width
    assert t.draft_cost(5, 3) is None  # beyond the table
    t.refine_draft(4, 15, 20.0)  # profiled value counts as one sample: running mean
    assert t.draft_cost(4, 15) == pytest.approx(17.75)
    t.refine_draft(4, 15, 1000.0)  # clipped to 2x the cell
    assert t.draft_cost(4, 15) < 2 * 17.75
    t.refine_draft(4, 7, 9.0)  # a width never profiled gets its own cell
    assert t.draft_cost(4, 7) == 9.0
    again = CostTable.from_json(json.loads(json.dumps(t.to_json())))
    assert again.draft == t.draft
    merged = CostTable.merge([t, CostTable(FP, {4: [(4, 10.0, 3)]}, draft={4: {0: (1.5, 3)}})])
    assert merged.draft[4][0] == (pytest.approx(1.25), 4)  # sample-weighted


def test_plain_steps_learn_their_own_offset() -> None:
    """A step verifying no drafts runs the engine's plain path: its correction is kept apart."""
    t = table()
    for _ in range(20):
        t.refine(4, 4, 12.0)  # plain step: table says 10
        t.refine(4, 16, 22.0)  # verify step: table says 16
    assert t.lookup(4, 4) == pytest.approx(12.0, abs=0.1)
    assert t.lookup(4, 16) == pytest.approx(22.0, abs=0.1)
    costs = t.costs(4, np.array([4, 16]))
    assert costs is not None and costs.tolist() == pytest.approx([12.0, 22.0], abs=0.1)
    assert t.lookup_many(4, np.array([4, 16])).tolist() == pytest.approx([12.0, 22.0], abs=0.1)
    assert CostTable.from_json(json.loads(json.dumps(t.to_json()))).plain_offsets == t.plain_offsets


def test_profile_times_draft_widths() -> None:
    calls: list[tuple[str, int, int]] = []
    t = profile_cost_table(lambda bs, n: calls.append(("v", bs, n)), [2], 3, FP, warmups=0, repeats=1,
                           progress=False, run_draft=lambda bs, w: calls.append(("d", bs, w)), widths=[0, 3])
    assert ("d", 2, 0) in calls and ("d", 2, 3) in calls
    assert sorted(t.draft[2]) == [0, 3]


def test_refine_never_drives_a_row_below_zero() -> None:
    # A profile with one slow point (a stall while profiling): live steps far cheaper than it must not
    # shift the row below zero at its cheap points, where a clip around a negative prediction diverged.
    fp = Fingerprint(hardware="h", model="m", k=15)
    table = CostTable(fp, {64: [(64, 13.0, 3), (256, 1400.0, 3), (1024, 1400.0, 3)]})
    for _ in range(2000):
        table.refine(64, 200, 90.0)
        table.refine(64, 70, 14.0)
    assert table.offsets[64][0] >= -6.5
    assert all(table.lookup(64, t) > 0 for t in (64, 65, 128, 256, 1024))

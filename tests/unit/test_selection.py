"""The D-Cut decision: prefix property, budgets, reference vs brute force, continuous vs reference, edges."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcut.cost_table import CostTable, Fingerprint, profile_token_points
from dcut.cut import log_confidence
from dcut.selection import (
    REFERENCE_RATIOS,
    bucket_budget,
    keep_depths_for_budget,
    prefix_scores,
    select,
)
from dcut.settings import DCutSettings

FP = Fingerprint(hardware="test", model="m", k=15)


def linear_table(batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32), k: int = 15,
                 per_token: float = 0.6) -> CostTable:
    """Cost like the CPU measurements: a per-batch base plus a price per verify token."""
    return CostTable(FP, {bs: [(t, 5.0 + 0.5 * bs + per_token * t, 1) for t in profile_token_points(bs, k)]
                          for bs in batch_sizes})


def kept_mask(depths: np.ndarray, k: int) -> np.ndarray:
    """Which drafts keep depths ``[bs]`` keep, ``[bs, k]``."""
    return np.arange(k) < depths[:, None]


log_confs = st.integers(0, 8).flatmap(lambda bs: st.integers(1, 6).flatmap(lambda k: st.lists(
    st.lists(st.one_of(st.floats(-6.0, 0.0), st.just(-math.inf), st.just(math.nan), st.just(-0.5)),
             min_size=k, max_size=k), min_size=bs, max_size=bs).map(
    lambda rows: np.array(rows, dtype=np.float32).reshape(bs, k))))


def test_log_confidence_is_log_softmax_of_the_drafted_token() -> None:
    logits = torch.randn(3, 4, 11)
    tokens = torch.randint(0, 11, (3, 4))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(log_confidence(logits.half(), tokens), expected, atol=2e-3, rtol=0)
    assert log_confidence(logits, tokens).dtype == torch.float32


def test_prefix_scores_nan_inf_and_max_depth() -> None:
    lc = np.array([[math.log(0.5), math.nan, 0.0], [0.3, math.log(0.5), -math.inf]])
    scores = prefix_scores(lc, np.array([3, 1]))
    assert scores.dtype == np.float32
    np.testing.assert_allclose(scores, [[0.5, 0.0, 0.0], [1.0, 0.0, 0.0]])


@given(log_confs)
def test_scores_non_increasing_and_in_unit_interval(lc: np.ndarray) -> None:
    scores = prefix_scores(lc)
    assert bool(((scores >= 0) & (scores <= 1)).all())
    assert bool((scores[:, 1:] <= scores[:, :-1]).all())


def test_bucket_budget_reference_formula() -> None:
    assert [bucket_budget(r, 4, 15) for r in REFERENCE_RATIOS] == [12, 28, 44, 60]  # 3/7/11/15 per request
    assert bucket_budget(1.0, 32, 15) == 32 * 15
    assert bucket_budget(0.0, 8, 15) == 0
    assert bucket_budget(0.25, 1, 1) == 0  # ceil(0.5) - 1
    assert bucket_budget(1.0, 0, 15) == 0
    assert bucket_budget(0.1, 10, 9) == 0  # 0.1 * 100 is 10.000000000000002 in floats: no off-by-one


@given(log_confs, st.integers(0, 60))
def test_keep_depths_prefix_and_budget_exact(lc: np.ndarray, budget: int) -> None:
    scores = prefix_scores(lc)
    depths = keep_depths_for_budget(scores, budget)
    positive = int((scores > 0).sum())
    assert int(depths.sum()) == min(budget, positive)
    kept = kept_mask(depths, lc.shape[1])
    assert bool((scores[kept] > 0).all())  # never a zero-score draft
    # the kept drafts are the top-budget scores: nothing dropped scores above anything kept
    if bool(kept.any()) and bool((~kept).any()):
        assert float(scores[kept].min()) >= float(scores[~kept].max())


def test_keep_depths_ties_are_prefixes() -> None:
    scores = np.ones((3, 4), dtype=np.float32)
    for budget in range(13):
        depths = keep_depths_for_budget(scores, budget)
        assert int(depths.sum()) == budget
        assert bool((depths.max() - depths.min()) <= 4)
    assert keep_depths_for_budget(scores, 5).tolist() == [4, 1, 0]  # row-major, stable


@pytest.mark.parametrize("mode", ["full", "fixed", "reference", "continuous"])
@given(lc=log_confs, count_bonus=st.booleans())
@settings(max_examples=60, deadline=None)
def test_select_keeps_prefixes_of_positive_drafts(mode: str, lc: np.ndarray, count_bonus: bool) -> None:
    bs, k = lc.shape
    depths, decision = select(lc, DCutSettings(mode=mode, count_bonus=count_bonus), linear_table())
    assert depths.shape == (bs,) and depths.dtype == np.int64
    assert bool(((depths >= 0) & (depths <= k)).all())
    assert int(depths.sum()) == int(decision.kept)
    assert decision.mode == mode and decision.fallback is False
    if mode != "full" and bs:
        scores = prefix_scores(lc)
        kept = kept_mask(depths, k)
        assert bool((scores[kept] > 0).all())
        bonus = bs if count_bonus else 0
        assert float(decision.expected_accepted) == pytest.approx(float(scores[kept].sum()) + bonus, abs=1e-4)


def test_fixed_budget_met_exactly() -> None:
    lc = np.log(np.random.default_rng(0).uniform(0.01, 1.0, (8, 15))).astype(np.float32)
    depths, decision = select(lc, DCutSettings(mode="fixed", fixed_ratio=0.5), None)
    assert int(depths.sum()) == bucket_budget(0.5, 8, 15) == int(decision.budget)
    assert decision.ratio == 0.5


def brute_force_reference(lc: np.ndarray, table: CostTable, bonus: bool) -> list[float]:
    """U for each bucket, computed independently (float64, table.lookup)."""
    bs, k = lc.shape
    scores = prefix_scores(lc).astype(np.float64).reshape(-1)
    best = -np.sort(-scores[scores > 0])
    out = []
    for r in REFERENCE_RATIOS:
        budget = min(bucket_budget(r, bs, k), best.size)
        out.append((float(best[:budget].sum()) + (bs if bonus else 0)) / table.lookup(bs, bs + budget))
    return out


@given(lc=log_confs.filter(lambda t: t.shape[0] > 0), bonus=st.booleans(),
       per_token=st.floats(0.0, 3.0))
@settings(max_examples=80, deadline=None)
def test_reference_equals_brute_force(lc: np.ndarray, bonus: bool, per_token: float) -> None:
    table = linear_table(per_token=per_token)
    depths, decision = select(lc, DCutSettings(mode="reference", count_bonus=bonus), table)
    utilities = brute_force_reference(lc, table, bonus)
    chosen_ratio = float(decision.ratio)
    assert chosen_ratio in REFERENCE_RATIOS
    assert utilities[REFERENCE_RATIOS.index(chosen_ratio)] >= max(utilities) * (1 - 1e-5)
    # exact ties (buckets capped to the same budget) go to the larger bucket
    budgets = [min(bucket_budget(r, *lc.shape), int((prefix_scores(lc) > 0).sum())) for r in REFERENCE_RATIOS]
    chosen_budget = budgets[REFERENCE_RATIOS.index(chosen_ratio)]
    assert int(decision.budget) == chosen_budget == int(depths.sum())
    assert all(b != chosen_budget for r, b in zip(REFERENCE_RATIOS, budgets, strict=True) if r > chosen_ratio)


def test_reference_tie_prefers_larger_bucket() -> None:
    # flat cost: every bucket costs the same, so keeping more is free
    table = CostTable(FP, {4: [(4, 10.0, 1), (64, 10.0, 1)]})
    depths, decision = select(np.full((4, 15), -0.1), DCutSettings(mode="reference"), table)
    assert float(decision.ratio) == 1.0 and int(depths.sum()) == 60


@given(lc=log_confs.filter(lambda t: t.shape[0] > 0), bonus=st.booleans(), per_token=st.floats(0.0, 3.0))
@settings(max_examples=80, deadline=None)
def test_continuous_never_worse_than_reference(lc: np.ndarray, bonus: bool, per_token: float) -> None:
    table = linear_table(per_token=per_token)
    _, reference = select(lc, DCutSettings(mode="reference", count_bonus=bonus), table)
    _, cont = select(lc, DCutSettings(mode="continuous", count_bonus=bonus), table)
    u_reference = float(reference.utilities[reference.chosen])
    u_cont = float(cont.utilities[cont.chosen])
    assert u_cont >= u_reference * (1 - 1e-6)


def test_continuous_fills_a_paid_for_step() -> None:
    # Staircase: 4 requests, any verify count 4..20 costs the same (one execution bucket).
    table = CostTable(FP, {4: [(4, 10.0, 1), (20, 10.0, 1), (21, 30.0, 1), (64, 60.0, 1)]})
    lc = np.full((4, 15), math.log(0.3))
    depths, decision = select(lc, DCutSettings(mode="continuous"), table)
    assert int(decision.budget) == 16 and int(depths.sum()) == 16


def test_min_saving_keeps_full_width_when_saving_is_small() -> None:
    table = linear_table(per_token=0.001)  # nearly flat: pruning saves < 1%
    lc = np.log(np.maximum(np.random.default_rng(1).random((8, 15)) ** 4, 1e-3))
    for mode in ("reference", "continuous"):
        _, without_floor = select(lc, DCutSettings(mode=mode), table)
        assert int(without_floor.budget) < 8 * 15
        depths, decision = select(lc, DCutSettings(mode=mode, min_saving=0.12), table)
        assert int(depths.sum()) == 8 * 15
        if mode == "reference":
            assert float(decision.ratio) == 1.0


def test_min_budget_floor_capped_at_available() -> None:
    lc = np.full((2, 4), -20.0)
    table = linear_table(per_token=5.0)
    depths, _ = select(lc, DCutSettings(mode="continuous", min_budget=3), table)
    assert int(depths.sum()) == 3
    depths, _ = select(lc, DCutSettings(mode="reference", min_budget=100), table)
    assert int(depths.sum()) == 8


def test_no_cost_falls_back_to_fixed_ratio() -> None:
    lc = np.full((64, 15), -0.2)
    for cost in (None, linear_table()):  # table covers bs <= 32 only
        depths, decision = select(lc, DCutSettings(mode="reference", fallback_ratio=0.75), cost)
        assert decision.fallback and decision.ratio == 0.75
        assert int(depths.sum()) == bucket_budget(0.75, 64, 15)
        assert decision.fallback is True


def test_edge_shapes() -> None:
    table = linear_table()
    for mode in ("full", "fixed", "reference", "continuous"):
        depths, decision = select(np.zeros((0, 15)), DCutSettings(mode=mode), table)
        assert depths.shape == (0,) and int(decision.kept) == 0
        depths, _ = select(np.full((1, 1), -0.1), DCutSettings(mode=mode), table)
        assert depths.tolist() in ([0], [1])
        depths, _ = select(np.full((3, 4), math.nan), DCutSettings(mode=mode), table)
        assert mode == "full" or depths.tolist() == [0, 0, 0]


def test_max_depth_never_keeps_missing_drafts() -> None:
    lc = np.zeros((3, 5))  # all confident
    max_depth = np.array([5, 2, 0])
    table = CostTable(FP, {4: [(0, 1.0, 1), (100, 1.0, 1)]})  # flat: keep everything available
    for mode in ("full", "fixed", "reference", "continuous"):
        depths, decision = select(lc, DCutSettings(mode=mode, fixed_ratio=1.0), table, max_depth)
        assert depths.tolist() == [5, 2, 0]
        assert int(decision.proposed) == 7


def test_global_top_k_beats_fixed_per_request_budget() -> None:
    """Same budget, per_request < global top-k < full, in expectation."""
    gen = np.random.default_rng(0)
    bs, k = 32, 15
    rates = np.clip(gen.beta(2.0, 1.0, bs), 0.05, 0.99)  # spread acceptance
    lc = np.repeat(np.log(rates)[:, None], k, axis=1)
    expected = prefix_scores(lc)  # exact: P(draft t accepted) = rate^(t+1)

    def accepted(depths: np.ndarray) -> float:
        return float(expected[kept_mask(depths, k)].sum())

    full = accepted(np.full(bs, k))
    for budget in (128, 256):
        fixed = accepted(np.full(bs, budget // bs))
        top = accepted(keep_depths_for_budget(expected, budget))
        assert fixed < top < full
    # and in a sampled simulation of the same model
    draws = gen.random((bs, k)) < rates[:, None]
    sampled = np.cumprod(draws, axis=1)  # prefix acceptance
    top_depths = keep_depths_for_budget(expected, 256)
    assert int(sampled[kept_mask(top_depths, k)].sum()) <= int(sampled.sum())


def test_per_request_keeps_the_same_depth_for_every_request() -> None:
    lc = np.log(np.maximum(np.random.default_rng(2).random((6, 7)), 1e-3))
    depths, decision = select(lc, DCutSettings(mode="per_request", per_request_depth=3, count_bonus=False), None,
                              max_depth=np.array([7, 7, 2, 7, 0, 7]))
    assert depths.tolist() == [3, 3, 2, 3, 0, 3]
    assert int(decision.kept) == 14 and int(decision.proposed) == 30
    scores = prefix_scores(lc, np.array([7, 7, 2, 7, 0, 7]))
    kept = kept_mask(depths, 7)
    assert float(decision.expected_accepted) == pytest.approx(float((scores * kept).sum()))

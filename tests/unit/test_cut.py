"""The device-side cut (``dcut.cut``, issue 61 items 1 and 3): it keeps what ``dcut.selection`` keeps, and reads
nothing back from its device."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from dcut import selection
from dcut.buckets import bucket_budget
from dcut.calibration import Calibrator
from dcut.cut import CalibrationTable, KeepRule, accepted_lengths, calibrate, cut, keep_counts, prefix_scores
from dcut.settings import DCutSettings
from dcut.vllm.state import NEVER

# Log-confidences on a grid of eighths: running sums are exact in float32 and float64, so distinct prefix scores are
# far apart and equal ones are computed from equal numbers (numpy's and torch's exp may differ in the last bit).
GRID = st.sampled_from([-i / 8 for i in range(33)] + [math.nan, -math.inf, 0.5])


@st.composite
def batches(draw: Any) -> tuple[np.ndarray, np.ndarray]:
    bs, k = draw(st.integers(1, 12)), draw(st.integers(1, 8))
    log_conf = np.array(draw(st.lists(GRID, min_size=bs * k, max_size=bs * k)), dtype=np.float32).reshape(bs, k)
    caps = np.array(draw(st.lists(st.integers(0, k), min_size=bs, max_size=bs)), dtype=np.int64)
    return log_conf, caps


def _reference(log_conf: np.ndarray, caps: np.ndarray, budget: int) -> np.ndarray:
    """What the runner does today (``dcut.vllm.state.RunnerDCut.on_drafted``): drafts past a cap are worth nothing
    (``NEVER``), then the global top-``budget`` of the prefix scores."""
    scored = np.where(np.arange(log_conf.shape[1]) >= caps[:, None], NEVER, log_conf)
    return selection.keep_depths_for_budget(selection.prefix_scores(scored), budget)


class Cost:
    """A step cost linear in the verified tokens, with a staircase (a ``selection.CostLookup``)."""

    def costs(self, bs: int, verify_tokens: np.ndarray) -> np.ndarray:
        return 5.0 + 0.2 * bs + 0.05 * np.ceil(verify_tokens / 8) * 8


@settings(max_examples=200, deadline=None)
@given(batches(), st.integers(0, 100))
def test_a_budget_keeps_the_global_top_of_the_prefix_scores(batch: tuple[np.ndarray, np.ndarray], budget: int):
    log_conf, caps = batch
    got = cut(torch.from_numpy(log_conf), KeepRule.new("cpu", budget), caps=torch.from_numpy(caps))
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), _reference(log_conf, caps, budget))


@settings(max_examples=200, deadline=None)
@given(batches(), st.sampled_from(["fixed", "reference", "continuous"]), st.sampled_from([0.25, 0.5, 0.75, 1.0]))
def test_the_cut_keeps_what_select_keeps_given_the_budget_it_chose(batch: tuple[np.ndarray, np.ndarray], mode: str,
                                                                  ratio: float):
    """The planner's budget (here ``select``'s own, on its cost staircase) cut on the device keeps ``select``'s
    depths."""
    log_conf = batch[0]
    depths, decision = selection.select(log_conf, DCutSettings(mode=mode, fixed_ratio=ratio), Cost())
    got = cut(torch.from_numpy(log_conf), KeepRule.new("cpu", decision.budget))
    np.testing.assert_array_equal(got.numpy(), depths)
    if mode == "fixed":
        assert decision.budget == min(bucket_budget(ratio, *log_conf.shape), int(np.count_nonzero(
            selection.prefix_scores(log_conf))))


@settings(max_examples=200, deadline=None)
@given(batches(), st.floats(0.0, 1.0))
def test_a_threshold_keeps_every_draft_scoring_at_least_it(batch: tuple[np.ndarray, np.ndarray], threshold: float):
    log_conf, caps = batch
    scored = np.where(np.arange(log_conf.shape[1]) >= caps[:, None], NEVER, log_conf)
    scores = selection.prefix_scores(scored)
    budget = int(np.count_nonzero(scores >= np.float32(threshold)))
    rule = KeepRule.new("cpu", log_conf.size, threshold)
    got = cut(torch.from_numpy(log_conf), rule, caps=torch.from_numpy(caps))
    np.testing.assert_array_equal(got.numpy(), selection.keep_depths_for_budget(scores, budget))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_calibration_is_the_calibrators_table_gathered(k_cal: int, k: int, seed: int):
    """Any counts: the table of a calibrator that has seen random outcomes (positions past its ``k`` pass through),
    then the cut on those calibrated values is the selection's."""
    rng = np.random.default_rng(seed)
    calibrator = Calibrator(k_cal, bins=5, prior=2.0, min_count=2)
    for _ in range(int(rng.integers(0, 4))):
        n = 16
        calibrator.update(np.log(rng.uniform(0.01, 1.0, (n, k_cal))), rng.integers(0, k_cal + 1, n),
                          rng.integers(0, k_cal + 1, n))
    log_conf = np.log(rng.uniform(0.0, 1.0, (7, k))).astype(np.float32)
    log_conf[0, 0], log_conf[1, -1] = np.nan, 0.3
    table = CalibrationTable.of(*calibrator.lookup_table(), "cpu")
    got = calibrate(torch.from_numpy(log_conf), table)
    torch.testing.assert_close(got, torch.from_numpy(calibrator.calibrate(log_conf)), atol=1e-6, rtol=1e-6,
                               equal_nan=True)
    budget = int(rng.integers(0, 7 * k + 1))
    np.testing.assert_array_equal(keep_counts(prefix_scores(got), KeepRule.new("cpu", budget)).numpy(),
                                  selection.keep_depths_for_budget(selection.prefix_scores(got.numpy()), budget))


def test_prefix_scores_are_the_selections() -> None:
    log_conf = np.log(np.random.default_rng(0).uniform(0.0, 1.0, (50, 15))).astype(np.float32)
    torch.testing.assert_close(prefix_scores(torch.from_numpy(log_conf)),
                               torch.from_numpy(selection.prefix_scores(log_conf)), atol=1e-7, rtol=1e-6)


def test_accepted_lengths_count_the_valid_slots_less_the_bonus() -> None:
    sampled = torch.tensor([[5, 6, -1, -1], [7, -1, -1, -1], [1, 2, 3, 4], [-1, -1, -1, -1]])
    assert accepted_lengths(sampled).tolist() == [1, 0, 3, 0]


class SyncError(AssertionError):
    """A data-dependent read of a tensor on the host: a device-to-host sync on a GPU."""


class NoSync(TorchFunctionMode):
    """Refuses what reads a tensor's values back to the host, or gives it a data-dependent shape."""

    READS = {torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
             torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.nonzero,
             torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere, torch.masked_select,
             torch.Tensor.masked_select, torch.unique, torch.Tensor.unique, torch.Tensor.nonzero_static}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self.READS:
            raise SyncError(f"{func.__name__} reads the device")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _has_mask(args[1]):
            raise SyncError("boolean-mask indexing has a data-dependent shape")
        if func is torch.Tensor.to and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values())):
            raise SyncError(".to('cpu') reads the device")
        return func(*args, **kwargs)


def _has_mask(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@pytest.mark.parametrize("read", [
    lambda t: t.cpu(), lambda t: t.sum().item(), lambda t: t.tolist(), lambda t: torch.nonzero(t),
    lambda t: t[t > 0], lambda t: t.to("cpu"), lambda t: bool(t.sum()), lambda t: int(t[0, 0]),
])
def test_no_sync_refuses_each_read(read: Any) -> None:
    """The mode has the power to see what the cut must not do."""
    with NoSync(), pytest.raises(SyncError):
        read(torch.rand(3, 4))


@pytest.mark.parametrize("rule", ["budget", "threshold"])
@pytest.mark.parametrize("calibrated", [False, True])
@pytest.mark.parametrize("capped", [False, True])
def test_the_step_path_reads_nothing_back(rule: str, calibrated: bool, capped: bool) -> None:
    """The cut, its caps and the outcome count, in every keep rule, under ``NoSync``; a plan change too."""
    bs, k = 16, 15
    log_conf = torch.log(torch.rand(bs, k, generator=torch.Generator().manual_seed(3)))
    calibrator = Calibrator(k)
    calibrator.update(log_conf.numpy(), np.full(bs, k), np.arange(bs) % (k + 1))
    table = CalibrationTable.of(*calibrator.lookup_table(), "cpu") if calibrated else None
    caps = torch.arange(bs) % (k + 1) if capped else None
    sampled = torch.where(torch.rand(bs, k + 1) < 0.5, 7, -1)
    with NoSync():
        keep_rule = KeepRule.new("cpu", 40) if rule == "budget" else KeepRule.new("cpu", bs * k, 0.3)
        kept = cut(log_conf, keep_rule, table, caps)
        accepted = accepted_lengths(sampled)
        keep_rule.set(20, 0.1)
        again = cut(log_conf, keep_rule, table, caps)
    assert kept.shape == again.shape == accepted.shape == (bs,)
    assert int(again.sum()) <= 20 and int(kept.sum()) <= (40 if rule == "budget" else bs * k)

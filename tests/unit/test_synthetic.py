"""The synthetic drafter: reproduces the seed's bs-32 budget table, deterministically, as a replayable trace."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dcut.replay.synthetic import CTX_LEN, PAPER_TABLE, PaperDrafter, budget_table, paper_trace, sample
from dcut.trace import Trace


def test_every_row_of_the_paper_table_within_5_percent() -> None:
    log_conf, accepted = sample(np.random.default_rng(0), 6400)
    table = budget_table(log_conf, accepted)
    assert list(table) == list(PAPER_TABLE)
    for name, (verify, acc) in table.items():
        paper_verify, paper_acc = PAPER_TABLE[name]
        assert verify == paper_verify, name  # the budgets are the paper's: anchors counted
        assert acc == pytest.approx(paper_acc, rel=0.05), name
    assert accepted.mean() == pytest.approx(201.2 / 32 - 1, rel=0.05)


def test_confidence_is_calibrated_in_aggregate() -> None:
    """The fit's tie-breaker: expected accepted drafts (sum of prefix scores) match the true ones."""
    log_conf, accepted = sample(np.random.default_rng(1), 6400)
    assert np.exp(np.cumsum(log_conf, axis=1)).sum() == pytest.approx(accepted.sum(), rel=0.05)


def test_sample_is_deterministic_for_a_seed() -> None:
    a = sample(np.random.default_rng(7), 500)
    b = sample(np.random.default_rng(7), 500)
    c = sample(np.random.default_rng(8), 500)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])


@pytest.mark.parametrize("k", [15, 7, 1])
def test_sample_shapes_and_ranges(k: int) -> None:
    log_conf, accepted = sample(np.random.default_rng(0), 1000, k)
    assert log_conf.shape == (1000, k) and log_conf.dtype == np.float64
    assert accepted.shape == (1000,) and accepted.dtype == np.int64
    conf = np.exp(log_conf)
    assert np.all(np.isfinite(log_conf)) and np.all(conf > 0) and np.all(conf <= 1)
    assert accepted.min() >= 0 and accepted.max() <= k
    assert {0, k} <= set(accepted.tolist())  # both a rejected first draft and a fully accepted block


def test_a_less_informative_drafter_loses_the_top_k_gain() -> None:
    """The top-k rows come from the confidence signal, not from the acceptance model alone."""
    noisy = PaperDrafter(noise=20.0)
    log_conf, accepted = sample(np.random.default_rng(0), 3200, params=noisy)
    table = budget_table(log_conf, accepted)
    assert table["confidence top 25%"][1] < 0.95 * PAPER_TABLE["confidence top 25%"][1]


def test_budget_table_needs_a_whole_batch() -> None:
    log_conf, accepted = sample(np.random.default_rng(0), 31)
    with pytest.raises(ValueError):
        budget_table(log_conf, accepted)


def test_paper_trace_round_trips_and_pools_the_sampled_rows(tmp_path: Path) -> None:
    trace = paper_trace(batch_sizes=(2, 3), steps=2, widths=(7, 15), seed=5)
    rng = np.random.default_rng(5)
    blocks = [sample(rng, bs) for bs in (2, 2, 3, 3)]
    want_conf = np.concatenate([b[0] for b in blocks]).astype(np.float16).astype(np.float64)
    want_acc = np.concatenate([b[1] for b in blocks])

    trace.save(tmp_path / "synthetic.npz")
    loaded = Trace.load(tmp_path / "synthetic.npz")
    for t in (trace, loaded):
        assert t.k == 15 and t.steps == 8 and t.widths() == [7, 15]
        assert t.step_bs.tolist() == [2, 2, 2, 2, 3, 3, 3, 3]
        assert np.all(np.isnan(t.verify_ms)) and np.all(np.isnan(t.draft_ms)) and np.all(np.isnan(t.overhead_ms))
        assert np.all(t.ctx_len == CTX_LEN)
        conf, acc = t.pool(15)
        assert np.array_equal(conf, want_conf) and np.array_equal(acc, want_acc)
        conf7, acc7 = t.pool(7)  # width 7 is the width-15 block truncated
        assert np.array_equal(conf7, want_conf[:, :7]) and np.array_equal(acc7, np.minimum(want_acc, 7))
    assert loaded.meta == trace.meta
    assert loaded.meta["source"] == "synthetic" and loaded.meta["params"]["noise"] == PaperDrafter().noise


def test_default_paper_trace_gives_replay_a_pool_of_thousands() -> None:
    trace = paper_trace()
    conf, acc = trace.pool(15)
    assert len(acc) == 32 * sum((1, 2, 4, 8, 16, 32, 64)) and trace.widths() == [15]
    for name, (_, acc_per_batch) in budget_table(conf, acc).items():  # float16 storage keeps the fit
        assert acc_per_batch == pytest.approx(PAPER_TABLE[name][1], rel=0.05), name


@pytest.mark.parametrize("widths", [(0,), (16,), (15, 20)])
def test_paper_trace_rejects_widths_outside_the_block(widths: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        paper_trace(batch_sizes=(1,), steps=1, widths=widths)

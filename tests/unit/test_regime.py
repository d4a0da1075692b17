"""The cost-regime figures of the model cards (`train.regime`), on a synthetic cost table."""

from dcut.cost_table import CostTable, Fingerprint
from train import regime as R

FP = Fingerprint(hardware="cpu", model="m", drafter="d", k=15, tensor_parallel_size=1)


def _table() -> CostTable:
    draft = {bs: {w: (0.5 + 0.1 * bs * w / 16, 1) for w in (1, 3, 7, 15)} for bs in (1, 16, 64)}
    return CostTable(FP, {1: [(1, 8.0, 1), (16, 9.0, 1)], 16: [(16, 10.0, 1), (256, 60.0, 1)],
                          64: [(64, 30.0, 1), (1024, 240.0, 1)]}, draft=draft)


def test_cost_figures_split_a_live_step_into_forward_and_overhead():
    rows = R.cost_figures(_table(), {1: 10.0, 16: 16.0, 64: 40.0})
    assert rows[1]["forward_ms"] == 8.0 and rows[1]["none_step_ms"] == 10.0
    assert abs(rows[1]["overhead_ms"] - 2.0) < 1e-9 and abs(rows[1]["forward_share"] - 0.8) < 1e-9
    assert abs(rows[64]["full_over_none"] - 240.0 / 40.0) < 1e-9
    assert abs(rows[16]["draft15_over_none"] - 2.0 / 16.0) < 1e-9
    assert R.in_regime(rows) == {"forward_dominates_bs1": True, "full_verify_ge_5x_none_bs64": True,
                                 "draft15_le_1.5x_none_bs16": True}


def test_conditions_fail_or_stay_unknown_honestly():
    rows = R.cost_figures(_table(), {1: 20.0, 64: 200.0})
    ok = R.in_regime(rows)
    assert ok["forward_dominates_bs1"] is False and ok["full_verify_ge_5x_none_bs64"] is False
    assert ok["draft15_le_1.5x_none_bs16"] is None  # no none figure at bs 16
    text = R.regime_section(rows, {15: {"acceptance_per_pos": [0.9, 0.8], "mean_accepted_per_step": 1.7},
                                   1: {"acceptance_per_pos": [0.9], "mean_accepted_per_step": 0.9}}, "src")
    assert "**no**" in text and "not measured" in text and "| 1 | 0.90 | 0.90 |  |" in text

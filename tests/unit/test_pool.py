"""`dcut pool`: interleaved comparisons of the same modes pooled round by round (`dcut.bench.pool`)."""

from __future__ import annotations

import json

import pytest

from dcut.bench.pool import pool
from dcut.cli import main


def report(rates: dict[str, list[float]], bs: int = 8) -> dict:
    """A compare report at one batch size: each mode's rate per round."""
    runs = [{"mode": m, "bs": bs, "repeat": r, "tokens_per_s": v} for m, values in rates.items()
            for r, v in enumerate(values)]
    return {"modes": list(rates), "batch_sizes": [bs], "runs": runs}


def test_rounds_of_every_run_pool_as_pairs_and_each_runs_ratio_is_kept():
    """Run one: joint 10 % ahead of dynamic in every round; run two, on a box twice as slow: 10 % ahead again.
    Pooled, the ratio is 1.1 whatever the box's speed; against none, the median of the rounds."""
    slow = report({"none": [50, 50, 50], "full": [40, 40, 40], "dynamic": [100, 80, 90], "joint": [110, 88, 99]})
    fast = report({"none": [100, 100, 100], "full": [80, 80, 80], "dynamic": [200, 160, 180],
                   "joint": [220, 176, 198]})
    row = pool([slow, fast])["rows"][0]
    assert row["rounds"] == 6 and row["per_run"] == pytest.approx([1.1, 1.1])
    assert row["dynamic"]["ratio"] == pytest.approx(1.1) and row["dynamic"]["ci95"] == pytest.approx([1.1, 1.1])
    assert row["dynamic"]["verdict"] == "joint faster" and row["best"]["ratio"] == pytest.approx(1.1)
    assert row["none"]["ratio"] == pytest.approx(1.98)  # (110, 88, 99) over 50, twice: the median round
    mixed = report({"none": [50, 50, 50], "full": [40, 40, 40], "dynamic": [100, 100, 100], "joint": [90, 110, 100]})
    assert pool([mixed, mixed])["rows"][0]["dynamic"]["verdict"] == "within noise"
    behind = report({"none": [50, 50, 50], "full": [40, 40, 40], "dynamic": [100, 100, 100], "joint": [90, 92, 91]})
    assert pool([behind, behind])["rows"][0]["best"]["verdict"] == "joint slower"


def test_a_modes_copies_count_as_one_mode_their_mean_in_each_round():
    """A floor run built A B B A (none, joint-w0, joint-w0#2, none#2): each side is the mean of its two engines."""
    floor = report({"none": [96, 104], "joint-w0": [90, 92], "joint-w0#2": [100, 98], "none#2": [104, 96]})
    row = pool([floor, floor], mode="joint-w0", against=("none",))["rows"][0]
    assert row["none"]["ratio"] == pytest.approx(0.95) and row["per_run"] == pytest.approx([0.95, 0.95])


def test_reports_of_different_comparisons_are_refused():
    a = report({"none": [1.0] * 3, "full": [1.0] * 3, "dynamic": [1.0] * 3, "joint": [1.0] * 3})
    with pytest.raises(ValueError, match="at least two"):
        pool([a])
    with pytest.raises(ValueError, match="batch_sizes"):
        pool([a, report({"none": [1.0] * 3, "full": [1.0] * 3, "dynamic": [1.0] * 3, "joint": [1.0] * 3}, bs=4)])
    with pytest.raises(ValueError, match="did not run dynamic"):
        b = report({"none": [1.0] * 3, "joint": [1.0] * 3})
        pool([b, b])


def test_a_run_of_one_batch_size_pools_with_the_full_runs_there():
    """A full run at bs 1 and 8 and a run of bs 1 alone: at ``batch_sizes=[1]`` the rounds of both pool (the full run's
    bs-8 rounds left out); a batch size one report did not run is refused."""
    rates = {"none": [100, 100], "joint-w0": [95, 97]}
    full = report(rates, bs=1)
    eight = report({"none": [10, 10], "joint-w0": [20, 20]}, bs=8)
    full = {**full, "batch_sizes": [1, 8], "runs": full["runs"] + eight["runs"]}
    alone = report({"none": [100, 100, 100], "joint-w0": [96, 96, 96]}, bs=1)
    (row,) = pool([full, alone], mode="joint-w0", against=("none",), batch_sizes=[1])["rows"]
    assert row["bs"] == 1 and row["rounds"] == 5 and row["per_run"] == pytest.approx([0.96, 0.96])
    with pytest.raises(ValueError, match="batch_sizes"):
        pool([full, alone], mode="joint-w0", against=("none",))
    with pytest.raises(ValueError, match="batch size 8"):
        pool([full, alone], mode="joint-w0", against=("none",), batch_sizes=[1, 8])


def test_the_command_writes_the_table_and_refuses_bad_input(tmp_path, capsys):
    rates = {"none": [50, 51, 49], "full": [40, 41, 39], "dynamic": [100, 90, 95], "joint": [105, 99, 101]}
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(report(rates)))
    assert main(["pool", *map(str, paths), "--out", str(tmp_path / "out")]) == 0
    assert "pooled over 2 runs" in capsys.readouterr().out
    written = json.loads((tmp_path / "out" / "pooled.json").read_text())
    assert written["rows"][0]["rounds"] == 6
    assert written["date"].startswith("20") and "commit" in written  # every result JSON says when and on which code
    assert main(["pool", str(paths[0])]) == 2
    assert "at least two" in capsys.readouterr().err
    assert main(["pool", str(paths[0]), str(tmp_path / "nowhere.json")]) == 2
    assert "nowhere.json" in capsys.readouterr().err
    assert main(["pool", *map(str, paths), "--bs", "8"]) == 0 and "pooled over 2 runs" in capsys.readouterr().out
    assert main(["pool", *map(str, paths), "--bs", "4"]) == 2
    assert "batch size 4" in capsys.readouterr().err
    assert main(["pool", *map(str, paths), "--bs", "x"]) == 2

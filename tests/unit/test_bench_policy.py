"""`dcut bench-policy --json` prints one JSON object with the machine and the results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dcut.cli import main

REPO = Path(__file__).resolve().parents[2]
DCUT = "import sys; from dcut.cli import main; sys.exit(main())"  # what the `dcut` script runs


def test_bench_policy_json() -> None:
    out = subprocess.run([sys.executable, "-c", DCUT, "bench-policy", "--json", "--repeats", "5"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    data = json.loads(out.stdout)
    assert {"cpu", "cores", "torch", "python"} <= set(data["machine"])
    assert len(data["results"]) == 2 * 5 * 2
    for row in data["results"]:
        assert set(row) == {"mode", "bs", "k", "median_us"}
        assert row["mode"] in {"reference", "continuous"} and row["median_us"] > 0
    assert {(r["bs"], r["k"]) for r in data["results"]} >= {(64, 15), (256, 15), (1, 7)}


def test_bench_policy_rejects_bad_repeats(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench-policy", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err
    assert main(["bench-policy", "--cold"]) == 2  # cold caches are a per-step figure
    assert "--step" in capsys.readouterr().err


def test_bench_step_times_the_runner_hooks() -> None:
    """`--step` drives the real runner state (width choice, selection, calibration, stats) per step."""
    out = subprocess.run([sys.executable, "-c", DCUT, "bench-policy", "--step", "--json", "--repeats", "5"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    rows = json.loads(out.stdout)["results"]
    cases = {(r["mode"], r["bs"], r["width"]) for r in rows}
    assert cases >= {("reference", 64, 15), ("joint", 1, 0), ("joint", 1, 7), ("joint", 64, 15)}
    assert all(r["median_us"] > 0 and r["drafted_us"] > 0 and not r["cold"] for r in rows)
    # the hooks' means add up to the step's mean
    assert all(abs(r["choose_us"] + r["drafted_us"] + r["cut_us"] - r["mean_us"]) < 0.5 for r in rows)


def test_bench_step_cold_evicts_the_caches_first() -> None:
    out = subprocess.run([sys.executable, "-c", DCUT, "bench-policy", "--step", "--cold", "--json", "--repeats", "3"],
                         cwd=REPO, capture_output=True, text=True, timeout=180, check=True)
    rows = json.loads(out.stdout)["results"]
    assert rows and all(r["cold"] and r["mean_us"] > 0 for r in rows)

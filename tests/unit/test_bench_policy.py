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


def test_bench_step_times_the_runner_hooks() -> None:
    """`--step` drives the real runner state (width choice, selection, calibration, stats) per step."""
    out = subprocess.run([sys.executable, "-c", DCUT, "bench-policy", "--step", "--json", "--repeats", "5"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    rows = json.loads(out.stdout)["results"]
    cases = {(r["mode"], r["bs"], r["width"]) for r in rows}
    assert cases >= {("reference", 64, 15), ("joint", 1, 0), ("joint", 64, 15)}
    assert all(r["median_us"] > 0 for r in rows)

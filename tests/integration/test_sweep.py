"""The batch-size sweep end to end on tiny models: two batch sizes, a short prompt set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dcut.cli import main

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
MODES = ["none", "full", "dynamic", "per_request", "reference", "joint"]
# The dynamic mode's schedule for this test: K differs by batch size, so what the engine verified shows whether
# vLLM's dynamic speculation ran (an engine of K=3 verifying one draft position at bs 1 and three at bs 4)
SCHEDULE = [(1, 1, 1), (2, 4096, 3)]


def test_sweep_two_batch_sizes(tmp_path, tiny_models, monkeypatch):
    from dcut.bench import sweep as sweep_module

    tiny = tiny_models
    best, picked = sweep_module.best_k_schedule, []

    def schedule(by_k: dict, batch_sizes: list[int]) -> list[tuple[int, int, int]]:
        picked.append(best(by_k, batch_sizes))  # the sweep's own pick from its fixed-K runs
        return SCHEDULE

    monkeypatch.setattr(sweep_module, "best_k_schedule", schedule)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def add(a, b):", "class Point:", "import os"]))
    out = tmp_path / "sweep"
    # `dcut sweep` in this process (its engines are in-process: tests/conftest.py's environment)
    assert main(["sweep", "--bs", "1,4", "--modes", ",".join(MODES), "--model", str(tiny["target"]),
                 "--draft", str(tiny["dflash"]), "--k", "3", "--prompts", str(prompts), "--max-tokens", "12",
                 "--max-model-len", "256", "--repeats", "2", "--enforce-eager", "--out", str(out)]) == 0

    record = json.loads((out / "sweep.json").read_text())
    assert record["machine"]["cpu"]
    cells = {(r["mode"], r["bs"]): r for r in record["results"]}
    assert set(cells) == {(m, b) for m in MODES for b in (1, 4)}
    for (mode, bs), r in cells.items():
        assert r["tokens_per_s"] > 0 and r["repeats"] == 2
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
        assert r["speedup_vs_none"] == pytest.approx(r["tokens_per_s"] / cells[("none", bs)]["tokens_per_s"])
        assert r["token_ids_sha256"] == cells[("none", bs)]["token_ids_sha256"], f"{mode} bs={bs} not lossless"
    for bs in (1, 4):  # per_request keeps auto's budget, spread evenly
        depth = cells[("per_request", bs)]["per_request_depth"]
        assert depth == round((cells[("reference", bs)]["mean_keep_ratio"] or 1.0) * 3)
    fixed_k = {(c["k"], c["bs"]) for c in record["dynamic_fixed_k"]}
    assert fixed_k >= {(1, 1), (3, 4)}, "the fixed-K runs dynamic was picked from"
    (own,) = picked
    assert [(lo, hi) for lo, hi, _ in own] == [(1, 1), (2, 4096)] and {k for *_, k in own} <= {1, 3}, own
    # dynamic ran vLLM's dynamic speculation, not the best fixed K standing in for it: one engine of K=3 whose
    # verified draft positions follow the schedule
    schedule = [list(r) for r in SCHEDULE]
    assert record["dynamic"] == {"schedule": schedule, "ran": "vllm"}, record["dynamic"]
    assert not any("failed" in note for note in record["notes"]), record["notes"]
    for bs, width in ((1, 1), (4, 3)):
        dynamic = cells[("dynamic", bs)]
        assert dynamic["k"] == 3 and dynamic["spec_schedule"] == schedule, dynamic
        verified = [a for a in dynamic["per_position_acceptance"] if a is not None]
        assert len(verified) == width, f"bs {bs}: drafts verified at {dynamic['per_position_acceptance']}"
    assert None not in cells[("full", 1)]["per_position_acceptance"], "full K=3 verifies all three positions"
    for bs in (1, 4):
        assert sum(cells[("joint", bs)]["width_histogram"].values()) > 0
    assert (out / "cost_tables" / "joint.json").exists(), "refined cost tables are saved"
    table = (out / "sweep.md").read_text()
    assert "| mode | bs 1 | bs 4 | geo |" in table and "identical to `none` in every cell: **yes**" in table
    assert (out / "speedup.png").stat().st_size > 0 and (out / "cost_table.png").stat().st_size > 0


def test_sweep_rejects_unknown_mode(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dcut.cli", "sweep", "--modes", "none,turbo"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown modes ['turbo']" in proc.stderr

"""The GPU check of the device-side cut (``dcut/bench/gpu_cut.py``) runs on a CPU at a tiny shape, and it and the cut
import nothing a bare torch box lacks."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import numpy as np

import dcut.cut
from dcut import selection
from dcut.bench import gpu_cut
from dcut.vllm.state import NEVER


def test_a_tiny_cpu_run_reports_every_batch_size(tmp_path: Path) -> None:
    out = tmp_path / "gpu-cut.json"
    assert gpu_cut.main(["--device", "cpu", "--batch-sizes", "1,4,16", "--k", "4", "--vocab", "300",
                         "--repeats", "2", "--warmups", "1", "--clock-n", "64", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["device"] and report["vocab"] == 300 and report["k"] == 4
    assert [r["bs"] for r in report["rows"]] == [1, 4, 16]
    for row in report["rows"]:
        assert row["no_sync"] and row["eager_repeatable"]
        assert row["graph_equal"] is None and row["graph_us"] is None  # no graph capture on a CPU
        assert row["eager_us"] > 0 and row["cut_eager_us"] > 0
        assert 0 < row["kept"] <= row["bs"] * 4
    clock = report["clock"]  # on a CPU the host clock is the device's: the timer's marks lie inside the launch
    assert 0 < clock["timer_ms"] <= clock["host_launch_ms"] <= clock["synchronized_ms"]


def test_the_checked_step_is_the_selections_cut() -> None:
    """What the script times is the cut of ``dcut.selection`` on the calibrated confidences, under the caps."""
    import torch

    step = gpu_cut.Step(bs=6, k=4, vocab=300, bins=10, device=torch.device("cpu"), seed=0)
    calibrated = dcut.cut.calibrate(step.confidences(), step.table).numpy()
    caps = step.caps.numpy()
    scored = np.where(np.arange(4) >= caps[:, None], NEVER, calibrated)
    expected = selection.keep_depths_for_budget(selection.prefix_scores(scored), int(step.rule.budget))
    np.testing.assert_array_equal(step().numpy(), expected)


def test_the_script_and_the_cut_import_only_torch_and_the_standard_library() -> None:
    for path, allowed in ((Path(gpu_cut.__file__), {"dcut"}), (Path(dcut.cut.__file__), set())):
        tree = ast.parse(path.read_text())
        roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
        roots |= {node.module.split(".")[0] for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
        assert roots - sys.stdlib_module_names - {"torch", "__future__"} <= allowed, path
    tree = ast.parse(Path(gpu_cut.__file__).read_text())
    assert {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module.startswith("dcut")} == {
        "dcut.cut", "dcut.vllm.step_clock"}
    clock = Path(gpu_cut.__file__).parent.parent / "vllm" / "step_clock.py"
    roots = {n.module.split(".")[0] for n in ast.walk(ast.parse(clock.read_text())) if isinstance(n, ast.ImportFrom)}
    assert roots - sys.stdlib_module_names <= {"__future__"}

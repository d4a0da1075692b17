"""The pure-PyTorch cost measurement: a tiny CPU run yields a complete cost model; the file stays torch-only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import dcut
from dcut.bench import gpu_costs
from dcut.replay.costs import CostModel

SCRIPT = Path(gpu_costs.__file__)
SIZES, D = (1, 2, 4), 4
TINY = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "16", "--vocab", "256", "--context", "32", "--batch-sizes", ",".join(map(str, SIZES)),
        "--max-tokens-per-request", str(D), "--drafter-layers", "1", "--repeats", "1", "--warmups", "0",
        "--device", "cpu"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> CostModel:
    out = tmp_path_factory.mktemp("gpu_costs") / "costs.json"
    assert gpu_costs.main([*TINY, "--out", str(out)]) == 0
    return CostModel.load(out)


def test_every_batch_size_has_a_verify_point_per_token_count(model: CostModel) -> None:
    assert model.name == "measured-gpu"
    assert model.batch_sizes() == list(SIZES)
    for bs in SIZES:
        row = model.table.points[bs]
        assert [p[0] for p in row] == [bs * t for t in range(1, D + 1)]
        assert all(ms > 0 and n == 1 for _, ms, n in row)
        assert model.none(bs) == row[0][1] > 0


def test_every_width_below_the_block_has_a_draft_cell(model: CostModel) -> None:
    for bs in SIZES:
        assert sorted(model.table.draft[bs]) == list(range(D))  # widths 0..D-1, k = D-1
        assert all(ms > 0 for ms, _ in model.table.draft[bs].values())
        assert model.draft(bs, D - 1) > 0


def test_fingerprint_and_notes(model: CostModel) -> None:
    fp = model.table.fingerprint
    assert fp.k == D - 1 and fp.tensor_parallel_size == 1 and fp.dtype == "bfloat16"
    assert fp.hardware.startswith("cpu")
    assert fp.model.startswith("Qwen3-shaped 2L h64") and fp.model.endswith("(random bf16, pure PyTorch)")
    assert fp.drafter == "DFlash-shaped (1 layers)"
    assert fp.vllm_version == "none (pure PyTorch)" and fp.dcut_version == dcut.__version__
    assert model.per_step_ms == model.per_token_ms == 0.0
    assert model.table.offsets == {} and model.table.plain_offsets == {}
    assert any("context: 32 tokens" in n for n in model.notes) and any("assumption" in n for n in model.notes)


def test_default_shape_is_qwen3_8b() -> None:
    shape = gpu_costs.Shape()
    params = shape.layers * shape.layer_params() + 2 * shape.vocab * shape.hidden
    assert 8.1e9 < params < 8.3e9  # Qwen3-8B: 8.2B parameters
    estimate = gpu_costs.estimate_seconds(shape, 5, [1, 2, 4, 8, 16, 32, 64], 16, 2048, 3, 10)
    assert estimate < 8 * 60


def test_script_imports_only_stdlib_and_torch() -> None:
    tree = ast.parse(SCRIPT.read_text())
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree))
    assert roots - sys.stdlib_module_names == {"torch"}


def test_help_runs_as_a_script() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--drafter-layers" in done.stdout and "--no-cuda-graphs" in done.stdout

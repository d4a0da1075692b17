"""Several engines on one GPU (`dcut.memory`): each its share of vLLM's budget, or a clear error before any starts.

Issue 63, defect 4: every engine of ``dcut compare`` took vLLM's default 0.9 of the GPU, so the second could not
start. Checked for one 80 GB GPU with the deep pair and with a Qwen3-8B-sized pair (8.19 B target parameters, a
1.05 B-parameter 5-layer drafter, bfloat16, max_model_len 8192: header-only safetensors, nothing loaded).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from dcut.bench.interleaved import arms_for
from dcut.memory import GpuMemoryError, engine_need, on_this_gpu, split_gpu_memory, with_gpu_shares
from dcut.settings import EMBEDDED_MODELS, EngineSettings
from dcut.vllm.engine import engine_kwargs
from tests.make_targets import compare_modes

GPU_80GB = 80 * 10**9
ROOT = Path(__file__).resolve().parents[2]
MAKE_COMPARE = compare_modes()  # the Makefile's `compare` arms


def _folder(path: Path, parameters: int, layers: int) -> str:
    """A model folder of ``parameters`` bfloat16 parameters and a Qwen3-8B-shaped attention (header only)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": layers, "hidden_size": 4096,
                                                  "num_attention_heads": 32, "num_key_value_heads": 8,
                                                  "head_dim": 128, "torch_dtype": "bfloat16"}))
    header = json.dumps({"w": {"dtype": "BF16", "shape": [parameters], "data_offsets": [0, 2 * parameters]}})
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode())
    return str(path)


@pytest.fixture
def qwen3_8b(tmp_path: Path) -> EngineSettings:
    return EngineSettings(model=_folder(tmp_path / "target", 8_190_735_360, 36),
                          draft=_folder(tmp_path / "drafter", 1_050_000_000, 5), dtype="bfloat16",
                          max_model_len=8192)


def _arms(base: EngineSettings, modes: list[str]) -> list[tuple[str, EngineSettings]]:
    return [(a.name, a.settings) for a in arms_for(base, modes, [(1, 64, 3)])]


def test_the_deep_pair_shares_one_gpu_in_every_arm_of_make_compare() -> None:
    deep = EngineSettings(model=str(ROOT / EMBEDDED_MODELS["deep"][0]), draft=str(ROOT / EMBEDDED_MODELS["deep"][1]))
    shared = with_gpu_shares(_arms(deep, MAKE_COMPARE), GPU_80GB)
    assert len(MAKE_COMPARE) == 7 and [s.gpu_memory_utilization for s in shared] == [0.128] * 7
    assert {engine_kwargs(s)["gpu_memory_utilization"] for s in shared} == {0.128}
    need = engine_need("joint", deep)
    assert need.weights == (26_753_408 + 2_311_808) * 4  # float32, from the committed safetensors headers
    assert need.kv_per_token == 2 * (16 + 1) * 2 * 64 * 4


def test_a_qwen3_8b_sized_pair_fits_three_engines_and_seven_are_refused_by_name(qwen3_8b) -> None:
    need = engine_need("joint", qwen3_8b)
    assert round(need.bytes / 2**30, 1) == 20.5  # 17.2 GiB weights, 1.3 GiB KV at 8192 tokens, 2 GiB overhead
    assert [s.gpu_memory_utilization for s in with_gpu_shares(_arms(qwen3_8b, ["none", "full", "joint"]),
                                                               GPU_80GB)] == [0.3] * 3
    with pytest.raises(GpuMemoryError, match=r"7 engines cannot share this GPU: engine 'none' needs 18.4 GiB .* "
                                             r"share is 0.128 x 74.5 GiB = 9.5 GiB; about 3 such engines fit"):
        with_gpu_shares(_arms(qwen3_8b, MAKE_COMPARE), GPU_80GB)


def test_the_budget_split_is_the_one_set_and_rounds_down() -> None:
    assert split_gpu_memory([engine_need("a", EngineSettings(
        model=str(ROOT / EMBEDDED_MODELS["deep"][0]), method="none", draft=None))] * 3, GPU_80GB, 0.8) == 0.266


def test_compare_refuses_before_any_engine_starts(qwen3_8b, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``dcut compare`` on an 80 GB GPU: the split is checked before vLLM is asked for anything; on CPU, nothing
    changes."""
    import torch

    from dcut.cli import main

    assert on_this_gpu([("none", qwen3_8b)]) == [qwen3_8b]  # this CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: NS(total_memory=GPU_80GB))
    monkeypatch.setattr("dcut.bench.interleaved._build_engine", lambda *a, **kw: pytest.fail("an engine started"))
    assert main(["compare", "--out", "/tmp/never", "--model", qwen3_8b.model, "--draft", qwen3_8b.draft,
                 "--dtype", "bfloat16", "--max-model-len", "8192", "--modes", ",".join(MAKE_COMPARE),
                 "--dynamic-schedule", "1-64:3"]) == 2
    assert "7 engines cannot share this GPU" in capsys.readouterr().err

"""GPU memory for several engines on one GPU: each its share of one engine's budget, refused before any starts.

vLLM gives one engine ``gpu_memory_utilization`` (default 0.9) of the GPU. ``dcut compare`` holds an engine per mode
in one process, so at vLLM's default the second engine finds the GPU already taken. ``split_gpu_memory`` divides
the budget evenly (each arm the same room: KV cache is part of what is compared) after checking that a share holds
what an engine cannot start without: its weights (target and drafter, at the engine's dtype), one request of
``max_model_len`` in KV cache (vLLM refuses to start with less) and ``ENGINE_OVERHEAD_BYTES``.

What it does not know: quantized weights (counted at the engine's dtype), and the activation, CUDA-graph and CUDA
context memory an engine really takes, which is an allowance here (``ENGINE_OVERHEAD_BYTES``), not a measurement.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from dcut.settings import EngineSettings

VLLM_BUDGET = 0.9  # vLLM 0.32's default gpu_memory_utilization: what one engine would take, split here
ENGINE_OVERHEAD_BYTES = 2 * 2**30  # per engine: activations, CUDA graphs, CUDA context (an allowance, not measured)
ATTENTION_LAYERS = ("full_attention", "sliding_attention")  # layer types that keep K/V per token
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


class GpuMemoryError(ValueError):
    """The engines cannot share the GPU: said before any starts."""


@dataclass(frozen=True)
class EngineNeed:
    """What one engine cannot start without, in bytes."""

    name: str
    weights: int  # target and drafter, at the engine's dtype
    kv_per_token: int  # target and drafter
    max_model_len: int

    @property
    def bytes(self) -> int:
        return self.weights + self.kv_per_token * self.max_model_len + ENGINE_OVERHEAD_BYTES


def engine_need(name: str, settings: EngineSettings) -> EngineNeed:
    """Read from the model folders: parameters from the safetensors headers, K/V width from ``config.json``."""
    folders = [Path(settings.model)] + ([Path(settings.draft)] if settings.method != "none" and settings.draft else [])
    configs = [_text_config(f) for f in folders]
    width = DTYPE_BYTES.get(settings.dtype) or DTYPE_BYTES.get(str(configs[0].get("torch_dtype")), 2)
    return EngineNeed(name, sum(_parameters(f) for f in folders) * width,
                      sum(_kv_per_token(c) for c in configs) * width, settings.max_model_len)


def split_gpu_memory(needs: list[EngineNeed], gpu_bytes: int, budget: float = VLLM_BUDGET) -> float:
    """Each engine's ``gpu_memory_utilization``: ``budget`` over the engines, rounded down; a ``GpuMemoryError``
    naming the engine that does not fit its share."""
    share = math.floor(budget / len(needs) * 1000) / 1000
    for need in needs:
        if need.bytes > share * gpu_bytes:
            fit = max(0, int(budget * gpu_bytes // need.bytes))
            raise GpuMemoryError(
                f"{len(needs)} engines cannot share this GPU: engine {need.name!r} needs {need.bytes / 2**30:.1f} GiB "
                f"(weights {need.weights / 2**30:.1f}, KV for one {need.max_model_len}-token request "
                f"{need.kv_per_token * need.max_model_len / 2**30:.1f}, overhead {ENGINE_OVERHEAD_BYTES / 2**30:.0f}), "
                f"its share is {share} x {gpu_bytes / 2**30:.1f} GiB = {share * gpu_bytes / 2**30:.1f} GiB; "
                f"about {fit} such engines fit (fewer modes, a shorter max_model_len or a larger GPU)")
    return share


def with_gpu_shares(named: list[tuple[str, EngineSettings]], gpu_bytes: int) -> list[EngineSettings]:
    """The settings with each engine's share of the GPU (``split_gpu_memory``); the budget split is the first
    engine's ``gpu_memory_utilization`` when set, else vLLM's default."""
    budget = named[0][1].gpu_memory_utilization or VLLM_BUDGET
    share = split_gpu_memory([engine_need(name, s) for name, s in named], gpu_bytes, budget)
    return [s.model_copy(update={"gpu_memory_utilization": share}) for _, s in named]


def on_this_gpu(named: list[tuple[str, EngineSettings]]) -> list[EngineSettings]:
    """``with_gpu_shares`` on GPU 0 when there is one (several engines of one process share it); on CPU the
    settings as they are (vLLM's CPU backend sizes its KV cache by ``VLLM_CPU_KVCACHE_SPACE``)."""
    import torch

    if not torch.cuda.is_available():
        return [s for _, s in named]
    return with_gpu_shares(named, torch.cuda.get_device_properties(0).total_memory)


def _parameters(folder: Path) -> int:
    """Parameters in the folder's safetensors files, from their headers (the tensors are not read)."""
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


def _text_config(folder: Path) -> dict:
    """``config.json``, or its ``text_config`` (a multimodal model's language model)."""
    config = json.loads((folder / "config.json").read_text())
    return {**config, **config.get("text_config", {})}


def _kv_per_token(config: dict) -> int:
    """K and V elements per token over the layers that keep them (hybrid models' linear layers keep none)."""
    types = config.get("layer_types")
    layers = sum(t in ATTENTION_LAYERS for t in types) if types else config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * layers * config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim

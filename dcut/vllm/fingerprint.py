"""The fingerprint a cost table is keyed by, derived one way only: from the ``VllmConfig`` an engine
runs with, and the accelerator it runs on. Before an engine exists (a replica asking the controller for a table),
the same config is built from the engine's arguments, so vLLM resolves ``dtype: auto``/``half`` and the CUDA graph
mode the way the engine will; the hardware is read as vLLM reads it for the engine, so a replica that holds no GPU
itself (its engine's workers do: ``num_gpus: 0``) still names the GPU, as the engine's worker does."""

from __future__ import annotations

from typing import Any

import dcut
from dcut.cost_table import Fingerprint, current_hardware
from dcut.settings import EngineSettings
from dcut.vllm.engine import engine_kwargs


def fingerprint_for(vllm_config: Any) -> Fingerprint:
    """What a cost table of this engine depends on."""
    import vllm

    spec = vllm_config.speculative_config
    return Fingerprint(
        hardware=engine_hardware(), model=str(vllm_config.model_config.model),
        drafter=str(spec.model) if spec is not None else None,
        k=spec.num_speculative_tokens if spec is not None else 0,
        tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
        dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
        cudagraph_mode=vllm_config.compilation_config.cudagraph_mode.name,
        enforce_eager=vllm_config.model_config.enforce_eager,
        vllm_version=vllm.__version__, dcut_version=dcut.__version__)


def engine_hardware() -> str:
    """The GPU as vLLM's platform names it (NVML; a process without a visible GPU on a GPU node, such as a replica
    whose engine workers hold the GPUs, reads GPU 0 there, as vLLM does for an engine launched from it), else the
    CPU's model and core count."""
    from vllm.platforms import current_platform

    return current_platform.get_device_name(0) if current_platform.is_cuda_alike() else current_hardware()


def fingerprint(settings: EngineSettings) -> Fingerprint:
    """The fingerprint the engine built from ``settings`` will give its cost table."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return fingerprint_for(AsyncEngineArgs(**engine_kwargs(settings)).create_engine_config())

"""The fingerprint a cost table is keyed by, derived one way only: from the ``VllmConfig`` an engine
runs with. Before an engine exists (a replica asking the controller for a table), the same config is
built from the engine's arguments, so vLLM resolves ``dtype: auto``/``half`` the way the engine will."""

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
        hardware=current_hardware(), model=str(vllm_config.model_config.model),
        drafter=str(spec.model) if spec is not None else None,
        k=spec.num_speculative_tokens if spec is not None else 0,
        tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
        dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
        vllm_version=vllm.__version__, dcut_version=dcut.__version__)


def fingerprint(settings: EngineSettings) -> Fingerprint:
    """The fingerprint the engine built from ``settings`` will give its cost table."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return fingerprint_for(AsyncEngineArgs(**engine_kwargs(settings)).create_engine_config())

"""vLLM's configuration as it resolves on a CUDA GPU, built on this CPU: the platform checks patched.

``with cuda_like():`` puts an H100-like ``CudaPlatformBase`` (vLLM's own CUDA platform logic, device queries
answered by hand) wherever vLLM holds its ``current_platform``, and says Triton is there (the V2 runner's
condition), so ``AsyncEngineArgs(...).create_engine_config()`` runs vLLM's CUDA branches: the runner, async
scheduling and CUDA graph defaults a GPU user gets. Nothing runs on a device; only the configuration is built.
On leaving, every module holds vLLM's CPU platform again, those first imported inside included (they took the
CUDA one by name: left so, a later CPU engine of the test run would be configured for CUDA).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest


@contextmanager
def cuda_like() -> Iterator[Any]:
    """vLLM's platform a CUDA one inside; the platform object."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        cpu, cuda = _patch(monkeypatch)
        try:
            yield cuda
        finally:
            for module in list(sys.modules.values()):
                if getattr(module, "__dict__", {}).get("current_platform") is cuda:
                    module.current_platform = cpu


def _patch(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    from dcut.vllm import patches

    patches.install()  # the plugin imports vLLM modules that need the real (CPU) platform: before the swap
    # the CUDA platform module imports this compiled extension for its side effects only; the CPU wheel lacks it
    monkeypatch.setitem(sys.modules, "vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    import vllm.config.vllm
    import vllm.platforms
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    class H100(CudaPlatformBase):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(9, 0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H100 80GB HBM3"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 80 * 2**30

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

    cpu, cuda = vllm.platforms.current_platform, H100()
    monkeypatch.setattr(vllm.platforms, "current_platform", cuda)
    for module in list(sys.modules.values()):  # modules that imported it by name
        if getattr(module, "__dict__", {}).get("current_platform") is cpu:
            monkeypatch.setattr(module, "current_platform", cuda)
    monkeypatch.setattr(vllm.config.vllm, "HAS_TRITON", True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    return cpu, cuda


def engine_config(settings: Any, **extra: Any) -> Any:
    """The ``VllmConfig`` the engine built from ``settings`` (``EngineSettings``) gets, with ``extra`` engine
    arguments."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from dcut.vllm.engine import engine_kwargs

    return AsyncEngineArgs(**engine_kwargs(settings), **extra).create_engine_config()

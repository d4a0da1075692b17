"""The single door from the deployments to the D-Cut vLLM plugin (``dcut.vllm``).

``engine_kwargs``, ``fingerprint``, ``read_stats`` and ``read_cost_table`` come from the plugin when it
is importable. Until it lands (or where it fails to import), the stand-ins below keep the same
signatures so the serving layer can be built and tested: they build a plain vLLM engine (no D-Cut),
fingerprint the settings and hardware, and report no D-Cut telemetry and no cost table.
"""

from __future__ import annotations

import inspect
import logging
import os
import platform
from typing import Any

from dcut.settings import EngineSettings

logger = logging.getLogger(__name__)


# ---- stand-ins (used only while dcut.vllm is missing) -----------------------------------------

def _standin_engine_kwargs(settings: EngineSettings) -> dict:
    """Minimal ``AsyncEngineArgs`` kwargs: target, drafter, sizes. No D-Cut wiring."""
    kw: dict[str, Any] = dict(
        model=settings.model,
        tokenizer=settings.model,
        dtype=settings.dtype,
        tensor_parallel_size=settings.tensor_parallel_size,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
        enforce_eager=settings.enforce_eager,
        seed=settings.seed,
    )
    if settings.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = settings.max_num_batched_tokens
    if settings.served_model_name:
        kw["served_model_name"] = [settings.served_model_name]
    if settings.method != "none":
        kw["speculative_config"] = {"method": settings.method, "model": settings.draft,
                                    "num_speculative_tokens": settings.num_speculative_tokens}
    return kw


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _standin_fingerprint(settings: EngineSettings) -> dict:
    return {"model": settings.model, "draft": settings.draft, "method": settings.method,
            "num_speculative_tokens": settings.num_speculative_tokens,
            "tensor_parallel_size": settings.tensor_parallel_size, "dtype": settings.dtype,
            "device": _cpu_name()}


async def _standin_read_stats(engine) -> dict:
    return {}


async def _standin_read_cost_table(engine) -> dict | None:
    return None


# ---- the plugin, when present -------------------------------------------------------------------
# DCUT_PLUGIN=off forces the stand-ins (pair it with VLLM_PLUGINS=none so vLLM skips the plugin too).

def _load() -> tuple[dict, bool]:
    found = {"engine_kwargs": _standin_engine_kwargs, "fingerprint": _standin_fingerprint,
             "read_stats": _standin_read_stats, "read_cost_table": _standin_read_cost_table}
    if os.environ.get("DCUT_PLUGIN", "on").lower() in ("off", "0", "false"):
        return found, False
    try:
        from dcut.vllm import api, engine  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - the plugin is optional for the serving layer
        logger.warning("dcut.vllm not importable (%s): engines run without D-Cut", e)
        return found, False
    found["engine_kwargs"] = engine.engine_kwargs
    found["fingerprint"] = getattr(api, "fingerprint", _standin_fingerprint)
    for name in ("read_stats", "read_cost_table"):  # async forms: aread_* or async read_*
        fn = getattr(api, "a" + name, None) or getattr(api, name, None)
        if fn is not None and inspect.iscoroutinefunction(fn):
            found[name] = fn
    return found, True


_found, HAVE_PLUGIN = _load()
engine_kwargs = _found["engine_kwargs"]
fingerprint = _found["fingerprint"]
read_stats = _found["read_stats"]
read_cost_table = _found["read_cost_table"]

__all__ = ["engine_kwargs", "fingerprint", "read_stats", "read_cost_table", "HAVE_PLUGIN"]

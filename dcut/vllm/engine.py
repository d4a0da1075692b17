"""Engine settings -> vLLM engine arguments, with D-Cut wired in. The one door to build engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from dcut.settings import EngineSettings

Section = TypeVar("Section", bound=BaseModel)

WORKER_EXTENSION = "dcut.vllm.worker.DCutWorkerExtension"


def engine_kwargs(settings: EngineSettings) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(**kw)`` and ``AsyncEngineArgs(**kw)``. vLLM's defaults stand for what is
    left unset (an engine without D-Cut runs as a user of vLLM would run it); a D-Cut or SpecExit engine changes
    what it must at ``VllmConfig.__post_init__`` (``dcut.vllm.engine_config``)."""
    k = settings.num_speculative_tokens
    kw: dict[str, Any] = dict(
        model=str(Path(settings.model)),
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens
        or max(2048, settings.max_model_len, settings.max_num_seqs * (k + 1)),
        tensor_parallel_size=settings.tensor_parallel_size,
        enforce_eager=settings.enforce_eager,
        seed=settings.seed,
        worker_extension_cls=WORKER_EXTENSION,
    )
    if settings.distributed_executor_backend:
        kw["distributed_executor_backend"] = settings.distributed_executor_backend
    if settings.served_model_name:
        kw["served_model_name"] = settings.served_model_name
    if settings.prefix_caching is not None:
        kw["enable_prefix_caching"] = settings.prefix_caching
    if settings.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = settings.gpu_memory_utilization
    if settings.async_scheduling is not None:
        kw["async_scheduling"] = settings.async_scheduling
    if settings.method != "none":
        if not settings.draft:
            raise ValueError(f"method {settings.method!r} needs a drafter path (settings.draft)")
        kw["speculative_config"] = {"method": settings.method, "model": str(Path(settings.draft)),
                                    "num_speculative_tokens": k}
        if settings.spec_schedule:
            kw["speculative_config"]["num_speculative_tokens_per_batch_size"] = [
                list(r) for r in settings.spec_schedule]
        extra = {"dcut": settings.dcut, "specexit": settings.specexit}
        if extra := {name: s.model_dump(mode="json") for name, s in extra.items() if s is not None}:
            kw["additional_config"] = extra
    return kw


def additional_settings(vllm_config: Any, name: str, model: type[Section]) -> Section | None:
    """The validated ``additional_config[name]`` of an engine (as ``engine_kwargs`` writes it), or None when the
    engine does not ask for it: a bad setting raises, with its name."""
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict) or extra.get(name) is None:
        return None
    raw = extra[name]
    return raw if isinstance(raw, model) else model.model_validate(raw)

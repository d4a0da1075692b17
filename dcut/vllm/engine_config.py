"""An engine's configuration, as D-Cut needs it: validated at ``VllmConfig.__post_init__``.

An engine that asks for D-Cut or SpecExit (``additional_config``) has its settings validated here, so a bad
setting stops the engine before anything loads; what D-Cut cannot live with is turned off for that engine alone,
one log line each (async scheduling, full CUDA graphs, the V2 model runner; ``docs/gpu.md`` says why). On a vLLM
other than the one the patches were written for, such an engine is refused; an engine that asks for neither is
left exactly as vLLM built it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from dcut.vllm import EXPECTED_VLLM_VERSION
from dcut.vllm.specexit import engine_settings
from dcut.vllm.state import settings_from_config

logger = logging.getLogger("vllm.dcut")

CONFIDENT_METHODS = ("dflash", "draft_model", "eagle", "eagle3")


def wrap_post_init(original: Callable[..., Any], installed: str | None = None) -> Callable[..., Any]:
    """Wraps ``vllm.config.VllmConfig.__post_init__``: validate, then make the config one D-Cut can run.
    ``installed``: the vLLM version (read from ``vllm`` when not given)."""
    if installed is None:
        import vllm

        installed = vllm.__version__
    mismatch = installed if installed != EXPECTED_VLLM_VERSION else None

    def __post_init__(self: Any) -> None:  # noqa: N807
        # both validate: a bad setting stops the engine here
        if settings_from_config(self) is not None or engine_settings(self) is not None:
            if mismatch:
                raise RuntimeError(f"D-Cut was written for vLLM {EXPECTED_VLLM_VERSION}; "
                                   f"vLLM {mismatch} is installed")
            _make_config_compatible(self)
        original(self)
    return __post_init__


def _make_config_compatible(config: Any) -> None:
    spec = config.speculative_config
    if engine_settings(config) is not None and (spec is None or spec.method != "dflash"):
        raise ValueError(f"additional_config.specexit reads a DFlash drafter's signals; speculative method is "
                         f"{None if spec is None else spec.method!r}")
    if settings_from_config(config) is not None and (spec is None or spec.method not in CONFIDENT_METHODS):
        method = None if spec is None else spec.method
        raise ValueError(f"additional_config.dcut needs a drafter that gives confidences "
                         f"({', '.join(CONFIDENT_METHODS)}); speculative method is {method!r}")
    if config.attention_config.hisparse_config is not None or getattr(config, "watermark_config", None) is not None:
        raise ValueError("D-Cut and SpecExit run on vLLM's V1 model runner; HiSparse and watermarking need the V2 one")
    if config.scheduler_config.async_scheduling is not False:
        logger.info("D-Cut: async scheduling turned off (drafts are cut before the next schedule)")
        config.scheduler_config.async_scheduling = False
    from vllm.config import CUDAGraphMode

    # Set here, before vLLM's __post_init__: left unset (None), vLLM resolves FULL_AND_PIECEWISE on CUDA. D-Cut
    # changes the verify length every step, as vLLM's per-batch-size K does, for which vLLM itself forces
    # PIECEWISE on the V1 runner "for reliability". enforce_eager still ends at NONE (vLLM sets it later).
    mode = config.compilation_config.cudagraph_mode
    if mode is None or mode.has_full_cudagraphs():
        logger.info("D-Cut: piecewise CUDA graphs (drafts per step vary), not %s", mode)
        config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE


def asks_for_dcut(config: Any) -> bool:
    """The engine asks for D-Cut or SpecExit (``additional_config``): cheap, read on every runner choice."""
    extra = getattr(config, "additional_config", None)
    return isinstance(extra, dict) and any(extra.get(name) is not None for name in ("dcut", "specexit"))


def wrap_use_v2_model_runner(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """Wraps the getter of ``vllm.config.VllmConfig.use_v2_model_runner``: the V1 runner for an engine that asks for
    D-Cut or SpecExit (their hooks are on V1's ``GPUModelRunner``), vLLM's own choice for any other. Per config, so
    a later engine of the process (a baseline in ``dcut compare``) still gets vLLM's default."""
    def use_v2_model_runner(self: Any) -> bool:
        return False if asks_for_dcut(self) else original(self)
    return use_v2_model_runner

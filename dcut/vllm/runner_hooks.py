"""Everything dcut-serve keeps for one vLLM model runner, in one object: ``RunnerHooks``.

It is the only thing hung on vLLM's objects: once on the model runner, and the same object on its
drafter (whose wrapped methods have no way back to the runner). Created at the first wrapped call on the
runner (the worker's warm-up, or the first step), with SpecExit first: a pair SpecExit cannot run on fails
there, at start-up. For an engine that asks for neither D-Cut nor SpecExit every field is None and the
drafter is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dcut.vllm.catch_up import ContextStash
from dcut.vllm.draft_pass import DraftPass
from dcut.vllm.fingerprint import fingerprint_for
from dcut.vllm.specexit import RunnerSpecExit
from dcut.vllm.state import RunnerDCut, settings_from_config
from dcut.vllm.step_clock import timer_for

ATTRIBUTE = "_dcut_hooks"  # the one attribute set on a vLLM model runner and on its drafter


@dataclass
class RunnerHooks:
    """D-Cut's and SpecExit's state for one model runner."""

    dcut: RunnerDCut | None  # None: the engine does not ask for D-Cut (or has no drafter)
    specexit: RunnerSpecExit | None  # None: SpecExit off
    stash: ContextStash | None  # width-0 drafter context, DFlash with mode joint and zero_width=catch_up only
    draft: DraftPass | None = None  # the drafter's current or last pass (D-Cut on only)

    @classmethod
    def build(cls, runner: Any) -> RunnerHooks:
        specexit = RunnerSpecExit.from_config(runner.vllm_config)
        settings = settings_from_config(runner.vllm_config)
        dcut = stash = None
        if settings is not None and runner.speculative_config is not None:
            dcut = RunnerDCut(settings, fingerprint_for(runner.vllm_config), runner.num_spec_tokens,
                              timer=timer_for(runner.device))
            if dcut.joint and settings.zero_width == "catch_up" and runner.speculative_config.method == "dflash":
                stash = ContextStash(host=runner.device.type == "cpu")
        return cls(dcut, specexit, stash)


def hooks_for(runner: Any) -> RunnerHooks:
    """The runner's hooks, created (and handed to its drafter) on first use."""
    hooks = runner.__dict__.get(ATTRIBUTE)
    if hooks is None:
        hooks = RunnerHooks.build(runner)
        setattr(runner, ATTRIBUTE, hooks)
        drafter = getattr(runner, "drafter", None)
        if drafter is not None and (hooks.dcut is not None or hooks.specexit is not None):
            setattr(drafter, ATTRIBUTE, hooks)
    return hooks


def drafter_hooks(drafter: Any) -> RunnerHooks | None:
    """The hooks of the runner that owns this drafter; None before the runner's first hooked call, or when
    neither D-Cut nor SpecExit is on."""
    return drafter.__dict__.get(ATTRIBUTE)


def runner_dcut(runner: Any) -> RunnerDCut | None:
    """The D-Cut state of a model runner; None when D-Cut is off."""
    return hooks_for(runner).dcut


def runner_specexit(runner: Any) -> RunnerSpecExit | None:
    """The SpecExit state of a model runner; None when SpecExit is off."""
    return hooks_for(runner).specexit

"""Where an engine step's time goes, per mode: timers around the engine's parts while a comparison runs.

A mode's tokens/s says which mode is faster, not why. Width 0 pinned against plain decoding is the case in point:
the two engines run the same target step, and what separates them is the target's forward in a speculative engine
(a DFlash target also returns the hidden states the drafter reads), the drafter's pass, and D-Cut's own work each
step. ``StepBreakdown`` wraps those parts (the vLLM methods and D-Cut's hooks below) in wall-clock timers for the
timed runs only (in-process engines: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as every benchmark here runs) and
reports milliseconds per engine step. Parts nest (the engine step holds all of them; ``execute_model`` the target
forward), so they are read side by side, not summed. A timer costs about a microsecond a call.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

# (module, class, method, what it is), in the order a step runs them
PARTS: tuple[tuple[str, str, str, str], ...] = (
    # LLMEngine's, not EngineCore's: the core binds its own step method once, at start (``step_fn``)
    ("vllm.v1.engine.llm_engine", "LLMEngine", "step", "engine step"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "scheduler"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", "execute_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs", "inputs"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward", "target forward"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens", "sampling + drafting"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "propose_draft_token_ids", "drafting (width 0: D-Cut's)"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "take_draft_token_ids", "draft hand-over (D-Cut's cut)"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", "scheduler update"),
    ("dcut.vllm.state", "RunnerDCut", "begin_step", "D-Cut begin_step"),
    ("dcut.vllm.state", "RunnerDCut", "choose_width", "D-Cut choose_width"),
    ("dcut.vllm.state", "RunnerDCut", "on_drafted", "D-Cut on_drafted"),
    ("dcut.vllm.state", "RunnerDCut", "cut", "D-Cut cut"),
)
STEP = "engine step"


class StepBreakdown:
    """Timers around ``PARTS`` while installed; time is booked to the label set by ``measuring``."""

    def __init__(self, parts: tuple[tuple[str, str, str, str], ...] = PARTS,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.parts, self._clock = parts, clock
        self._label: str | None = None
        self._seconds: dict[tuple[str, str], float] = defaultdict(float)
        self._calls: dict[tuple[str, str], int] = defaultdict(int)
        self._originals: list[tuple[type, str, Any]] = []

    def __enter__(self) -> StepBreakdown:
        for module, cls_name, method, name in self.parts:
            cls = getattr(importlib.import_module(module), cls_name)
            original = cls.__dict__[method]  # KeyError: this vLLM has no such method, the breakdown would lie
            self._originals.append((cls, method, original))
            setattr(cls, method, self._timed(original, name))
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, method, original in reversed(self._originals):
            setattr(cls, method, original)
        self._originals.clear()

    def _timed(self, original: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            label = self._label
            if label is None:
                return original(*args, **kwargs)
            start = self._clock()
            try:
                return original(*args, **kwargs)
            finally:
                self._seconds[(label, name)] += self._clock() - start
                self._calls[(label, name)] += 1
        return timed

    def measuring(self, label: str | None) -> None:
        """Book what runs from now on to ``label`` (None: to nothing, e.g. during warm-up)."""
        self._label = label

    def per_step(self, label: str) -> dict[str, float]:
        """Milliseconds per engine step of each part timed under ``label`` (parts never called are left out)."""
        steps = self._calls.get((label, STEP), 0)
        if not steps:
            return {}
        return {name: 1000.0 * self._seconds[(label, name)] / steps
                for _, _, _, name in self.parts if self._calls.get((label, name))}

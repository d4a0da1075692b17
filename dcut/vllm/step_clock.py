"""Step timers: when the device did a stage of a step's work, not when the host launched it (issue 61, item 2).

``RunnerDCut`` times the target's part of a step (``verify_ms``), the drafter's (``draft_ms``), the catch-up flush
and the engine's gap between steps; they refine the cost table and price the widths. On a GPU the host returns from a
launch at once, so a host timer around the target's forward measures its launch (a cost table refined on that drifts
down to nothing). A timer here *marks* points in the device's work and reads the time between two marks later, where
the engine has already waited for them: ``RunnerDCut.cut`` runs after vLLM's ``take_draft_token_ids`` waited for the
draft tokens' copy to the host, which follows every mark of the step (vLLM 0.32's ``sample_tokens`` starts that copy
after ``propose_draft_token_ids`` returns).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch


class StepTimer(Protocol):
    """Marks in a device's work, and the milliseconds between two of them."""

    def mark(self) -> Any:
        """A point in the device's work, enqueued now (reached when the device has done what came before)."""
        ...

    def ms(self, start: Any, end: Any) -> float:
        """Milliseconds of device time from ``start`` to ``end``; read where the engine has waited for ``end``."""
        ...


class HostTimer:
    """A device that has done its work when the call that gave it returns (the CPU): its clock is the host's."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        """``clock``: seconds, monotonic (replay passes its simulated clock)."""
        self._clock = clock

    def mark(self) -> float:
        return self._clock()

    def ms(self, start: float, end: float) -> float:
        return (end - start) * 1000.0


class EventTimer:
    """A CUDA device: a mark is a timing event recorded on the current stream, timed by the device itself."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()  # (returns at once where it is read: the engine has waited for later work)
        return start.elapsed_time(end)


def timer_for(device: torch.device) -> StepTimer:
    """Device events on CUDA; the host clock where the device is the host."""
    return EventTimer() if device.type == "cuda" else HostTimer()

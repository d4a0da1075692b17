"""What a replayed policy sees and decides: the interface every policy in replay implements.

Replay calls, per step of a simulated batch of ``bs`` requests: ``width(bs, last)`` before drafting
(``last``: what the previous step's verification showed), then ``keep(log_conf)`` on the drafts of
that width (``[bs, width]`` natural-log confidences) for per-request keep depths. Widths must be
among the ``widths`` the policy was built with (those the trace holds, plus 0). A policy with ``decides`` true
pays D-Cut's host work on each step (``dcut.replay.costs.CostModel.host_ms``); other engines' rules do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Verified:
    """The outcome of one step's verification, as an engine sees it after the step."""

    width: int  # the width the verified drafts were drafted at
    kept: np.ndarray  # [bs] drafts verified per request
    accepted: np.ndarray  # [bs] drafts accepted per request (<= kept)
    step_ms: float  # the whole step that produced them: verify + draft + engine overhead


class Policy(Protocol):
    """A decision rule under replay."""

    name: str

    def width(self, bs: int, last: Verified | None) -> int:
        """How many positions to draft this step (0: none)."""
        ...

    def keep(self, log_conf: np.ndarray) -> np.ndarray:
        """Keep depths ``[bs]`` (ints in ``[0, width]``) for drafts ``[bs, width]``."""
        ...


class FixedWidth:
    """Draft ``w`` every step and verify all of it: ``none`` (no speculation) at 0, vLLM's fixed K otherwise."""

    def __init__(self, w: int, name: str | None = None) -> None:
        self.w = w
        self.name = name or ("none" if w == 0 else f"fixed-{w}")

    def width(self, bs: int, last: Verified | None) -> int:
        return self.w

    def keep(self, log_conf: np.ndarray) -> np.ndarray:
        return np.full(log_conf.shape[0], log_conf.shape[1], dtype=np.int64)


def nearest_width(want: int, widths: list[int]) -> int:
    """The largest available width not above ``want`` (0 when none is)."""
    below = [w for w in widths if w <= want]
    return max(below) if below else 0

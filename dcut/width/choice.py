"""The joint choice itself: each candidate width's best uniform depth and estimated tokens/s of the whole
step, and the pick among them with hysteresis (the formula is in ``dcut.width``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_WIDTHS = (0, 1, 2, 3, 5, 7, 11, 15)


def widths_for(k: int, widths: Sequence[int] | None = None) -> list[int]:
    """The candidate widths for an engine drafting at most ``k``: the default set (0 and k always
    in), or exactly the given ones that fit (``[0]`` pins width 0: a diagnostic and a baseline)."""
    if widths is None:
        return sorted({w for w in DEFAULT_WIDTHS if w <= k} | {0, k})
    return sorted({w for w in widths if 0 <= w <= k}) or [0]


@dataclass(frozen=True)
class WidthChoice:
    """The outcome of ``choose_width``: the width, its best uniform depth and their estimate."""

    width: int
    depth: int
    tokens_per_step: float
    step_ms: float

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tokens_per_step / self.step_ms if self.step_ms > 0 else 0.0


def width_utilities(bs: int, widths: Sequence[int], survival: np.ndarray,
                    verify_ms: Callable[[int, np.ndarray], np.ndarray | None],
                    draft_ms: Callable[[int, np.ndarray], np.ndarray | None],
                    overhead_ms: Callable[[np.ndarray], np.ndarray]) -> list[WidthChoice | None]:
    """The best (depth, estimate) of each width; all None where a cost is unknown for this batch size.

    The engine's work outside the model (scheduling, sampled-token bookkeeping, detokenising the
    outputs) grows with the tokens a step emits: ``overhead_ms(tokens)`` prices it.

    Vectorised over widths and depths (it runs before every drafting pass): one cost lookup for
    all verify sizes ``bs * (1 + d)``, one for all widths.
    """
    costs = step_costs(bs, widths, survival.shape[1], verify_ms, draft_ms)
    return utilities_at(bs, widths, survival, costs, overhead_ms)


def step_costs(bs: int, widths: Sequence[int], k: int, verify_ms: Callable[[int, np.ndarray], np.ndarray | None],
               draft_ms: Callable[[int, np.ndarray], np.ndarray | None]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(verify [k + 1], draft [len(widths)])``: the verify cost at each uniform depth ``0..k`` and the drafter's
    at each width, for steps of ``bs``; None where either is unknown. Apart from ``utilities_at`` so that one
    decision can weigh several acceptance curves at the cost of one lookup."""
    verify = verify_ms(bs, bs * (1 + np.arange(k + 1)))
    draft = draft_ms(bs, np.asarray(widths))
    return None if verify is None or draft is None else (verify, draft)


def utilities_at(bs: int, widths: Sequence[int], survival: np.ndarray,
                 costs: tuple[np.ndarray, np.ndarray] | None,
                 overhead_ms: Callable[[np.ndarray], np.ndarray]) -> list[WidthChoice | None]:
    """``width_utilities`` on costs already looked up (``step_costs``)."""
    if costs is None:
        return [None] * len(widths)
    verify, draft = costs
    depths = np.arange(survival.shape[1] + 1)
    gains = np.concatenate([np.zeros((len(widths), 1)), np.cumsum(survival, axis=1)], axis=1)
    tokens = bs * (1.0 + gains)
    step = verify[None, :] + draft[:, None] + overhead_ms(tokens)
    rate = np.where(depths[None, :] <= np.asarray(widths)[:, None], tokens / step, -np.inf)
    best = rate.argmax(axis=1)
    rows = np.arange(len(widths))
    return [WidthChoice(int(w), int(d), float(t), float(ms))
            for w, d, t, ms in zip(widths, best, tokens[rows, best], step[rows, best], strict=True)]


def choose_width(choices: Sequence[WidthChoice | None], current: int | None, hysteresis: float,
                 noise: Callable[[int], float] | None = None) -> WidthChoice | None:
    """The best width, kept at ``current`` unless another beats it by more than ``hysteresis`` and by more
    than twice the combined standard error of the two estimates (``noise(w)``: relative standard error).

    Switching has a price the estimate does not see (a new width's acceptance is less known, the
    estimate is noisy); hysteresis keeps the choice from flapping between near-equal widths, and the
    standard errors keep a lucky stretch of requests from passing for a better width (at bs 1 one
    request's acceptance swings a width's measured rate by half).
    """
    valid = [c for c in choices if c is not None]
    if not valid:
        return None
    best = max(valid, key=lambda c: c.tokens_per_s)
    held = next((c for c in valid if c.width == current), None)
    if held is None or best is held:
        return best
    margin = hysteresis
    if noise is not None:
        margin = max(margin, 2.0 * (noise(best.width) ** 2 + noise(held.width) ** 2) ** 0.5)
    return held if best.tokens_per_s <= (1.0 + margin) * held.tokens_per_s else best

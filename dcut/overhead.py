"""The engine's time per step outside the model, fitted as a line in the tokens a step emits.

The width choice (``dcut.width``) adds it to a step's model costs from the cost table; replay fits the same
line to a recorded trace (``dcut.replay.cases``).
"""

from __future__ import annotations

import numpy as np


class EngineOverhead:
    """The engine's time per step outside the model (scheduling, bookkeeping, detokenising the
    outputs), as ``a + b * tokens emitted``, fitted by least squares on recent steps.

    Measured between the end of one step's drafting and the start of the next step. Samples are
    clipped to ``max_ms`` (an idle engine, a pause between requests, is not overhead); the fit is
    redone every ``refit`` samples and kept non-negative; with too little spread in tokens it is a
    single per-token rate.
    """

    def __init__(self, window: int = 256, refit: int = 64, max_ms: float = 50.0) -> None:
        # ``refit``: a fit is a few small numpy ops, ~0.2 ms on a CPU engine with its caches cold after the forward
        # (every 16 samples it was 0.013 ms of each width-0 step at bs 1); the line moves over hundreds of steps.
        # The last ``window`` samples in place, in ring order: Python lists, a sample written each engine step (into
        # numpy arrays, two scalar writes cost 0.012 ms of a width-0 step at bs 1, caches cold), read as arrays by
        # a fit every ``refit`` steps (flat lists convert in microseconds; a deque of tuples took 70 us).
        self._tokens, self._ms = [0.0] * window, [0.0] * window
        self._count = self._next = 0
        self.refit, self.max_ms = refit, max_ms
        self.per_step_ms, self.per_token_ms = 0.0, 0.0
        self._since = 0

    def add(self, tokens: int, ms: float) -> None:
        if tokens <= 0 or not 0.0 <= ms <= self.max_ms:
            return
        self._tokens[self._next], self._ms[self._next] = tokens, ms
        self._next = (self._next + 1) % len(self._tokens)
        self._count = min(self._count + 1, len(self._tokens))
        self._since += 1
        if self._since >= self.refit or self._count < self.refit:
            self._since = 0
            self._fit()

    def ms(self, tokens: float | np.ndarray) -> float | np.ndarray:
        return self.per_step_ms + self.per_token_ms * tokens

    def _fit(self) -> None:
        n = self._count
        tokens, ms = np.array(self._tokens[:n], dtype=float), np.array(self._ms[:n], dtype=float)
        self.per_step_ms, self.per_token_ms = linear_fit(tokens, ms, min_points=8, min_spread=0.2)


def linear_fit(x: np.ndarray, y: np.ndarray, min_points: int = 2, min_spread: float = 0.0) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` with both terms non-negative, where there are ``min_points`` points whose
    ``x`` spans more than ``min_spread`` of its mean; otherwise (or if a term would be negative) ``a = 0`` and
    ``b`` the median of ``y / x``."""
    if len(x) >= min_points and np.ptp(x) > min_spread * np.mean(x):
        dx = x - x.mean()  # the normal equations of a line (np.polyfit's SVD cost 80 us here, in a step)
        b = float(dx @ (y - y.mean()) / (dx @ dx))
        a = float(y.mean()) - b * float(x.mean())
        if a >= 0 and b >= 0:
            return a, b
    return 0.0, float(np.median(y / np.maximum(x, 1e-9)))

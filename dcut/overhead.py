"""The engine's time per step outside the model, fitted as a line in the tokens a step emits.

The width choice (``dcut.width``) adds it to a step's model costs from the cost table; replay fits the same
line to a recorded trace (``dcut.replay.cases``).
"""

from __future__ import annotations

from collections import deque

import numpy as np


class EngineOverhead:
    """The engine's time per step outside the model (scheduling, bookkeeping, detokenising the
    outputs), as ``a + b * tokens emitted``, fitted by least squares on recent steps.

    Measured between the end of one step's drafting and the start of the next step. Samples are
    clipped to ``max_ms`` (an idle engine, a pause between requests, is not overhead); the fit is
    redone every ``refit`` samples and kept non-negative; with too little spread in tokens it is a
    single per-token rate.
    """

    def __init__(self, window: int = 256, refit: int = 16, max_ms: float = 50.0) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self.refit, self.max_ms = refit, max_ms
        self.per_step_ms, self.per_token_ms = 0.0, 0.0
        self._since = 0

    def add(self, tokens: int, ms: float) -> None:
        if tokens <= 0 or not 0.0 <= ms <= self.max_ms:
            return
        self._samples.append((float(tokens), ms))
        self._since += 1
        if self._since >= self.refit or len(self._samples) < self.refit:
            self._since = 0
            self._fit()

    def ms(self, tokens: float | np.ndarray) -> float | np.ndarray:
        return self.per_step_ms + self.per_token_ms * tokens

    def _fit(self) -> None:
        data = np.asarray(self._samples)
        self.per_step_ms, self.per_token_ms = linear_fit(data[:, 0], data[:, 1], min_points=8, min_spread=0.2)


def linear_fit(x: np.ndarray, y: np.ndarray, min_points: int = 2, min_spread: float = 0.0) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` with both terms non-negative, where there are ``min_points`` points whose
    ``x`` spans more than ``min_spread`` of its mean; otherwise (or if a term would be negative) ``a = 0`` and
    ``b`` the median of ``y / x``."""
    if len(x) >= min_points and np.ptp(x) > min_spread * np.mean(x):
        b, a = np.polyfit(x, y, 1)
        if a >= 0 and b >= 0:
            return float(a), float(b)
    return 0.0, float(np.median(y / np.maximum(x, 1e-9)))

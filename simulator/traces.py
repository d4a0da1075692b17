"""Demand traces, one value a second, as a fraction of what the fleet serves at the reference utilisation (1.0:
the fleet size is exactly what the demand needs)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

TraceName = Literal["step", "ramp", "diurnal", "bursty"]
TRACES: tuple[TraceName, ...] = ("step", "ramp", "diurnal", "bursty")
STEP_AT_S = 300


@dataclass(frozen=True)
class Trace:
    """Demand per second; ``smooth`` is the same without noise, the baseline for counting flaps."""

    name: TraceName
    fraction: np.ndarray
    smooth: np.ndarray
    step_at_s: int | None = None

    @property
    def duration_s(self) -> int:
        return len(self.fraction)


def ou_noise(n: int, sigma: float, tau_s: float, rng: np.random.Generator) -> np.ndarray:
    """Relative noise with a correlation time (an Ornstein-Uhlenbeck walk in 1 s steps): traffic wanders for
    minutes; it does not jump independently every second, which the look-back average would hide."""
    a = math.exp(-1.0 / tau_s)
    shocks = rng.normal(0.0, sigma * math.sqrt(1 - a * a), n)
    out = np.empty(n)
    x = rng.normal(0.0, sigma)
    for i in range(n):
        x = a * x + shocks[i]
        out[i] = x
    return out


def make_trace(name: TraceName, seed: int = 0, noise: float = 0.03, noise_tau_s: float = 120.0) -> Trace:
    """step: 10% -> 100% at 5 min, 15 min more; ramp: 10% -> 100% over an hour, 10 min held, back over an hour;
    diurnal: a real day, 10% at midnight to 100% at noon; bursty: 30% with bursts of 1.5-3x lasting 30 s-5 min,
    about every 10 min, for 4 hours. All but the step carry ``noise`` (relative, correlated over ``noise_tau_s``)."""
    rng = np.random.default_rng(seed)
    if name == "step":
        t = np.arange(STEP_AT_S + 900)
        smooth = np.where(t < STEP_AT_S, 0.1, 1.0)
        return Trace(name, smooth, smooth, STEP_AT_S)
    if name == "ramp":
        hold, ramp = 600, 3600
        smooth = np.concatenate([np.full(hold, 0.1), np.linspace(0.1, 1.0, ramp), np.full(hold, 1.0),
                                 np.linspace(1.0, 0.1, ramp), np.full(hold, 0.1)])
    elif name == "diurnal":
        smooth = 0.55 - 0.45 * np.cos(2 * np.pi * np.arange(86_400) / 86_400)
    elif name == "bursty":
        n = 4 * 3600
        smooth = np.full(n, 0.3)
        start = 0.0
        while (start := start + rng.exponential(600.0)) < n:
            length = int(rng.uniform(30, 300))
            smooth[int(start):int(start) + length] *= rng.uniform(1.5, 3.0)
    else:
        raise ValueError(f"unknown trace {name!r}; choose from {', '.join(TRACES)}")
    fraction = np.clip(smooth * (1 + ou_noise(len(smooth), noise, noise_tau_s, rng)), 0.0, None)
    return Trace(name, fraction, smooth)

"""The engine's time per step outside the model, as a line in the tokens a step emits (``dcut.overhead``)."""

from __future__ import annotations

import numpy as np
import pytest

from dcut.overhead import EngineOverhead, linear_fit


def test_the_line_is_the_least_squares_line() -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(1, 65, 200).astype(float)
    y = 0.4 + 0.02 * x + rng.normal(0, 0.05, 200)
    a, b = linear_fit(x, y)
    slope, intercept = np.polyfit(x, y, 1)
    assert (a, b) == pytest.approx((intercept, slope), rel=1e-9)
    assert (a, b) == pytest.approx((0.4, 0.02), abs=0.03)


def test_too_little_spread_or_a_negative_term_is_one_rate_per_token() -> None:
    x, y = np.full(20, 8.0), np.linspace(1.0, 3.0, 20)
    assert linear_fit(x, y, min_points=8, min_spread=0.2) == (0.0, pytest.approx(float(np.median(y / 8.0))))
    x = np.arange(1.0, 21.0)
    y = 5.0 - 0.1 * x  # falling: a negative slope is not an overhead
    assert linear_fit(x, y)[0] == 0.0 and linear_fit(x, y)[1] == pytest.approx(float(np.median(y / x)))


def test_the_overhead_fits_its_last_window_of_samples_only() -> None:
    """A ring of ``window`` samples: once a new regime has filled it, the old one is gone from the fit; a sample
    of no tokens or outside [0, max_ms] (an idle engine) is not one."""
    o = EngineOverhead(window=32, refit=4, max_ms=50.0)
    for i in range(32):
        o.add(1 + i % 16, 1.0 + 0.1 * (1 + i % 16))
    assert (o.per_step_ms, o.per_token_ms) == pytest.approx((1.0, 0.1))
    for i in range(35):  # refits every 4: the one after the 35th sees only the new regime
        o.add(1 + i % 16, 2.0 + 0.05 * (1 + i % 16))
        o.add(0, 1.0)
        o.add(4, 80.0)
    assert (o.per_step_ms, o.per_token_ms) == pytest.approx((2.0, 0.05))
    assert float(o.ms(10.0)) == pytest.approx(2.5)

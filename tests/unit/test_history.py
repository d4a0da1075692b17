"""`RequestHistory`: a request's recent blocks against what calibration expected of them, and whether that
record predicts better than calibration alone."""

from __future__ import annotations

import numpy as np
import pytest

from dcut.history import MIN_BLOCKS, RequestHistory

W = 8  # drafts per block
EXPECTED = 4.0  # what calibration expects of every block: acceptance is all or nothing at 0.5 across requests


def _feed(history: RequestHistory, outcomes: np.ndarray) -> None:
    """``outcomes[step, request]``: True where the request's block was accepted whole, else not at all."""
    ids = [f"r{i}" for i in range(outcomes.shape[1])]
    for row in outcomes:
        history.observe(ids, [EXPECTED] * len(ids), [W] * len(ids), [W if ok else 0 for ok in row])


def _phased(steps: int, requests: int, phase: int) -> np.ndarray:
    """Each request alternates phases of ``phase`` steps, accepting every block, then none (staggered)."""
    t = np.arange(steps)[:, None] + np.arange(requests)[None, :] * 3
    return (t // phase) % 2 == 0


def test_a_new_request_is_worth_what_calibration_says():
    h = RequestHistory()
    assert h.factor("new") == 1.0
    assert h.factors(["a", "b"]) is None  # nothing judged yet: calibration alone


def test_phases_per_request_make_the_factors_useful_and_follow_each_request():
    h = RequestHistory()
    outcomes = _phased(200, 4, phase=10)
    _feed(h, outcomes)
    assert h.blocks >= MIN_BLOCKS and h.useful
    factors = h.factors(["r0", "r1", "r2", "r3"])
    assert factors is not None
    for i, f in enumerate(factors):
        if outcomes[-1, i]:
            assert f > 1.5  # accepting whole blocks lately: worth about twice what calibration says
        else:
            assert f < 0.5


def test_uncorrelated_outcomes_leave_the_factors_unused():
    h = RequestHistory()
    rng = np.random.default_rng(0)
    _feed(h, rng.random((400, 4)) < 0.5)
    assert h.blocks >= MIN_BLOCKS and not h.useful
    assert h.factors(["r0"]) is None


def test_a_request_that_verifies_nothing_drifts_back_towards_a_factor_of_one():
    h = RequestHistory()
    _feed(h, np.zeros((3, 1), dtype=bool))
    low = h.factor("r0")
    seen = [low]
    for _ in range(12):
        h.observe(["r0"], [0.0], [0], [0])  # its drafts were cut, or width 0 was drafted
        seen.append(h.factor("r0"))
    assert low < 0.3
    assert all(a < b for a, b in zip(seen, seen[1:], strict=False)) and seen[-1] == pytest.approx(1.0, abs=0.05)


def test_finished_requests_are_forgotten():
    h = RequestHistory()
    _feed(h, np.zeros((3, 2), dtype=bool))
    h.drop({"r0"})
    assert h.factor("r0") == 1.0 and h.factor("r1") < 0.3

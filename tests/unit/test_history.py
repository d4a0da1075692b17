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


def test_a_new_request_starts_from_its_kinds_record():
    """Greedy requests deliver what calibration expects, sampled ones a fifth of it: a new request of either kind is
    priced by its kind before it has a block of its own, and the factors predict well enough to be used."""
    h = RequestHistory()
    h.sampled = {f"s{i}" for i in range(400)} | {"s-new"}
    for step in range(100):
        ids = [f"g{step}", f"s{step}"]
        h.observe(ids, [2.0, 2.0], [4, 4], [2, 0 if step % 5 else 2])  # sampled: 2 accepted one step in five
    greedy, sampled = h.kind_factors()
    assert greedy > 1.4 and sampled < 0.4, (greedy, sampled)
    assert h.factor("s-new") < 0.5 < 1.3 < h.factor("g-new")
    assert h.useful and h.factors(["s-new", "g-new"]).tolist() == [h.factor("s-new"), h.factor("g-new")]


def test_one_kind_alone_is_scored_exactly_as_without_kinds():
    """While only one kind has verified blocks its ratio to the stream is exactly 1: every factor is what it was
    before kinds existed (a stream of greedy requests, or of sampled ones, decides as before)."""
    rng = np.random.default_rng(3)
    plain, marked = RequestHistory(), RequestHistory()
    marked.sampled = {f"r{i}" for i in range(50)}  # every request sampled
    for _ in range(300):
        ids = [f"r{i}" for i in rng.choice(50, 4, replace=False)]
        expected, accepted = rng.uniform(0, 3, 4).tolist(), rng.integers(0, 4, 4).tolist()
        for h in (plain, marked):
            h.observe(ids, expected, [3] * 4, accepted)
    assert plain.kind_factors()[0] == marked.kind_factors()[1] == 1.0
    assert [plain.factor(f"r{i}") for i in range(50)] == [marked.factor(f"r{i}") for i in range(50)]
    assert plain.summary() == marked.summary()  # the same blocks judged, the same errors

"""A request's own record against its calibrated confidences, for drafters whose acceptance runs in phases.

Calibration maps a drafter's confidence to the acceptance seen across all requests. Some drafters' acceptance also
runs in phases per request, which the confidence does not show and the request's last blocks do: the MoE pair's
blocks are accepted all or nothing, a request rejecting every block for its first 8-20 steps and then accepting
whole blocks, at confidences that barely differ (position 0: 0.33 against 0.38, median, on the committed trace).
``RequestHistory`` keeps, per request, its recent accepted drafts against what calibration expected of them (both
decayed, shrunk towards a ratio of 1), and hands D-Cut the ratio as the factor its next block is worth.

Requests of two kinds share a batch, and calibration is fitted on both: greedy requests (a draft is kept when it is
the target's argmax) and sampled ones (at temperature > 0 the target keeps a draft with its own probability of it,
so far fewer). Calibration then prices a sampled request's drafts at what the stream's average request delivers, and
its record takes blocks to correct that, about a whole request at temperature 1; so each kind keeps its own decayed
ratio, and a request's record starts from its kind's ratio to the whole stream's. While one kind is seen that ratio
is exactly 1: a stream of one kind is scored as before.

Whether the factors are worth using is measured, not assumed: each verified block is predicted both ways before its
outcome is counted, and the factors are used only while they predict better. Where a request's residuals are
uncorrelated (the deep pair's trace) they would only add noise, and they stay unused.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import numpy as np

DECAY = 0.5  # what a verified block's evidence weighs after each further verified block of its request
# ... after a step in which the request verified nothing (width 0, or its drafts cut): a request judged poor is tried
# again after a few steps, since nothing else would bring news of it.
IDLE = 0.7
PRIOR = 2.0  # pseudo-drafts at a ratio of 1 every factor is shrunk with (one verified block weighs about as much)
JUDGED = 0.99  # what a block's prediction error weighs after each further block (about the last 100)
MIN_BLOCKS = 128  # verified blocks judged before the factors may be used (on 64 the deep pair's passed, by chance)
MARGIN = 0.8  # used while their squared error is below this fraction of the calibration's own
KIND_DECAY = 0.99  # what a verified block weighs in its kind's ratio after each further block of that kind (~100)


class RequestHistory:
    """Per running request: decayed accepted and expected drafts; per engine: whether the factors pay."""

    def __init__(self) -> None:
        self._accepted: dict[str, float] = {}
        self._expected: dict[str, float] = {}
        self._error = 0.0  # decayed squared error of the blocks' predictions: calibration alone
        self._error_factored = 0.0  # and scaled by the factors
        self.blocks = 0  # verified blocks judged
        self.sampled: Container[str] = frozenset()  # the requests sampling at temperature > 0 (the runner's own set)
        self._kind_accepted = [0.0, 0.0]  # decayed accepted drafts of greedy [0] and sampled [1] requests' blocks
        self._kind_expected = [0.0, 0.0]  # and what calibration expected of them

    @property
    def useful(self) -> bool:
        """The factors predicted the verified blocks clearly better than calibration alone."""
        return self.blocks >= MIN_BLOCKS and self._error_factored < MARGIN * self._error

    def summary(self) -> dict[str, float | int | bool | None]:
        """For the snapshot: whether the factors are in use, on how many blocks judged, and their squared error
        as a fraction of calibration's alone (below ``MARGIN``: in use)."""
        ratio = self._error_factored / self._error if self._error > 0 else None
        return {"in_use": self.useful, "blocks": self.blocks, "error_ratio": ratio}

    def factor(self, req_id: str, kinds: tuple[float, float] | None = None) -> float:
        """What the request's next block is worth against its calibrated expectation (a new request: its kind's).
        ``kinds``: ``kind_factors()``, where the caller has them."""
        kind = (kinds or self.kind_factors())[req_id in self.sampled]
        return (self._accepted.get(req_id, 0.0) + PRIOR * kind) / (self._expected.get(req_id, 0.0) + PRIOR)

    def kind_factors(self) -> tuple[float, float]:
        """Greedy and sampled requests' ratios of accepted to expected drafts over the whole stream's (module
        docstring): exactly 1 while only one kind has verified blocks."""
        done, due = self._kind_accepted, self._kind_expected
        stream = (done[0] + done[1] + PRIOR) / (due[0] + due[1] + PRIOR)
        return (done[0] + PRIOR) / (due[0] + PRIOR) / stream, (done[1] + PRIOR) / (due[1] + PRIOR) / stream

    def factors(self, req_ids: Sequence[str]) -> np.ndarray | None:
        """Each request's factor, or None while the factors are not useful (use calibration alone)."""
        if not self.useful:
            return None
        kinds = self.kind_factors()
        return np.fromiter((self.factor(r, kinds) for r in req_ids), float, len(req_ids))

    def observe(self, req_ids: Sequence[str], expected: Sequence[float], verified: Sequence[int],
                accepted: Sequence[int]) -> None:
        """One step's verification: request i verified ``verified[i]`` drafts, which calibration expected to yield
        ``expected[i]`` accepted, and ``accepted[i]`` were. A request that verified nothing only ages."""
        done_of, due_of, error, factored, blocks = self._accepted, self._expected, self._error, self._error_factored, 0
        kind_done, kind_due, sampled = self._kind_accepted, self._kind_expected, self.sampled
        kinds = self.kind_factors()  # (the step's blocks are predicted from what came before it)
        idle = []
        for r, e, v, a in zip(req_ids, expected, verified, accepted, strict=True):
            if v <= 0:
                idle.append(r)
                continue
            predicted = min(self.factor(r, kinds) * e, v)  # before this outcome is counted: out of sample
            done, due = done_of.get(r, 0.0), due_of.get(r, 0.0)
            kind = int(r in sampled)
            kind_done[kind] = KIND_DECAY * kind_done[kind] + a
            kind_due[kind] = KIND_DECAY * kind_due[kind] + e
            error = JUDGED * error + (a - e) ** 2
            factored = JUDGED * factored + (a - predicted) ** 2
            blocks += 1
            done_of[r] = DECAY * done + a
            due_of[r] = DECAY * due + e
        self._error, self._error_factored, self.blocks = error, factored, self.blocks + blocks
        self.idle(idle)  # (other requests than those judged: the order does not matter)

    def idle(self, req_ids: Sequence[str]) -> None:
        """A step in which these requests verified nothing."""
        for r in req_ids:
            if r in self._expected:
                self._accepted[r] *= IDLE
                self._expected[r] *= IDLE

    def drop(self, req_ids: set[str]) -> None:
        """Finished requests."""
        for r in req_ids:
            self._accepted.pop(r, None)
            self._expected.pop(r, None)

"""The D-Cut decision: which drafts of a batch to verify (docs/algorithm.md, sections 1-2).

Host-side numpy on a ``[bs, K]`` copy of the drafter's log-confidences. The decision is a few dozen operations on
at most a few thousand numbers, and the cut reads its keep depths on the host in the same step anyway. As torch ops
(or GPU kernel launches) each cost the host several microseconds, more with the caches the forward pass left cold;
the same work in numpy ufuncs took a drafting step's D-Cut hooks from about 1.1-1.3 ms to 0.6-0.8 ms on a CPU
engine's cold caches (``dcut bench-policy --step --cold``, docs/history.md section 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from dcut.buckets import REFERENCE_RATIOS, bucket_budget
from dcut.settings import DCutSettings


class CostLookup(Protocol):
    """Measured step cost; ``dcut.cost_table.CostTable`` implements it."""

    def costs(self, bs: int, verify_tokens: np.ndarray) -> np.ndarray | None:
        """Cost in ms (> 0) of a step of ``bs`` requests verifying ``verify_tokens`` tokens
        (elementwise); None when nothing covers this batch size."""
        ...


def prefix_scores(log_conf: np.ndarray, max_depth: np.ndarray | None = None) -> np.ndarray:
    """``exp(cumsum(log_conf))``: the estimated probability that drafts ``0..t`` are all accepted.

    NaN counts as -inf and positive log-confidences are clamped to 0, so scores are in [0, 1] and
    non-increasing along K (which is what makes any global top-k a per-request prefix). Positions
    ``>= max_depth[i]`` (a request that proposed fewer drafts) score 0. Float32, summed in float64 (as torch
    sums float32 on a CPU).
    """
    # (ufuncs, not np.nan_to_num or np.clip: those cost 3-10 us on a small array, a ufunc 1)
    lc = np.minimum(np.fmax(np.asarray(log_conf, dtype=np.float32), -math.inf), 0.0)  # fmax: NaN -> -inf
    scores = np.exp(_running_sum(lc, axis=-1))
    if max_depth is not None:
        scores[np.arange(scores.shape[-1]) >= np.asarray(max_depth)[..., None]] = 0.0
    return scores


def keep_depths_for_budget(scores: np.ndarray, budget: int) -> np.ndarray:
    """Per-request keep depths (int64 ``[bs]``) for the global top-``budget`` of ``scores``.

    A stable descending sort of the row-major flattened scores breaks ties by position, so the
    kept drafts are always a prefix of each request. Drafts scoring 0 (past ``max_depth``, or a
    -inf/NaN confidence) are never kept: the budget is capped at the drafts with a positive score.
    """
    bs, k = scores.shape
    order = _order(scores)
    return _depths_from_order(order, min(int(np.count_nonzero(scores)), budget), bs, k)


@dataclass
class Decision:
    """One step's decision, on the host."""

    mode: str
    ratio: float | None  # the bucket used; None for continuous (no bucket)
    budget: int  # drafts kept across the batch
    kept: int  # == budget: the budget is capped at the drafts with a positive score
    proposed: int  # drafts proposed across the batch
    expected_accepted: float  # sum of kept prefix scores [+ bs if count_bonus]
    candidates: np.ndarray | None = None  # budgets evaluated, largest first (reference: 4; continuous: bs*K..0)
    utilities: np.ndarray | None = None  # U per candidate (-inf where not available)
    chosen: int | None = None  # index into candidates
    fallback: bool = False  # no cost covered this batch size
    gains: np.ndarray | None = None  # [bs*K + 1]: running sum of the prefix scores sorted best first, from 0
    scores: np.ndarray | None = None  # [bs, K]: the prefix scores ranked (where the budget was chosen on them)


def select(
    log_conf: np.ndarray,
    settings: DCutSettings,
    cost: CostLookup | None,
    max_depth: np.ndarray | None = None,
) -> tuple[np.ndarray, Decision]:
    """Keep depths ``[bs]`` (int64) for this step and the decision behind them.

    ``log_conf`` is ``[bs, K]`` (raw or calibrated log-confidences); ``max_depth`` gives each
    request's number of proposed drafts when fewer than K.
    """
    bs, k = log_conf.shape
    if bs * k == 0:
        return np.zeros(bs, dtype=np.int64), Decision(settings.mode, None, 0, 0, 0, 0.0)
    scores = prefix_scores(log_conf, max_depth)
    bonus = float(bs) if settings.count_bonus else 0.0
    limits = None if max_depth is None else np.clip(np.asarray(max_depth, dtype=np.int64), 0, k)
    proposed = bs * k if limits is None else int(limits.sum())
    if settings.mode == "full":
        depths = np.full(bs, k, dtype=np.int64) if limits is None else limits
        return depths, Decision("full", 1.0, proposed, proposed, proposed, float(scores.sum()) + bonus)

    if settings.mode == "per_request":  # the baseline D-Cut's global top-k is measured against
        depths = np.full(bs, min(settings.per_request_depth, k), dtype=np.int64)
        if limits is not None:
            depths = np.minimum(depths, limits)
        kept = int(depths.sum())
        expected = float(scores[np.arange(k) < depths[:, None]].sum()) + bonus
        return depths, Decision("per_request", kept / (bs * k), kept, kept, proposed, expected)

    # Zero-score drafts (past max_depth, -inf/NaN confidence) sort last and are never kept.
    available = int(np.count_nonzero(scores))
    order = _order(scores)
    gains = np.zeros(bs * k + 1, dtype=scores.dtype)  # gains[j]: the sum of the j best scores
    gains[1:] = _running_sum(scores.reshape(-1)[order], axis=0)

    if settings.mode == "fixed":
        return _fixed(settings.fixed_ratio, "fixed", False, bs, k, proposed, available, order, gains, bonus)
    # Candidates are in descending order: argmax returns the first maximum, so ties go to the
    # larger budget (on a flat step of the staircase, fill the execution bucket already paid for).
    if settings.mode == "reference":
        candidates = np.minimum(_reference_budgets(bs, k), available)
        step_ms = None if cost is None else cost.costs(bs, candidates + bs)
    else:  # continuous and joint: every budget bs*K..0 on the cost staircase
        candidates = _budgets_down(bs * k, 0)
        step_ms = None if cost is None else cost.costs(bs, _budgets_down(bs * (k + 1), bs))
    if step_ms is None:
        return _fixed(settings.fallback_ratio, settings.mode, True, bs, k, proposed, available, order,
                      gains, bonus)

    utilities = (gains[candidates] + bonus) / step_ms
    if settings.mode != "reference":
        utilities[: bs * k - available] = -math.inf  # the budgets above ``available``
    chosen = int(np.argmax(utilities))
    budget = int(candidates[chosen])
    ratio = REFERENCE_RATIOS[::-1][chosen] if settings.mode == "reference" else None
    if settings.min_saving > 0.0:
        # Full width is the first candidate of reference (ratio 1, capped) and budget `available` of
        # continuous.
        full_ms = step_ms[0] if settings.mode == "reference" else step_ms[bs * k - available]
        if step_ms[chosen] > (1.0 - settings.min_saving) * full_ms:
            budget = available
            ratio = 1.0 if ratio is not None else None
    if settings.min_budget > 0:
        budget = max(budget, min(available, settings.min_budget))
    depths = _depths_from_order(order, budget, bs, k)
    return depths, Decision(settings.mode, ratio, budget, budget, proposed, float(gains[budget]) + bonus,
                            candidates, utilities, chosen, False, gains, scores)


def _fixed(ratio: float, mode: str, fallback: bool, bs: int, k: int, proposed: int, available: int,
           order: np.ndarray, gains: np.ndarray, bonus: float) -> tuple[np.ndarray, Decision]:
    """A single bucket: ``fixed`` mode, or the fallback when no cost covers this batch size."""
    budget = min(available, bucket_budget(ratio, bs, k))
    depths = _depths_from_order(order, budget, bs, k)
    return depths, Decision(mode, ratio, budget, budget, proposed, float(gains[budget]) + bonus, fallback=fallback)


def _running_sum(values: np.ndarray, axis: int) -> np.ndarray:
    """``cumsum`` of float32 ``values`` accumulated in float64 (a float32 sum over a few thousand scores drifts)."""
    return np.add.accumulate(values, axis=axis, dtype=np.float64).astype(np.float32)


def _order(scores: np.ndarray) -> np.ndarray:
    """Row-major flat positions of ``scores``, best first; ties in position order (a stable sort of the negated
    scores: every per-request prefix ranks before the rest of its request)."""
    return np.argsort(-scores.reshape(-1), kind="stable")


def _depths_from_order(order: np.ndarray, budget: int, bs: int, k: int) -> np.ndarray:
    """How many of each request's drafts are among the first ``budget`` of the sort ``order``."""
    return np.bincount(order[:budget] // k, minlength=bs).astype(np.int64, copy=False)


_CACHE: dict[tuple[Any, ...], np.ndarray] = {}


def _cached(key: tuple[Any, ...], make: Any) -> np.ndarray:
    """Small constant arrays, built once (read-only: callers must not write to them)."""
    found = _CACHE.get(key)
    if found is None:
        found = _CACHE[key] = make()
        found.flags.writeable = False
    return found


def _budgets_down(top: int, bottom: int) -> np.ndarray:
    """``top, top-1, ..., bottom``."""
    return _cached(("down", top, bottom), lambda: np.arange(top, bottom - 1, -1))


def _reference_budgets(bs: int, k: int) -> np.ndarray:
    """The four buckets' budgets, largest ratio first."""
    return _cached(("reference", bs, k), lambda: np.array(
        [bucket_budget(r, bs, k) for r in reversed(REFERENCE_RATIOS)], dtype=np.int64))

"""The D-Cut decision: which drafts of a batch to verify (docs/algorithm.md, sections 1-2).

Everything here is vectorised over the batch and free of host syncs (no ``.item()``,
``.tolist()`` or ``bool(tensor)`` on data), so ``select`` can run on the GPU inside an engine step
without stalling it. Shapes (``bs``, ``K``) are host-side and may be used freely.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from dcut.buckets import REFERENCE_RATIOS, bucket_budget
from dcut.settings import DCutSettings


class CostLookup(Protocol):
    """Measured step cost; ``dcut.cost_table.CostTable`` implements it."""

    def costs(self, bs: int, verify_tokens: Tensor) -> Tensor | None:
        """Cost in ms (> 0) of a step of ``bs`` requests verifying ``verify_tokens`` tokens
        (elementwise), on ``verify_tokens``' device; None when nothing covers this batch size."""
        ...


def log_confidence(logits: Tensor, tokens: Tensor) -> Tensor:
    """``logit[tok] - logsumexp(logits)`` in float32: the drafter's log-probability of each draft."""
    logits = logits.float()
    picked = logits.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def prefix_scores(log_conf: Tensor, max_depth: Tensor | None = None) -> Tensor:
    """``exp(cumsum(log_conf))``: the estimated probability that drafts ``0..t`` are all accepted.

    NaN counts as -inf and positive log-confidences are clamped to 0, so scores are in [0, 1] and
    non-increasing along K (which is what makes any global top-k a per-request prefix). Positions
    ``>= max_depth[i]`` (a request that proposed fewer drafts) score 0.
    """
    lc = log_conf.float().nan_to_num(nan=-math.inf, posinf=0.0, neginf=-math.inf).clamp_(max=0.0)
    scores = lc.cumsum_(dim=-1).exp_()
    if max_depth is not None:
        scores.masked_fill_(_beyond_depth(scores, max_depth), 0.0)
    return scores


def keep_depths_for_budget(scores: Tensor, budget: int | Tensor) -> Tensor:
    """Per-request keep depths (int64 ``[bs]``) for the global top-``budget`` of ``scores``.

    A stable descending sort of the row-major flattened scores breaks ties by position, so the
    kept drafts are always a prefix of each request. Drafts scoring 0 (past ``max_depth``, or a
    -inf/NaN confidence) are never kept: the budget is capped at the drafts with a positive score.
    """
    bs, k = scores.shape
    if bs * k == 0:
        return torch.zeros(bs, dtype=torch.int64, device=scores.device)
    with _one_cpu_thread(scores.device):
        _, order = torch.sort(scores.reshape(-1), descending=True, stable=True)
        return _depths_from_order(order, torch.clamp(torch.count_nonzero(scores), max=budget), bs, k)


@dataclass
class Decision:
    """One step's decision. Tensors stay on their device (reading one syncs)."""

    mode: str
    ratio: float | Tensor | None  # the bucket used; None for continuous (no bucket)
    budget: int | Tensor  # drafts kept across the batch
    kept: int | Tensor  # == budget: the budget is capped at the drafts with a positive score
    proposed: int | Tensor  # drafts proposed across the batch
    expected_accepted: Tensor  # sum of kept prefix scores [+ bs if count_bonus]
    candidates: Tensor | None = None  # budgets evaluated, largest first (reference: 4; continuous: bs*K..0)
    utilities: Tensor | None = None  # U per candidate (-inf where not available)
    chosen: Tensor | None = None  # index into candidates
    fallback: bool = False  # no cost covered this batch size
    gains: Tensor | None = None  # [bs*K + 1]: running sum of the prefix scores sorted best first, from 0
    scores: Tensor | None = None  # [bs, K]: the prefix scores ranked (where the budget was chosen on them)



def select(
    log_conf: Tensor,
    settings: DCutSettings,
    cost: CostLookup | None,
    max_depth: Tensor | None = None,
) -> tuple[Tensor, Decision]:
    """Keep depths ``[bs]`` (int64) for this step and the decision behind them.

    ``log_conf`` is ``[bs, K]`` (raw or calibrated log-confidences); ``max_depth`` gives each
    request's number of proposed drafts when fewer than K.
    """
    threads = _cpu_threads(log_conf.device)
    if threads > 1:  # see _one_cpu_thread; inlined here because a generator costs ~3 us
        torch.set_num_threads(1)
    try:
        return _select(log_conf, settings, cost, max_depth)
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


def _cpu_threads(device: torch.device) -> int:
    """Torch's CPU thread count, or 1 where the count must not be changed: vLLM's CPU worker binds
    its OpenMP threads and replaces ``torch.set_num_threads`` by a stub that logs a warning on
    every call (seen: two warnings per step, and ~1 ms of selection time)."""
    if device.type != "cpu" or not torch.set_num_threads.__module__.startswith("torch"):
        return 1
    return torch.get_num_threads()


@contextmanager
def _one_cpu_thread(device: torch.device) -> Iterator[None]:
    """Run tiny CPU ops on this thread only, restoring the thread count after.

    The tensors here have at most a few thousand elements; splitting them over an OpenMP team
    never pays, and when the other cores are busy (an engine's forward pass, a shared machine) a
    parallel region waits for them: measured 7.7 ms instead of 45 us for one ``exp`` of 3840
    floats on 2 busy cores. Setting and restoring the count costs under 1 us.
    """
    threads = _cpu_threads(device)
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _select(log_conf: Tensor, settings: DCutSettings, cost: CostLookup | None,
            max_depth: Tensor | None) -> tuple[Tensor, Decision]:
    bs, k = log_conf.shape
    device = log_conf.device
    if bs * k == 0:
        zero = torch.zeros((), device=device)
        return torch.zeros(bs, dtype=torch.int64, device=device), Decision(settings.mode, None, 0, 0, 0, zero)
    scores = prefix_scores(log_conf, max_depth)
    bonus = float(bs) if settings.count_bonus else 0.0
    proposed: int | Tensor = bs * k
    if max_depth is not None:
        proposed = max_depth.to(device=device, dtype=torch.int64).clamp(0, k).sum()
    if settings.mode == "full":
        depths = torch.full((bs,), k, dtype=torch.int64, device=device)
        if max_depth is not None:
            depths = max_depth.to(device=device, dtype=torch.int64).clamp(0, k)
        return depths, Decision("full", 1.0, proposed, proposed, proposed, scores.sum() + bonus)

    if settings.mode == "per_request":  # the baseline D-Cut's global top-k is measured against
        depths = torch.full((bs,), min(settings.per_request_depth, k), dtype=torch.int64, device=device)
        if max_depth is not None:
            depths = torch.minimum(depths, max_depth.to(device=device, dtype=torch.int64).clamp(0, k))
        kept_mask = torch.arange(k, device=device).unsqueeze(0) < depths.unsqueeze(1)
        kept = depths.sum()
        return depths, Decision("per_request", depths.float().mean() / k, kept, kept, proposed,
                                (scores * kept_mask).sum() + bonus)

    # Zero-score drafts (past max_depth, -inf/NaN confidence) sort last and are never kept.
    available = torch.count_nonzero(scores)
    sorted_scores, order = torch.sort(scores.reshape(-1), descending=True, stable=True)
    gains = sorted_scores.new_zeros(bs * k + 1)  # gains[j]: the sum of the j best scores
    torch.cumsum(sorted_scores, 0, out=gains[1:])

    if settings.mode == "fixed":
        return _fixed(settings.fixed_ratio, "fixed", False, bs, k, proposed, available, order, gains, bonus)
    # Candidates are in descending order: argmax returns the first maximum, so ties go to the
    # larger budget (on a flat step of the staircase, fill the execution bucket already paid for).
    if settings.mode == "reference":
        candidates = torch.minimum(_reference_budgets(bs, k, device), available)
        step_ms = None if cost is None else cost.costs(bs, candidates + bs)
    else:  # continuous and joint: every budget bs*K..0 on the cost staircase
        candidates = _budgets_down(bs * k, 0, device)
        step_ms = None if cost is None else cost.costs(bs, _budgets_down(bs * (k + 1), bs, device))
    if step_ms is None:
        return _fixed(settings.fallback_ratio, settings.mode, True, bs, k, proposed, available, order,
                      gains, bonus)

    utilities = _plus(torch.take(gains, candidates), bonus) / step_ms
    if settings.mode != "reference":
        utilities.masked_fill_(candidates > available, -math.inf)
    chosen = torch.argmax(utilities)
    budget = torch.take(candidates, chosen)  # take: indexing by a 0-dim tensor would sync
    ratio = torch.take(_reference_ratios(device), chosen) if settings.mode == "reference" else None
    if settings.min_saving > 0.0:
        # Full width is the first candidate of reference (ratio 1, capped) and budget `available` of
        # continuous.
        full_ms = step_ms[0] if settings.mode == "reference" else torch.take(step_ms, bs * k - available)
        too_dear = torch.take(step_ms, chosen) > (1.0 - settings.min_saving) * full_ms
        budget = torch.where(too_dear, available, budget)
        if ratio is not None:
            ratio = torch.where(too_dear, 1.0, ratio)
    if settings.min_budget > 0:
        budget = torch.maximum(budget, torch.clamp(available, max=settings.min_budget))
    depths = _depths_from_order(order, budget, bs, k)
    expected = _plus(torch.take(gains, budget), bonus)
    return depths, Decision(settings.mode, ratio, budget, budget, proposed, expected, candidates,
                            utilities, chosen, False, gains, scores)


def _fixed(ratio: float, mode: str, fallback: bool, bs: int, k: int, proposed: int | Tensor,
           available: Tensor, order: Tensor, gains: Tensor, bonus: float) -> tuple[Tensor, Decision]:
    """A single bucket: ``fixed`` mode, or the fallback when no cost covers this batch size."""
    budget = torch.clamp(available, max=bucket_budget(ratio, bs, k))
    depths = _depths_from_order(order, budget, bs, k)
    return depths, Decision(mode, ratio, budget, budget, proposed, _plus(torch.take(gains, budget), bonus),
                            fallback=fallback)


def _plus(values: Tensor, bonus: float) -> Tensor:
    """``values + bonus``, skipping the op (a few us on CPU) when there is no bonus."""
    return values + bonus if bonus else values


def _depths_from_order(order: Tensor, budget: int | Tensor, bs: int, k: int) -> Tensor:
    """How many of each request's drafts have a rank below ``budget`` in the sort ``order``."""
    ranks = torch.empty_like(order).scatter_(0, order, _arange(bs * k, order.device))
    return (ranks.view(bs, k) < budget).sum(dim=1)


def _beyond_depth(scores: Tensor, max_depth: Tensor) -> Tensor:
    """Mask of positions at or past each request's number of drafts."""
    positions = _arange(scores.shape[-1], scores.device)
    return positions >= max_depth.to(scores.device).unsqueeze(-1)


_CACHE: dict[tuple[Any, ...], Tensor] = {}


def _cached(key: tuple[Any, ...], make: Any) -> Tensor:
    """Small constant tensors, built once per device (creating them costs more than the math)."""
    found = _CACHE.get(key)
    if found is None:
        found = _CACHE[key] = make()
    return found


def _arange(n: int, device: torch.device) -> Tensor:
    return _cached(("arange", n, device), lambda: torch.arange(n, device=device))


def _budgets_down(top: int, bottom: int, device: torch.device) -> Tensor:
    """``top, top-1, ..., bottom``."""
    return _cached(("down", top, bottom, device),
                   lambda: torch.arange(top, bottom - 1, -1, device=device))


def _reference_budgets(bs: int, k: int, device: torch.device) -> Tensor:
    """The four buckets' budgets, largest ratio first."""
    return _cached(("reference", bs, k, device), lambda: torch.tensor(
        [bucket_budget(r, bs, k) for r in reversed(REFERENCE_RATIOS)], dtype=torch.int64, device=device))


def _reference_ratios(device: torch.device) -> Tensor:
    return _cached(("ratios", device), lambda: torch.tensor(REFERENCE_RATIOS[::-1], device=device))

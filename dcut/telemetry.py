"""Per-step statistics, their rolling summaries, and throughput estimates (docs/algorithm.md, section 5).

A replica records one ``StepRecord`` per engine step, keeps the recent ones in a ``StepWindow``,
and reports ``summary()`` to the controller. The estimate functions turn a cost table and the
live acceptance curve into tokens/s per batch size, which the autoscaler compares against
demand.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dcut.settings import DCutSettings
from dcut.snapshot import ThroughputEstimate

if TYPE_CHECKING:
    from dcut.selection import CostLookup


@dataclass
class StepRecord:
    """What one engine step proposed, kept, accepted and cost."""

    batch_size: int
    proposed: int  # drafts proposed across the batch
    kept: int  # drafts verified across the batch
    accepted: int  # drafts accepted across the batch (bonus tokens not included)
    accepted_per_position: list[int]  # [t]: requests whose draft t was accepted
    kept_per_position: list[int]  # [t]: requests that verified draft t
    ratio: float | None = None
    budget: int | None = None
    step_ms: float | None = None
    selection_us: float | None = None
    fallback: bool = False
    width: int | None = None  # positions drafted per request this step (None: the engine's K)
    probe: bool = False  # a probe step (mode joint): another width, verified in full
    verify_ms: float | None = None  # target forward + sampling/rejection (execute_model -> drafter)
    draft_ms: float | None = None  # the drafter's pass (or keeping it in sync at width 0)
    timestamp: float = field(default_factory=time.time)


@dataclass
class StepTotals:
    """Counts over every step since start (or the last reset), not only the window: a reader that takes
    two readings can tell what happened between them (a load-test point), whatever the window holds."""

    steps: int = 0
    request_steps: int = 0  # sum of batch sizes
    proposed: int = 0
    kept: int = 0
    accepted: int = 0  # drafts accepted, bonus tokens not included
    keep_ratio_sum: float = 0.0  # sum of kept / proposed over steps that proposed anything
    keep_ratio_steps: int = 0

    def add(self, record: StepRecord) -> None:
        self.steps += 1
        self.request_steps += record.batch_size
        self.proposed += record.proposed
        self.kept += record.kept
        self.accepted += record.accepted
        if record.proposed > 0:
            self.keep_ratio_sum += record.kept / record.proposed
            self.keep_ratio_steps += 1


class StepWindow:
    """The last ``maxlen`` steps and their summaries, and the totals of every step added."""

    def __init__(self, maxlen: int = 512) -> None:
        self.records: deque[StepRecord] = deque(maxlen=maxlen)
        self.totals = StepTotals()

    def add(self, record: StepRecord) -> None:
        self.records.append(record)
        self.totals.add(record)

    def __len__(self) -> int:
        return len(self.records)

    def mean_keep_ratio(self) -> float | None:
        """Mean over steps (that proposed anything) of kept / proposed."""
        ratios = self._keep_ratios()
        return sum(ratios) / len(ratios) if ratios else None

    def mean_accepted_length(self) -> float | None:
        """Accepted drafts per request-step."""
        requests = sum(r.batch_size for r in self.records)
        return sum(r.accepted for r in self.records) / requests if requests else None

    def keep_ratio_histogram(self) -> list[int]:
        """Steps per keep-ratio bin [0, 0.1), ..., [0.9, 1.0]."""
        hist = [0] * 10
        for ratio in self._keep_ratios():
            hist[min(9, int(ratio * 10))] += 1
        return hist

    def position_acceptance(self) -> list[float | None]:
        """[t]: accepted at t / verified at t, i.e. P(drafts 0..t accepted | draft t verified)."""
        accepted = _sum_lists(r.accepted_per_position for r in self.records)
        kept = _sum_lists(r.kept_per_position for r in self.records)
        return [a / n if n else None for a, n in zip(accepted, kept, strict=False)]

    def acceptance_curve(self) -> list[float]:
        """[t]: P(a prefix of length t + 1 is accepted), made non-increasing (running minimum).

        Positions never verified get 0: nothing is known there, and an estimate must not promise
        tokens it has never seen.
        """
        curve, low = [], 1.0
        for rate in self.position_acceptance():
            low = 0.0 if rate is None else min(low, rate)
            curve.append(low)
        return curve

    def batch_size_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(r.batch_size for r in self.records).items()))

    def mean_step_ms(self) -> dict[int, float]:
        """Mean measured step time per batch size."""
        sums: dict[int, list[float]] = {}
        for r in self.records:
            if r.step_ms is not None:
                sums.setdefault(r.batch_size, []).append(r.step_ms)
        return {bs: sum(v) / len(v) for bs, v in sorted(sums.items())}

    def width_histogram(self) -> dict[int, int]:
        """Steps per drafted width."""
        return dict(sorted(Counter(r.width for r in self.records if r.width is not None).items()))

    def mean_ms(self, name: str) -> float | None:
        """Mean of a timed part of the step (``verify_ms``, ``draft_ms``, ``step_ms``) over the window."""
        values = [v for r in self.records if (v := getattr(r, name)) is not None]
        return sum(values) / len(values) if values else None

    def summary(self) -> dict[str, Any]:
        """Everything above as one JSON-able dict (string keys)."""
        return {
            "steps": len(self.records),
            "mean_keep_ratio": self.mean_keep_ratio(),
            "mean_accepted_length": self.mean_accepted_length(),
            "keep_ratio_histogram": self.keep_ratio_histogram(),
            "position_acceptance": self.position_acceptance(),
            "acceptance_curve": self.acceptance_curve(),
            "batch_size_histogram": {str(b): n for b, n in self.batch_size_histogram().items()},
            "mean_step_ms": {str(b): ms for b, ms in self.mean_step_ms().items()},
            "fallback_steps": sum(r.fallback for r in self.records),
            "width_histogram": {str(w): n for w, n in self.width_histogram().items()},
            "probe_steps": sum(r.probe for r in self.records),
            "mean_verify_ms": self.mean_ms("verify_ms"),
            "mean_draft_ms": self.mean_ms("draft_ms"),
        }

    def _keep_ratios(self) -> list[float]:
        return [r.kept / r.proposed for r in self.records if r.proposed > 0]


def expected_tokens_per_step(b: int, acceptance_curve: Sequence[float], settings: DCutSettings,
                             cost: CostLookup | None) -> tuple[float, int]:
    """``E(b) = b + sum of kept prefix scores`` with every request following ``acceptance_curve``.

    Runs the real decision on a batch of ``b`` identical requests; returns E(b) and the number of
    drafts it keeps.
    """
    from dcut.selection import select  # here, not at the top: a Serve replica reads capacity and demand without torch

    if b <= 0:
        return 0.0, 0
    curve = np.clip(np.asarray(list(acceptance_curve), dtype=np.float64), 0.0, 1.0)
    if curve.size == 0:
        return float(b), 0
    with np.errstate(divide="ignore", invalid="ignore"):  # an acceptance of 0: every later draft is worthless
        log_curve = np.log(curve)
        log_conf = np.nan_to_num(np.diff(log_curve, prepend=0.0), nan=-math.inf, neginf=-math.inf)
    _, decision = select(np.tile(log_conf.astype(np.float32), (b, 1)), settings, cost)
    # expected_accepted includes the b bonus tokens only with count_bonus; E(b) counts them once.
    drafts = float(decision.expected_accepted) - (b if settings.count_bonus else 0)
    return b + drafts, int(decision.kept)


def step_time(b: int, kept: int, cost: CostLookup, draft_ms: float = 0.0) -> float | None:
    """``T(b) = C_verify(b, b + kept) + C_draft(b)`` in ms; None beyond the cost table."""
    costs = cost.costs(b, np.array([b + kept]))
    return None if costs is None else float(costs[0]) + draft_ms


def throughput_by_batch_size(batch_sizes: Iterable[int], acceptance_curve: Sequence[float],
                             settings: DCutSettings, cost: CostLookup,
                             draft_ms: float = 0.0) -> list[ThroughputEstimate]:
    """Tokens/s and per-request tokens/s at each batch size the cost table covers."""
    estimates = []
    for b in batch_sizes:
        tokens, kept = expected_tokens_per_step(b, acceptance_curve, settings, cost)
        ms = step_time(b, kept, cost, draft_ms) if b > 0 else None
        if ms is None or ms <= 0:
            continue
        per_s = tokens * 1000.0 / ms
        estimates.append(ThroughputEstimate(b, tokens, ms, per_s, per_s / b))
    return estimates


def capacity(estimates: Iterable[ThroughputEstimate], min_request_rate: float,
             max_batch_size: int | None = None) -> float:
    """Objective tokens/s a replica can serve: ``min_request_rate`` x the most requests it runs at once while each
    still gets that rate (the largest estimated batch size, up to ``max_batch_size``, whose per-request rate meets
    it; one request when none does; 0 without estimates). In ``demand``'s units (requests x the objective rate),
    so demand / capacity is the share of those request slots in use. The replica's total tokens/s would not do: at
    batch 16 it delivers ~6x the objective to each request, and a policy comparing requests x objective against
    that planned ~6x more requests per replica than it can run at once (docs/experiments/2026-12-01-autoscaling/)."""
    usable = [e for e in estimates if max_batch_size is None or e.batch_size <= max_batch_size]
    if not usable:
        return 0.0
    meeting = [e.batch_size for e in usable if e.request_tokens_per_s >= min_request_rate]
    return min_request_rate * (max(meeting) if meeting else 1)


def demand(running: int, waiting: int, per_request_rate: float) -> float:
    """Tokens/s asked for now: every running and waiting request served at the objective rate."""
    return (running + waiting) * per_request_rate


def _sum_lists(lists: Iterable[list[int]]) -> list[int]:
    total: list[int] = []
    for values in lists:
        if len(values) > len(total):
            total.extend([0] * (len(values) - len(total)))
        for t, v in enumerate(values):
            total[t] += v
    return total

"""How many positions to draft this step: the joint choice of drafted width and verify budget.

D-Cut's verify budget alone leaves the drafter's own pass untouched, and on small targets that
pass, not verification, dominates a speculative step (``docs/benchmarks.md``). Before drafting,
``choose_width`` picks the width W (0 = draft nothing) that maximises expected tokens per
second of the whole step::

    U(W) = max over d <= W of  E / (C_verify(bs, bs * (1 + d)) + C_draft(bs, W) + O(E)),  E = bs * (1 + S_W(d))

where ``S_W(d)`` is the expected number of accepted drafts among the first d of a block drafted
at width W (acceptance depends on W: the DFlash block is non-causal). The uniform depth d is a
conservative stand-in for the global top-k that runs after drafting on the real confidences;
``O(E)`` is the engine's measured overhead outside the model for a step emitting E tokens.

Acceptance is learned per width from what verification shows (``WidthStats``); positions that
are never verified would never be learned, so ``ProbeBudget`` spends a bounded share of time on
occasional probe steps that draft another width and verify all of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

DEFAULT_WIDTHS = (0, 1, 2, 3, 5, 7, 11, 15)
EXPLORE_SHARE = 0.15  # probe share while some plausible width is unmeasured at a batch size (then ``share``)
PLAUSIBLE = 0.75  # a width estimated under this share of the chosen width's tokens/s is not explored


def widths_for(k: int, widths: Sequence[int] | None = None) -> list[int]:
    """The candidate widths for an engine drafting at most ``k``: the default set (0 and k always
    in), or exactly the given ones that fit (``[0]`` pins width 0: a diagnostic and a baseline)."""
    if widths is None:
        return sorted({w for w in DEFAULT_WIDTHS if w <= k} | {0, k})
    return sorted({w for w in widths if 0 <= w <= k}) or [0]


def position_counts(verified: Tensor, accepted: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per draft position t < k, over requests: how many verified draft t, how many reached it
    (verified it with every earlier draft accepted), how many accepted it. Request i verified its
    first ``verified[i]`` drafts and the first ``accepted[i]`` of those were accepted."""
    positions = torch.arange(k).unsqueeze(0)
    n = verified.to(torch.int64).clamp(0, k).unsqueeze(1)
    a = torch.minimum(accepted.to(torch.int64).unsqueeze(1), n)
    return (positions < n).sum(0), ((positions < n) & (positions <= a)).sum(0), (positions < a).sum(0)


class WidthStats:
    """Per (width, position): requests that reached the position and how many were accepted.

    ``reached[w, t]`` counts verified drafts at position t of a block drafted at width ``w``
    whose earlier drafts were all accepted; ``accepted[w, t]`` those accepted too. The ratio is the
    conditional acceptance ``q_w[t]``; its running product the survival ``s_w[t]``. Counts are
    capped (scaled down together) so the estimate follows a changing workload.
    """

    def __init__(self, widths: Sequence[int], k: int, prior_q: float = 0.5, prior_weight: float = 2.0,
                 cap: float = 4096.0) -> None:
        self.widths = list(widths)
        self.k = k
        self.prior_q, self.prior_weight, self.cap = prior_q, prior_weight, cap
        self.reached = torch.zeros(len(self.widths), k, dtype=torch.float64)
        self.accepted = torch.zeros(len(self.widths), k, dtype=torch.float64)
        self._index = {w: i for i, w in enumerate(self.widths)}
        self._survival: np.ndarray | None = None

    def observe(self, width: int, reached: Tensor, accepted: Tensor) -> None:
        """Count one step's per-position ``reached`` and ``accepted`` (``position_counts``) for ``width``."""
        i = self._index.get(width)
        if i is None or width == 0:
            return
        self.reached[i] += reached.to(torch.float64)
        self.accepted[i] += accepted.to(torch.float64)
        self._survival = None
        top = float(self.reached[i].max())
        if top > self.cap:
            self.reached[i] *= self.cap / top
            self.accepted[i] *= self.cap / top

    def conditional(self) -> Tensor:
        """``q[w, t]``, Beta-smoothed towards the pooled rate of position t over all widths."""
        pooled = (self.accepted.sum(0) + self.prior_weight * self.prior_q) / (
            self.reached.sum(0) + self.prior_weight)
        return (self.accepted + self.prior_weight * pooled) / (self.reached + self.prior_weight)

    def survival(self) -> np.ndarray:
        """``s[w, t]`` = P(drafts 0..t of a width-w block all accepted); 0 past each width.

        Recomputed only after new observations (it is read before every drafting pass)."""
        if self._survival is None:
            s = self.conditional().cumprod(dim=1)
            widths = torch.tensor(self.widths).unsqueeze(1)
            self._survival = s.masked_fill(torch.arange(self.k).unsqueeze(0) >= widths, 0.0).numpy()
        return self._survival

    def observations(self) -> dict[int, int]:
        """Requests observed at position 0, per width (how much each width's estimate rests on)."""
        return {w: int(self.reached[i, 0]) for i, w in enumerate(self.widths) if w}


@dataclass(frozen=True)
class WidthChoice:
    """The outcome of ``choose_width``: the width, its best uniform depth and their estimate."""

    width: int
    depth: int
    tokens_per_step: float
    step_ms: float

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tokens_per_step / self.step_ms if self.step_ms > 0 else 0.0


def width_utilities(bs: int, widths: Sequence[int], survival: np.ndarray,
                    verify_ms: Callable[[int, np.ndarray], np.ndarray | None],
                    draft_ms: Callable[[int, np.ndarray], np.ndarray | None],
                    overhead_ms: Callable[[np.ndarray], np.ndarray]) -> list[WidthChoice | None]:
    """The best (depth, estimate) of each width; all None where a cost is unknown for this batch size.

    The engine's work outside the model (scheduling, sampled-token bookkeeping, detokenising the
    outputs) grows with the tokens a step emits: ``overhead_ms(tokens)`` prices it.

    Vectorised over widths and depths (it runs before every drafting pass): one cost lookup for
    all verify sizes ``bs * (1 + d)``, one for all widths.
    """
    k = survival.shape[1]
    depths = np.arange(k + 1)
    verify = verify_ms(bs, bs * (1 + depths))
    draft = draft_ms(bs, np.asarray(widths))
    if verify is None or draft is None:
        return [None] * len(widths)
    gains = np.concatenate([np.zeros((len(widths), 1)), np.cumsum(survival, axis=1)], axis=1)
    tokens = bs * (1.0 + gains)
    step = verify[None, :] + draft[:, None] + overhead_ms(tokens)
    rate = np.where(depths[None, :] <= np.asarray(widths)[:, None], tokens / step, -np.inf)
    best = rate.argmax(axis=1)
    rows = np.arange(len(widths))
    return [WidthChoice(int(w), int(d), float(t), float(ms))
            for w, d, t, ms in zip(widths, best, tokens[rows, best], step[rows, best], strict=True)]


def choose_width(choices: Sequence[WidthChoice | None], current: int | None, hysteresis: float) -> WidthChoice | None:
    """The best width, kept at ``current`` unless another beats it by more than ``hysteresis``.

    Switching has a price the estimate does not see (a new width's acceptance is less known, the
    estimate is noisy); hysteresis keeps the choice from flapping between near-equal widths.
    """
    valid = [c for c in choices if c is not None]
    if not valid:
        return None
    best = max(valid, key=lambda c: c.tokens_per_s)
    held = next((c for c in valid if c.width == current), None)
    if held is not None and best.tokens_per_s <= (1.0 + hysteresis) * held.tokens_per_s:
        return held
    return best


class RealizedRates:
    """What each width actually delivered, per batch-size bucket: tokens emitted over time spent.

    A width chosen at step n is paid for by step n's drafter pass, the engine's time between the
    steps and step n+1's verification, and it yields step n+1's emitted tokens (bonus plus
    accepted drafts). Those cycles, averaged (EMA after ``1/weight`` samples), are the ground truth
    the cost model only predicts: once a width has ``min_samples`` cycles in a bucket, its
    measured rate replaces the estimate (``apply``). The model still prices widths never tried,
    which is how they get tried; probes (counted too: a probe verifies everything, a lower bound of
    what the width delivers) measure the others, faster while some width is still unmeasured.
    """

    def __init__(self, min_samples: int = 3, weight: float = 0.1) -> None:
        self.min_samples, self.weight = min_samples, weight
        self._cells: dict[tuple[int, int], tuple[float, float, int]] = {}

    def add(self, bucket: int, width: int, tokens: float, ms: float) -> None:
        if ms <= 0:
            return
        t, m, n = self._cells.get((bucket, width), (tokens, ms, 0))
        w = max(self.weight, 1.0 / (n + 1))
        self._cells[(bucket, width)] = (t + w * (tokens - t), m + w * (ms - m), n + 1)

    def apply(self, bucket: int, choices: Sequence[WidthChoice | None]) -> list[WidthChoice | None]:
        """``choices`` with the measured tokens per step and step time where there are enough cycles."""
        out: list[WidthChoice | None] = []
        for c in choices:
            cell = None if c is None else self._cells.get((bucket, c.width))
            if c is not None and cell is not None and cell[2] >= self.min_samples:
                c = WidthChoice(c.width, c.depth, cell[0], cell[1])
            out.append(c)
        return out

    def samples(self, bucket: int, width: int) -> int:
        return self._cells.get((bucket, width), (0.0, 0.0, 0))[2]

    def summary(self) -> dict[str, dict[str, float]]:
        """``{"bucket/width": {"tokens_per_s", "samples"}}`` for the snapshot."""
        return {f"{b}/{w}": {"tokens_per_s": 1000.0 * t / m, "samples": n}
                for (b, w), (t, m, n) in sorted(self._cells.items())}


def plausible_widths(choices: Sequence[WidthChoice | None], chosen: WidthChoice,
                     floor: float = PLAUSIBLE) -> list[int]:
    """The widths worth exploring at this batch size: priced (measured where it was, else the model's
    estimate from the profiled costs and the acceptance learned over every width) within ``floor`` of the
    chosen width. At bs 64 a full-width step costs ~8 plain ones: exploring widths the model already puts far
    below would spend the short runs where it matters on measuring what will not be chosen. The steady
    probe share still visits every width, so a width the model misjudges is found in time."""
    return [c.width for c in choices
            if c is not None and (c.width == chosen.width or c.tokens_per_s >= floor * chosen.tokens_per_s)]


class ProbeBudget:
    """Occasional probe steps, paid from a credit of ``share`` of the steps taken.

    A probe drafts a width other than the chosen one and verifies all of it, so acceptance at
    widths and positions D-Cut has stopped using stays known. Each step earns ``share`` of a
    step; a probe costs its step time in units of the chosen step's (at least one), so probes
    take at most ``share`` of the time. The width least measured is probed first (ties rotate); a
    dear one waits until the credit covers it.
    """

    def __init__(self, widths: Sequence[int], share: float) -> None:
        self.widths = list(widths)
        self.share = share
        self.credit = 0.0
        self._next = 0

    def probe(self, chosen: WidthChoice, full_step_ms: Callable[[int], float | None],
              samples: Callable[[int], int] | None = None, explore: Sequence[int] = ()) -> int | None:
        """A width to probe this step, or None. ``full_step_ms(w)``: a step drafting and verifying w;
        ``samples(w)``: how much is known of w already (the least known is probed first);
        ``explore``: the widths not measured enough yet at this batch size (``plausible_widths``): while
        there are any, earn ``EXPLORE_SHARE`` and probe only them."""
        if self.share <= 0:
            return None
        self.credit += max(self.share, EXPLORE_SHARE) if explore else self.share
        candidates = [w for w in (explore or self.widths) if w != chosen.width]
        if not candidates or self.credit < 1.0:
            return None
        rotated = candidates[self._next % len(candidates):] + candidates[: self._next % len(candidates)]
        width = min(rotated, key=samples) if samples is not None else rotated[0]
        cost = full_step_ms(width)
        price = 1.0 if cost is None or chosen.step_ms <= 0 else max(1.0, cost / chosen.step_ms)
        if self.credit < price:
            return None
        self.credit -= price
        self._next += 1
        return width

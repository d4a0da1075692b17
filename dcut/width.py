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

Acceptance is learned per width from what verification shows (``WidthStats``), and what each width
actually delivered is measured (``RealizedRates``): once measured, a width is judged by that, not by
the model. Which widths get measured is decided by optimism (``Explorer``): a width is tried while
its optimistic estimate (acceptance at an upper confidence bound, or its measured rate plus a margin
that shrinks with samples) beats the current choice, and never once it cannot, so exploration
ends by itself where the choice is clear. Positions that are never verified would never be learned,
so ``ProbeBudget`` spends a small steady share of time on probe steps that verify a whole block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dcut.learned import RealizedCell
from dcut.selection import prefix_scores

DEFAULT_WIDTHS = (0, 1, 2, 3, 5, 7, 11, 15)
EXPLORE_SHARE = 0.2  # at most this share of step time tries widths that might beat the current choice
OPTIMISM = 1.5  # upper confidence bound, in standard errors, on an unmeasured width's acceptance
SHRINK_REQUESTS = 256  # requests at which a width's own realized/predicted tokens ratio weighs as much as the pooled
EXPLORE_REQUESTS = 32  # a width measured on this many fresh requests at a batch size is judged on its rate alone


def widths_for(k: int, widths: Sequence[int] | None = None) -> list[int]:
    """The candidate widths for an engine drafting at most ``k``: the default set (0 and k always
    in), or exactly the given ones that fit (``[0]`` pins width 0: a diagnostic and a baseline)."""
    if widths is None:
        return sorted({w for w in DEFAULT_WIDTHS if w <= k} | {0, k})
    return sorted({w for w in widths if 0 <= w <= k}) or [0]


def marginal_gains(log_conf: Tensor) -> Tensor:
    """``g[j]`` = expected accepted drafts per request from the (j+1)-th draft per request of a block
    ``[bs, W]``, when drafts are kept by D-Cut's global top-k of prefix scores: the expected tokens of a
    budget of ``d * bs`` drafts are ``bs * (1 + sum(g[:d]))``. Non-increasing, in [0, 1]; at bs 1 it is
    the prefix score itself. (The mean prefix score per position would price a uniform depth per
    request, and miss what the global top-k is for: spending the budget on the requests that will
    accept it.)"""
    bs, w = log_conf.shape
    scores = torch.sort(prefix_scores(log_conf).reshape(-1), descending=True).values
    gains = torch.cat([scores.new_zeros(1), scores.cumsum(0)])[:: bs] / bs  # [w + 1]: top j*bs drafts
    return gains.diff()


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
        self._survival: dict[float, np.ndarray] = {}
        # Mean (calibrated) prefix score of every drafted block, per width: the survival the drafter's own
        # confidences predict, over all drafts, cut or not.
        self.expected = torch.zeros(len(self.widths), k, dtype=torch.float64)
        self.expected_requests = torch.zeros(len(self.widths), dtype=torch.float64)

    def observe(self, width: int, reached: Tensor, accepted: Tensor) -> None:
        """Count one step's per-position ``reached`` and ``accepted`` (``position_counts``) for ``width``."""
        i = self._index.get(width)
        if i is None or width == 0:
            return
        self.reached[i] += reached.to(torch.float64)
        self.accepted[i] += accepted.to(torch.float64)
        self._survival = {}
        self._cap()

    def _cap(self) -> None:
        """Scale a width's counts down together where they pass ``cap`` (so the estimate follows the workload)."""
        scale = self.cap / self.reached.max(dim=1, keepdim=True).values.clamp(min=self.cap)
        self.reached *= scale
        self.accepted *= scale

    def observe_scores(self, width: int, gains: Tensor, requests: int, weight: float = 0.02) -> None:
        """Fold in one drafted block's ``marginal_gains`` (``[width]``, from calibrated confidences).

        Counted acceptance alone is biased wherever D-Cut cuts: only the most confident drafts are
        verified, so the acceptance counted at late positions is that of the best drafts, not of the
        block. Calibrated confidences cover every draft, cut or not, and price the block as D-Cut will
        spend it: a mean over the first ``1/weight`` requests, then a moving average."""
        i = self._index.get(width)
        if i is None or width == 0 or requests <= 0:
            return
        n = float(self.expected_requests[i])
        w = max(weight, requests / (n + requests))
        self.expected[i, :width] += w * (gains[:width].to(torch.float64).cpu() - self.expected[i, :width])
        self.expected_requests[i] += requests
        self._survival = {}

    def load(self, reached: Sequence[Sequence[float]], accepted: Sequence[Sequence[float]],
             expected: Sequence[Sequence[float]], expected_requests: Sequence[float]) -> None:
        """Take over counts and gains learned elsewhere (``dcut.learned``), capped like this stats' own."""
        self.reached = torch.tensor(reached, dtype=torch.float64)
        self.accepted = torch.tensor(accepted, dtype=torch.float64)
        self._cap()
        self.expected = torch.tensor(expected, dtype=torch.float64)
        self.expected_requests = torch.tensor(expected_requests, dtype=torch.float64)
        self._survival = {}

    def conditional(self) -> Tensor:
        """``q[w, t]``, Beta-smoothed towards the pooled rate of position t over all widths."""
        pooled = (self.accepted.sum(0) + self.prior_weight * self.prior_q) / (
            self.reached.sum(0) + self.prior_weight)
        return (self.accepted + self.prior_weight * pooled) / (self.reached + self.prior_weight)

    def survival(self, optimism: float = 0.0) -> np.ndarray:
        """``s[w, t]`` = P(drafts 0..t of a width-w block all accepted); 0 past each width.

        A width that has been drafted: the mean prefix score of its blocks (``observe_scores``). One
        never drafted: at positions some wider block reached, those blocks' mean prefix scores (DFlash
        acceptance depends on the width, so this is a prior); elsewhere the product of counted
        conditional rates, pooled over widths. With ``optimism`` > 0 each is raised by that many
        standard errors of a Beta posterior on its observations (``q + z sqrt(q (1 - q) / (n + prior))``,
        at most 1): an upper confidence bound, so an untried width looks as good as it might be until
        there is evidence. Recomputed only after new observations
        (it is read before every drafting pass)."""
        found = self._survival.get(optimism)
        if found is None:
            q = self.conditional()
            if optimism:
                q = (q + optimism * (q * (1 - q) / (self.reached + self.prior_weight)).sqrt()).clamp(max=1.0)
            s = q.cumprod(dim=1)
            # Drafted widths: what their confidences predict. Widths not drafted yet: where a wider block was
            # drafted, what its confidences predict at the same positions (pooled over blocks, by requests).
            requests = self.expected_requests.unsqueeze(1) * (torch.arange(self.k).unsqueeze(0)
                                                              < torch.tensor(self.widths).unsqueeze(1))
            pooled_n = requests.sum(0)
            pooled = (requests * self.expected).sum(0) / pooled_n.clamp(min=1e-9)
            scored = self.expected_requests > 0
            e = torch.where(scored.unsqueeze(1), self.expected, pooled.unsqueeze(0))
            n = torch.where(scored.unsqueeze(1), self.expected_requests.unsqueeze(1), pooled_n.unsqueeze(0))
            if optimism:  # the same bound, on as many observations as requests drafted at those positions
                e = (e + optimism * (e * (1 - e) / (n + self.prior_weight)).clamp(min=0).sqrt()).clamp(max=1.0)
                e = e.cummin(dim=1).values
            s = torch.where(n > 0, e, s)
            widths = torch.tensor(self.widths).unsqueeze(1)
            found = s.masked_fill(torch.arange(self.k).unsqueeze(0) >= widths, 0.0).numpy()
            self._survival[optimism] = found
        return found

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


def choose_width(choices: Sequence[WidthChoice | None], current: int | None, hysteresis: float,
                 noise: Callable[[int], float] | None = None) -> WidthChoice | None:
    """The best width, kept at ``current`` unless another beats it by more than ``hysteresis`` and by more
    than twice the combined standard error of the two estimates (``noise(w)``: relative standard error).

    Switching has a price the estimate does not see (a new width's acceptance is less known, the
    estimate is noisy); hysteresis keeps the choice from flapping between near-equal widths, and the
    standard errors keep a lucky stretch of requests from passing for a better width (at bs 1 one
    request's acceptance swings a width's measured rate by half).
    """
    valid = [c for c in choices if c is not None]
    if not valid:
        return None
    best = max(valid, key=lambda c: c.tokens_per_s)
    held = next((c for c in valid if c.width == current), None)
    if held is None or best is held:
        return best
    margin = hysteresis
    if noise is not None:
        margin = max(margin, 2.0 * (noise(best.width) ** 2 + noise(held.width) ** 2) ** 0.5)
    return held if best.tokens_per_s <= (1.0 + margin) * held.tokens_per_s else best


@dataclass
class _Cell:
    """One (bucket, width)'s cycles: realized and predicted tokens and ms (running means, then EMAs), the
    spread of the predicted rate, how many cycles and the bucket's tick at the last one."""

    tokens: float
    ms: float
    predicted_tokens: float
    predicted_ms: float
    rate: float
    rate_var: float = 0.0
    n: int = 0
    last: int = 0


class RealizedRates:
    """What each width delivered, per batch-size bucket, beside what the policy predicted it would.

    A width chosen at step n is paid for by step n's drafter pass, the engine's time between the
    steps and step n+1's verification, and it yields step n+1's emitted tokens (bonus plus
    accepted drafts). Per cycle the policy also predicted the tokens (from the calibrated
    confidences of the drafts it kept) and the time (from the cost table).

    A width's estimate, once it has ``min_samples`` cycles, is its *predicted* tokens, corrected by
    its realized/predicted tokens ratio shrunk towards the bucket's ratio pooled over all widths (by
    how many requests it rests on), over its *measured* time (``apply``). Two widths measured at
    different moments are compared on what their drafts' confidences promised, which follows the
    requests of the moment far less noisily than what one step happened to accept (at bs 1 that
    swings a width's realized rate by half); the pooled ratio keeps the model honest, and
    ``summary`` shows realized beside predicted per width.

    Means are long-run (a running mean, then an average over about ``1/weight`` cycles). What a
    width's measurement is worth fades with the cycles since it was taken (``fresh``, half-life
    ``half_life`` cycles of the bucket), so a width measured long ago is worth re-measuring.
    """

    def __init__(self, min_samples: int = 3, min_requests: int = 32, weight: float = 0.02,
                 half_life: float = 256.0) -> None:
        self.min_samples, self.min_requests, self.weight, self.half_life = min_samples, min_requests, weight, half_life
        self._cells: dict[tuple[int, int], _Cell] = {}
        self._pooled: dict[int, list[float]] = {}  # realized and predicted tokens and ms, pooled per bucket
        self._ticks: dict[int, int] = {}

    def add(self, bucket: int, width: int, tokens: float, ms: float, predicted_tokens: float,
            predicted_ms: float) -> None:
        if ms <= 0 or predicted_ms <= 0:
            return
        tick = self._ticks[bucket] = self._ticks.get(bucket, 0) + 1
        rate = predicted_tokens / predicted_ms
        c = self._cells.setdefault((bucket, width), _Cell(tokens, ms, predicted_tokens, predicted_ms, rate))
        w = max(self.weight, 1.0 / (c.n + 1))
        c.tokens += w * (tokens - c.tokens)
        c.ms += w * (ms - c.ms)
        c.predicted_tokens += w * (predicted_tokens - c.predicted_tokens)
        c.predicted_ms += w * (predicted_ms - c.predicted_ms)
        delta = rate - c.rate
        c.rate, c.rate_var = c.rate + w * delta, (1.0 - w) * (c.rate_var + w * delta * delta)
        c.n, c.last = c.n + 1, tick
        pool = self._pooled.setdefault(bucket, [0.0, 0.0, 0.0, 0.0])
        for i, value in enumerate((tokens, predicted_tokens, ms, predicted_ms)):
            pool[i] = pool[i] * (1.0 - self.weight) + value  # discounted sums: recent cycles weigh most

    def charge(self, bucket: int, width: int, ms: float) -> None:
        """Add ``ms`` to each of a width's recent cycles (work they deferred, paid later by another width)."""
        cell = self._cells.get((bucket, width))
        if cell is not None:
            cell.ms += ms

    def correction(self, bucket: int) -> tuple[float, float]:
        """Realized over predicted, tokens and ms, over the bucket's recent cycles of every width."""
        pool = self._pooled.get(bucket)
        if pool is None or pool[1] <= 0 or pool[3] <= 0:
            return 1.0, 1.0
        return pool[0] / pool[1], pool[2] / pool[3]

    def apply(self, bucket: int, choices: Sequence[WidthChoice | None]) -> list[WidthChoice | None]:
        """``choices`` with each measured width's predicted tokens corrected by the pooled tokens ratio, and
        its measured time: a step's time hardly varies with the requests of the moment, and where the cost
        table is wrong it is wrong per width (a plain step and a drafting one miss by different amounts),
        which a pooled ratio would hide."""
        pooled, _ = self.correction(bucket)
        out: list[WidthChoice | None] = []
        for c in choices:
            cell = None if c is None else self._cells.get((bucket, c.width))
            if c is not None and cell is not None and self._measured(bucket, cell):
                # The width's own realized/predicted ratio, shrunk towards the pooled one by how few requests
                # it rests on: at bs 64 a few cycles say what the width's drafts deliver; at bs 1 they do not.
                own = min(cell.n, 1.0 / self.weight) * bucket
                ratio = (own * cell.tokens / cell.predicted_tokens + SHRINK_REQUESTS * pooled) / (own + SHRINK_REQUESTS)
                c = WidthChoice(c.width, c.depth, cell.predicted_tokens * ratio, cell.ms)
            out.append(c)
        return out

    def _measured(self, bucket: int, cell: _Cell) -> bool:
        """Enough cycles, over enough requests (a bucket's batch size each), to stand for the width."""
        return cell.n >= self.min_samples and cell.n * bucket >= self.min_requests

    def samples(self, bucket: int, width: int) -> int:
        cell = self._cells.get((bucket, width))
        return 0 if cell is None else cell.n

    def fresh(self, bucket: int, width: int) -> float:
        """Cycles of ``width`` in ``bucket``, discounted by the cycles recorded since the last one."""
        cell = self._cells.get((bucket, width))
        if cell is None:
            return 0.0
        return cell.n * 0.5 ** ((self._ticks.get(bucket, 0) - cell.last) / self.half_life)

    def noise(self, bucket: int, width: int) -> float:
        """The relative standard error of a width's estimate: the spread of its cycles' predicted rates over
        the square root of the cycles averaged (at most ``1/weight``); 0 for an unmeasured width."""
        cell = self._cells.get((bucket, width))
        if cell is None or not self._measured(bucket, cell) or cell.rate <= 0:
            return 0.0
        return cell.rate_var ** 0.5 / cell.rate / min(cell.n, 1.0 / self.weight) ** 0.5

    def optimistic(self, bucket: int, model: Sequence[WidthChoice | None], z: float = OPTIMISM
                   ) -> list[float | None]:
        """Each width's optimistic tokens/s: measured (``min_samples`` cycles or more), its estimate raised by
        ``z`` spreads of a cycle's rate over the square root of its fresh cycles; else ``model``'s (an
        optimistic estimate); None where neither exists."""
        measured = self.apply(bucket, model)
        out: list[float | None] = []
        for c, m in zip(model, measured, strict=True):
            cell = None if c is None else self._cells.get((bucket, c.width))
            if m is not None and cell is not None and self._measured(bucket, cell) and cell.rate > 0:
                spread = cell.rate_var ** 0.5 / cell.rate
                out.append(m.tokens_per_s * (1.0 + z * spread / max(self.fresh(bucket, c.width), 1.0) ** 0.5))
            else:
                out.append(None if c is None else c.tokens_per_s)
        return out

    def cells(self) -> list[RealizedCell]:
        """Every (bucket, width)'s measurement, for ``dcut.learned``."""
        return [RealizedCell(bucket=b, width=w, tokens=c.tokens, ms=c.ms, predicted_tokens=c.predicted_tokens,
                             predicted_ms=c.predicted_ms, rate=c.rate, rate_var=c.rate_var, n=c.n)
                for (b, w), c in sorted(self._cells.items())]

    def load(self, cells: Sequence[RealizedCell]) -> None:
        """Start from measurements taken elsewhere: trusted as this replica's own, and fresh (a width measured
        by the fleet is not explored again until the measurement fades)."""
        for c in cells:
            self._cells[(c.bucket, c.width)] = _Cell(c.tokens, c.ms, c.predicted_tokens, c.predicted_ms, c.rate,
                                                     c.rate_var, c.n, self._ticks.get(c.bucket, 0))
            pool = self._pooled.setdefault(c.bucket, [0.0, 0.0, 0.0, 0.0])
            for i, value in enumerate((c.tokens, c.predicted_tokens, c.ms, c.predicted_ms)):
                pool[i] += value * min(c.n, 1.0 / self.weight)

    def summary(self) -> dict[str, dict[str, float]]:
        """``{"bucket/width": {tokens_per_s, predicted_tokens_per_s, samples}}``: realized beside predicted."""
        return {f"{b}/{w}": {"tokens_per_s": 1000.0 * c.tokens / c.ms,
                             "predicted_tokens_per_s": 1000.0 * c.predicted_tokens / c.predicted_ms, "samples": c.n}
                for (b, w), c in sorted(self._cells.items())}


class _StepCredit:
    """A credit of ``share`` of a step earned per step, spent on steps other than the chosen one at their
    time in units of the chosen step's (at least one), so they take at most ``share`` of the time."""

    def __init__(self, share: float) -> None:
        self.share = share
        self.credit = 0.0

    def _spend(self, chosen: WidthChoice, cost: float | None) -> bool:
        """Pay for a step costing ``cost`` ms (None: unknown, one chosen step) if the credit covers it."""
        price = 1.0 if cost is None or chosen.step_ms <= 0 else max(1.0, cost / chosen.step_ms)
        if self.credit < price:
            return False
        self.credit -= price
        return True


class Explorer(_StepCredit):
    """Tries widths that might beat the current choice, paid from a credit of ``share`` of the steps.

    A width is a candidate while its optimistic tokens/s (``RealizedRates.optimistic`` over an
    optimistic model) beats the chosen width's and it has been measured on fewer than ``requests``
    fresh requests at this batch size (``samples``); an exploring step drafts it and verifies as the
    policy would, so what it delivers is what the width is worth. The most promising candidate goes
    first; a dear one waits until the credit covers its step. Candidates run out as measurements
    tighten the bounds, and then nothing is spent: exploration is a phase, not a tax.
    """

    def __init__(self, share: float = EXPLORE_SHARE, requests: int = EXPLORE_REQUESTS) -> None:
        super().__init__(share)
        self.requests = requests

    def pick(self, chosen: WidthChoice, widths: Sequence[int], optimistic: Sequence[float | None],
             samples: Callable[[int], float], step_ms: Callable[[int], float | None]) -> int | None:
        """A width to try this step, or None."""
        candidates = [(rate, w) for w, rate in zip(widths, optimistic, strict=True)
                      if w != chosen.width and rate is not None and rate > chosen.tokens_per_s
                      and samples(w) < self.requests]
        if not candidates or self.share <= 0:
            return None
        self.credit += self.share
        _, width = max(candidates)
        return width if self._spend(chosen, step_ms(width)) else None


class ProbeBudget(_StepCredit):
    """Occasional probe steps, paid from a credit of ``share`` of the steps taken.

    A probe drafts a width other than the chosen one and verifies all of it, so acceptance at
    widths and positions D-Cut has stopped using stays known. Each step earns ``share`` of a
    step; a probe costs its step time in units of the chosen step's (at least one), so probes
    take at most ``share`` of the time. The width least measured is probed first (ties rotate); a
    dear one waits until the credit covers it.
    """

    def __init__(self, widths: Sequence[int], share: float) -> None:
        super().__init__(share)
        self.widths = list(widths)
        self._next = 0

    def probe(self, chosen: WidthChoice, full_step_ms: Callable[[int], float | None],
              samples: Callable[[int], int] | None = None) -> int | None:
        """A width to probe this step, or None. ``full_step_ms(w)``: a step drafting and verifying w;
        ``samples(w)``: how much is known of w already (the least known is probed first)."""
        if self.share <= 0:
            return None
        self.credit += self.share
        candidates = [w for w in self.widths if w != chosen.width]
        if not candidates or self.credit < 1.0:
            return None
        rotated = candidates[self._next % len(candidates):] + candidates[: self._next % len(candidates)]
        width = min(rotated, key=samples) if samples is not None else rotated[0]
        if not self._spend(chosen, full_step_ms(width)):
            return None
        self._next += 1
        return width

"""What each width actually delivered per batch-size bucket, beside what the policy predicted: once
measured, a width is judged by this, not by the model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dcut.learned import RealizedCell
from dcut.width.acceptance import OPTIMISM
from dcut.width.choice import WidthChoice

# Requests at which a width's own realized/predicted tokens ratio weighs as much as the pooled one. Replayed over five
# starts (deep-cpu, deep-h20, moe-cpu; 2026-12-06) 16, 32 and 64 are level (geometric mean of `joint` / best baseline
# 1.050-1.051) and 128 and 256 below (1.045 each): at 256 a width's own record, 50 cycles at bs 1 or 15 at bs 8, was
# outweighed by the other widths' and a few percent between widths went unseen (live at bs 8, width 3 realized 4 %
# above the held width 7, predicted level).
SHRINK_REQUESTS = 64
STALL = 3.0  # a cycle is counted at most this many times its predicted time (longer: a stall, not the width's cost)
# The machine changed speed: this many cycles in a row of one width, each over (or each under) its mean time over
# predicted by more than ``shift`` (``DCutSettings.speed_shift``). Not one stall (capped above), nor a few: a run no
# noise on a steady machine makes.
SHIFT_RUN = 8
# The weight of a drafted block in its bucket's recent gains per position (about the last 8 blocks), and the ticks
# (cycles of the bucket, per 1/RECENT) over which what they say halves in weight (width 0 drafts nothing new).
RECENT = 0.125


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
    charged: float = 0.0  # of ``ms``: deferred work charged to the cycles (``charge``), as an EMA alike
    run: int = 0  # pure cycles in a row over (+) or under (-) the mean time over predicted by more than ``shift``
    run_ratio: float = 0.0  # their summed time over predicted
    # the pure decode cycles alone, averaged as above, their own time (no charges): the speed-shift detector's mean
    # (``_shifted``). A cycle that also prefilled takes up to twice a pure one, and admissions come in bursts
    # (requests of one length admitted together finish together): judged against a mean of both, a burst read as a
    # change of speed.
    pure_ms: float = 0.0
    pure_predicted_ms: float = 0.0
    pure_n: int = 0
    # The spreads of a cycle's realized over predicted tokens and of its time over predicted, about their means:
    # with ``rate_var``, what the width's estimate is uncertain by (``_spread``).
    ratio_var: float = 0.0
    time_var: float = 0.0
    # What each position of the cycles' blocks was worth per request (``add``'s ``gains``), averaged as above, and
    # the requests per cycle: the drafts' share of ``predicted_tokens``, which ``apply`` moves with the requests of now.
    gains: np.ndarray | None = None
    requests: float = 0.0


@dataclass
class _Recent:
    """A bucket's recent blocks: what each position was worth per request (``RECENT``-weighted; positions past the
    last block's ``width`` are older), and the bucket's tick at the last one."""

    gains: np.ndarray
    width: int
    tick: int


@dataclass
class _Probes:
    """One (bucket, width)'s probe cycles: summed tokens, ms and squared tokens, how many, and the bucket's tick at
    the last one."""

    tokens: float = 0.0
    ms: float = 0.0
    squares: float = 0.0
    n: int = 0
    last: int = 0

    def spread(self) -> float:
        """The relative standard deviation of a probe cycle's tokens (0 below two cycles)."""
        if self.n < 2 or self.tokens <= 0:
            return 0.0
        mean = self.tokens / self.n
        return _relative(max(self.squares / self.n - mean * mean, 0.0), mean)


def _moved(var: float, w: float, delta: float) -> float:
    """An exponentially weighted variance after one more value ``delta`` off the mean (weight ``w``)."""
    return (1.0 - w) * (var + w * delta * delta)


def _relative(var: float, mean: float) -> float:
    """A relative standard deviation (0 where the mean is not positive)."""
    return var ** 0.5 / mean if mean > 0 else 0.0


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
    ``summary`` shows realized beside predicted per width. What its confidences promised *then* is moved to the
    requests of *now* (``_predicted_now``): by how much more or less the positions it drafted are worth in the
    bucket's recent blocks. Without it, the width drafting in an easy stretch outshone one measured in a harder
    one (replayed, deep pair at bs 4: width 15 held on 69 % of the steps, its estimate swinging 950-1,370 tok/s with
    the requests while width 3's, measured earlier, stayed at 1,120; `joint` 0.969x fixed width 3).

    Means are long-run (a running mean, then an average over about ``1/weight`` cycles). What a
    width's measurement is worth fades with the cycles since it was taken (``fresh``, half-life
    ``half_life`` cycles of the bucket), so a width measured long ago is worth re-measuring. Where a width's
    cycles say the machine changed speed (``SHIFT_RUN`` in a row off its mean by more than ``shift``), the bucket's
    other widths are forgotten (``_shifted``): measured at another speed, they cannot be compared with it.
    """

    def __init__(self, min_samples: int = 3, min_requests: int = 32, weight: float = 0.02,
                 half_life: float = 256.0, shift: float | None = None) -> None:
        self.min_samples, self.min_requests, self.weight, self.half_life = min_samples, min_requests, weight, half_life
        self.shift = shift  # None: no speed shifts noticed
        self.shifts: dict[int, int] = {}  # speed shifts noticed, per bucket
        self._cells: dict[tuple[int, int], _Cell] = {}
        self._pooled: dict[int, list[float]] = {}  # realized and predicted tokens and ms, pooled per bucket
        self._ticks: dict[int, int] = {}
        self._probes: dict[tuple[int, int], _Probes] = {}
        self._recent: dict[int, _Recent] = {}

    def add(self, bucket: int, width: int, tokens: float, ms: float, predicted_tokens: float,
            predicted_ms: float, pure: bool = True, gains: np.ndarray | None = None, requests: int = 0) -> None:
        """One cycle of ``width``; ``pure``: its verification step held no prefill (only pure cycles can say the
        machine changed speed: ``_Cell.pure_ms``). ``gains``: what each position of the cycle's block was worth per
        request, calibrated (``dcut.width.acceptance.marginal_gains``; None at width 0), of ``requests`` requests."""
        if ms <= 0 or predicted_ms <= 0:
            return
        # A stall (a cold engine after another ran, a shape met for the first time, the OS) is not what the width
        # costs, and a mean over the few dozen cycles a width is explored on cannot shrug one off (logged live on
        # the MoE pair: single cycles at 3.6-5x their predicted time, 19.5 ms against 4).
        ms = min(ms, STALL * predicted_ms)
        tick = self._ticks[bucket] = self._ticks.get(bucket, 0) + 1
        if gains is not None and gains.size:
            self._note_recent(bucket, gains, tick)
        rate = predicted_tokens / predicted_ms
        c = self._cells.get((bucket, width))  # (setdefault would build a cell each call)
        if c is None:
            c = self._cells[(bucket, width)] = _Cell(tokens, ms, predicted_tokens, predicted_ms, rate)
        if not pure or self.shift is None or not self._shifted(bucket, width, c, ms / predicted_ms):  # (the run's)
            if pure:
                p = max(self.weight, 1.0 / (c.pure_n + 1))
                c.pure_ms += p * (ms - c.pure_ms)
                c.pure_predicted_ms += p * (predicted_ms - c.pure_predicted_ms)
                c.pure_n += 1
            w = max(self.weight, 1.0 / (c.n + 1))
            if c.n:
                c.ratio_var = _moved(c.ratio_var, w, tokens / predicted_tokens - c.tokens / c.predicted_tokens
                                     if predicted_tokens > 0 and c.predicted_tokens > 0 else 0.0)
                c.time_var = _moved(c.time_var, w, ms / predicted_ms - (c.ms - c.charged) / c.predicted_ms)
            c.tokens += w * (tokens - c.tokens)
            c.ms += w * (ms - c.ms)
            c.charged -= w * c.charged
            c.predicted_tokens += w * (predicted_tokens - c.predicted_tokens)
            c.predicted_ms += w * (predicted_ms - c.predicted_ms)
            c.rate_var = _moved(c.rate_var, w, rate - c.rate)
            c.rate += w * (rate - c.rate)
            if gains is not None and gains.size:
                c.gains = np.array(gains, dtype=np.float64) if c.gains is None else c.gains + w * (gains - c.gains)
            c.requests += w * (requests - c.requests)
            c.n += 1
        c.last = tick
        pool = self._pooled.setdefault(bucket, [0.0, 0.0, 0.0, 0.0])
        for i, value in enumerate((tokens, predicted_tokens, ms, predicted_ms)):
            pool[i] = pool[i] * (1.0 - self.weight) + value  # discounted sums: recent cycles weigh most

    def _note_recent(self, bucket: int, gains: np.ndarray, tick: int) -> None:
        """Fold a drafted block's ``gains`` into the bucket's recent ones (positions past its width keep theirs)."""
        found = self._recent.get(bucket)
        if found is None or found.gains.size < gains.size:
            grown = np.array(gains, dtype=np.float64)
            if found is not None:
                grown[: found.gains.size] = found.gains
            found = self._recent[bucket] = _Recent(grown, gains.size, tick)
        found.gains[: gains.size] += RECENT * (gains - found.gains[: gains.size])
        found.width, found.tick = gains.size, tick

    def _shifted(self, bucket: int, width: int, c: _Cell, ratio: float) -> bool:
        """Whether this cycle ends a run (``SHIFT_RUN``) that says the machine changed speed; if so, the width's
        time is what the run measured, and the bucket's other widths are forgotten: they were measured at the old
        speed, and compared with this one at the new they would be judged on the machine's moment, not on what
        they are worth (replayed on a machine alternating 2x every 250 steps, width 0 learned on slow stretches
        and width 3 on fast ones, and ``joint`` drafted width 3 on a third of the steps at bs 32 where width 0 was
        best throughout). Forgotten widths are priced by the model (whose cost table follows the live steps) until
        exploration measures them again."""
        if c.pure_n == 0:
            return False
        mean = c.pure_ms / c.pure_predicted_ms  # (what the cycles took themselves: deferred work is paid later)
        assert self.shift is not None
        step = 1 if ratio > mean * (1.0 + self.shift) else -1 if ratio * (1.0 + self.shift) < mean else 0
        if step == 0 or step * c.run < 0:
            c.run, c.run_ratio = step, ratio if step else 0.0
            return False
        c.run, c.run_ratio = c.run + step, c.run_ratio + ratio
        if abs(c.run) < SHIFT_RUN:
            return False
        now = c.run_ratio / abs(c.run)
        c.charged *= now / mean
        c.ms *= now / mean  # (cycles that also prefilled keep their share in it, at the new speed)
        c.pure_ms, c.run, c.run_ratio = c.pure_predicted_ms * now, 0, 0.0
        c.n, c.pure_n = min(c.n, SHIFT_RUN), min(c.pure_n, SHIFT_RUN)  # what it measured before weighs no more
        for key in [k for k in self._cells if k[0] == bucket and k[1] != width]:
            del self._cells[key]
        for key in [k for k in self._probes if k[0] == bucket]:
            del self._probes[key]
        self.shifts[bucket] = self.shifts.get(bucket, 0) + 1
        return True

    def add_probe(self, bucket: int, width: int, tokens: float, ms: float, predicted_ms: float) -> None:
        """A probe's cycle (every draft verified, which the policy would not do): a rate the width can at least
        deliver, for ``optimistic`` alone. A fresh engine's calibrating start is all probes at full width; if what
        they delivered never counted, a width the model priced low there was never explored (replayed on the
        MoE pair at bs 4: width 15 priced at 1,976 tok/s, width 0 held at 2,437, and full width delivering 2,581)."""
        if ms <= 0:
            return
        found = self._probes.setdefault((bucket, width), _Probes())
        found.tokens += tokens
        found.ms += min(ms, STALL * predicted_ms) if predicted_ms > 0 else ms
        found.squares += tokens * tokens
        found.n += 1
        found.last = self._ticks.get(bucket, 0)

    def charge(self, bucket: int, width: int, ms: float, cycles: int) -> None:
        """Charge ``ms`` of work that a width's last ``cycles`` cycles deferred (paid later, by another width).

        Spread over those cycles, so the mean moves by their weight in it, not by the whole share: added to the
        mean whole, each flush raised every older cycle too, and charges that came every few cycles piled up
        faster than new cycles pulled the mean back (live, bs 64: width 0's cycles realized 717 tok/s against
        1,964 for the same engine pinned at width 0)."""
        cell = self._cells.get((bucket, width))
        if cell is None or cycles <= 0:
            return
        # what the last ``cycles`` cycles weigh in the mean: a running mean's first cycles alike, then an EMA's
        share = min(cycles, cell.n) / cell.n if cell.n * self.weight <= 1.0 else 1.0 - (1.0 - self.weight) ** cycles
        cell.ms += ms / cycles * share
        cell.charged += ms / cycles * share

    def correction(self, bucket: int) -> tuple[float, float]:
        """Realized over predicted, tokens and ms, over the bucket's recent cycles of every width."""
        pool = self._pooled.get(bucket)
        if pool is None or pool[1] <= 0 or pool[3] <= 0:
            return 1.0, 1.0
        return pool[0] / pool[1], pool[2] / pool[3]

    def delivered(self, bucket: int, width: int) -> tuple[float, float] | None:
        """A measured width's realized tokens and ms a cycle (deferred work it was charged included); None where
        it is not measured."""
        cell = self._cells.get((bucket, width))
        if cell is None or not self._measured(bucket, cell) or cell.ms <= 0:
            return None
        return cell.tokens, cell.ms

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
                own = self._averaged(cell) * bucket
                ratio = (own * cell.tokens / cell.predicted_tokens + SHRINK_REQUESTS * pooled) / (own + SHRINK_REQUESTS)
                c = WidthChoice(c.width, c.depth, self._predicted_now(bucket, cell) * ratio, cell.ms)
            out.append(c)
        return out

    def _predicted_now(self, bucket: int, cell: _Cell) -> float:
        """A width's predicted tokens a cycle, its drafts' share moved by how much more (or less) the positions
        its blocks drafted are worth in the bucket's recent blocks than they were over its own cycles: a width
        measured in an easy stretch of requests is not better for it than one measured in a hard one."""
        recent = self._recent.get(bucket)
        if recent is None or cell.gains is None or cell.requests <= 0:
            return cell.predicted_tokens
        t = min(recent.width, cell.gains.size)  # the positions both the width's blocks and the recent ones drafted
        then = float(cell.gains[:t].sum())
        if then <= 0:
            return cell.predicted_tokens
        # trusted less as it ages (width 0 drafts nothing): then, the width's own long-run prediction
        trust = 0.5 ** ((self._ticks.get(bucket, 0) - recent.tick) * RECENT)
        scale = 1.0 + trust * (float(recent.gains[:t].sum()) / then - 1.0)
        return cell.requests + (cell.predicted_tokens - cell.requests) * scale

    def _averaged(self, cell: _Cell) -> float:
        """The cycles a cell's means rest on: all of them while a running mean, about ``1/weight`` once an EMA."""
        return min(cell.n, 1.0 / self.weight)

    def _measured(self, bucket: int, cell: _Cell) -> bool:
        """Enough cycles, over enough requests (a bucket's batch size each), to stand for the width."""
        return cell.n >= self.min_samples and cell.n * bucket >= self.min_requests

    def samples(self, bucket: int, width: int) -> int:
        cell = self._cells.get((bucket, width))
        return 0 if cell is None else cell.n

    def fresh(self, bucket: int, width: int) -> float:
        """Cycles of ``width`` in ``bucket``, discounted by the cycles recorded since the last one."""
        cell = self._cells.get((bucket, width))
        return 0.0 if cell is None else self._faded(bucket, cell.n, cell.last)

    def _faded(self, bucket: int, n: float, last: int) -> float:
        """``n`` observations taken at the bucket's tick ``last``, discounted by the cycles recorded since."""
        return n * 0.5 ** ((self._ticks.get(bucket, 0) - last) / self.half_life)

    @staticmethod
    def _raised(rate: float, spread: float, fresh: float, z: float) -> float:
        """``rate`` raised by ``z`` relative ``spread``s over the square root of its fresh observations (at least 1)."""
        return rate * (1.0 + z * spread / max(fresh, 1.0) ** 0.5)

    def _spread(self, bucket: int, cell: _Cell) -> float:
        """The relative spread, per cycle, of what a measured width's estimate rests on: the rate its drafts
        promised, its realized/predicted tokens ratio (at the weight it has against the pooled one, ``apply``) and
        its time. The promised rate's alone made the bound too narrow to be worth testing: it follows the
        confidences, which swing far less than what a step accepts or what it takes on a shared machine."""
        own = self._averaged(cell) * bucket  # requests, as ``apply`` weighs the width's own ratio
        weight = own / (own + SHRINK_REQUESTS)
        ratio = cell.tokens / cell.predicted_tokens if cell.predicted_tokens > 0 else 0.0
        time = (cell.ms - cell.charged) / cell.predicted_ms  # the cycles' own: a flush's charge is no spread
        return (cell.rate_var / cell.rate ** 2 + (weight * _relative(cell.ratio_var, ratio)) ** 2
                + _relative(cell.time_var, time) ** 2) ** 0.5

    def noise(self, bucket: int, width: int) -> float:
        """The relative standard error of a width's estimate: the spread of its cycles' predicted rates over
        the square root of the cycles averaged (at most ``1/weight``); 0 for an unmeasured width."""
        cell = self._cells.get((bucket, width))
        if cell is None or not self._measured(bucket, cell) or cell.rate <= 0:
            return 0.0
        return _relative(cell.rate_var, cell.rate) / self._averaged(cell) ** 0.5

    def optimistic(self, bucket: int, model: Sequence[WidthChoice | None], z: float = OPTIMISM
                   ) -> list[float | None]:
        """Each width's optimistic tokens/s: measured (``min_samples`` cycles or more), its estimate raised by
        ``z`` of its spread per cycle (``_spread``) over the square root of its fresh cycles; else the best of
        ``model``'s (an optimistic estimate), what its few cycles delivered and what its probes did
        (``add_probe``), raised alike by ``z`` spreads of a probe's tokens over the square root of its fresh probes;
        None where none exists.

        Why the few cycles count: a width the model prices low (confidences not calibrated yet) stopped being
        explored after a handful of cycles, before it was measured, whatever those cycles delivered (the MoE
        pair at bs 1: width 15 delivered 1,862 tok/s over its first cycles, the model said 700, and ``joint``
        stayed at width 0, 415 tok/s, for 2,000 cycles). Why the probes' bound: what a calibrating start's
        probes delivered in a hard stretch is no verdict on the width (replayed on the MoE pair at bs 1 from one
        start of five: 64 probes at width 15 delivered 700 tok/s, width 0 was held at 756 and width 15, 1,264
        drafted alone, was never tried again: 0.59x the best baseline); as they age at a held width 0, which
        learns nothing of the others, their bound widens until the width is tried."""
        measured = self.apply(bucket, model)
        out: list[float | None] = []
        for c, m in zip(model, measured, strict=True):
            cell = None if c is None else self._cells.get((bucket, c.width))
            if m is not None and cell is not None and self._measured(bucket, cell) and cell.rate > 0:
                out.append(self._raised(m.tokens_per_s, self._spread(bucket, cell),
                                        self._faded(bucket, cell.n, cell.last), z))
            elif c is not None:
                seen = [c.tokens_per_s]
                if cell is not None and cell.ms > 0:
                    seen.append(1000.0 * cell.tokens / cell.ms)
                probes = self._probes.get((bucket, c.width))
                if probes is not None and probes.ms > 0:
                    seen.append(self._raised(1000.0 * probes.tokens / probes.ms, probes.spread(),
                                             self._faded(bucket, probes.n, probes.last), z))
                out.append(max(seen))
            else:
                out.append(None)
        return out

    def cells(self) -> list[RealizedCell]:
        """Every (bucket, width)'s measurement, for ``dcut.learned``."""
        return [RealizedCell(bucket=b, width=w, tokens=c.tokens, ms=c.ms, predicted_tokens=c.predicted_tokens,
                             predicted_ms=c.predicted_ms, rate=c.rate, rate_var=c.rate_var, n=c.n,
                             ratio_var=c.ratio_var, time_var=c.time_var,
                             gains=None if c.gains is None else c.gains.tolist(), requests=c.requests)
                for (b, w), c in sorted(self._cells.items())]

    def load(self, cells: Sequence[RealizedCell]) -> None:
        """Start from measurements taken elsewhere: trusted as this replica's own, and fresh (a width measured
        by the fleet is not explored again until the measurement fades)."""
        for c in cells:
            self._cells[(c.bucket, c.width)] = _Cell(c.tokens, c.ms, c.predicted_tokens, c.predicted_ms, c.rate,
                                                     c.rate_var, c.n, self._ticks.get(c.bucket, 0),
                                                     pure_ms=c.ms, pure_predicted_ms=c.predicted_ms, pure_n=c.n,
                                                     ratio_var=c.ratio_var, time_var=c.time_var,
                                                     gains=None if c.gains is None else np.array(c.gains),
                                                     requests=c.requests)
            pool = self._pooled.setdefault(c.bucket, [0.0, 0.0, 0.0, 0.0])
            for i, value in enumerate((c.tokens, c.predicted_tokens, c.ms, c.predicted_ms)):
                pool[i] += value * min(c.n, 1.0 / self.weight)

    def summary(self) -> dict[str, dict[str, float]]:
        """``{"bucket/width": {tokens_per_s, predicted_tokens_per_s, samples, tokens, ms, predicted_tokens,
        predicted_ms}}``: realized beside predicted, and what a cycle emitted and took (which term is off)."""
        return {f"{b}/{w}": {"tokens_per_s": 1000.0 * c.tokens / c.ms,
                             "predicted_tokens_per_s": 1000.0 * c.predicted_tokens / c.predicted_ms, "samples": c.n,
                             "tokens": c.tokens, "ms": c.ms, "predicted_tokens": c.predicted_tokens,
                             "predicted_ms": c.predicted_ms}
                for (b, w), c in sorted(self._cells.items())}

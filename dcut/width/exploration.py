"""Steps spent on widths other than the chosen one, each paid from a credit of a share of the steps:
exploring widths that might beat the choice, and probes that verify a whole block."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dcut.width.choice import WidthChoice

EXPLORE_SHARE = 0.2  # at most this share of step time tries widths that might beat the current choice
EXPLORE_REQUESTS = 32  # a width measured on this many fresh requests at a batch size,
EXPLORE_CYCLES = 8  # over at least this many fresh cycles, is judged on its rate alone


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
    optimistic model) beats the chosen width's by more than the choice's hysteresis (short of that it
    could not be chosen, whatever it measured), and either it has been measured on fewer than
    ``requests`` fresh requests or ``cycles`` fresh cycles at this batch size (``cycles(w)``, of ``bs``
    requests each), or its point estimate beats the chosen width's, yet not by enough for the choice to
    move. Such a contest is measured until the choice moves or the width's bound falls: live at bs 16,
    width 3, estimated 13 % above the held width 11, stopped being tried after its 8 cycles, too few to
    clear the choice's noise margin, and width 11 was held on 70 % of the steps.

    An exploring step drafts the width and verifies as the policy would, so what it delivers is what
    the width is worth. Cycles as well as requests: a cycle's time is one measurement whatever its
    batch size, and at bs 64 one cycle passed for a measured width (live, width 0's few cycles there
    beat the held width's rate and were never added to). The most promising candidate goes first; a
    dear one waits until the credit covers its step. Candidates run out as measurements tighten the
    bounds, and then nothing is spent: exploration is a phase, not a tax.
    """

    def __init__(self, share: float = EXPLORE_SHARE, requests: int = EXPLORE_REQUESTS,
                 cycles: int = EXPLORE_CYCLES) -> None:
        super().__init__(share)
        self.requests, self.cycles = requests, cycles

    def pick(self, chosen: WidthChoice, widths: Sequence[int], optimistic: Sequence[float | None],
             cycles: Callable[[int], float], bs: int, step_ms: Callable[[int], float | None],
             estimates: Sequence[float | None] | None = None, margin: float = 0.0) -> int | None:
        """A width to try this step, or None. ``estimates``: each width's point estimate (tokens/s); ``margin``:
        what a width must beat the chosen one by to be chosen instead (the hysteresis)."""
        points = estimates if estimates is not None else [None] * len(widths)
        floor = (1.0 + margin) * chosen.tokens_per_s
        candidates = [(rate, w) for w, rate, point in zip(widths, optimistic, points, strict=True)
                      if w != chosen.width and rate is not None and rate > floor
                      and (cycles(w) < self.cycles or cycles(w) * bs < self.requests
                           or (point is not None and point > chosen.tokens_per_s))]
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
              samples: Callable[[int], float] | None = None) -> int | None:
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

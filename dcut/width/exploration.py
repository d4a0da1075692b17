"""Steps spent on widths other than the chosen one, each paid from a credit of a share of the steps:
exploring widths that might beat the choice, and probes that verify a whole block."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dcut.width.choice import WidthChoice

EXPLORE_SHARE = 0.2  # at most this share of step time tries widths that might beat the current choice


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
    could not be chosen, whatever it measured): an upper confidence bound, measured or not. The bound
    of a measured width is as wide as everything its estimate rests on is uncertain (the rate its
    drafts promised, what they delivered against that, the time its cycles took), and it shrinks with
    its fresh cycles, so a width within the noise of the choice is measured until the two separate.
    It used to be tried once measured only while its point estimate beat the choice: live at bs 8,
    width 3 measured 826 tok/s on 10 cycles against the held width 11's 869 on 677, and it was
    never tried again, while width 3 drafted alone was 4 % faster over the run.

    An exploring step drafts the width and verifies as the policy would, so what it delivers is what
    the width is worth. The most promising candidate goes first; a dear one waits until the credit
    covers its step. Candidates run out as measurements tighten the bounds, and then nothing is spent:
    exploration is a phase, not a tax (it comes back as measurements age, ``RealizedRates.fresh``).
    """

    def __init__(self, share: float = EXPLORE_SHARE) -> None:
        super().__init__(share)

    def candidate(self, chosen: WidthChoice, widths: Sequence[int], optimistic: Sequence[float | None],
                  margin: float = 0.0) -> int | None:
        """The width exploration would try next against ``chosen`` (the best optimistic rate that beats it by
        ``margin``, the hysteresis: short of that it could not be chosen), or None. It depends only on the decision:
        taken once per decision, then ``spend_on`` each step (worked out every step, on a CPU engine with its caches
        cold after the forward, the list of candidates cost 0.01 ms a step)."""
        if self.share <= 0:
            return None
        floor = (1.0 + margin) * chosen.tokens_per_s
        candidates = [(rate, w) for w, rate in zip(widths, optimistic, strict=True)
                      if w != chosen.width and rate is not None and rate > floor]
        return max(candidates)[1] if candidates else None

    def spend_on(self, chosen: WidthChoice, width: int | None, step_ms: Callable[[int], float | None]) -> int | None:
        """``width`` (``candidate``'s) to try this step, or None: this step's share is earned, and spent if it
        covers the width's step."""
        if width is None:
            return None
        self.credit += self.share
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

    def due(self) -> bool:
        """Earn this step's share; whether the credit may pay for a probe now (``pick`` then picks it). Apart so
        that a step with no probe due builds nothing for ``pick``."""
        if self.share <= 0:
            return False
        self.credit += self.share
        return self.credit >= 1.0

    def pick(self, chosen: WidthChoice, full_step_ms: Callable[[int], float | None],
             samples: Callable[[int], float] | None = None) -> int | None:
        """Once ``due``: the width to probe this step, or None where there is none or it costs more than the credit.
        ``full_step_ms(w)``: a step drafting and verifying w; ``samples(w)``: how much is known of w already (the
        least known is probed first)."""
        candidates = [w for w in self.widths if w != chosen.width]
        if not candidates:
            return None
        rotated = candidates[self._next % len(candidates):] + candidates[: self._next % len(candidates)]
        width = min(rotated, key=samples) if samples is not None else rotated[0]
        if not self._spend(chosen, full_step_ms(width)):
            return None
        self._next += 1
        return width

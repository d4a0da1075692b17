"""How many positions to draft this step: the joint choice of drafted width and verify budget.

D-Cut's verify budget alone leaves the drafter's own pass untouched, and on small targets that
pass, not verification, dominates a speculative step (``docs/history.md``). Before drafting,
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

One module per part: ``choice`` (the utility and the pick), ``acceptance`` (``WidthStats``),
``realized`` (``RealizedRates``), ``exploration`` (``Explorer``, ``ProbeBudget``).
"""

from dcut.width.acceptance import OPTIMISM, WidthStats, marginal_gains, per_request_gains, position_counts
from dcut.width.choice import WidthChoice, choose_width, step_costs, utilities_at, width_utilities, widths_for
from dcut.width.exploration import Explorer, ProbeBudget
from dcut.width.realized import RealizedRates

__all__ = [
    "OPTIMISM",
    "Explorer",
    "ProbeBudget",
    "RealizedRates",
    "WidthChoice",
    "WidthStats",
    "choose_width",
    "marginal_gains",
    "per_request_gains",
    "position_counts",
    "step_costs",
    "utilities_at",
    "width_utilities",
    "widths_for",
]

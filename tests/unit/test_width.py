"""The drafted-width choice: per-width acceptance, the joint utility, hysteresis and probes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dcut.width import (
    ProbeBudget,
    RealizedRates,
    WidthChoice,
    WidthStats,
    choose_width,
    plausible_widths,
    position_counts,
    width_utilities,
    widths_for,
)


def test_default_widths_include_zero_and_k() -> None:
    assert widths_for(15) == [0, 1, 2, 3, 5, 7, 11, 15]
    assert widths_for(4) == [0, 1, 2, 3, 4]
    assert widths_for(7, [3, 9]) == [3]  # given widths are taken as they are (those that fit)
    assert widths_for(15, [0]) == [0]


def test_width_stats_count_reached_positions_per_width() -> None:
    stats = WidthStats([0, 2, 4], k=4, prior_weight=0.0)
    # Three requests drafted at width 4: verified 4/4/2 drafts, accepted 1/4/2.
    stats.observe(4, *position_counts(torch.tensor([4, 4, 2]), torch.tensor([1, 4, 2]), 4)[1:])
    q = stats.conditional()
    assert q[2].tolist() == pytest.approx([3 / 3, 2 / 3, 1 / 1, 1 / 1])
    s = stats.survival()
    assert s[2].tolist() == pytest.approx(np.cumprod([1, 2 / 3, 1, 1]).tolist())
    assert s[0].tolist() == [0, 0, 0, 0] and s[1, 2:].tolist() == [0, 0]  # nothing past each width
    assert stats.observations() == {2: 0, 4: 3}


def test_unobserved_width_borrows_the_pooled_rate() -> None:
    stats = WidthStats([2, 4], k=4, prior_q=0.5, prior_weight=2.0)
    for _ in range(50):
        stats.observe(4, *position_counts(torch.tensor([4] * 8), torch.tensor([4] * 8), 4)[1:])  # all accepted
    q = stats.conditional()
    assert q[0, 0] > 0.9  # width 2 never observed: pooled towards width 4's rate, not the 0.5 prior


def no_overhead(tokens: np.ndarray) -> np.ndarray:
    return 0.0 * tokens


def flat_verify(bs: int, tokens: np.ndarray) -> np.ndarray:
    return 10.0 + 0.0 * tokens


def steep_verify(bs: int, tokens: np.ndarray) -> np.ndarray:
    return 1.0 + 1.0 * tokens


def test_utilities_pick_drafting_when_cheap_and_accepted() -> None:
    widths = [0, 2, 4]
    survival = np.array([[0, 0, 0, 0], [0.9, 0.8, 0, 0], [0.9, 0.8, 0.7, 0.6]])
    cheap = width_utilities(4, widths, survival, flat_verify, lambda bs, w: 0.1 * w, no_overhead)
    assert choose_width(cheap, None, 0.0).width == 4  # verify is flat, drafting nearly free
    dear = width_utilities(4, widths, survival, flat_verify, lambda bs, w: 50.0 * w, no_overhead)
    assert choose_width(dear, None, 0.0).width == 0  # the drafter costs more than it brings
    steep = width_utilities(4, widths, survival, steep_verify, lambda bs, w: 0.0 * w, no_overhead)
    best = choose_width(steep, None, 0.0)
    assert best.width in (2, 4) and best.depth == 1  # verification per token dominates: cut the depth
    assert steep[0].tokens_per_step == 4 and steep[0].step_ms == pytest.approx(5.0)  # tokens / step time
    big = width_utilities(64, widths, survival, steep_verify, lambda bs, w: 0.0 * w, no_overhead)
    assert choose_width(big, None, 0.0).width == 0  # at bs 64 no draft pays its verify cost


def test_unknown_costs_give_no_choice() -> None:
    out = width_utilities(4, [0, 2], np.zeros((2, 2)), lambda bs, t: None, lambda bs, w: 0.0 * w, no_overhead)
    assert out == [None, None] and choose_width(out, None, 0.0) is None


def test_hysteresis_holds_the_current_width() -> None:
    a, b = WidthChoice(2, 2, 10.0, 10.0), WidthChoice(4, 4, 10.4, 10.0)
    assert choose_width([a, b], current=2, hysteresis=0.05).width == 2
    assert choose_width([a, b], current=2, hysteresis=0.01).width == 4
    assert choose_width([a, b], current=None, hysteresis=0.5).width == 4


def test_probes_cost_at_most_their_share() -> None:
    probes = ProbeBudget([0, 1, 3, 7], share=0.05)
    chosen = WidthChoice(0, 0, 4.0, 10.0)
    taken = [probes.probe(chosen, lambda w: 10.0 + 10.0 * w) for _ in range(2000)]
    widths = [w for w in taken if w is not None]
    assert widths and set(widths) <= {1, 3, 7}  # never the chosen width
    time_spent = sum(10.0 + 10.0 * w - 10.0 for w in widths)
    assert time_spent <= 0.05 * 2000 * 10.0 * 1.01  # the extra time of probes stays within the share
    assert ProbeBudget([0, 1], share=0.0).probe(chosen, lambda w: 1.0) is None


def test_exploration_probes_more_until_widths_are_measured() -> None:
    chosen = WidthChoice(0, 0, 4.0, 10.0)
    calm, eager = ProbeBudget([0, 1, 3], share=0.02), ProbeBudget([0, 1, 3], share=0.02)
    calm_n = sum(calm.probe(chosen, lambda w: 10.0) is not None for _ in range(200))
    eager_taken = [eager.probe(chosen, lambda w: 10.0, lambda w: 0, explore=[3]) for _ in range(200)]
    eager_n = sum(w is not None for w in eager_taken)
    assert calm_n <= 4 and eager_n >= 25
    assert {w for w in eager_taken if w is not None} == {3}  # only the widths still to be measured


def test_only_widths_within_reach_are_explored() -> None:
    """At a large batch the model prices wide blocks far below the chosen width: they are not explored (a
    full-width probe there costs several plain steps); a width it cannot price is not either."""
    chosen = WidthChoice(1, 1, 70.0, 50.0)  # 1400 tokens/s
    choices = [WidthChoice(0, 0, 64.0, 48.0), chosen, WidthChoice(3, 2, 80.0, 70.0),
               WidthChoice(15, 3, 90.0, 300.0), None]
    assert plausible_widths(choices, chosen) == [0, 1, 3]
    assert plausible_widths(choices, chosen, floor=0.0) == [0, 1, 3, 15]


def test_realized_rates_replace_the_estimate_once_measured() -> None:
    rates = RealizedRates(min_samples=2)
    estimate = [WidthChoice(0, 0, 4.0, 4.0), WidthChoice(3, 2, 10.0, 5.0)]  # width 3 looks better
    rates.add(4, 3, tokens=6.0, ms=12.0)
    assert rates.apply(4, estimate)[1].tokens_per_s == estimate[1].tokens_per_s  # one cycle is not enough
    rates.add(4, 3, tokens=6.0, ms=12.0)
    measured = rates.apply(4, estimate)
    assert measured[1].tokens_per_s == pytest.approx(500.0) and choose_width(measured, None, 0.0).width == 0
    assert rates.apply(8, estimate) == estimate  # other batch-size buckets are separate

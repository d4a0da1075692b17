"""The drafted-width choice: per-width acceptance, the joint utility, hysteresis, exploration and probes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dcut.width import (
    Explorer,
    ProbeBudget,
    RealizedRates,
    WidthChoice,
    WidthStats,
    choose_width,
    marginal_gains,
    position_counts,
    step_costs,
    utilities_at,
    width_utilities,
    widths_for,
)
from dcut.width.realized import SHIFT_RUN, SHRINK_REQUESTS


def test_default_widths_include_zero_and_k() -> None:
    assert widths_for(15) == [0, 1, 2, 3, 5, 7, 11, 15]
    assert widths_for(4) == [0, 1, 2, 3, 4]
    assert widths_for(7, [3, 9]) == [3]  # given widths are taken as they are (those that fit)
    assert widths_for(15, [0]) == [0]


def test_width_stats_count_reached_positions_per_width() -> None:
    stats = WidthStats([0, 2, 4], k=4, prior_weight=0.0)
    # Three requests drafted at width 4: verified 4/4/2 drafts, accepted 1/4/2.
    stats.observe(4, *position_counts(np.array([4, 4, 2]), np.array([1, 4, 2]), 4)[1:])
    q = stats.conditional()
    assert q[2].tolist() == pytest.approx([3 / 3, 2 / 3, 1 / 1, 1 / 1])
    s = stats.survival()
    assert s[2].tolist() == pytest.approx(np.cumprod([1, 2 / 3, 1, 1]).tolist())
    assert s[0].tolist() == [0, 0, 0, 0] and s[1, 2:].tolist() == [0, 0]  # nothing past each width
    assert stats.observations() == {2: 0, 4: 3}


def test_position_counts_of_several_steps_at_once_are_each_steps_own() -> None:
    steps = [(np.array([4, 4, 2]), np.array([1, 4, 2])), (np.array([3]), np.array([0])),
             (np.array([2, 1]), np.array([2, 1]))]
    step = np.repeat(np.arange(3), [len(v) for v, _ in steps])
    together = position_counts(np.concatenate([v for v, _ in steps]), np.concatenate([a for _, a in steps]), 4, step, 3)
    for i, (verified, accepted) in enumerate(steps):
        for mine, alone in zip(together, position_counts(verified, accepted, 4), strict=True):
            assert mine[i].tolist() == alone.tolist()


def test_unobserved_width_borrows_the_pooled_rate() -> None:
    stats = WidthStats([2, 4], k=4, prior_q=0.5, prior_weight=2.0)
    for _ in range(50):
        stats.observe(4, *position_counts(np.array([4] * 8), np.array([4] * 8), 4)[1:])  # all accepted
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


def test_one_lookup_of_costs_weighs_several_acceptance_curves_as_separate_calls_do() -> None:
    """A decision prices its model and its optimistic curve on one cost lookup (``step_costs``): the same figures,
    to the last bit, as a full ``width_utilities`` call per curve; and the lookup is made once."""
    widths = [0, 2, 4]
    model = np.array([[0, 0, 0, 0], [0.9, 0.8, 0, 0], [0.9, 0.8, 0.7, 0.6]])
    hopeful = np.minimum(model + 0.05, 1.0)
    lookups = []

    def verify(bs: int, tokens: np.ndarray) -> np.ndarray:
        lookups.append(tokens.tolist())
        return steep_verify(bs, tokens)

    costs = step_costs(4, widths, 4, verify, lambda bs, w: 0.3 * w)
    shared = [utilities_at(4, widths, s, costs, lambda t: 0.1 + 0.01 * t) for s in (model, hopeful)]
    assert len(lookups) == 1 and lookups[0] == [4, 8, 12, 16, 20]
    alone = [width_utilities(4, widths, s, steep_verify, lambda bs, w: 0.3 * w, lambda t: 0.1 + 0.01 * t)
             for s in (model, hopeful)]
    assert shared == alone
    assert shared[1][2].tokens_per_step > shared[0][2].tokens_per_step  # the optimistic curve expects more
    assert utilities_at(4, widths, model, None, no_overhead) == [None, None, None]


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
    taken = [probes.pick(chosen, lambda w: 10.0 + 10.0 * w) if probes.due() else None for _ in range(2000)]
    widths = [w for w in taken if w is not None]
    assert widths and set(widths) <= {1, 3, 7}  # never the chosen width
    time_spent = sum(10.0 + 10.0 * w - 10.0 for w in widths)
    assert time_spent <= 0.05 * 2000 * 10.0 * 1.01  # the extra time of probes stays within the share
    assert not ProbeBudget([0, 1], share=0.0).due()


def test_probes_go_to_the_least_measured_width() -> None:
    probes = ProbeBudget([0, 1, 3], share=0.5)
    chosen = WidthChoice(0, 0, 4.0, 10.0)
    taken = [probes.pick(chosen, lambda w: 10.0, lambda w: {1: 5, 3: 0}[w]) if probes.due() else None
             for _ in range(4)]
    assert [w for w in taken if w is not None] == [3, 3]


def test_an_optimistic_bound_tightens_with_observations() -> None:
    stats = WidthStats([2, 4], k=4)
    assert stats.survival(1.5)[1].tolist() == [1.0, 1.0, 1.0, 1.0]  # nothing known: anything is possible
    for _ in range(40):  # half the first drafts accepted, none past them
        stats.observe(4, *position_counts(np.array([4] * 8), np.array([1, 0] * 4), 4)[1:])
    hopeful, mean = stats.survival(1.5)[1], stats.survival()[1]
    assert mean[0] == pytest.approx(0.5, abs=0.01) and 0.5 < hopeful[0] < 0.6


def test_drafted_widths_are_priced_by_their_calibrated_confidences() -> None:
    """Counted acceptance at cut positions is that of the best drafts only; the block's confidences price
    every draft, and a width never drafted borrows a wider block's confidences at the positions it has."""
    stats = WidthStats([2, 4], k=4, prior_weight=2.0)
    stats.observe(4, *position_counts(np.array([1] * 8), np.array([1] * 8), 4)[1:])  # kept 1, all accepted
    stats.observe_scores(4, np.array([0.6, 0.3, 0.1, 0.05]), requests=8)
    s = stats.survival()
    assert s[1].tolist() == pytest.approx([0.6, 0.3, 0.1, 0.05])
    assert s[0].tolist() == pytest.approx([0.6, 0.3, 0.0, 0.0])  # width 2: width 4's first two positions


def test_a_width_is_priced_again_under_the_calibration_of_now() -> None:
    """A width drafted once while calibration knew nothing keeps that price until ``rescore`` prices its blocks
    under what calibration learned since (the MoE pair: width 15 priced at half what it delivered, never
    drafted again)."""
    stats = WidthStats([2, 4], k=4)
    block = torch.full((3, 4), math.log(0.1))  # an under-confident drafter: raw 0.1 ...
    stats.observe_scores(4, marginal_gains(block.numpy()), requests=3)
    stats.observe_block(block)
    assert stats.survival()[1][0] == pytest.approx(0.1)
    stats.rescore(lambda width, log_conf: np.zeros_like(log_conf))  # ... learned to be accepted every time
    assert stats.survival()[1].tolist() == pytest.approx([1.0] * 4)
    assert stats.survival()[0][:2].tolist() == pytest.approx([1.0, 1.0])  # width 2 borrows width 4's price


def test_marginal_gains_price_the_global_top_k() -> None:
    # One sure request and one hopeless one: the first draft per request (budget bs) is worth the sure
    # request's first two drafts, which a uniform depth of 1 would not keep.
    log_conf = np.log(np.array([[1.0, 1.0, 1.0], [0.01, 0.01, 0.01]], dtype=np.float32))
    g = marginal_gains(log_conf)
    assert g.tolist() == pytest.approx([1.0, 0.5 + 0.005, 0.00005 + 0.0000005], rel=1e-3)
    assert marginal_gains(log_conf[:1]).tolist() == pytest.approx([1.0, 1.0, 1.0])  # bs 1: the prefix scores
    stacked = marginal_gains(np.stack([log_conf, log_conf[::-1]]))  # blocks stacked: one row each
    assert stacked.shape == (2, 3) and np.allclose(stacked, g[None, :])


def test_the_explorer_tries_only_widths_whose_bound_beats_the_choice_until_it_no_longer_does() -> None:
    explorer = Explorer(share=0.5)
    chosen = WidthChoice(3, 3, 40.0, 10.0)  # 4000 tokens/s
    widths = [0, 3, 7, 15]
    bound = {0: 1000.0, 7: 5000.0, 15: 3900.0}
    picks = []
    for _ in range(40):
        w = explorer.spend_on(chosen, explorer.candidate(chosen, widths, [bound.get(w, 4000.0) for w in widths]),
                              lambda w: 10.0)
        picks.append(w)
        if w is not None:
            bound[w] -= 125.0  # each cycle tightens its bound
    tried = [w for w in picks if w is not None]
    assert set(tried) == {7} and len(tried) == 8  # 15 cannot beat width 3 even at its best; 0 neither
    assert picks[-1] is None and sum(w is not None for w in picks[:16]) == 8  # half the steps while exploring


def test_a_measured_width_behind_the_choice_is_tried_while_its_bound_clears_the_hysteresis() -> None:
    """Measured or not, behind the choice or not: the bound decides. Live at bs 8 a width measured 5 % behind
    the held one on 10 cycles was never tried again (it was ahead over the run)."""
    explorer = Explorer(share=1.0)
    chosen = WidthChoice(11, 11, 40.0, 40.0)  # 1000 tokens/s
    widths, optimistic = [3, 5, 11, 15], [1060.0, 1015.0, 1000.0, 990.0]
    picks = {explorer.spend_on(chosen, explorer.candidate(chosen, widths, optimistic, 0.02), lambda w: 40.0)
             for _ in range(5)}
    assert picks == {3}  # 5's bound (1.5 %) is inside the 2 % hysteresis; 15's is below the choice
    assert {explorer.spend_on(chosen, explorer.candidate(chosen, widths, optimistic), lambda w: 40.0)
            for _ in range(5)} == {3}  # the best bound first
    assert explorer.candidate(chosen, widths, [1010.0, 1015.0, 1000.0, 990.0], 0.02) is None


def test_a_dear_width_waits_for_its_credit() -> None:
    explorer = Explorer(share=0.2)
    chosen = WidthChoice(0, 0, 10.0, 10.0)
    candidate = explorer.candidate(chosen, [0, 15], [1000.0, 5000.0])
    picks = [explorer.spend_on(chosen, candidate, lambda w: 50.0) for _ in range(50)]
    assert sum(p is not None for p in picks) == 2  # each try costs 5 chosen steps: 20% of the time


def test_a_decision_s_candidate_is_tried_as_its_credit_pays_for_it() -> None:
    """The runner takes the candidate once per decision (``Explorer.candidate``) and spends on it each step
    (``spend_on``): a width whose step costs 7.5 chosen steps, at a share of 0.3, is tried every 25 steps; a
    decision with nothing to try earns no credit."""
    chosen, widths, optimistic = WidthChoice(0, 0, 10.0, 10.0), [0, 3, 15], [1000.0, 3000.0, 5000.0]
    explorer = Explorer(share=0.3)
    candidate = explorer.candidate(chosen, widths, optimistic)
    assert candidate == 15  # the best bound
    spent = [explorer.spend_on(chosen, candidate, lambda w: 5.0 * w) for _ in range(60)]
    assert [i for i, w in enumerate(spent) if w is not None] == [25, 50] and {w for w in spent if w} == {15}
    idle = Explorer(share=0.3)
    assert idle.candidate(chosen, widths, [1000.0, 900.0, None]) is None
    assert idle.spend_on(chosen, None, lambda w: 1.0) is None and idle.credit == 0.0
    assert Explorer(share=0.0).candidate(chosen, widths, optimistic) is None


def test_a_probe_is_picked_only_when_due() -> None:
    """``ProbeBudget.due`` earns the step's share and says when a probe may be paid; ``pick`` then picks it (the
    runner builds ``pick``'s callables only on a due step): at a share of 0.1, a probe every 10 steps, rotating
    over the widths other than the chosen one."""
    chosen = WidthChoice(3, 3, 40.0, 10.0)
    fresh = ProbeBudget([0, 3, 7], share=0.1)
    assert not any(fresh.due() for _ in range(10))  # a credit of 0.1 a step reaches 1 after the tenth
    probes = ProbeBudget([0, 3, 7], share=0.1)
    taken = [probes.pick(chosen, lambda w: 10.0) if probes.due() else None for _ in range(60)]
    assert [(i, w) for i, w in enumerate(taken) if w is not None] == [(10, 0), (20, 7), (30, 0), (40, 7), (50, 0)]
    assert not ProbeBudget([0, 3], share=0.0).due()


def test_realized_rates_replace_the_estimate_once_measured() -> None:
    rates = RealizedRates(min_samples=2, min_requests=8)
    estimate = [WidthChoice(0, 0, 16.0, 4.0), WidthChoice(3, 2, 40.0, 5.0)]  # width 3 looks better
    rates.add(4, 3, tokens=12.0, ms=12.0, predicted_tokens=12.0, predicted_ms=12.0)
    assert rates.apply(4, estimate)[1].tokens_per_s == estimate[1].tokens_per_s  # one cycle is not enough
    rates.add(4, 3, tokens=12.0, ms=12.0, predicted_tokens=12.0, predicted_ms=12.0)
    measured = rates.apply(4, estimate)
    assert measured[1].tokens_per_s == pytest.approx(1000.0) and choose_width(measured, None, 0.0).width == 0
    assert rates.apply(8, estimate) == estimate  # other batch-size buckets are separate


def test_a_width_not_yet_measured_is_as_hopeful_as_what_its_few_cycles_delivered() -> None:
    """The model prices width 15 at 700 tok/s (uncalibrated confidences) and one cycle delivered 1,800: it stays a
    candidate for exploration until measured, whichever is higher; a width never run keeps the model's figure."""
    rates = RealizedRates(min_samples=3, min_requests=32)
    model = [WidthChoice(0, 0, 1.0, 1.5), WidthChoice(15, 15, 2.1, 3.0), WidthChoice(7, 7, 1.0, 2.0)]
    rates.add(1, 15, tokens=5.4, ms=3.0, predicted_tokens=2.1, predicted_ms=3.0)
    assert rates.optimistic(1, model) == pytest.approx([1000.0 / 1.5, 1800.0, 500.0])
    rates.add(1, 15, tokens=0.3, ms=3.0, predicted_tokens=2.1, predicted_ms=3.0)  # an unlucky one: their mean
    assert rates.optimistic(1, model)[1] == pytest.approx(950.0)
    rates.add(1, 15, tokens=0.3, ms=3.0, predicted_tokens=2.1, predicted_ms=3.0)  # their mean, 667: the model's
    assert rates.optimistic(1, model)[1] == pytest.approx(700.0)


def test_what_probes_delivered_keeps_a_width_a_candidate_but_never_measures_it() -> None:
    """A calibrating start verified width 15 in full at 2,000 tok/s while the model prices it at 700: it stays a
    candidate for exploration (optimistic 2,000, stalls capped), but the probes do not count as its measurement."""
    rates = RealizedRates(min_samples=3, min_requests=32)
    model = [WidthChoice(0, 0, 1.0, 1.5), WidthChoice(15, 15, 2.1, 3.0)]
    for _ in range(4):
        rates.add_probe(1, 15, tokens=6.0, ms=3.0, predicted_ms=3.0)
    rates.add_probe(1, 15, tokens=6.0, ms=300.0, predicted_ms=3.0)  # a stall: counted as 3x its predicted time
    assert rates.optimistic(1, model)[1] == pytest.approx(1000.0 * 30.0 / 21.0)
    assert rates.optimistic(1, model)[0] == pytest.approx(1000.0 / 1.5)
    assert rates.apply(1, model) == model and rates.fresh(1, 15) == 0.0


def test_what_uneven_probes_delivered_is_a_bound_that_widens_as_it_ages() -> None:
    """Probes that delivered 1 token, 1 token, 1 token and 13 (a request's hard start, then an easy stretch) say
    little of what the width is worth: its optimistic rate is their rate raised by ``z`` spreads over the square root
    of the probes, and raised further as the bucket's cycles at the held width age them (half-life), up to ``z``
    spreads. Otherwise a width probed in a hard stretch is never tried again while the held width is 0 (replayed
    on the MoE pair at bs 1: 0.59x the best baseline from one start of five)."""
    rates = RealizedRates(min_samples=3, min_requests=32, half_life=10.0)
    model = [WidthChoice(0, 0, 1.0, 1.0), WidthChoice(15, 15, 1.0, 4.0)]
    for tokens in (1.0, 1.0, 1.0, 13.0):
        rates.add_probe(1, 15, tokens=tokens, ms=4.0, predicted_ms=4.0)
    rate, spread = 1000.0 * 16.0 / 16.0, 27.0 ** 0.5 / 4.0  # mean 4 tokens, standard deviation sqrt(27)
    assert rates.optimistic(1, model, z=1.5)[1] == pytest.approx(rate * (1.0 + 1.5 * spread / 2.0))
    for _ in range(20):  # two half-lives at width 0: the four probes weigh as one
        rates.add(1, 0, tokens=1.0, ms=1.0, predicted_tokens=1.0, predicted_ms=1.0)
    assert rates.optimistic(1, model, z=1.5)[1] == pytest.approx(rate * (1.0 + 1.5 * spread))
    even = RealizedRates(min_samples=3, min_requests=32)
    for _ in range(4):
        even.add_probe(1, 15, tokens=4.0, ms=4.0, predicted_ms=4.0)
    assert even.optimistic(1, model)[1] == pytest.approx(rate)  # alike probes: their rate, as certain as it gets


def test_a_measured_widths_bound_is_as_wide_as_what_its_cycles_delivered_and_took_swings() -> None:
    """Two widths with the same means at bs 8: one whose cycles delivered and took just what was predicted, one
    whose cycles delivered half or one and a half times it and took 0.8 or 1.2 times it. The first's bound is its
    estimate; the second's is raised by ``z`` of its combined spread (the tokens ratio at its weight against the
    pooled one: 320 requests against ``SHRINK_REQUESTS``) over the square root of its cycles."""
    steady, swinging = RealizedRates(), RealizedRates()
    for i in range(40):
        steady.add(8, 7, tokens=20.0, ms=10.0, predicted_tokens=20.0, predicted_ms=10.0)
        swinging.add(8, 7, tokens=(10.0, 30.0)[i % 2], ms=(8.0, 12.0)[i % 2], predicted_tokens=20.0,
                     predicted_ms=10.0)
    model = [WidthChoice(7, 7, 20.0, 10.0)]
    assert steady.apply(8, model)[0].tokens_per_s == pytest.approx(2000.0)
    point = swinging.apply(8, model)[0].tokens_per_s
    assert point == pytest.approx(2000.0, rel=0.01)  # (the pooled ratio weighs recent cycles most)
    assert steady.optimistic(8, model, z=1.5)[0] == pytest.approx(2000.0)
    weight = 320.0 / (320.0 + SHRINK_REQUESTS)
    spread = ((weight * 0.5) ** 2 + 0.2 ** 2) ** 0.5
    assert swinging.optimistic(8, model, z=1.5)[0] == pytest.approx(point * (1.0 + 1.5 * spread / 40 ** 0.5))


def test_deferred_work_charged_to_steady_cycles_adds_nothing_to_their_spread() -> None:
    """Width 0's cycles, each 10 ms as predicted, each charged 2 ms of the drafter's deferred writes: they cost 12 ms,
    steadily. The charge is what they cost, not a swing in it, so the bound is the estimate."""
    rates = RealizedRates()
    for _ in range(40):
        rates.add(8, 0, tokens=8.0, ms=10.0, predicted_tokens=8.0, predicted_ms=10.0)
        rates.charge(8, 0, 2.0, cycles=1)
    model = [WidthChoice(0, 0, 8.0, 10.0)]
    (point,) = rates.apply(8, model)
    assert point.step_ms == pytest.approx(12.0, rel=0.01)
    assert rates.optimistic(8, model)[0] == pytest.approx(point.tokens_per_s)


def test_measured_widths_are_judged_on_predictions_corrected_by_what_was_realized() -> None:
    """Two widths measured at different moments: their predictions compare them, and the bucket's pooled
    realized/predicted ratio corrects both (here the model promised twice the tokens it got)."""
    rates = RealizedRates(min_samples=1, min_requests=1, shift=0.3)
    for _ in range(4):
        rates.add(8, 3, tokens=10.0, ms=10.0, predicted_tokens=20.0, predicted_ms=10.0)
        rates.add(8, 7, tokens=14.0, ms=10.0, predicted_tokens=28.0, predicted_ms=10.0)
    a, b = rates.apply(8, [WidthChoice(3, 3, 1.0, 1.0), WidthChoice(7, 7, 1.0, 1.0)])
    assert a.tokens_per_s == pytest.approx(1000.0) and b.tokens_per_s == pytest.approx(1400.0)
    summary = rates.summary()["8/7"]
    assert summary["predicted_tokens_per_s"] == pytest.approx(2 * summary["tokens_per_s"])


def test_a_width_measured_in_an_easy_stretch_is_judged_on_what_its_positions_are_worth_now() -> None:
    """Width 3 measured while each request's first three drafts were worth 0.9 / 0.6 / 0.3 (1.8 accepted a block),
    then width 15 drafted in a harder stretch, its first three worth half: width 3 is priced on the stretch of now,
    its drafts' share of its tokens halved (in a replay, an easy stretch held a wide width against a narrow one
    measured earlier). What the recent blocks say fades as they age (width 0 for long): width 3's own prediction
    stands again."""
    rates = RealizedRates(min_samples=1, min_requests=1)
    easy, hard = np.array([0.9, 0.6, 0.3]), np.array([0.45, 0.3, 0.15, *([0.1] * 12)])
    for _ in range(40):
        rates.add(4, 3, tokens=11.2, ms=10.0, predicted_tokens=11.2, predicted_ms=10.0, gains=easy, requests=4)
    choices = [WidthChoice(3, 3, 1.0, 1.0), WidthChoice(15, 15, 1.0, 1.0)]
    before = rates.apply(4, choices)[0].tokens_per_s
    assert before == pytest.approx(1120.0)
    for _ in range(40):
        rates.add(4, 15, tokens=9.0, ms=10.0, predicted_tokens=9.0, predicted_ms=10.0, gains=hard, requests=4)
    now = rates.apply(4, choices)
    assert now[0].tokens_per_s == pytest.approx(1000.0 * (4 + 7.2 * 0.5) / 10.0, rel=0.01)  # 760, not 1,120
    assert now[1].tokens_per_s == pytest.approx(900.0, rel=0.01)  # the width drafting now: its own stretch
    rates.add(4, 0, tokens=4.0, ms=5.0, predicted_tokens=4.0, predicted_ms=5.0)  # width 0: nothing is drafted,
    assert 760.0 < rates.apply(4, choices)[0].tokens_per_s < 1120.0  # what drafts are worth now is less sure
    for _ in range(80):  # and as it ages, width 3's own prediction stands again
        rates.add(4, 0, tokens=4.0, ms=5.0, predicted_tokens=4.0, predicted_ms=5.0)
    assert rates.apply(4, choices)[0].tokens_per_s == pytest.approx(before, rel=0.001)


def test_measurements_fade_so_old_ones_are_worth_retaking() -> None:
    rates = RealizedRates(half_life=10.0)
    rates.add(1, 7, 4.0, 10.0, 4.0, 10.0)
    assert rates.fresh(1, 7) == pytest.approx(1.0)
    for _ in range(10):
        rates.add(1, 15, 4.0, 10.0, 4.0, 10.0)
    assert rates.fresh(1, 7) == pytest.approx(0.5) and rates.fresh(1, 15) > 9


def test_noisy_estimates_need_a_clear_lead_to_switch() -> None:
    a, b = WidthChoice(7, 7, 10.0, 10.0), WidthChoice(15, 15, 11.0, 10.0)  # 15 looks 10% better
    assert choose_width([a, b], current=7, hysteresis=0.02).width == 15
    assert choose_width([a, b], current=7, hysteresis=0.02, noise=lambda w: 0.05).width == 7  # within 2 sigma


def test_deferred_work_is_charged_to_the_width_that_deferred_it() -> None:
    rates = RealizedRates(min_samples=1, min_requests=1)
    rates.add(4, 0, tokens=4.0, ms=4.0, predicted_tokens=4.0, predicted_ms=4.0)
    rates.charge(4, 0, 2.0, cycles=1)
    (zero,) = rates.apply(4, [WidthChoice(0, 0, 1.0, 1.0)])
    assert zero.step_ms == pytest.approx(6.0)
    rates.charge(4, 7, 2.0, cycles=1)  # an unmeasured width: nothing to charge
    assert rates.samples(4, 7) == 0


def test_a_stalled_cycle_costs_a_width_at_most_a_few_cycles_worth() -> None:
    """Twelve 10 ms cycles and one of 500 ms (a stall): the width is measured near 10 ms a cycle, not at 48."""
    rates = RealizedRates(min_samples=1, min_requests=1)
    for ms in [10.0] * 6 + [500.0] + [10.0] * 6:
        rates.add(4, 7, tokens=40.0, ms=ms, predicted_tokens=40.0, predicted_ms=10.0)
    assert rates.summary()["4/7"]["tokens_per_s"] == pytest.approx(1000.0 * 40 / (10.0 + 20.0 / 13))


@pytest.mark.parametrize("every", [1, 2, 5])
def test_deferred_work_paid_every_few_cycles_adds_its_share_and_no_more(every: int) -> None:
    """Cycles of 10 ms that each deferred 5 ms, paid every ``every`` cycles: the width's cycles cost 15 ms. Charged
    to the long-run mean whole, each payment raised the older cycles too, and the mean ran away (every 2: 136 ms,
    every 1: 260)."""
    rates = RealizedRates(min_samples=1, min_requests=1, shift=0.3)
    for i in range(1, 2001):
        rates.add(4, 0, tokens=4.0, ms=10.0, predicted_tokens=4.0, predicted_ms=10.0)
        if i % every == 0:
            rates.charge(4, 0, 5.0 * every, cycles=every)
    assert rates.summary()["4/0"]["tokens_per_s"] == pytest.approx(1000.0 * 4 / 15, rel=0.02)
    assert rates.shifts == {}  # deferred work paid later is not the machine changing speed


def test_a_machine_that_slows_is_noticed_and_the_widths_measured_before_are_forgotten() -> None:
    """Width 0 held at 10 ms a cycle, width 3 measured once beside it; the machine slows 2x. Within ``SHIFT_RUN``
    cycles width 0 reads the new speed (its long mean alone would still say ~12 ms) and width 3, measured at the old
    speed, is unmeasured again, to be priced by the model until explored; other buckets keep theirs."""
    rates = RealizedRates(min_samples=1, min_requests=1, shift=0.3)
    for _ in range(4):
        rates.add(8, 3, tokens=20.0, ms=15.0, predicted_tokens=20.0, predicted_ms=15.0)
        rates.add(16, 3, tokens=40.0, ms=25.0, predicted_tokens=40.0, predicted_ms=25.0)
    for _ in range(100):
        rates.add(8, 0, tokens=8.0, ms=10.0, predicted_tokens=8.0, predicted_ms=10.0)
    for i in range(SHIFT_RUN):
        assert rates.shifts == {} and rates.samples(8, 3) == 4, i  # not before the run is complete
        rates.add(8, 0, tokens=8.0, ms=20.0, predicted_tokens=8.0, predicted_ms=10.0)
    assert rates.shifts == {8: 1}
    assert rates.summary()["8/0"]["tokens_per_s"] == pytest.approx(1000.0 * 8 / 20)
    assert rates.samples(8, 3) == 0 and rates.samples(16, 3) == 4
    model = [WidthChoice(0, 0, 8.0, 10.0), WidthChoice(3, 2, 20.0, 14.0)]
    assert rates.apply(8, model)[1] == model[1]


@pytest.mark.parametrize("cycles", [
    [10.0, 14.0, 7.0, 11.0, 9.0, 13.5, 7.5] * 40,  # noise of +-40 %, never many cycles in a row beyond +-30 %
    [10.0] * 100 + [30.0] * (SHIFT_RUN - 1) + [10.0] * 50,  # a burst of stalls, one cycle short of a run, and after
])
def test_noise_and_short_bursts_are_not_a_change_of_speed(cycles: list[float]) -> None:
    rates = RealizedRates(min_samples=1, min_requests=1, shift=0.3)
    for ms in cycles:
        rates.add(4, 7, tokens=30.0, ms=ms, predicted_tokens=30.0, predicted_ms=10.0)
    assert rates.shifts == {}


def test_a_burst_of_cycles_that_also_prefilled_is_not_a_change_of_speed_but_slow_pure_cycles_are() -> None:
    """Width 2 at 10 ms a pure cycle and 18 ms one verified beside prefills, which come in bursts (requests of one
    length admitted together finish together). A burst of them, however long, is no change of speed, and judged on the
    pure cycles' own mean, pure ones that follow are not a change the other way either (against the mean of both they
    would be 30 % under it); the mean the policy reads holds both. Pure cycles at twice their time are a change."""
    rates = RealizedRates(min_samples=1, min_requests=1, shift=0.3)
    rates.add(64, 0, tokens=64.0, ms=8.0, predicted_tokens=64.0, predicted_ms=8.0)
    for pure in [True, False] * 20 + [False] * (3 * SHIFT_RUN) + [True] * (3 * SHIFT_RUN):
        rates.add(64, 2, tokens=100.0, ms=10.0 if pure else 18.0, predicted_tokens=100.0, predicted_ms=10.0, pure=pure)
    assert rates.shifts == {} and rates.samples(64, 0) == 1
    assert 10.0 < 1000.0 * 100.0 / rates.summary()["64/2"]["tokens_per_s"] < 18.0  # both kinds, in the mean
    for _ in range(SHIFT_RUN):
        rates.add(64, 2, tokens=100.0, ms=20.0, predicted_tokens=100.0, predicted_ms=10.0)
    assert rates.shifts == {64: 1} and rates.samples(64, 0) == 0

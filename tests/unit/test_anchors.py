"""Other engines' rules as replay policies: vLLM adaptive verification, SGLang adaptive steps, TRT-LLM schedule."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np
import pytest

from dcut.cost_table import CostTable, Fingerprint
from dcut.replay.anchors import (
    SGLANG_BS_AWARE_SLOTS,
    SGLangAdaptive,
    SGLangSlot,
    TRTLLMSchedule,
    VLLMAdaptive,
)
from dcut.replay.costs import CostModel
from dcut.replay.policy import Verified

FP = Fingerprint(hardware="test", model="dense", drafter="dflash", k=7)
WIDTHS = [0, 1, 3, 7]
SIZES = (1, 4, 16, 64)


def cost_model(slope: Callable[[int], float]) -> CostModel:
    """Verify: 10 ms plus ``slope(bs)`` ms per draft token; drafter: 0.5 ms plus 0.02 ms per drafted position."""
    points = {bs: [(bs, 10.0, 1), (8 * bs, 10.0 + slope(bs) * 7 * bs, 1)] for bs in SIZES}
    draft = {bs: {0: (0.5, 1), 7: (0.5 + 0.02 * 7 * bs, 1)} for bs in SIZES}
    return CostModel("test", CostTable(FP, points, draft=draft), per_step_ms=1.0, per_token_ms=0.01)


def confidences(bs: int = 16, w: int = 7) -> np.ndarray:
    return np.log(np.random.default_rng(0).uniform(0.3, 0.95, size=(bs, w)))


def verified(w: int, accepted: list[int] | np.ndarray) -> Verified:
    accepted = np.asarray(accepted, dtype=np.int64)
    return Verified(w, np.full(len(accepted), w, dtype=np.int64), np.minimum(accepted, w), 10.0)


# vLLM adaptive verification


def test_vllm_drafts_full_k_and_keeps_the_global_top_survivals_as_prefixes() -> None:
    policy = VLLMAdaptive(cost_model(lambda bs: 0.2), 7, WIDTHS, online_estimator=False)
    assert policy.width(16, None) == 7
    log_conf = confidences()
    depths = policy.keep(log_conf)
    assert depths.dtype == np.int64 and depths.shape == (16,)
    assert 0 < depths.sum() < depths.size * 7 and depths.min() >= 0 and depths.max() <= 7
    survival = np.exp(np.cumsum(log_conf, axis=1))
    kept = np.arange(7)[None, :] < depths[:, None]
    assert survival[kept].min() >= survival[~kept].max()  # one global threshold, not a per-request quota


def test_vllm_keeps_more_when_verification_is_cheap() -> None:
    kept = [VLLMAdaptive(cost_model(lambda bs, s=s: s), 7, WIDTHS, online_estimator=False).keep(confidences()).sum()
            for s in (0.0, 0.05, 0.2, 1.0)]
    assert kept[0] == 16 * 7  # a flat verify cost: every draft is worth verifying
    assert kept[0] > kept[1] > kept[2] > kept[3]
    assert kept[3] == 0  # a draft token dearer than what it returns: verify none


def run_vllm(policy: VLLMAdaptive, log_conf: Callable[[int], np.ndarray],
             accepts: Callable[[int, np.ndarray], np.ndarray], steps: int, late: bool = False) -> list[np.ndarray]:
    """Replay ``steps`` steps: ``log_conf(n)`` drafts step n, ``accepts(n, kept)`` grades them. ``late``:
    outcomes reach the policy as replay's ``run_cell`` hands them over, after a first outcome of a step
    that drafted nothing and a step late."""
    history: list[np.ndarray] = []
    bs = log_conf(0).shape[0]
    outcomes: deque[Verified | None] = deque([None, verified(0, [0] * bs)] if late else [None])
    for n in range(steps):
        w = policy.width(bs, outcomes.popleft())
        depths = policy.keep(log_conf(n)[:, :w])
        history.append(depths)
        outcomes.append(Verified(w, depths, np.minimum(accepts(n, depths), depths), 10.0))
    return history


def test_vllm_estimator_verifies_everything_while_warming_up_then_learns_observed_acceptance() -> None:
    policy = VLLMAdaptive(cost_model(lambda bs: 0.05), 7, WIDTHS, refit_interval=20, warmup_refits=3)
    assert policy.estimator is not None
    # Rows 0-7 are confident and always accepted, rows 8-15 hesitant and always rejected.
    log_conf = np.concatenate([np.full((8, 7), np.log(0.9)), np.full((8, 7), np.log(0.3))])
    prior = policy.estimator.predict(log_conf)[1]
    assert np.allclose(prior, 1 / (1 + np.exp(-1.5)))  # vLLM's uniform start
    history = run_vllm(policy, lambda n: log_conf, lambda n, kept: np.where(np.arange(16) < 8, kept, 0), 120)
    assert all((d == 7).all() for d in history[:60])  # 3 refits x 20 steps of full verification
    assert (history[-1][:8] == 7).all() and (history[-1][8:] == 0).all()  # then the rejected rows are cut
    learned = policy.estimator.predict(log_conf)[1]
    assert policy.estimator.weight > 0
    assert learned[8, 0] < 0.05 < 0.95 < learned[0, 0]


def test_vllm_estimator_moves_toward_a_low_observed_rate() -> None:
    policy = VLLMAdaptive(cost_model(lambda bs: 0.05), 7, WIDTHS, refit_interval=10, warmup_refits=2)
    assert policy.estimator is not None
    log_conf = np.full((4, 7), np.log(0.8))
    before = policy.estimator.predict(log_conf)[1][0, 0]
    run_vllm(policy, lambda n: log_conf, lambda n, kept: np.zeros_like(kept), 20)
    after = policy.estimator.predict(log_conf)[1][0, 0]
    assert after < before - 0.2


@pytest.mark.parametrize("late", [False, True])
def test_vllm_estimator_grades_each_step_with_its_own_outcome(late: bool) -> None:
    policy = VLLMAdaptive(cost_model(lambda bs: 0.05), 7, WIDTHS, refit_interval=10, warmup_refits=3)
    assert policy.estimator is not None
    # Steps alternate: confident drafts that are accepted, hesitant ones that are rejected. Pairing an
    # outcome with the wrong step would teach the opposite, which the non-negative slope cannot follow.
    confident, hesitant = np.full((4, 7), np.log(0.9)), np.full((4, 7), np.log(0.3))
    run_vllm(policy, lambda n: hesitant if n % 2 else confident,
             lambda n, kept: np.zeros_like(kept) if n % 2 else kept, 60, late)
    learned = policy.estimator.predict(np.concatenate([confident, hesitant]))[1]
    assert learned[0, 0] > 0.9 and learned[4, 0] < 0.1


def test_vllm_is_deterministic() -> None:
    def run() -> list[np.ndarray]:
        policy = VLLMAdaptive(cost_model(lambda bs: 0.05), 7, WIDTHS, refit_interval=5, warmup_refits=1)
        rng = np.random.default_rng(1)
        return run_vllm(policy, lambda n: confidences(), lambda n, kept: rng.integers(0, 8, size=kept.shape), 30)

    assert all((a == b).all() for a, b in zip(run(), run(), strict=True))


# SGLang --speculative-adaptive


def run_sglang(policy: SGLangAdaptive, bs: int, accepted: Callable[[int], list[int]], steps: int) -> list[int]:
    """``steps`` steps at ``bs``; ``accepted(width)`` says what each request accepted; the widths chosen."""
    widths, last = [], None
    for _ in range(steps):
        w = policy.width(bs, last)
        widths.append(w)
        last = verified(w, accepted(w))
    return widths


def test_sglang_maps_step_tiers_onto_available_widths() -> None:
    cost = cost_model(lambda bs: 0.05)
    assert SGLangAdaptive(cost, 15, [0, 1, 3, 7, 15]).slots[0].tiers == [1, 3, 7]
    assert SGLangAdaptive(cost, 15, [0, 1, 3, 7, 15]).width(4, None) == 7  # the tier closest to K
    assert SGLangAdaptive(cost, 7, [0, 2, 7]).slots[0].tiers == [0, 2, 7]  # 1 -> 0, 3 -> 2


def test_sglang_tier_rises_after_high_accept_lengths() -> None:
    policy = SGLangAdaptive(cost_model(lambda bs: 0.05), 7, WIDTHS, initial_steps=1)
    widths = run_sglang(policy, 4, lambda w: [w] * 4, 40)
    assert widths[:15] == [1] * 15  # 10 warm-up batches, then a decision every 5
    assert widths[15] == 3 and widths[-1] == 7
    assert widths == sorted(widths)


def test_sglang_tier_falls_after_low_accept_lengths() -> None:
    policy = SGLangAdaptive(cost_model(lambda bs: 0.05), 7, WIDTHS)
    widths = run_sglang(policy, 4, lambda w: [0] * 4, 40)
    assert widths[0] == 7 and widths[-1] == 1
    assert widths == sorted(widths, reverse=True)


def test_sglang_hysteresis_holds_either_tier_between_the_thresholds() -> None:
    cost = cost_model(lambda bs: 0.05)
    accepted = [2, 2, 2, 3, 3]  # mean 2.4: above 7's drop line (2.25), not above 3's rise line (2.5)
    assert set(run_sglang(SGLangAdaptive(cost, 7, WIDTHS), 5, lambda w: accepted, 100)) == {7}
    assert set(run_sglang(SGLangAdaptive(cost, 7, WIDTHS, initial_steps=3), 5, lambda w: accepted, 100)) == {3}


def test_sglang_bs_aware_slots_route_by_batch_size_and_probe_out_of_zero() -> None:
    cost = cost_model(lambda bs: 0.05)
    policy = SGLangAdaptive(cost, 7, WIDTHS, slots=SGLANG_BS_AWARE_SLOTS)
    assert [policy.width(bs, None) for bs in (1, 7, 8, 31, 32, 64, 200)] == [7, 7, 3, 3, 1, 0, 0]
    probing = SGLangAdaptive(cost, 7, WIDTHS, slots={1: SGLangSlot((0, 3))}, initial_steps=0)
    widths = run_sglang(probing, 4, lambda w: [w] * 4, 20)
    assert widths[:15] == [0] * 15 and widths[15:] == [3] * 5


# TensorRT-LLM draft_len_schedule


def run_trtllm(policy: TRTLLMSchedule, accepted: list[list[int]]) -> list[int]:
    """One step per list of accepted counts (its length is the batch size); the widths chosen."""
    widths, last = [], None
    for step in accepted:
        w = policy.width(len(step), last)
        widths.append(w)
        last = verified(w, step)
    return widths


def test_trtllm_schedule_uses_the_first_key_at_or_above_bs_and_zero_beyond_the_last() -> None:
    policy = TRTLLMSchedule(cost_model(lambda bs: 0.05), 7, WIDTHS, schedule={4: 7, 8: 3, 32: 1})
    assert [policy.width(bs, None) for bs in (1, 4, 5, 8, 9, 32, 33, 500)] == [7, 7, 3, 3, 1, 1, 0, 0]
    assert TRTLLMSchedule(cost_model(lambda bs: 0.05), 7, WIDTHS, schedule={4: 5, 8: 9}).lengths == [3, 7]
    assert (policy.keep(confidences(4, 3)) == 3).all()


def test_trtllm_gate_is_off_by_default() -> None:
    policy = TRTLLMSchedule(cost_model(lambda bs: 0.05), 7, WIDTHS, schedule={64: 7})
    assert set(run_trtllm(policy, [[0] * 4] * 50)) == {7}


def test_trtllm_gate_switches_speculation_off_for_good_under_low_rolling_acceptance() -> None:
    policy = TRTLLMSchedule(cost_model(lambda bs: 0.05), 7, WIDTHS, schedule={64: 4},
                            acceptance_rate_window_size=4, acceptance_rate_threshold=0.5)
    assert policy.lengths == [3]
    # Batch rates 1/3 each (1 of 3 drafts accepted); the mean is judged from the 4th rate on.
    widths = run_trtllm(policy, [[1, 1]] * 4 + [[3, 3]] * 10)
    assert widths[:4] == [3] * 4 and widths[4:] == [0] * 10  # off after 4 low rates; high rates later do not count
    assert policy.disabled


def test_trtllm_gate_waits_for_a_full_window_and_ignores_steps_without_drafts() -> None:
    policy = TRTLLMSchedule(cost_model(lambda bs: 0.05), 7, WIDTHS, schedule={2: 3},
                            acceptance_rate_window_size=3, acceptance_rate_threshold=0.5)
    widths = run_trtllm(policy, [[3, 3], [3, 3], [0, 0], [0, 0], [0, 0, 0], [0, 0, 0], [0, 0]])
    # rates 1, 1, 0 (mean 0.67), 0 (0.33 -> off); the bs-3 steps drafted nothing, so were never recorded
    assert widths == [3, 3, 3, 3, 0, 0, 0]
    policy = TRTLLMSchedule(cost_model(lambda bs: 0.05), 7, WIDTHS, schedule={2: 3},
                            acceptance_rate_window_size=3, acceptance_rate_threshold=0.5)
    assert run_trtllm(policy, [[0, 0, 0]] * 20 + [[0, 0]]) == [0] * 20 + [3]


def test_trtllm_from_costs_stops_speculating_where_verification_gets_dear() -> None:
    expected = {1: 0.8, 3: 1.8, 7: 2.5}
    policy = TRTLLMSchedule.from_costs(cost_model(lambda bs: 0.003 * bs), 7, WIDTHS, expected)
    assert policy.keys == [4, 16] and policy.lengths == [7, 3]  # bs 1 merged into key 4; the bs-64 zero implicit
    assert [policy.width(bs, None) for bs in (1, 4, 16, 17, 64)] == [7, 7, 3, 0, 0]
    cheap = TRTLLMSchedule.from_costs(cost_model(lambda bs: 0.0), 7, WIDTHS, expected)
    assert cheap.keys[-1] == 64 and min(cheap.lengths) > 0  # a flat verify cost: speculate at every batch size
    assert cheap.lengths == [7, 3]  # ... narrower where the drafter's own pass grows with bs


def test_names() -> None:
    cost = cost_model(lambda bs: 0.05)
    assert VLLMAdaptive(cost, 7, WIDTHS).name == "vllm-adaptive"
    assert SGLangAdaptive(cost, 7, WIDTHS).name == "sglang-adaptive"
    assert TRTLLMSchedule(cost, 7, WIDTHS, schedule={}).name == "trtllm-schedule"

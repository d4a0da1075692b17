"""SGLang ``--speculative-adaptive``: accept-length tiers per batch-size slot."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from dcut.replay.anchors.full_verification import verify_all
from dcut.replay.costs import CostModel
from dcut.replay.policy import Verified, nearest_width


@dataclass(frozen=True)
class SGLangSlot:
    """One batch-size slot of SGLang's adaptive config: its step tiers and the hysteresis of moves."""

    candidate_steps: tuple[int, ...]
    up_hysteresis: float = 0.0
    down_hysteresis: float = -0.25


# PR #21599's built-in config: one slot for every batch size.
SGLANG_PR21599_SLOTS = {1: SGLangSlot((1, 3, 7))}
# Mainline's ``DEFAULT_ADAPTIVE_CONFIG`` since the batch-size-aware slots (PR #24055): keys are lower bounds.
SGLANG_BS_AWARE_SLOTS = {1: SGLangSlot((1, 3, 5, 7)), 8: SGLangSlot((0, 1, 3), 0.0, 0.0),
                         32: SGLangSlot((0, 1), 0.0, 0.0), 64: SGLangSlot((0,), 0.0, 0.0)}


class _StepTiers:
    """One slot's tier state: SGLang's ``AdaptiveStepSlot`` over widths instead of step counts."""

    def __init__(self, tiers: list[int], initial: int, slot: SGLangSlot, ema_alpha: float, update_interval: int,
                 warmup_batches: int) -> None:
        self.tiers = tiers
        self.index = min(range(len(tiers)), key=lambda i: (abs(tiers[i] - initial), -tiers[i]))
        self.ema = float(self.steps - 1)  # neutral start: one accepted draft short of the tier
        self.slot = slot
        self.ema_alpha = ema_alpha
        self.update_interval = update_interval
        self.warmup_batches = warmup_batches
        self.batches = 0

    @property
    def steps(self) -> int:
        return self.tiers[self.index]

    def update(self, accepted: np.ndarray, drafted: bool) -> None:
        """Fold a verified batch's mean accepted drafts into the EMA; retier every few batches."""
        if accepted.size == 0:
            return
        if drafted:  # a batch that drafted nothing says nothing about acceptance
            self.ema += self.ema_alpha * (float(accepted.mean()) - self.ema)
        self.batches += 1
        if self.batches > self.warmup_batches and (self.batches - self.warmup_batches) % self.update_interval == 0:
            self._retier()

    def _retier(self) -> None:
        if self.steps == 0:  # after a no-drafting interval, probe the next tier up
            self.index = min(self.index + 1, len(self.tiers) - 1)
            if self.steps > 0 and self.ema < 0:
                self.ema = float(self.steps - 1)
            return
        start = self.index
        while self.index > 0:
            below = self.tiers[self.index - 1]
            if self.ema > (0.5 if below == 0 else below - 0.5) + self.slot.down_hysteresis:
                break
            self.index -= 1
        if self.index == start:
            while self.index < len(self.tiers) - 1 and self.ema > self.steps - 0.5 + self.slot.up_hysteresis:
                self.index += 1


class SGLangAdaptive:
    """SGLang ``--speculative-adaptive``: an EMA of the accept length moves the drafted width between tiers.

    Sources read: sgl-project/sglang PR #21599 ("[SPEC][1/N] feat: add adaptive speculative_num_steps
    for EAGLE topk=1", merged) and the earliest version of its
    ``python/sglang/srt/speculative/adaptive_spec_params.py`` in the index, which matches the PR's
    description (``AdaptiveSpeculativeParams.update`` and ``_recompute_params``); the mainline version of that file
    (read at 015c872628e328b530880bcf95ae91222604b225: ``AdaptiveStepSlot``,
    ``DEFAULT_ADAPTIVE_CONFIG``, ``AdaptiveSpeculativeParams._route``) and
    ``adaptive_step_router.py`` (``AdaptiveStepRouter.batch_size_key_for_batch``) after PR #24055
    ("[SPEC][5/N] feat: batchsize-aware support"); roadmap issue #23705.

    The rule: after each verify, the batch mean of accepted drafts per request updates an EMA
    (alpha 0.2, started at tier - 1; not updated while drafting nothing). After 10 warm-up batches,
    every 5 batches the tier moves down while ``ema <= lower tier - 0.5 + down_hysteresis`` (-0.25;
    ``0.5 + down_hysteresis`` when the lower tier is 0), and, only if it did not move down, up while
    ``ema > tier - 0.5 + up_hysteresis`` (0.0); a 0 tier probes the next tier up. The start tier is
    the one closest to ``--speculative-num-steps`` (here ``k``; ties to the larger). Every draft is
    verified. ``slots`` maps batch-size lower bounds to tiers, each with its own EMA
    (``SGLANG_PR21599_SLOTS``, the default, or mainline's ``SGLANG_BS_AWARE_SLOTS``).

    Mapping: SGLang's ``speculative_num_steps`` s drafts s tokens (EAGLE, topk 1: s + 1 verified
    with the bonus), so tier s is width ``nearest_width(min(s, k), widths)`` (the largest available
    width not above s); tiers that map to the same width merge, and the thresholds are taken on the
    mapped widths, since an accept length can never exceed the width actually drafted.

    Deviations: the EMA skips outcomes of steps that drafted nothing by the outcome's own width
    (SGLang checks the slot's current tier: the same thing when outcomes arrive at once, but replay
    hands them over a step late); the start-tier rule is PR #21599's for every slot (mainline snaps an absent
    ``initial_steps`` to a slot's middle tier); the router's padding of the batch size to the next
    captured CUDA-graph size is not modelled; mainline's ``ceiling_coeff`` (0, off, in every
    default slot) is not implemented. ``cost`` is unused: the rule is cost-blind.
    """

    name = "sglang-adaptive"

    def __init__(self, cost: CostModel, k: int, widths: list[int], *, slots: dict[int, SGLangSlot] | None = None,
                 initial_steps: int | None = None, ema_alpha: float = 0.2, update_interval: int = 5,
                 warmup_batches: int = 10) -> None:
        initial = nearest_width(min(k if initial_steps is None else initial_steps, k), widths)
        config = slots or SGLANG_PR21599_SLOTS
        self.keys = sorted(config)
        self.slots = [_StepTiers(sorted({nearest_width(min(s, k), widths) for s in config[key].candidate_steps}),
                                 initial, config[key], ema_alpha, update_interval, warmup_batches)
                      for key in self.keys]

    def width(self, bs: int, last: Verified | None) -> int:
        if last is not None:
            self._route(len(last.accepted)).update(np.asarray(last.accepted), last.width > 0)
        return self._route(bs).steps

    def keep(self, log_conf: np.ndarray) -> np.ndarray:
        return verify_all(log_conf)

    def _route(self, bs: int) -> _StepTiers:
        """The slot whose lower bound is the largest not above ``bs`` (the first below all)."""
        return self.slots[max(0, bisect.bisect_right(self.keys, bs) - 1)]

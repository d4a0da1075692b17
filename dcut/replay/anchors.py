"""Other engines' speculation rules as replay policies: the anchors dcut-serve is judged against.

Each class re-implements one engine's decision rule, read from that engine's source (cited per
class, with the commit read where the index gave one), on replay's interface
(``dcut.replay.policy``), so that replay prices it on the same trace and cost model as dcut's own
policies. Where the rule had to be adapted to replay (no request identity across steps, a cost
model instead of the engine's own profile), the class says how and why.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

import numpy as np

from dcut.replay.costs import CostModel
from dcut.replay.policy import Verified, nearest_width


def _full(log_conf: np.ndarray) -> np.ndarray:
    """Verify every draft: what the width-only rules (SGLang, TensorRT-LLM) do after drafting."""
    return np.full(log_conf.shape[0], log_conf.shape[1], dtype=np.int64)


class OnlineAcceptanceEstimator:
    """Per-position acceptance ``p_t = sigmoid(weight * logit(q) + bias[t])``, refit while serving.

    vLLM's ``OnlineAcceptanceEstimator`` (``vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py``,
    PR #52228, read at 322dc44b0f9c1326aec8916540e62cea4e397e76), which gives adaptive verification
    acceptance estimates for drafters without a trained confidence head (DFlash). The feature is
    ``logit(q)`` of the drafted token's probability ``q`` (``_predict_kernel``: the token's logit
    minus the log-sum-exp of the others, clamped to +-40), which is ``log q - log(1 - q)`` of our
    log-confidences. One slope shared by all positions, one intercept per position (init 0 and
    1.5: a uniform ~0.82). Every step folds the previous step's graded drafts into IRLS sufficient
    statistics (``_accumulate_kernel``: position t is observed while the chain reached it and it was
    verified, ``t <= accepted and t < kept``, label ``t < accepted``, weighted by the prediction made
    at draft time); every ``refit_interval`` steps one damped Newton step (``_refit_kernel``: the
    arrowhead system solved through its Schur complement; steps scaled by ``n / (n + damping)``; a
    slope step that would turn the slope negative is dropped) and the statistics are cleared. For
    the first ``warmup_refits`` refits callers verify whole blocks, so the labels are not censored
    by the estimator's own trimming (``needs_full_verification``).

    An earlier version of the file (165b36638705d0ba564933c57fbb9f1e053661c9) fit two parameters per
    position on the top-2 logit margin with a hard 50-observation gate; the later one is used here.
    """

    MAX_FEATURE = 40.0

    def __init__(self, k: int, refit_interval: int = 100, warmup_refits: int = 3, damping: float = 50.0,
                 l2: float = 1e-3, initial_bias: float = 1.5) -> None:
        self.refit_interval = refit_interval
        self.warmup_refits = warmup_refits
        self.damping = damping
        self.l2 = l2
        self.weight = 0.0
        self.bias = np.full(k, initial_bias)
        self.refits = 0
        # Drafts (features, predictions) waiting for their grades, oldest first: replay's ``run_cell``
        # hands a step's outcome to the step after the next, so up to two wait.
        self._pending: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=2)
        self._clear()

    @property
    def warming_up(self) -> bool:
        return self.refits < self.warmup_refits

    def predict(self, log_conf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(features, acceptance probabilities)``, both ``[bs, W]``, under the current coefficients."""
        log_q = np.minimum(log_conf, 0.0)  # float16 traces can round log q a hair above 0
        with np.errstate(divide="ignore"):
            features = np.clip(log_q - np.log(-np.expm1(log_q)), -self.MAX_FEATURE, self.MAX_FEATURE)
        probs = 1.0 / (1.0 + np.exp(-(self.weight * features + self.bias[: log_conf.shape[1]])))
        return features, probs

    def remember(self, features: np.ndarray, probs: np.ndarray) -> None:
        """Hold this step's drafts until ``observe`` gets their grades."""
        self._pending.append((features, probs))

    def observe(self, last: Verified) -> None:
        """Fold the oldest waiting drafts in, graded by ``last``; refit every ``refit_interval`` steps.
        An outcome of width 0 had no drafts (and no ``keep``) behind it."""
        if last.width == 0 or not self._pending:
            return
        features, probs = self._pending.popleft()
        if features.shape != (len(last.accepted), last.width):
            return
        positions = np.arange(features.shape[1])[None, :]
        accepted = np.asarray(last.accepted, dtype=np.int64)[:, None]
        kept = np.asarray(last.kept, dtype=np.int64)[:, None]
        observed = ((positions <= accepted) & (positions < kept)).astype(np.float64)
        weights = probs * (1.0 - probs) * observed
        residuals = ((positions < accepted) - probs) * observed
        w = features.shape[1]
        self._coupling[:w] += (weights * features).sum(0)
        self._information[:w] += weights.sum(0)
        self._score[:w] += residuals.sum(0)
        self._counts[:w] += observed.sum(0)
        self._slope_information += float((weights * features * features).sum())
        self._slope_score += float((residuals * features).sum())
        self._steps += 1
        if self._steps >= self.refit_interval:
            self._refit()

    def _refit(self) -> None:
        """One damped Newton step on this round's statistics alone (a gradient carried across
        rounds points where the coefficients already went), then a clean round."""
        information = self._information + self.l2
        shrink = float((self._coupling**2 / information).sum())
        coupling = float((self._coupling * self._score / information).sum())
        slope_step = (self._slope_score - coupling) / (self._slope_information + self.l2 - shrink)
        n = float(self._counts.sum())
        slope_step *= n / (n + self.damping)
        if not np.isfinite(slope_step) or self.weight + slope_step < 0.0:
            slope_step = 0.0  # a negative slope would say decisive drafts are accepted less often
        self.weight += slope_step
        damped = self._counts / (self._counts + self.damping)  # a position nobody reached holds still
        bias_step = (self._score - self._coupling * slope_step) / information * damped
        self.bias += np.where(np.isfinite(bias_step), bias_step, 0.0)
        self.refits += 1
        self._clear()

    def _clear(self) -> None:
        k = len(self.bias)
        self._coupling = np.zeros(k)  # sum(w * feature) per position
        self._information = np.zeros(k)  # sum(w) per position
        self._score = np.zeros(k)  # sum(label - p) per position
        self._counts = np.zeros(k)
        self._slope_information = 0.0  # sum(w * feature^2), all positions
        self._slope_score = 0.0  # sum((label - p) * feature), all positions
        self._steps = 0


class VLLMAdaptive:
    """vLLM adaptive verification: draft K every step, verify the global top-B survival scores.

    Sources read: vLLM PR #47808 ("[Spec Decode] DSpark confidence-scheduled verification", merged)
    and PR #52228 ("[Model Runner V2] Acceptance estimation for adaptive verification", merged:
    extends it to drafters without a confidence head, DFlash included); mainline
    ``vllm/v1/worker/gpu/spec_decode/adaptive_verification.py`` (read at
    057929c3632766486896597cf27e1425fd838e63): ``AdaptiveVerificationManager.get_num_tokens`` (the
    budget), ``_assign_draft_token_budget`` (the allocation), ``build_cost_tables_from_curves`` and
    ``set_initial_cost_curves`` (the profiled costs); ``acceptance_estimator.py`` (see
    ``OnlineAcceptanceEstimator``).

    The rule: every step drafts the full K. Each draft slot is scored by its survival, the running
    product of its request's per-position acceptance estimates; the budget B (any integer from 0 to
    all drafts) maximises ``(bs + sum of the top-B survivals) / (verify(bs, bs + B) + draft(bs, K))``
    (``get_num_tokens``: the numerator counts one bonus token per sampling request); the globally
    best B slots are verified, a prefix of each request since survival only falls along it.
    Estimates come from ``OnlineAcceptanceEstimator`` (PR #52228, the default: a DFlash drafter has
    no confidence head), or with ``online_estimator=False`` are the drafter's raw confidences, as
    DSpark's trained head is used in PR #47808.

    Deviations: the denominator adds ``cost.overhead(expected tokens)`` (``count_overhead``; vLLM's
    curves time the target forward and the drafter only, so ``count_overhead=False`` is vLLM's
    formula); costs are replay's cost model, linear between its profiled token counts, where vLLM
    builds a step function padded to the next captured CUDA-graph size below the capture limit
    (the median of 5 replays per size, made monotone); vLLM sizes B from the confidences of two
    steps earlier (an asynchronous copy) and only allocates on the current ones, while replay has
    no request identity across steps, so both use the current ones; vLLM grades a step's drafts at
    the next step, replay's ``run_cell`` a step later still, and the estimator learns when they
    arrive; the rejection sampler's one-chunk cap on the budget (``max_total_logits``) is not
    modelled.
    """

    name = "vllm-adaptive"

    def __init__(self, cost: CostModel, k: int, widths: list[int], *, online_estimator: bool = True,
                 count_overhead: bool = True, refit_interval: int = 100, warmup_refits: int = 3,
                 damping: float = 50.0, l2: float = 1e-3, initial_bias: float = 1.5) -> None:
        self.cost = cost
        self.k = nearest_width(k, widths)
        self.count_overhead = count_overhead
        self.estimator = (OnlineAcceptanceEstimator(self.k, refit_interval, warmup_refits, damping, l2, initial_bias)
                          if online_estimator else None)
        self._verify_ms: dict[tuple[int, int], np.ndarray] = {}

    def width(self, bs: int, last: Verified | None) -> int:
        if self.estimator is not None and last is not None:
            self.estimator.observe(last)
        return self.k

    def keep(self, log_conf: np.ndarray) -> np.ndarray:
        if log_conf.shape[1] == 0:
            return _full(log_conf)
        if self.estimator is None:
            return self._admit(np.exp(np.minimum(log_conf, 0.0)))
        features, probs = self.estimator.predict(log_conf)
        self.estimator.remember(features, probs)
        return _full(log_conf) if self.estimator.warming_up else self._admit(probs)

    def _admit(self, probs: np.ndarray) -> np.ndarray:
        """Keep depths of the best budget: the globally top-B survivals, counted per request."""
        bs, w = probs.shape
        survival = np.cumprod(probs, axis=1).ravel()
        order = np.argsort(-survival, kind="stable")  # stable: equal survivals stay in position order
        expected = bs + np.concatenate(([0.0], np.cumsum(survival[order])))
        costs = self._verify_row(bs, w) + self.cost.draft(bs, w)
        if self.count_overhead:
            costs = costs + self.cost.overhead(expected)
        budget = int(np.argmax(expected / costs))
        return np.bincount(order[:budget] // w, minlength=bs).astype(np.int64)

    def _verify_row(self, bs: int, w: int) -> np.ndarray:
        """Verify cost of every budget 0..bs*w at ``bs`` (cached: replay asks at the same few shapes)."""
        row = self._verify_ms.get((bs, w))
        if row is None:
            row = self.cost.table.lookup_many(bs, bs + np.arange(bs * w + 1))
            if row is None:
                raise ValueError(f"cost model {self.cost.name} does not cover batch size {bs}")
            self._verify_ms[(bs, w)] = row
        return row


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
        return _full(log_conf)

    def _route(self, bs: int) -> _StepTiers:
        """The slot whose lower bound is the largest not above ``bs`` (the first below all)."""
        return self.slots[max(0, bisect.bisect_right(self.keys, bs) - 1)]


class TRTLLMSchedule:
    """TensorRT-LLM ``draft_len_schedule``: a static batch size -> draft length table, 0 above its last key.

    Sources read: NVIDIA/TensorRT-LLM PR #10860 ("[TRTLLM-10319][feat] Dynamic draft length on spec
    decode one-model path", merged 2026-03-13) and ``tensorrt_llm/_torch/speculative/utils.py``
    ``get_draft_len_for_batch_size`` (the draft length of the first key >= bs, 0 beyond the last
    key: "implicit max concurrency control"); PR #12262 ("[TRTLLM-11556][feat] Expand dynamic
    speculation to all spec decode algorithms": DFlash, MTP, PARD, ...); PR #12905
    ("[TRTLLM-11558][feat] BREAKING: Acceptance rate based speculation off in one model path") and
    ``tensorrt_llm/_torch/speculative/speculation_gate.py`` (``SpeculationGate.record_acceptance_rate``)
    with its construction in ``PyExecutor.__init__`` (``pyexecutor/py_executor.py``: a gate only
    when both ``acceptance_rate_window_size`` and ``acceptance_rate_threshold`` are set; default
    None, off). PR #8194's older ``Drafter.get_draft_len_for_batch_size`` (``drafter.py``: the
    largest key <= bs) is superseded by #10860's and not followed.

    The rule: width = ``schedule[first key >= bs]``, 0 above the last key (values above ``k`` or
    between available widths go to ``nearest_width``); every draft is verified. With the gate on,
    every speculating step records its batch acceptance rate (accepted / verified drafts over the
    requests that drafted: ``PyExecutor._update_batch_acceptance_rate``, known from a third-party
    reading of py_executor.py, not from the file itself); once ``window`` rates are recorded, a
    rolling mean of the last ``window`` below ``threshold`` turns speculation off for good.

    ``from_costs`` builds the table a user would: how to choose it is not documented (source not
    found in the index: PR #10860 shows only the example ``{4: 4, 8: 2, 32: 1}``, and DESIGN.md
    section 3 calls such tables hand-written), so it is the quick benchmark sweep dcut's replay
    brief describes: per profiled batch size, the width with the best tokens per ms, against plain
    decoding. ``cost`` is otherwise unused: the rule itself is a static table.
    """

    name = "trtllm-schedule"

    def __init__(self, cost: CostModel, k: int, widths: list[int], *, schedule: dict[int, int],
                 acceptance_rate_window_size: int | None = None,
                 acceptance_rate_threshold: float | None = None) -> None:
        self.keys = sorted(schedule)
        self.lengths = [nearest_width(min(schedule[key], k), widths) for key in self.keys]
        self.gate: tuple[int, float] | None = None  # (window, threshold): PR #12905's switch-off
        if acceptance_rate_window_size and acceptance_rate_threshold is not None:
            self.gate = (acceptance_rate_window_size, acceptance_rate_threshold)
        self.rates: deque[float] = deque(maxlen=acceptance_rate_window_size or None)
        self.recorded = 0
        self.disabled = False

    @classmethod
    def from_costs(cls, cost: CostModel, k: int, widths: list[int], expected_accepted_by_width: dict[int, float],
                   *, acceptance_rate_window_size: int | None = None,
                   acceptance_rate_threshold: float | None = None) -> TRTLLMSchedule:
        """The table from a quick benchmark: at each profiled batch size the width maximising
        ``bs (1 + E[accepted at w]) / (verify(bs, bs (1 + w)) + draft(bs, w) + overhead)``, 0 where no
        width beats plain decoding (``bs / (plain(bs) + overhead)``: a server without a drafter, what a
        user compares against). Keys are written the way #10860 reads them ("up to this batch size"):
        runs of equal lengths merge into their last key, and a trailing 0 band is left implicit."""
        choices = [w for w in widths if 0 < w <= k and w in expected_accepted_by_width]
        best: list[tuple[int, int]] = []
        for bs in cost.batch_sizes():
            rates = {0: bs / (cost.plain(bs) + cost.overhead(bs))}
            for w in choices:
                tokens = bs * (1.0 + expected_accepted_by_width[w])
                rates[w] = tokens / (cost.verify(bs, bs * (1 + w)) + cost.draft(bs, w) + cost.overhead(tokens))
            best.append((bs, max(sorted(rates), key=lambda w: rates[w])))  # ties go to the smaller width
        while best and best[-1][1] == 0:
            best.pop()
        schedule = {bs: w for i, (bs, w) in enumerate(best) if i + 1 == len(best) or best[i + 1][1] != w}
        return cls(cost, k, widths, schedule=schedule, acceptance_rate_window_size=acceptance_rate_window_size,
                   acceptance_rate_threshold=acceptance_rate_threshold)

    def width(self, bs: int, last: Verified | None) -> int:
        if last is not None and self.gate is not None and not self.disabled:
            self._record(last, *self.gate)
        if self.disabled:
            return 0
        i = bisect.bisect_left(self.keys, bs)
        return self.lengths[i] if i < len(self.keys) else 0

    def keep(self, log_conf: np.ndarray) -> np.ndarray:
        return _full(log_conf)

    def _record(self, last: Verified, window: int, threshold: float) -> None:
        """``SpeculationGate.record_acceptance_rate`` for one step; steps that drafted nothing are not recorded."""
        drafted = int(np.sum(last.kept))
        if drafted == 0:
            return
        self.rates.append(float(np.sum(last.accepted)) / drafted)
        self.recorded += 1
        if self.recorded >= window and sum(self.rates) / len(self.rates) < threshold:
            self.disabled = True

"""vLLM adaptive verification, with its online acceptance estimator for drafters without a confidence head."""

from __future__ import annotations

from collections import deque

import numpy as np

from dcut.replay.anchors.full_verification import verify_all
from dcut.replay.costs import CostModel
from dcut.replay.policy import Verified, nearest_width


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
            return verify_all(log_conf)
        if self.estimator is None:
            return self._admit(np.exp(np.minimum(log_conf, 0.0)))
        features, probs = self.estimator.predict(log_conf)
        self.estimator.remember(features, probs)
        return verify_all(log_conf) if self.estimator.warming_up else self._admit(probs)

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

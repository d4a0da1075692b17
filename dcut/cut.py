"""The per-step cut on the drafter's device: confidences, calibrated prefix scores, a keep rule, per-request caps,
kept counts.

Issue 61: the host plans (every N steps: the width and a keep rule per batch-size bucket), the device cuts (every
step). Everything here is torch on the tensors' own device with fixed shapes: no device-to-host read, no Python loop
over requests, so a step never waits on it and it can be captured in a CUDA graph (``dcut/bench/gpu_cut.py`` checks
both on a GPU; ``tests/unit/test_cut.py`` checks it without one). It imports neither vLLM, Ray nor the host-side
decision modules, so a copy runs wherever torch does.

Semantics are ``dcut.selection``'s and ``dcut.calibration``'s: a draft's calibrated log-confidence is
``min(log(a[t, bin] + b[t, bin] * raw), 0)``; its prefix score ``exp(cumsum)`` of those (NaN as -inf, positives as 0);
the kept drafts are the global top-``budget`` of the batch's positive scores, ties to the earlier flat position (the
stable sort of ``selection.keep_depths_for_budget``), each request's a prefix of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Float32 bytes of the logits converted at a time by ``log_confidence``: a whole float32 copy at bs 64, width 15 and
# a 151,936-token vocabulary is 0.58 GB that vLLM's memory profiling never sees; 32 MiB at a time keeps the transient
# at an eighth of the bf16 logits there (measured: 31.9 of 278 MiB; tests/unit/test_confidence_memory.py), 18 chunks.
CONFIDENCE_CHUNK_BYTES = 32 << 20


def log_confidence(logits: Tensor, tokens: Tensor) -> Tensor:
    """``logit[tok] - logsumexp(logits)`` in float32, on the logits' device: the drafter's log-probability of
    each draft (over the vocabulary, so it stays where the logits are). The log-sum-exp is taken over row chunks
    converted to float32 one at a time (``CONFIDENCE_CHUNK_BYTES``: why), never over a float32 copy of the whole."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    picked = flat.gather(-1, tokens.long().reshape(-1, 1)).squeeze(-1).float()
    top = flat.amax(dim=-1).float()  # (exact: a bf16/fp16 value converts to float32 without rounding)
    sums = torch.empty_like(top)
    rows = min(flat.shape[0], max(1, CONFIDENCE_CHUNK_BYTES // (4 * max(vocab, 1))))  # (shapes: no device read)
    chunk = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)  # one buffer, reused
    for start in range(0, flat.shape[0], rows):
        part = chunk[: min(rows, flat.shape[0] - start)]
        part.copy_(flat[start: start + rows]).sub_(top[start: start + rows, None]).exp_()
        torch.sum(part, dim=-1, out=sums[start: start + rows])
    return (picked - top - sums.log()).view(logits.shape[:-1])


def log_confidence_of_probs(probs: Tensor, tokens: Tensor) -> Tensor:
    """``log p[tok] - log(sum p)`` in float32 (probabilities floored at 1e-30): what ``log_confidence`` gives on the
    log of ``probs``, without a ``[rows, vocab]`` log copy."""
    picked = probs.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1).float().clamp_min(1e-30)
    return picked.log() - probs.sum(dim=-1, dtype=torch.float32).log()


@dataclass(frozen=True)
class CalibrationTable:
    """``calibrated = a + b * raw`` per (position, raw-confidence bin): ``a``, ``b`` ``[positions, bins]`` float32 on
    the cut's device (``Calibrator.lookup_table``). Positions past ``positions`` pass through uncalibrated."""

    a: Tensor
    b: Tensor

    @classmethod
    def of(cls, a: object, b: object, device: torch.device | str) -> CalibrationTable:
        """From host arrays (numpy or nested lists), copied once to ``device`` (off the step: when the table
        changes)."""
        return cls(torch.as_tensor(a, dtype=torch.float32, device=device),
                   torch.as_tensor(b, dtype=torch.float32, device=device))


@dataclass(frozen=True)
class KeepRule:
    """The plan's keep rule, as 0-dim device tensors a plan change writes in place (a captured graph keeps reading
    them): keep a draft while it ranks within ``budget`` across the batch *and* its prefix score is at least
    ``threshold``. A budget rule leaves the threshold at 0; a threshold rule leaves the budget at every draft."""

    budget: Tensor  # int64
    threshold: Tensor  # float32

    @classmethod
    def new(cls, device: torch.device | str, budget: int, threshold: float = 0.0) -> KeepRule:
        # (``full``: a fill kernel; a ``torch.tensor`` on a GPU would be a blocking host-to-device copy)
        return cls(torch.full((), budget, dtype=torch.int64, device=device),
                   torch.full((), threshold, dtype=torch.float32, device=device))

    def set(self, budget: int, threshold: float = 0.0) -> None:
        """A new plan: host numbers written into the same tensors (a host-to-device write, no read)."""
        self.budget.fill_(budget)
        self.threshold.fill_(threshold)


def calibrate(log_conf: Tensor, table: CalibrationTable) -> Tensor:
    """``Calibrator.calibrate`` on the device: the log of the calibrated acceptance probability, ``[bs, K]`` float32."""
    positions, bins = table.a.shape
    k = min(positions, log_conf.shape[-1])
    lc = log_conf[..., :k].float()
    raw = lc.exp().nan_to_num(nan=0.0).clamp(0.0, 1.0)  # (NaN counts as 0, as ``calibration._prob``)
    cell = (raw * bins).long().clamp(max=bins - 1).unsqueeze(-1)
    a = table.a[:k].expand(*lc.shape, bins).gather(-1, cell).squeeze(-1)
    b = table.b[:k].expand(*lc.shape, bins).gather(-1, cell).squeeze(-1)
    calibrated = torch.log(a + b * raw).clamp(max=0.0)
    return calibrated if k == log_conf.shape[-1] else torch.cat([calibrated, log_conf[..., k:].float()], dim=-1)


def prefix_scores(log_conf: Tensor, caps: Tensor | None = None) -> Tensor:
    """``exp(cumsum(log_conf))`` ``[bs, K]`` float32, non-increasing along K: NaN counts as -inf, positive values as
    0, the running sum is taken in float64 (``selection.prefix_scores``); positions at or past a request's cap
    (``caps`` ``[bs]``, on the same device: they change when the batch does, and are written there then) score 0."""
    lc = log_conf.float().nan_to_num(nan=-torch.inf).clamp(max=0.0)
    scores = lc.double().cumsum(dim=-1).float().exp()
    if caps is not None:
        within = torch.arange(scores.shape[-1], device=scores.device) < caps.unsqueeze(-1)
        scores = scores * within
    return scores


def keep_counts(scores: Tensor, rule: KeepRule) -> Tensor:
    """Per request, how many of its drafts the rule keeps (int64 ``[bs]``). Ranks come from one stable descending
    sort of the flattened scores (ties to the earlier position), so with scores non-increasing along K the kept set
    is a prefix of each request; zero scores are never kept."""
    bs, k = scores.shape
    flat = scores.reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    kept = (rank < rule.budget) & (flat >= rule.threshold) & (flat > 0)
    return kept.view(bs, k).sum(dim=1)


def cut(log_conf: Tensor, rule: KeepRule, table: CalibrationTable | None = None,
        caps: Tensor | None = None) -> Tensor:
    """One step's cut: the drafts' raw log-confidences ``[bs, K]`` -> kept drafts per request ``[bs]`` (int64)."""
    calibrated = log_conf if table is None else calibrate(log_conf, table)
    return keep_counts(prefix_scores(calibrated, caps), rule)


def accepted_lengths(sampled: Tensor) -> Tensor:
    """Drafts accepted per request (int64 ``[bs]``) from the rejection sampler's output ``[bs, drafts + 1]``
    (rejected slots -1, the last valid one the bonus token): the outcome, counted where it lies, for the host to read
    a step late."""
    return ((sampled != -1).sum(dim=1) - 1).clamp(min=0)

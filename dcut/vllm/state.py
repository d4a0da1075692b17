"""D-Cut's per-engine state inside a vLLM model runner: decide after drafting, cut, measure.

One ``RunnerDCut`` lives on each model runner (every tensor-parallel rank has one and takes the
same decision, because every rank drafts the same tokens with the same confidences). The flow
of one engine step, as driven by the patches in ``dcut.vllm.patches``:

1. ``begin_step``   (``execute_model``)   — note the shape of the step and start its clock;
2. ``on_drafted``   (``propose_draft_token_ids``) — score the fresh drafts, choose keep depths
   on the device (no host sync), and note how many of the verified drafts were accepted;
3. ``cut``          (``take_draft_token_ids``) — truncate each request's drafts before the
   scheduler sees them (so a pruned draft is never scheduled, verified or counted as rejected),
   record the step and refine the cost table from its measured time.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import dcut
from dcut.calibration import Calibrator
from dcut.cost_table import CostTable, Fingerprint, current_hardware, profile_cost_table
from dcut.selection import Decision, select
from dcut.settings import DCutSettings
from dcut.telemetry import StepRecord, StepWindow, ThroughputEstimate, throughput_by_batch_size
from dcut.vllm import metrics

logger = logging.getLogger("vllm.dcut")

LOG_INTERVAL_S = 10.0
OVERHEAD_GAP_S = 0.5  # a longer gap between steps is an idle engine, not per-step overhead
OVERHEAD_EMA = 0.05
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "dcut" / "cost_tables"


@dataclass
class _Pending:
    """What ``on_drafted`` decided, waiting for ``cut`` (tensors may still be on the device)."""

    keep: Tensor
    decision: Decision
    log_conf: Tensor
    selection_us: float


@dataclass
class _Verified:
    """Outcome of the verification done in this step (for stats and calibration)."""

    req_ids: list[str]
    num_draft: Tensor  # drafts verified per request (what was scheduled)
    accepted: Tensor  # drafts accepted per request


def settings_from_config(vllm_config: Any) -> DCutSettings | None:
    """The validated D-Cut settings of an engine, or None when D-Cut is not asked for."""
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict) or extra.get("dcut") is None:
        return None
    raw = extra["dcut"]
    return raw if isinstance(raw, DCutSettings) else DCutSettings.model_validate(raw)


def fingerprint_for(vllm_config: Any) -> Fingerprint:
    """What a cost table of this engine depends on (``dcut.vllm.engine.fingerprint`` must agree)."""
    spec = vllm_config.speculative_config
    return make_fingerprint(
        model=str(vllm_config.model_config.model),
        drafter=str(spec.model) if spec is not None else None,
        k=spec.num_speculative_tokens if spec is not None else 0,
        tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
        dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
    )


def make_fingerprint(model: str, drafter: str | None, k: int, tensor_parallel_size: int, dtype: str) -> Fingerprint:
    import vllm

    return Fingerprint(hardware=current_hardware(), model=model, drafter=drafter, k=k,
                       tensor_parallel_size=tensor_parallel_size, dtype=dtype, vllm_version=vllm.__version__,
                       dcut_version=dcut.__version__)


class RunnerDCut:
    """D-Cut attached to one model runner."""

    def __init__(self, settings: DCutSettings, fingerprint: Fingerprint, k: int) -> None:
        self.settings = settings
        self.fingerprint = fingerprint
        self.k = k
        self.cost_table: CostTable | None = None
        self.cost_source = "none"
        self.calibrator = Calibrator(k) if settings.calibrate else None
        self.window = StepWindow(settings.stats_window)
        self.steps = 0
        self._pending: _Pending | None = None
        self._verified: _Verified | None = None
        self._step_shape: tuple[int, int] | None = None  # (bs, verify tokens) of a pure decode step
        self._step_start = 0.0
        self._step_end: float | None = None
        self.overhead_ms = 0.0  # EMA of engine time between steps (scheduler, outputs): part of T(b)
        self._last_conf: dict[str, Tensor] = {}  # req id -> log conf of the drafts it was given
        self._last_log = time.monotonic()

    # -- cost table ------------------------------------------------------------------------
    def cache_path(self) -> Path:
        root = Path(self.settings.cache_dir) if self.settings.cache_dir else DEFAULT_CACHE_DIR
        return root / f"{self.fingerprint.key()}.json"

    def load_or_profile(self, run_step: Any, batch_sizes: list[int]) -> None:
        """Use a handed-in table, else the cache for this fingerprint, else profile (and cache).

        Every mode loads one: the modes that do not decide by cost still give throughput estimates.
        """
        start = time.perf_counter()
        if self.settings.cost_table:
            self.cost_table = CostTable.load_for(self.settings.cost_table, self.fingerprint)
            self.cost_source = f"given ({self.settings.cost_table})"
        elif self.cache_path().exists():
            self.cost_table = CostTable.load_for(self.cache_path(), self.fingerprint)
            self.cost_source = f"cache ({self.cache_path()})"
        elif self.settings.profile:
            logger.info("D-Cut: profiling the step cost for batch sizes %s (K=%d)", batch_sizes, self.k)
            self.cost_table = profile_cost_table(
                run_step, batch_sizes, self.k, self.fingerprint,
                warmups=self.settings.profile_warmups, repeats=self.settings.profile_repeats)
            self.cost_table.save(self.cache_path())
            self.cost_source = "profiled"
        else:
            self.cost_source = "none (fallback ratio)"
        logger.info("D-Cut: cost table %s in %.1f s", self.cost_source, time.perf_counter() - start)

    # -- the step --------------------------------------------------------------------------
    def begin_step(self, num_scheduled: dict[str, int], spec_tokens: dict[str, list[int]]) -> None:
        """Remember the step's shape when it is a pure decode/verify step (the cost table's kind)."""
        self._step_start = time.perf_counter()
        if self._step_end is not None and (gap := self._step_start - self._step_end) < OVERHEAD_GAP_S:
            self.overhead_ms += OVERHEAD_EMA * (gap * 1000.0 - self.overhead_ms)
        pure = all(n == 1 + len(spec_tokens.get(r, ())) for r, n in num_scheduled.items())
        self._step_shape = (len(num_scheduled), sum(num_scheduled.values())) if pure else None

    def on_drafted(self, req_ids: list[str], log_conf: Tensor | None, sampled: Tensor | None,
                   num_draft_tokens: list[int] | None) -> None:
        """Decide keep depths for fresh drafts ``[bs, K]``; note the just-verified outcome."""
        if sampled is not None and num_draft_tokens is not None and torch.is_tensor(sampled):
            # sampled: [bs, max_drafts + 1], rejected slots are -1; accepted = valid - 1 (bonus).
            accepted = ((sampled != -1).sum(dim=1) - 1).clamp(min=0)
            self._verified = _Verified(list(req_ids), torch.tensor(num_draft_tokens), accepted)
        else:
            self._verified = None
        if log_conf is None:
            self._pending = None
            return
        start = time.perf_counter()
        scored = self.calibrator.calibrate(log_conf) if self.calibrator is not None else log_conf
        keep, decision = select(scored, self.settings, self.cost_table)
        self._pending = _Pending(keep, decision, log_conf, (time.perf_counter() - start) * 1e6)

    def cut(self, req_ids: list[str], drafts: list[list[int]]) -> list[list[int]]:
        """Truncate each request's drafts to its keep depth; record the step."""
        self._step_end = time.perf_counter()
        step_ms = (self._step_end - self._step_start) * 1000.0
        pending, self._pending = self._pending, None
        verified, self._verified = self._verified, None
        if pending is not None and len(drafts) == pending.keep.shape[0]:
            depths = pending.keep.tolist()
            drafts = [d[:n] for d, n in zip(drafts, depths, strict=True)]
        self._record(pending, verified, step_ms)
        if pending is not None and self.calibrator is not None:
            conf = pending.log_conf.cpu()
            self._last_conf = {r: conf[i] for i, r in enumerate(req_ids)}
        return drafts

    def _record(self, pending: _Pending | None, verified: _Verified | None, step_ms: float) -> None:
        self.steps += 1
        if self._step_shape is not None and self.cost_table is not None and self.settings.refine:
            bs, tokens = self._step_shape
            if self.cost_table.covering(bs) is not None:
                self.cost_table.refine(bs, tokens, step_ms)
        per_pos_kept = [0] * self.k
        per_pos_acc = [0] * self.k
        accepted_total = 0
        if verified is not None:
            nd, acc = verified.num_draft.tolist(), verified.accepted.tolist()
            for n, a in zip(nd, acc, strict=False):
                a = min(a, n)
                accepted_total += a
                for t in range(min(n, self.k)):
                    per_pos_kept[t] += 1
                    per_pos_acc[t] += t < a
            if self.calibrator is not None:
                self._update_calibration(verified)
        # Only the counts: Decision.to_dict would also copy every candidate's U to the host each step.
        decision = pending.decision if pending is not None else None
        proposed = int(decision.proposed) if decision is not None else 0
        kept = int(decision.kept) if decision is not None else 0
        bs = len(verified.req_ids) if verified is not None else 0
        record = StepRecord(
            timestamp=time.time(),
            batch_size=bs,
            proposed=proposed,
            kept=kept,
            accepted=accepted_total,
            accepted_per_position=per_pos_acc,
            kept_per_position=per_pos_kept,
            ratio=kept / proposed if proposed else 1.0,
            budget=int(decision.budget) if decision is not None else 0,
            step_ms=step_ms,
            selection_us=pending.selection_us if pending is not None else 0.0,
            fallback=decision is not None and decision.fallback,
        )
        self.window.add(record)
        metrics.observe(record, self.fingerprint.model)
        if time.monotonic() - self._last_log >= LOG_INTERVAL_S:
            self._last_log = time.monotonic()
            self._log_summary()

    def _update_calibration(self, verified: _Verified) -> None:
        rows = [(i, self._last_conf[r]) for i, r in enumerate(verified.req_ids) if r in self._last_conf]
        if not rows:
            return
        idx = torch.tensor([i for i, _ in rows])
        log_conf = torch.stack([c for _, c in rows])
        self.calibrator.update(log_conf, verified.num_draft[idx], verified.accepted[idx].cpu())

    def estimates(self) -> list[ThroughputEstimate]:
        """Predicted tokens/s per profiled batch size from the cost table and live acceptance."""
        if self.cost_table is None or not len(self.window):
            return []
        sizes = sorted(int(b) for b in self.cost_table.to_json()["points"])
        return throughput_by_batch_size(sizes, self.window.acceptance_curve(), self.settings, self.cost_table,
                                        draft_ms=self.overhead_ms)

    def _log_summary(self) -> None:
        """One line in the engine log every LOG_INTERVAL_S, beside vLLM's own stats lines."""
        w = self.window
        logger.info("D-Cut: %d steps, mean keep ratio %s, accepted drafts/request-step %s, "
                    "position acceptance %s, cost table %s", len(w), _fmt(w.mean_keep_ratio()),
                    _fmt(w.mean_accepted_length()), [_fmt(p) for p in w.position_acceptance()[:8]],
                    self.cost_source)

    # -- reading ---------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Forget recorded steps (e.g. after a warm-up), keep the cost table and calibration."""
        self.window = StepWindow(self.settings.stats_window)
        self.steps = 0

    def snapshot(self) -> dict[str, Any]:
        """JSON-able stats for the Python API, the Serve replica and the CLI."""
        out: dict[str, Any] = {
            "settings": self.settings.model_dump(),
            "fingerprint": self.fingerprint.model_dump(),
            "cost_source": self.cost_source,
            "steps": self.steps,
            "window": self.window.summary(),
            "selection_us_median": statistics.median(sel) if (sel := [
                r.selection_us for r in self.window.records if r.selection_us]) else None,
            "estimates": [asdict(e) for e in self.estimates()],
            "overhead_ms": self.overhead_ms,
        }
        if self.calibrator is not None:
            out["calibration"] = self.calibrator.reliability()
        return out


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"



"""What a ``RunnerDCut`` knows beyond one step, in and out: its cost table (handed in, cached, or profiled
with the engine's dummy steps), its learned state (handed on to a replica that starts after it, adopted from
one that ran before), and what it publishes (throughput estimates, the snapshot, a periodic log line).

A mixin of ``dcut.vllm.state.RunnerDCut``, which owns every attribute named below; the step itself (width
choice, decision, cut, accounting) is there.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dcut.calibration import Calibrator
from dcut.context_cost import profile_context
from dcut.cost_table import CostTable, Fingerprint, StepCost, cached_table_path, profile_cost_table
from dcut.history import RequestHistory
from dcut.learned import LearnedState
from dcut.overhead import EngineOverhead
from dcut.settings import DCutSettings
from dcut.snapshot import CostSource, DCutSnapshot, Overhead, ThroughputEstimate, Totals, WindowSummary
from dcut.telemetry import StepWindow, throughput_by_batch_size
from dcut.vllm.step_records import Decided
from dcut.width import RealizedRates, WidthStats, choose_width, width_utilities, widths_for

logger = logging.getLogger("vllm.dcut")



class RunnerKnowledge:
    """The cost table, the learned state and the published figures of a ``RunnerDCut``."""

    settings: DCutSettings
    fingerprint: Fingerprint
    k: int
    joint: bool
    widths: list[int]
    width_stats: WidthStats
    realized: RealizedRates
    calibrators: dict[int, Calibrator]
    history: RequestHistory | None
    _decided: dict[int, Decided]
    _held: dict[int, int]  # per covering batch size: the width hysteresis holds on to
    pooled_calibrator: Calibrator | None
    overhead: EngineOverhead
    cost_table: CostTable | None
    cost_source: CostSource
    cost_path: str | None
    _window: StepWindow
    window: StepWindow  # every held step counted (``RunnerDCut.window``)
    settle: Callable[[], None]  # count the held steps
    steps: int
    calibrating: int
    cost_table_s: float | None = None  # start-up: loading or profiling the cost table took this long
    compile_s: float | None = None  # start-up: vLLM's compile seconds (CompilationTimes), where it said

    # -- cost table ------------------------------------------------------------------------
    def cache_path(self) -> Path:
        return cached_table_path(self.settings.cache_dir, self.fingerprint.key())

    def load_or_profile(self, run_step: Any, run_draft: Any, batch_sizes: list[int],
                        context_lens: list[int] | None = None) -> None:
        """Use a handed-in table, else the cache for this fingerprint, else profile (and cache); a profile
        measures verify steps at ``context_lens`` too (``run_step(bs, tokens, context)``: ``dcut.context_cost``).

        Every mode loads one: the modes that do not decide by cost still give throughput estimates.
        """
        start = time.perf_counter()
        if self.settings.cost_table:
            self.cost_table = CostTable.load_for(self.settings.cost_table, self.fingerprint)
            self.cost_source, self.cost_path = "given", str(self.settings.cost_table)
        elif self.cache_path().exists():
            table = CostTable.load_for(self.cache_path(), self.fingerprint)
            # The fingerprint leaves out max_num_seqs: a table cached by an engine of fewer sequences lacks our larger
            # batch sizes, and beyond the table the policy runs blind (live, a table cached by a bs-16 run left a
            # bs-64 engine drafting nothing on 509 of 512 steps). Profile what is missing, and cache the union.
            missing = [b for b in batch_sizes if b not in table.points]
            if missing and self.settings.profile:
                logger.info("D-Cut: the cached table %s lacks batch sizes %s: profiling them", self.cache_path(),
                            missing)
                table = CostTable.merge([table, self._profile(run_step, run_draft, missing, context_lens)])
                table.save(self.cache_path())
            self.cost_table = table
            self.cost_source, self.cost_path = "cache", str(self.cache_path())
        elif self.settings.profile:
            self.cost_table = self._profile(run_step, run_draft, batch_sizes, context_lens)
            self.cost_table.save(self.cache_path())
            self.cost_source = "profiled"
        else:
            self.cost_source = "fallback"
        self.cost_table_s = time.perf_counter() - start
        logger.info("D-Cut: cost table %s%s in %.1f s", self.cost_source, f" ({self.cost_path})" if self.cost_path
                    else "", self.cost_table_s)
        if self.settings.learned and self.joint:
            state = LearnedState.model_validate_json(Path(self.settings.learned).read_text())
            if state.fingerprint != self.fingerprint.key() or state.widths != self.widths:
                logger.warning("D-Cut: learned state %s is of another engine (fingerprint or widths): ignored",
                               self.settings.learned)
            else:
                self.adopt(state)
                logger.info("D-Cut: started from learned state %s (%d measured widths x buckets)",
                            self.settings.learned, len(state.realized))

    def _profile(self, run_step: Any, run_draft: Any, batch_sizes: list[int],
                 context_lens: list[int] | None) -> CostTable:
        """A table profiled at ``batch_sizes``: verify and draft costs, and the verify cost's growth with context."""
        # Every default width as well as the chosen ones: the table is cached by fingerprint and
        # shared with engines whose widths differ.
        widths = sorted(set(widths_for(self.k)) | set(widths_for(self.k, self.settings.widths)))
        logger.info("D-Cut: profiling verify and draft costs for batch sizes %s (K=%d, widths %s)",
                    batch_sizes, self.k, widths)
        table = profile_cost_table(
            run_step, batch_sizes, self.k, self.fingerprint, warmups=self.settings.profile_warmups,
            repeats=self.settings.profile_repeats, run_draft=run_draft, widths=widths)
        if context_lens:
            started = time.perf_counter()
            table.context = profile_context(
                run_step, table.lookup, batch_sizes, self.k, self.settings.profile_context_len,
                context_lens, warmups=self.settings.profile_warmups, repeats=self.settings.profile_repeats)
            logger.info("D-Cut: verify cost by context profiled at %s in %.1f s: slopes %s", context_lens,
                        time.perf_counter() - started, table.context.to_json())
        return table

    # -- learned state (dcut.learned) -------------------------------------------------------
    def learned(self) -> LearnedState | None:
        """Mode joint: what this runner has learned, for a replica that starts after it."""
        if not self.joint:
            return None
        self.settle()
        ws = self.width_stats
        return LearnedState(
            fingerprint=self.fingerprint.key(), k=self.k, widths=self.widths, reached=ws.reached.tolist(),
            accepted=ws.accepted.tolist(), expected=ws.expected.tolist(),
            expected_requests=ws.expected_requests.tolist(),
            calibration={w: c.state() for w, c in self.calibrators.items()},
            pooled_calibration=None if self.pooled_calibrator is None else self.pooled_calibrator.state(),
            realized=self.realized.cells(), overhead_ms=(self.overhead.per_step_ms, self.overhead.per_token_ms))

    def adopt(self, state: LearnedState) -> None:
        """Start from ``state`` (same fingerprint and widths): acceptance, calibration, measured rates."""
        self.settle()
        self.width_stats.load(state.reached, state.accepted, state.expected, state.expected_requests)
        for w, cal in state.calibration.items():
            if w in self.calibrators:
                self.calibrators[w].load(cal)
        if self.pooled_calibrator is not None and state.pooled_calibration is not None:
            self.pooled_calibrator.load(state.pooled_calibration)
        self.realized.load(state.realized)
        self.overhead.per_step_ms, self.overhead.per_token_ms = state.overhead_ms
        self._decided.clear()
        self.calibrating = 0  # calibrated already, by the runner that learned this

    # -- reading ---------------------------------------------------------------------------
    def estimates(self) -> list[ThroughputEstimate]:
        """Tokens/s per profiled batch size. Mode ``joint``: where the width held there is measured, what its
        cycles delivered (``RealizedRates.delivered``); elsewhere the model's best width from the cost table and
        live acceptance, corrected by what the bucket's recent cycles realized against what was predicted for
        them (``RealizedRates.correction``). The model's best is not what the policy drafts once it has measured
        (replayed, deep pair at bs 16: the model said width 15 at 2,517 tokens/s, the policy held width 3, which
        delivered 2,285, and the estimate read 13 % over); autoscaling reads these figures."""
        self.settle()
        table = self.cost_table
        if table is None or not len(self.window):
            return []
        sizes = sorted(table.points)
        if not self.joint:
            return throughput_by_batch_size(sizes, self.window.acceptance_curve(), self.settings,
                                            StepCost(table, self.k), draft_ms=0.0)
        survival = self.width_stats.survival()
        out = []
        for b in sizes:
            held = self._held.get(b)
            found = None if held is None else self.realized.delivered(b, held)
            if found is not None:
                tokens, ms = found
            else:
                best = choose_width(width_utilities(b, self.widths, survival, table.lookup_many, table.draft_costs,
                                                    self.overhead.ms), None, 0.0)
                if best is None or best.step_ms <= 0:
                    continue
                ratio, time_ratio = self.realized.correction(b)
                tokens, ms = best.tokens_per_step * ratio, best.step_ms * time_ratio
            rate = 1000.0 * tokens / ms
            out.append(ThroughputEstimate(b, tokens, ms, rate, rate / b))
        return out

    def _log_summary(self) -> None:
        """One line in the engine log every LOG_INTERVAL_S, beside vLLM's own stats lines."""
        w = self.window
        logger.info("D-Cut: %d steps, widths %s, mean keep ratio %s, accepted drafts/request-step %s, "
                    "position acceptance %s, cost table %s%s%s", len(w), w.width_histogram(),
                    _fmt(w.mean_keep_ratio()), _fmt(w.mean_accepted_length()),
                    [_fmt(p) for p in w.position_acceptance()[:8]], self.cost_source,
                    ", request history in use" if self.history is not None and self.history.useful else "",
                    f", speed shifts per bucket {self.realized.shifts}" if self.joint and self.realized.shifts else "")

    def reset_stats(self) -> None:
        """Forget recorded steps (e.g. after a warm-up), keep the cost table and calibration."""
        self.settle()
        self._window = StepWindow(self.settings.stats_window)
        self.steps = 0

    def snapshot(self) -> DCutSnapshot:
        """The runner's one published record (`dcut.snapshot.DCutSnapshot`)."""
        self.settle()
        sel = [r.selection_us for r in self.window.records if r.selection_us]
        joint = {}
        if self.joint:
            joint = {"width_realized": self.realized.summary(), "speed_shifts": dict(self.realized.shifts),
                     "width_observations": self.width_stats.observations(),
                     "width_survival": dict(zip(self.widths, self.width_stats.survival().tolist(), strict=True)),
                     "request_history": None if self.history is None else self.history.summary()}
        return DCutSnapshot(
            settings=self.settings, fingerprint=self.fingerprint, cost_source=self.cost_source,
            cost_path=self.cost_path, steps=self.steps, window=WindowSummary(**self.window.summary()),
            totals=Totals(**asdict(self.window.totals)),
            selection_us_median=statistics.median(sel) if sel else None, estimates=self.estimates(),
            overhead=Overhead(per_step_ms=self.overhead.per_step_ms, per_token_ms=self.overhead.per_token_ms),
            cost_table=None if self.cost_table is None else self.cost_table.to_json(),
            calibration={w: c.reliability() for w, c in self.calibrators.items()} or None, learned=self.learned(),
            cost_table_s=self.cost_table_s, compile_s=self.compile_s, **joint)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"

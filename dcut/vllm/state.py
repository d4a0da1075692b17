"""D-Cut's per-engine state inside a vLLM model runner: choose the width, decide, cut, measure.

One ``RunnerDCut`` lives on each model runner (``dcut.vllm.runner_hooks.RunnerHooks``). The flow of one
engine step, as driven by the wrappers in ``dcut.vllm.step_hooks``:

1. ``begin_step``   (``execute_model``) — note the shape of the step and start its clock;
2. ``choose_width`` (``propose_draft_token_ids``, before drafting) — the target's part of the
   step is over (its time refines the verify cost); mode ``joint`` picks how many positions to
   draft from the two-part cost and the acceptance learned per width, or a probe width;
3. ``on_drafted``   (after drafting) — the drafter's time refines the draft cost; score the fresh
   drafts and choose keep depths on a host copy of their confidences (``dcut.selection``: why the host), note
   what verification accepted;
4. ``cut``          (``take_draft_token_ids``) — truncate each request's drafts before the
   scheduler sees them (so a pruned draft is never scheduled, verified or counted as rejected),
   record the step. The step's times are read here, from marks the device reached, where vLLM has already waited
   for the drafts (``dcut.vllm.step_clock``): on a GPU a host timer would time launches.

With tensor parallelism every rank keeps its own state; the width must agree across ranks (the
drafter's forward has collectives), so the patch hands rank 0's choice to the others.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dcut.calibration import Calibrator
from dcut.cost_table import CostTable, Fingerprint, StepCost
from dcut.history import RequestHistory
from dcut.overhead import EngineOverhead
from dcut.selection import prefix_scores, select
from dcut.settings import DCutSettings
from dcut.snapshot import CostSource
from dcut.speculation import RequestSpeculation
from dcut.telemetry import StepRecord, StepWindow
from dcut.trace import TraceWriter
from dcut.vllm import prometheus
from dcut.vllm.engine import additional_settings
from dcut.vllm.runner_knowledge import RunnerKnowledge
from dcut.vllm.step_clock import HostTimer, StepTimer
from dcut.vllm.step_records import Cycle, Decided, Held, LastDrafts, Pending, Verified
from dcut.width import (
    OPTIMISM,
    Explorer,
    ProbeBudget,
    RealizedRates,
    WidthChoice,
    WidthStats,
    choose_width,
    marginal_gains,
    per_request_gains,
    position_counts,
    step_costs,
    utilities_at,
    widths_for,
)

logger = logging.getLogger("vllm.dcut")

LOG_INTERVAL_S = 10.0
NEVER = -1.0e4  # a log-confidence no budget keeps (exp underflows to 0), without -inf arithmetic
# Steps a fresh width decision holds at its batch size before it is taken again (``MAX_HOLD_STEPS``: longer once
# settled). What it rests on (acceptance per width, measured rates, costs) moves over hundreds of steps, and taking it
# costs about a millisecond of Python on a CPU engine (under cProfile: 0.8 ms of a 19 ms step at bs 8), more than
# D-Cut's selection itself.
REDECIDE_STEPS = 8
# A decision taken again and found unchanged is held twice as long as the last, up to this many steps; a change
# brings the hold back to ``REDECIDE_STEPS``. Settled, the width is re-taken only to notice a change (profiled at bs
# 1, deep pair, width 0: 0.36 ms a decision, 0.045 ms a step when taken every 8).
MAX_HOLD_STEPS = 32
POOLED_UNTIL = 64  # first drafts a width's own calibrator must have seen before it replaces the pooled one
# Steps between re-pricings of every width's recent blocks under the calibration of now (``WidthStats.rescore``:
# why). Calibration moves over hundreds of steps; one re-pricing costs about a millisecond of small CPU ops.
RESCORE_STEPS = 64
# Requests whose drafts a fresh engine verifies in full, at its widest width, before it decides anything: calibration
# from nothing. A drafter's raw confidence can be far off (the MoE pair's: raw about 0.05 deep in its block, accepted
# 99 % of the time); judged on it, every drafting width looks worthless, width 0 is chosen, and the drafts that
# would correct the calibration are never verified (replayed: joint at width 0 for 500 steps, 0.43x width 15).
CALIBRATE_REQUESTS = 64
# Steps whose outcomes are held and counted together (``RunnerDCut.settle``): acceptance per width and position,
# calibration, each block's price, the step's times (cost-table refinement, cycles measured and priced), the step
# records and their metrics. What a step's code costs on a CPU engine is mostly the caches the forward pass left cold
# (measured in an engine: ``select`` 184 us on its first call after the forward, 58 us repeated at once), so counting
# eight steps in one go costs little more than counting one. What these counts feed (the width decision,
# ``REDECIDE_STEPS``; the calibration) moves over hundreds of steps.
ACCOUNT_STEPS = 8
# Steps whose verified outcomes the calibrators hold before they count them in one update (``Calibrator.flush``). An
# update, and the lookup table rebuilt after it, were the dearest part of a step's accounting (measured warm: 0.44 ms
# for a width's calibrator and the pooled one, 0.16 ms to rebuild the table; in an engine, MoE pair at bs 1, 0.08-0.1
# ms a step when done every ``ACCOUNT_STEPS``, 0.02-0.04 ms every 32); calibration moves over hundreds of steps.
CALIBRATION_STEPS = 32


def settings_from_config(vllm_config: Any) -> DCutSettings | None:
    """The validated D-Cut settings of an engine, or None when D-Cut is not asked for."""
    return additional_settings(vllm_config, "dcut", DCutSettings)


class RunnerDCut(RunnerKnowledge):
    """D-Cut attached to one model runner: the step. Its cost table, learned state and published figures:
    ``RunnerKnowledge`` (``dcut.vllm.runner_knowledge``)."""

    def __init__(self, settings: DCutSettings, fingerprint: Fingerprint, k: int,
                 clock: Callable[[], float] = time.perf_counter, timer: StepTimer | None = None) -> None:
        """``clock``: seconds, monotonic; replay (``dcut.replay``) drives the runner on a simulated one. ``timer``:
        the device's stages (``dcut.vllm.step_clock``; default: ``clock``'s, for a device that is the host)."""
        self.settings = settings
        self._clock = clock
        self._timer = timer if timer is not None else HostTimer(clock)
        self.fingerprint = fingerprint
        self.k = k
        self.joint = settings.mode == "joint"
        self.widths = widths_for(k, settings.widths) if self.joint else [k]
        self.width_stats = WidthStats(self.widths, k)
        self.probes = ProbeBudget(self.widths, settings.probe_share)
        self.realized = RealizedRates(shift=settings.speed_shift)
        self._shifts_counted = 0  # of the realized rates' speed shifts, those counted in the metrics
        self.explorer = Explorer()
        self._cycle: Cycle | None = None  # the last width's cycle, still being paid for
        self.cost_table: CostTable | None = None
        self.cost_source: CostSource = "pending"
        self.cost_path: str | None = None
        # Mode joint drafts several widths: until a width's own calibrator has seen enough, every width's
        # outcomes, pooled by position, calibrate it (a width first tried must not be judged on raw scores);
        # after, a position it has seen too rarely falls back on the pooled counts there.
        multi = settings.calibrate and len([w for w in self.widths if w]) > 1
        self.pooled_calibrator = Calibrator(k) if multi else None
        self.calibrators = {w: Calibrator(w, fallback=self.pooled_calibrator) for w in self.widths if w
                            } if settings.calibrate else {}
        self._window = StepWindow(settings.stats_window)
        self._held_steps: list[Held] = []  # steps not yet counted (``settle``)
        self._rescored_at = 0  # ``steps`` at the last ``WidthStats.rescore``
        self._calibrated_at = 0  # ``steps`` at the last calibration update (``CALIBRATION_STEPS``)
        self.steps = 0
        self._pending: Pending | None = None
        self._verified: Verified | None = None
        self._last: LastDrafts | None = None
        self._step_shape: tuple[int, int] | None = None  # (bs, verify tokens) of a pure decode step
        self._step_start = 0.0  # host clock: the step's wall time, read at ``cut``, after the engine waited
        # The timer's marks (``_read_times``): this step's start, the end of its target part (= the drafter's start),
        # the drafter's end (the next step's gap starts there), the flush inside drafting; read at ``cut``.
        self._step_mark: Any = None
        self._verify_end: Any = None
        self._draft_start: Any = None
        self._draft_end: Any = None
        self._gap: tuple[Any, Any] | None = None
        self._drafted: tuple[Any, Any, int | None] | None = None  # drafter start, end, covering batch size
        self._flush: tuple[Any, Any, int | None, float, int] | None = None  # start, end, bucket, share, cycles
        self._verify_ms: float | None = None
        self._draft_ms: float | None = None
        self.overhead = EngineOverhead()  # engine time outside execute_model..drafter, by tokens emitted
        self._emitted = 0  # tokens the last recorded step emitted (bs + accepted drafts)
        self._finished_cycle: Cycle | None = None
        self._step_bs = 0
        self.width = k  # the width drafted this step
        self.probe = False
        self._held: dict[int, int] = {}  # per covering batch size: the width hysteresis holds on to
        self._decided: dict[int, Decided] = {}  # per batch size: the last decision, taken again for a few steps
        self._choices = 0  # widths chosen so far (the clock of ``_decided``)
        self._last_log = time.monotonic()
        self._gap_ms: float | None = None  # the engine's time between the last drafting pass and this step
        self._zero_cycles = 0  # width-0 cycles whose drafter writes wait in the catch-up stash
        self._zero_rows = 0  # and the rows they stashed (about a row per request)
        self.calibrating = CALIBRATE_REQUESTS if self.joint and self.calibrators else 0  # requests left to verify
        self.tracer = TraceWriter(k, {"fingerprint": fingerprint.model_dump(), "k": k}) if settings.trace else None
        self.trace_widths = [w for w in settings.trace_widths if w <= k] or [k]
        self._trace_turn = 0
        self.requests = RequestSpeculation(k, settings.default_max_width)  # caps, and what speculation did
        self.history = RequestHistory() if self.joint else None  # each request's record against calibration
        self._caps: list[int] | None = None  # this step's caps, in batch order (None: none below K)
        # The batch's mean context (tokens so far; the hooks set it each step, before the width is chosen): every
        # verify cost this step looks up or refines is priced at it (dcut.context_cost). None: the profiled one.
        self.context: float | None = None

    def finished(self, req_ids: set[str]) -> None:
        """Requests that finished: their usage stays readable, their record against calibration goes."""
        self.requests.drop(req_ids)
        if self.history is not None:
            self.history.drop(req_ids)

    # -- the step --------------------------------------------------------------------------
    def begin_step(self, num_scheduled: dict[str, int], spec_tokens: dict[str, list[int]]) -> None:
        """Remember the step's shape when it is a pure decode/verify step (the cost table's kind)."""
        self._step_start = self._clock()
        mark = self._timer.mark()
        if self._draft_end is not None:  # the engine's gap since the last drafting pass (read at cut)
            self._gap = (self._draft_end, mark)
        self._step_mark, self._draft_end = mark, None
        self._step_bs = len(num_scheduled)
        # Pure: each request scheduled its one token and its drafts, no more (a prefill schedules more). vLLM's
        # scheduler trims a request's drafts to what it schedules, so none schedules fewer and the sums tell.
        tokens = sum(num_scheduled.values())
        pure = tokens == len(num_scheduled) + sum(map(len, spec_tokens.values()))
        self._step_shape = (len(num_scheduled), tokens) if pure else None

    def choose_width(self, bs: int, scheduled_width: int, req_ids: list[str] | None = None) -> int:
        """The width to draft this step (host int, decided before drafting); starts the draft clock.

        Modes other than ``joint`` draft what the scheduler asked for. ``joint`` maximises the
        estimated tokens/s of the whole step over the candidate widths (``dcut.width``), holds on
        to its last choice within the hysteresis, and now and then probes another width; where the
        batch's requests (``req_ids``) have lately accepted too little for drafting to pay, width 0.
        """
        self._draft_start = self._verify_end = self._timer.mark()
        self.width, self.probe = scheduled_width, False
        if self.tracer is not None:  # recording: every width in turn, each verified in full
            self.width = self.trace_widths[self._trace_turn % len(self.trace_widths)]
            self._trace_turn += 1
            return self.width
        table = self.cost_table
        if not self.joint or table is None or bs <= 0:
            return self.width
        if self.calibrating > 0:  # a probe: drafted wide and verified in full (CALIBRATE_REQUESTS: why)
            self.calibrating -= bs
            # the widest it may draft: pinned at width 3, blocks of K taught no calibrator it reads and cost K's steps
            self.width, self.probe = self.widths[-1], True
            return self.width
        self._choices += 1
        decision = self._decided.get(bs)
        if decision is None or self._choices - decision.step >= decision.hold:
            self.settle()  # decide on every step verified so far
            decision = self._decided[bs] = _held_for(self._decide(bs, table), decision)
        chosen, bucket = decision.chosen, decision.bucket
        if chosen is None or bucket is None:
            # Beyond what was measured: the cheapest step there is, never the dearest (it used to draft
            # everything here, and at bs 64 a width pinned to 0 drafted full blocks on 42% of its steps).
            self.width = self.widths[0]
            return self.width

        explore = self.explorer.spend_on(chosen, decision.explore, decision.step_ms.get)
        if explore is not None:  # drafted and verified as the policy would: measures what the width is worth
            self.width = explore
            return self.width
        # (the least measured width goes first: fresh cycles measured at a width, of bucket requests). None where
        # width 0 is chosen and no width could beat it even optimistically: a probe could change nothing here.
        hopeless = chosen.width == 0 and decision.explore is None
        probe = None if hopeless or not self.probes.due() else \
            self.probes.pick(chosen, lambda w: self._full_step_ms(bs, w),
                             functools.partial(self.realized.fresh, bucket))
        self.width, self.probe = (probe, True) if probe is not None else (self._gated(chosen, decision, req_ids),
                                                                          False)
        return self.width

    def _gated(self, chosen: WidthChoice, decision: Decided, req_ids: list[str] | None) -> int:
        """``chosen``'s width, or width 0 where the batch's requests' recent blocks (``RequestHistory``) make its
        expected tokens, scaled by their mean factor, slower than a step without drafts."""
        zero = decision.zero
        if not chosen.width or self.history is None or not req_ids or zero is None:
            return chosen.width
        factors = self.history.factors(req_ids)
        if factors is None:
            return chosen.width
        bs = len(req_ids)
        scaled = (bs + float(factors.mean()) * (chosen.tokens_per_step - bs)) / chosen.step_ms
        return 0 if scaled < zero.tokens_per_step / zero.step_ms else chosen.width

    def _decide(self, bs: int, table: CostTable) -> Decided:
        """The width for steps of ``bs`` (None beyond the cost table), and what exploration weighs against it:
        the width it would try, which rests on the decision alone, and each width's estimated step time
        (``REDECIDE_STEPS`` says why it is held)."""
        bucket, verify_ms = table.covering(bs), functools.partial(table.lookup_many, context=self.context)
        if bucket is None:
            return Decided(self._choices, None, None)
        survival = self.width_stats.survival()
        costs = step_costs(bs, self.widths, survival.shape[1], verify_ms, table.draft_costs)
        model = utilities_at(bs, self.widths, survival, costs, self.overhead.ms)
        estimates = self.realized.apply(bucket, model)
        chosen = choose_width(estimates, self._held.get(bucket), self.settings.width_hysteresis,
                              lambda w: self.realized.noise(bucket, w))
        if chosen is None:
            return Decided(self._choices, bucket, None)
        self._held[bucket] = chosen.width
        hopeful = utilities_at(bs, self.widths, self.width_stats.survival(OPTIMISM), costs, self.overhead.ms)
        zero = next((c for c in estimates if c is not None and c.width == 0 and c.step_ms > 0), None)
        explore = self.explorer.candidate(chosen, self.widths, self.realized.optimistic(bucket, hopeful),
                                          self.settings.width_hysteresis)
        return Decided(self._choices, bucket, chosen, explore, {c.width: c.step_ms for c in hopeful if c is not None},
                       zero)

    def held_width(self, bs: int) -> int | None:
        """The width chosen (not explored or probed) for steps of ``bs``, which hysteresis holds on to; None
        before a decision at its covering batch size. Per covering batch size: a width held at one batch size
        is no reason to keep it at another (held engine-wide, bs 32's width 5 was kept at bs 64 on a quarter of
        the steps, where width 3 delivered 9 % more)."""
        cover = None if self.cost_table is None else self.cost_table.covering(bs)
        return None if cover is None else self._held.get(cover)

    def mark(self) -> Any:
        """A mark in the device's work now (``dcut.vllm.step_clock``): where a flush starts."""
        return self._timer.mark()

    def on_flush(self, start: Any, rows: int) -> None:
        """The width-0 steps' deferred drafter writes (``dcut.vllm.catch_up``, ``rows`` rows) were just paid (from
        mark ``start`` to now), inside this drafting pass: they are the width-0 steps' cost, not this width's. Taken
        off this pass's drafter time, and the counted width-0 cycles' rows' share of it charged to them (otherwise
        width 0 looks cheaper than it is and whichever width drafts next, dearer: a bias that kept joint at width 0).
        Only their share: the stash also holds the prompts of requests admitted at width 0, a pass every drafting
        width pays too, whatever its width. Its time is read, and charged, at ``cut``."""
        self.settle()  # the width-0 cycles still held
        bucket = None if self.cost_table is None else self.cost_table.covering(self._step_bs)
        share = min(1.0, self._zero_rows / rows) if rows > 0 else 0.0
        self._flush = (start, self._timer.mark(), bucket, share, self._zero_cycles)
        self._zero_cycles = self._zero_rows = 0

    def _read_times(self) -> None:
        """This step's device times from its marks, read where the engine has waited for all of them (``cut``;
        ``dcut.vllm.step_clock``: why not earlier), and what they feed in step order: the engine's gap before the
        step (its overhead, the last cycle's time), the flush's charge to width 0, the target's and the drafter's
        parts (the cycle finished, the cycle started). On the host, the same figures the host clock gave."""
        timer, gap, flush, drafted = self._timer, self._gap, self._flush, self._drafted
        self._gap = self._flush = self._drafted = None
        if gap is not None:
            gap_ms = self._gap_ms = timer.ms(*gap)
            self.overhead.add(self._emitted, gap_ms)
            if self._cycle is not None:
                self._cycle.ms += gap_ms
                self._cycle.clean = gap_ms <= self.overhead.max_ms  # not an idle engine
        flush_ms = 0.0
        if flush is not None:
            start, end, bucket, share, cycles = flush
            flush_ms = timer.ms(start, end)
            if bucket is not None and cycles:
                self.realized.charge(bucket, 0, flush_ms * share, cycles)
        if self._verify_end is not None and self._step_mark is not None:
            self._verify_ms = timer.ms(self._step_mark, self._verify_end)
        self._verify_end = None
        if drafted is None:
            return
        start, end, bucket = drafted
        self._draft_ms = None if start is None else timer.ms(start, end) - flush_ms
        finished = self._cycle
        self._cycle = None if bucket is None or self._draft_ms is None else Cycle(bucket, self.width, self.probe,
                                                                                   self._draft_ms)
        if finished is not None and self._verify_ms is not None:
            finished.ms += self._verify_ms
            self._finished_cycle = finished

    def _full_step_ms(self, bs: int, width: int) -> float | None:
        """Estimated step time drafting ``width`` and verifying all of it (a probe)."""
        assert self.cost_table is not None
        verify = self.cost_table.lookup(bs, bs * (1 + width), self.context)
        draft = self.cost_table.draft_cost(bs, width)
        return None if verify is None or draft is None else verify + draft + float(self.overhead.ms(bs * (1 + width)))

    def on_drafted(self, req_ids: list[str], log_conf: Tensor | None, sampled: Tensor | None,
                   num_draft_tokens: list[int] | None, context_lens: list[int] | None = None,
                   caps: list[int] | None = None) -> None:
        """Decide keep depths for fresh drafts ``[bs, W]``; note the just-verified outcome.
        ``context_lens``: each request's tokens so far (recorded in a trace); ``caps``: each request's cap on
        its drafts (``dcut.speculation``; None: K for all)."""
        self._caps = caps if caps is not None and min(caps, default=self.k) < self.k else None
        self._draft_end = self._timer.mark()
        bucket = None if self.cost_table is None else self.cost_table.covering(len(req_ids))
        self._drafted, self._draft_start = (self._draft_start, self._draft_end, bucket), None  # (read at cut)
        width = self.width if log_conf is not None and log_conf.shape[-1] else 0
        if sampled is not None and num_draft_tokens is not None and torch.is_tensor(sampled) and self._last:
            # sampled: [bs, max_drafts + 1], rejected slots are -1; accepted = valid - 1 (bonus).
            accepted = np.maximum((sampled.cpu().numpy() != -1).sum(1) - 1, 0)
            counts = accepted.tolist()
            self._verified = Verified(list(req_ids), np.array(num_draft_tokens, dtype=np.int64), accepted,
                                      self._last.width, sum(counts))
            self.requests.step(req_ids, caps, width, num_draft_tokens, counts)
            if self.history is not None:
                self._observe_history(req_ids, num_draft_tokens, counts, self._last)
        else:
            self._verified = None
            self.requests.step(req_ids, caps, width)
            if self.history is not None:
                self.history.idle(req_ids)
        if self.tracer is not None:  # (recording a trace: its times are read now, a wait on a GPU)
            self._read_times()
            self._trace(req_ids, log_conf, context_lens)
        if log_conf is None or log_conf.shape[-1] == 0:
            self._pending = None
            return
        start = self._clock()
        # The decision is host work (dcut.selection: why): one copy of the drafter's confidences, which the cut
        # reads on the host anyway (its keep depths, the raw confidences calibration counts).
        raw = log_conf.detach().to("cpu", torch.float32).numpy()
        if self.probe or self.settings.mode == "full" or self.tracer is not None:
            self._pending = Pending(None, None, raw, 0.0)
            if self.joint:  # every draft is verified: what the width's blocks are worth, and each request's
                scored = self._calibrated(raw.shape[-1], raw)
                self._pending.expected, self._pending.block = marginal_gains(scored), prefix_scores(scored).sum(1)
            return
        scored = self._calibrated(raw.shape[-1], raw)
        if self._caps is not None:  # drafts beyond a request's cap are worth nothing to the budget
            scored = np.where(np.arange(scored.shape[-1]) >= np.asarray(self._caps)[:, None], NEVER, scored)
        cost = None if self.cost_table is None else StepCost(self.cost_table, raw.shape[-1],
                                                             float(self.overhead.ms(raw.shape[0])), self.context)
        factors = None if self.history is None else self.history.factors(req_ids)
        ranked = scored if factors is None else _scaled(scored, factors)
        keep, decision = select(ranked, self.settings, cost)
        gains = block = None
        if self.joint:  # what each further draft per request is worth: select's sorted sums, where it made them
            bs = len(req_ids)
            # (calibration's view, as a width's blocks are priced: the factors are this moment's requests')
            gains = marginal_gains(scored) if decision.gains is None or factors is not None else \
                per_request_gains(decision.gains, bs)
            # what calibration alone expects of each request's kept drafts (RequestHistory weighs the outcome)
            scores = decision.scores if factors is None and decision.scores is not None else prefix_scores(scored)
            block = (scores * (np.arange(scores.shape[-1]) < keep[:, None])).sum(1)
        self._pending = Pending(keep, decision, raw, (self._clock() - start) * 1e6, gains, block)

    def _observe_history(self, req_ids: list[str], verified: list[int], accepted: list[int],
                         last: LastDrafts) -> None:
        """Weigh each request's verified block against what calibration expected of it when it was kept."""
        assert self.history is not None
        if last.expected is None:
            self.history.idle(req_ids)
            return
        aligned = last.rows(req_ids)
        expected = last.expected
        if aligned is not None:  # requests that drafted nothing last step expected nothing
            (mine, theirs), expected = aligned, np.zeros(len(req_ids))
            expected[mine] = last.expected[theirs]
        self.history.observe(req_ids, expected.tolist(), verified, accepted)  # (floats: numpy scalars are slow)

    def _trace(self, req_ids: list[str], log_conf: Tensor | None, context_lens: list[int] | None) -> None:
        """Record this drafting pass, and what verification showed of the last one."""
        assert self.tracer is not None
        v = self._verified
        if v is not None:
            self.tracer.verified(v.req_ids, v.num_draft.tolist(), v.accepted.tolist())
        conf = None if log_conf is None or log_conf.shape[-1] == 0 else log_conf.float().cpu().numpy()
        self.tracer.step(req_ids, context_lens or [0] * len(req_ids), self.width if conf is not None else 0, conf,
                         self._verify_ms, self._draft_ms, self._gap_ms)
        if len(self.tracer) % 256 == 0:
            self.save_trace()

    def save_trace(self) -> Path | None:
        """Write the trace recorded so far to ``<trace>/trace-<fingerprint>-<pid>.npz``; its path."""
        if self.tracer is None or self.settings.trace is None:
            return None
        path = Path(self.settings.trace) / f"trace-{self.fingerprint.key()}-{os.getpid()}.npz"
        self.tracer.save(path)
        return path

    def cut(self, req_ids: list[str], drafts: list[list[int]]) -> list[list[int]]:
        """Truncate each request's drafts to its keep depth; record the step, its device times read now."""
        self._read_times()
        pending, self._pending = self._pending, None
        verified, self._verified = self._verified, None
        caps, self._caps = self._caps, None
        if any(drafts):  # (a width-0 step has nothing to cut)
            if pending is not None and pending.keep is not None and len(drafts) == pending.keep.shape[0]:
                drafts = [d[:n] for d, n in zip(drafts, pending.keep.tolist(), strict=True)]
            if caps is not None and len(caps) == len(drafts):  # a request's cap holds in every mode, probes included
                drafts = [d[:c] for d, c in zip(drafts, caps, strict=True)]
        step_ms = (self._clock() - self._step_start) * 1000.0
        raw = None if pending is None else pending.log_conf
        self._record(pending, verified, step_ms, raw)
        block = None if pending is None else pending.block
        self._last = None if raw is None else LastDrafts(list(req_ids), raw, raw.shape[-1], block)
        return drafts

    def _record(self, pending: Pending | None, verified: Verified | None, step_ms: float,
                raw: np.ndarray | None) -> None:
        """Account for the step: now, only what the next step's clock reads (the tokens it emitted, for the engine's
        overhead); the rest is held for ``settle`` (``raw``: this step's raw log-confidences on the CPU)."""
        self.steps += 1
        bs = self._step_bs
        self._emitted = bs + (verified.accepted_total if verified is not None else 0)
        proposed = pending.log_conf.size if pending is not None else 0
        decision = pending.decision if pending is not None else None
        record = StepRecord(  # kept, budget, ratio and the per-position counts: filled in by ``_count``
            timestamp=time.time(),
            batch_size=bs,
            proposed=proposed,
            kept=proposed,
            accepted=verified.accepted_total if verified is not None else 0,
            accepted_per_position=[0] * self.k,
            kept_per_position=[0] * self.k,
            step_ms=step_ms,
            selection_us=pending.selection_us if pending is not None else 0.0,
            fallback=decision is not None and decision.fallback,
            width=self.width,
            probe=self.probe,
            verify_ms=self._verify_ms,
            draft_ms=self._draft_ms,
        )
        self._held_steps.append(Held(record, pending, verified, self._last, raw, self._step_shape, self.context,
                                     self._finished_cycle, self._cycle))
        self._finished_cycle = None
        self._verify_ms = self._draft_ms = None
        if len(self._held_steps) >= ACCOUNT_STEPS:
            self.settle()

    def _time(self, h: Held) -> None:
        """A held step's timings, in step order: its times refine the cost table, the cycle it finished is
        measured, and the cycle it started is priced (``_predict``). Held with the rest (``ACCOUNT_STEPS``): the
        width decision settles before it reads them; exploration's count of fresh cycles and a drafting step's
        budget read them up to ``ACCOUNT_STEPS`` - 1 steps late (taken each step, they were 0.05 ms of a width-0 step
        on the CPU engine, a sixth of D-Cut's work there)."""
        table, record, c = self.cost_table, h.record, h.finished
        emitted = record.batch_size + record.accepted
        if table is not None and self.settings.refine and h.shape is not None:
            if record.verify_ms is not None and table.covering(h.shape[0]):
                table.refine(*h.shape, record.verify_ms, context=h.context)
            if record.draft_ms is not None:
                table.refine_draft(h.shape[0], record.width or 0, record.draft_ms)  # (width: always set here)
        # A cycle whose verification shared its step with prefills is counted only if asked (``count_mixed_steps``).
        # Pure steps alone misrank what admissions cost (live, deep pair, bs 64, steady traffic: width 2 pinned
        # realized 1,339 tok/s on its pure steps against width 0's 1,323, yet ran at 832 against 892 tok/s), but
        # counting the others, up to twice a pure step and in bursts, made joint choose worse
        # (docs/experiments/2026-12-05-compare-mixed).
        counted = c is not None and self.joint and c.clean and (h.shape is not None or self.settings.count_mixed_steps)
        # A probe verifies everything, which the policy would not: it teaches acceptance, and a rate the width can at
        # least deliver (what exploration weighs), not the rate itself.
        if counted and c.probe:
            self.realized.add_probe(c.bucket, c.width, emitted, c.ms, c.predicted_ms)
        elif counted:
            self.realized.add(c.bucket, c.width, emitted, c.ms, c.predicted_tokens, c.predicted_ms, h.shape is not None,
                              c.gains, record.batch_size)
            if c.width == 0:
                self._zero_cycles += 1
                self._zero_rows += record.batch_size
        if self.joint and h.cycle is not None and table is not None:
            self._predict(h.cycle, table, h.pending, record.batch_size, h.context)

    @property
    def window(self) -> StepWindow:
        """The recent steps' records, every held step counted."""
        self.settle()
        return self._window

    def settle(self) -> None:
        """Count the held steps (``ACCOUNT_STEPS``: why they wait), in order. Whatever reads what they feed
        (acceptance per width, calibration, the records) calls this first."""
        held, self._held_steps = self._held_steps, []
        for h in held:
            self._time(h)
        if held:
            self._count(held)
        first = self._calibrated_at == 0 and self.calibrating <= 0  # the first decisions see the calibration phase
        if first or self.steps - self._calibrated_at >= CALIBRATION_STEPS:
            self._calibrated_at = self.steps
            for c in (*self.calibrators.values(), self.pooled_calibrator):
                if c is not None:
                    c.flush()  # one update for the held outcomes
        if self.joint and self.steps - self._rescored_at >= RESCORE_STEPS:
            self._rescored_at = self.steps
            self.width_stats.rescore(self._calibrated)
        if held and time.monotonic() - self._last_log >= LOG_INTERVAL_S:
            self._last_log = time.monotonic()
            self._log_summary()

    def _count(self, held: list[Held]) -> None:
        """The held steps, in order: what their verification showed (per position, in one count for all of them:
        counting each step alone cost more than the rest of its accounting), what their drafts are priced at,
        their records."""
        verified = [h for h in held if h.verified is not None]
        if verified:
            outcomes = [h.verified for h in verified]
            step = np.repeat(np.arange(len(outcomes)), [len(v.req_ids) for v in outcomes])
            kept_at, reached_at, accepted_at = position_counts(np.concatenate([v.num_draft for v in outcomes]),
                                                               np.concatenate([v.accepted for v in outcomes]), self.k,
                                                               step, len(outcomes))
            for h, kept, accepted in zip(verified, kept_at.tolist(), accepted_at.tolist(), strict=True):
                h.record.kept_per_position, h.record.accepted_per_position = kept, accepted
            if self.joint:
                widths = np.array([v.width for v in outcomes])
                for w in {v.width for v in outcomes}:
                    mine = widths == w
                    self.width_stats.observe(w, reached_at[mine].sum(0), accepted_at[mine].sum(0))
            for h in verified:
                self._update_calibration(h.verified, h.last)
        for h in held:
            record, pending = h.record, h.pending
            if pending is not None and pending.expected is not None and h.raw is not None:
                self.width_stats.observe_scores(h.raw.shape[-1], pending.expected, record.batch_size)
                self.width_stats.observe_block(h.raw)
            decision = pending.decision if pending is not None else None
            if decision is not None:  # read off the device only now
                record.kept, record.budget = int(decision.kept), int(decision.budget)
            else:
                record.budget = record.kept
            record.ratio = record.kept / record.proposed if record.proposed else 1.0
            self._window.add(record)
        shifts = sum(self.realized.shifts.values())
        prometheus.observe([h.record for h in held], self.fingerprint.model, shifts - self._shifts_counted)
        self._shifts_counted = shifts

    def _predict(self, cycle: Cycle, table: CostTable, pending: Pending | None, bs: int,
                 context: float | None) -> None:
        """What this step's drafts should yield next step, and what the cycle should cost: the kept drafts'
        calibrated prefix scores (every draft for a probe), the table's verify cost for the kept tokens,
        the drafter's cost at the width and the engine's overhead."""
        decision = None if pending is None else pending.decision
        cycle.gains = None if pending is None else pending.expected
        if decision is not None:
            drafts = int(decision.budget)
            tokens = float(decision.expected_accepted) + (0.0 if self.settings.count_bonus else bs)
        elif pending is not None and pending.expected is not None:  # a probe: every draft verified
            drafts = pending.log_conf.size
            tokens = bs + bs * float(pending.expected.sum())  # the gains of keeping every draft
        else:  # width 0
            drafts, tokens = 0, float(bs)
        verify = table.lookup(bs, bs + drafts, context)
        draft = table.draft_cost(bs, cycle.width)
        if verify is not None and draft is not None:
            cycle.predicted_tokens = tokens
            cycle.predicted_ms = verify + draft + float(self.overhead.ms(tokens))

    def _calibrated(self, width: int, log_conf: np.ndarray) -> np.ndarray:
        """``log_conf`` of blocks drafted at ``width``, calibrated as a block of that width is now."""
        calibrator = self._calibrator(width)
        return log_conf if calibrator is None else calibrator.calibrate(log_conf)

    def _calibrator(self, width: int) -> Calibrator | None:
        """The width's own calibrator once it has seen ``POOLED_UNTIL`` first drafts, else the pooled one."""
        own = self.calibrators.get(width)
        if own is None or self.pooled_calibrator is None or own.first_drafts >= POOLED_UNTIL:
            return own
        return self.pooled_calibrator

    def _update_calibration(self, verified: Verified, last: LastDrafts | None) -> None:
        calibrator = self.calibrators.get(verified.width)
        if last is None or calibrator is None:
            return
        aligned = last.rows(verified.req_ids)
        if aligned is None:  # the same batch, same order
            conf, num_draft, accepted = last.log_conf, verified.num_draft, verified.accepted
        else:
            mine, theirs = aligned
            if not mine.size:
                return
            conf, num_draft, accepted = last.log_conf[theirs], verified.num_draft[mine], verified.accepted[mine]
        for c in (calibrator, self.pooled_calibrator):
            if c is not None:
                c.observe(conf, num_draft, accepted)


def _held_for(decision: Decided, last: Decided | None) -> Decided:
    """``decision`` with its hold: twice ``last``'s where it chose the same width, else ``REDECIDE_STEPS``."""
    if last is not None and decision.chosen is not None and last.chosen is not None \
            and decision.chosen.width == last.chosen.width:
        decision.hold = min(2 * last.hold, MAX_HOLD_STEPS)
    else:
        decision.hold = REDECIDE_STEPS
    return decision


def _scaled(log_conf: np.ndarray, factors: np.ndarray) -> np.ndarray:
    """``log_conf`` with each request's block scaled by its factor (``RequestHistory``): its first position's
    log-confidence moved by ``log(factor)``, so every prefix score of the request is (capped at 1 by
    ``prefix_scores``)."""
    scaled = log_conf.copy()
    scaled[:, 0] += np.log(factors).astype(log_conf.dtype)
    return scaled

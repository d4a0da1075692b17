"""The replay loop: a steady batch of ``bs`` requests stepped through a trace under one policy.

Step n verifies what step n-1 kept (each request accepts ``min(true accepted, kept)`` and emits one
more token), then the policy chooses a width, the trace supplies that width's drafts, and the
policy keeps a prefix of each request's drafts. The step costs ``verify(bs, bs + kept) +
draft(bs, width) + overhead(emitted)`` on the cost model (for ``none``: a step without speculation, no drafter).

Draws are common to every policy: request slot i at step n reads row ``(i * (pool // bs) + n) mod pool``
of the pool of the width it drafted, so two policies drafting the same width at the same step see the
same drafts, and a difference between their figures is a difference between their decisions. Each slot
walks through consecutive rows from its own starting point: a recorded request's steps are consecutive
rows, so a slot's acceptance drifts the way a request's does, and slots start far apart in the pool.

The batch's context at step n, also common to every policy, is the mean recorded context of the rows the
widest width's pool gives at step n (or a fixed one, ``Pools(context=...)``); every verify step and every
decision of step n is priced at it where the cost model has a context term (``dcut.context_cost``).

The project's own policies run as they do in an engine: ``RunnerPolicy`` drives the runner
(``dcut.vllm.state.RunnerDCut``: width choice, probes, realized rates, calibration, selection, cost
refinement) on a simulated clock that advances by the modelled times, so what it measures is what
the cost model says.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dcut.replay.costs import CostModel
from dcut.replay.policy import Policy, Verified
from dcut.settings import DCutSettings
from dcut.trace import Trace


class Pools:
    """Each width's rows of a trace: what replay draws a request's drafts and true acceptance from."""

    def __init__(self, trace: Trace, context: float | None = None) -> None:
        """``context``: every step's mean context, instead of the trace's recorded ones."""
        self.k = trace.k
        self._pools = {w: trace.pool(w) for w in trace.widths()}
        if not self._pools:
            raise ValueError("the trace holds no fully verified rows")
        self._context = trace.pool_context(max(self._pools))
        self._fixed_context = context

    @property
    def widths(self) -> list[int]:
        return sorted(self._pools)

    def pool(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """``(log_conf [n, width], accepted [n])``: every fully verified row drafted at ``width``."""
        return self._pools[width]

    def mean_accepted(self, width: int) -> float:
        return float(self._pools[width][1].mean())

    def rows(self, width: int, step: int, bs: int) -> tuple[np.ndarray, np.ndarray]:
        """``(log_conf [bs, width], accepted [bs])`` for request slots 0..bs-1 at ``step``."""
        if width == 0:
            return np.zeros((bs, 0)), np.zeros(bs, dtype=np.int64)
        conf, accepted = self._pools[width]
        n = len(accepted)
        index = (np.arange(bs) * (n // bs) + step) % n
        return conf[index], accepted[index]

    def context(self, step: int, bs: int) -> float | None:
        """The batch's mean context at ``step`` (None where the trace recorded none, as synthetic ones do)."""
        if self._fixed_context is not None:
            return self._fixed_context
        n = len(self._context)
        lengths = self._context[(np.arange(bs) * (n // bs) + step) % n]
        return float(lengths.mean()) if (lengths > 0).all() else None


class SimClock:
    """Seconds on the replay's timeline (what ``RunnerDCut`` reads instead of ``perf_counter``)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, ms: float) -> None:
        self.t += ms / 1000.0


@dataclass
class Cell:
    """One policy at one batch size: what it emitted, in what time, and how it chose."""

    policy: str
    bs: int
    steps: int
    tokens: float
    ms: float
    widths: dict[int, int]
    verified_drafts: int
    drafted: int
    predicted_tokens_per_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tokens / self.ms if self.ms > 0 else 0.0


def run_cell(policy: Policy, bs: int, pools: Pools, cost: CostModel, steps: int, warmup: int,
             clock: SimClock | None = None, none: bool = False) -> Cell:
    """Replay ``warmup + steps`` steps; the figures count the last ``steps`` (steady state).
    ``none``: no speculation, an engine without a drafter (every step costs ``cost.none``)."""
    clock = clock or SimClock()
    begin = getattr(policy, "begin", None)
    kept = np.zeros(bs, dtype=np.int64)
    true = np.zeros(bs, dtype=np.int64)
    width_prev, last = 0, None
    tokens = ms = 0.0
    widths: Counter[int] = Counter()
    verified = drafted = 0
    step_ms = 0.0
    for n in range(warmup + steps):
        accepted = np.minimum(true, kept)
        emitted = bs + int(accepted.sum())
        context = pools.context(n, bs)
        if n:  # what this step's verification shows, before the next width is chosen (as in the engine)
            last = Verified(width_prev, kept, accepted, step_ms)
        if begin is not None:
            begin(bs, kept, context)
        if none:
            verify_ms, draft_ms, w = cost.none(bs, context), 0.0, 0
        else:
            verify_ms = cost.verify(bs, bs + int(kept.sum()), context)
            clock.advance(verify_ms)
            w = policy.width(bs, last)
            draft_ms = cost.draft(bs, w)
            clock.advance(draft_ms)
        conf, true = pools.rows(w, n, bs)
        new_kept = np.asarray(policy.keep(conf), dtype=np.int64)  # at width 0 too: an engine's hooks run every step
        step_ms = verify_ms + draft_ms + cost.overhead(emitted)
        clock.advance(step_ms - verify_ms - draft_ms)
        if n >= warmup:
            tokens += emitted
            ms += step_ms
            widths[w] += 1
            verified += int(kept.sum())
            drafted += bs * w
        kept, width_prev = np.clip(new_kept, 0, w), w
    predicted = getattr(policy, "predicted_tokens_per_s", None)
    extra = policy.report() if callable(getattr(policy, "report", None)) else {}
    return Cell(policy.name, bs, steps, tokens, ms, dict(sorted(widths.items())), verified, drafted,
                predicted() if callable(predicted) else None, extra)


class RunnerPolicy:
    """The runner an engine runs (``RunnerDCut``), in any of its modes, on the replay's clock."""

    def __init__(self, name: str, settings: DCutSettings, cost: CostModel, k: int, clock: SimClock) -> None:
        import torch

        from dcut.vllm.state import RunnerDCut

        self._torch = torch
        self.name = name
        self.runner = RunnerDCut(settings, cost.table.fingerprint, k, clock=clock)
        self.runner.cost_table = copy.deepcopy(cost.table)  # it refines its own copy from the steps it times
        self.runner.cost_source = "given"
        self.k = k
        self._ids: list[str] = []
        self._last: Verified | None = None
        self._bs = 0
        self._held: int | None = None
        self._steps = 0
        self.converged_at = 0  # the step from which the chosen width stayed what it is at the end

    def begin(self, bs: int, kept: np.ndarray, context: float | None = None) -> None:
        self._bs = bs
        self.runner.context = context  # what the engine's hooks tell it each step
        if len(self._ids) != bs:
            self._ids = [f"r{i}" for i in range(bs)]
        n = kept.tolist()
        self.runner.begin_step({r: 1 + d for r, d in zip(self._ids, n, strict=True)},
                               {r: [0] * d for r, d in zip(self._ids, n, strict=True)})

    def width(self, bs: int, last: Verified | None) -> int:
        self._last = last
        width = self.runner.choose_width(bs, self.k, self._ids)
        held = self.runner.held_width(bs)
        if held != self._held:  # the chosen width (not an exploring or probe step) changed
            self._held, self.converged_at = held, self._steps
        self._steps += 1
        return width

    def keep(self, log_conf: np.ndarray) -> np.ndarray:
        torch = self._torch
        bs, w = log_conf.shape
        last = self._last
        sampled = num_draft = None
        if last is not None and last.kept.size == bs:
            # vLLM's sampled ids: accepted drafts and the bonus token valid, rejected slots -1.
            cols = np.arange(int(last.kept.max(initial=0)) + 1)
            sampled = torch.from_numpy(np.where(cols[None, :] <= last.accepted[:, None], 0, -1))
            num_draft = last.kept.tolist()
        conf = torch.from_numpy(log_conf.astype(np.float32)) if w else None
        self.runner.on_drafted(self._ids, conf, sampled, num_draft)
        drafts = self.runner.cut(self._ids, [[0] * w for _ in range(bs)])
        return np.asarray([len(d) for d in drafts], dtype=np.int64)

    def report(self) -> dict[str, Any]:
        """Mode joint: when the choice settled, and per width what it predicted beside what it got."""
        if not self.runner.joint:
            return {}
        cover = self.runner.cost_table.covering(self._bs) if self.runner.cost_table is not None else None
        realized = {k.split("/")[1]: {m: round(v, 1) for m, v in cell.items()}
                    for k, cell in self.runner.realized.summary().items() if k.split("/")[0] == str(cover)}
        return {"converged_at_step": self.converged_at, "width_estimates": realized}

    def predicted_tokens_per_s(self) -> float | None:
        """What the runner predicts for this batch size at the end of the run (``RunnerDCut.estimates``, the
        figure autoscaling uses), to set beside what the replay measured."""
        table = self.runner.cost_table
        cover = None if table is None else table.covering(self._bs)
        return next((e.tokens_per_s for e in self.runner.estimates() if e.batch_size == cover), None)


def oracle(bs: int, pools: Pools, cost: CostModel, steps: int, warmup: int) -> Cell:
    """The best any policy could do on these draws: knowing each request's true acceptance at every
    width, draft the width that pays best and verify only drafts that will be accepted (all of them,
    or fewer where the cost table's steps make the last few dearer than they are worth).

    Maximises total tokens over total time (not each step's rate): Dinkelbach's iteration on
    ``tokens - rate * ms`` per step converges to the best ratio in a few rounds. Width 0 costs the
    cheaper of a ``none`` step (no drafter) and a width-0 step, so the oracle is at least ``none``.
    Each step is priced at its context, as the policies' are.
    """
    widths = [0, *pools.widths]
    options = []  # per step and width: (tokens [B+1], ms [B+1]) for verify budgets B = 0..accepted drafts
    for n in range(steps):
        row = []
        context = pools.context(warmup + n, bs)
        zero = min(cost.none(bs, context), cost.verify(bs, bs, context) + cost.draft(bs, 0))
        for w in widths:
            accepted = int(pools.rows(w, warmup + n, bs)[1].sum())
            tokens = bs + np.arange(accepted + 1, dtype=np.float64)
            verify = cost.table.lookup_many(bs, tokens.astype(np.int64), context)
            if verify is None:
                raise ValueError(f"cost model {cost.name} does not cover batch size {bs}")
            ms = (np.full_like(tokens, zero) if w == 0 else verify + cost.draft(bs, w)) + cost.overhead(tokens)
            row.append((tokens, ms))
        options.append(row)
    return _picked("oracle", bs, widths, _best_ratio(options), options)


def confidence_oracle(bs: int, pools: Pools, cost: CostModel, steps: int, warmup: int) -> Cell:
    """The best a policy deciding on the drafter's confidences could do: each step it sees every width's drafts
    with their confidences calibrated in hindsight (per width, position and confidence bin, fitted on the whole
    trace: ``dcut.calibration.Calibrator``), drafts the width and keeps the global top-B that maximise expected
    tokens over time, and gets what those drafts truly yield.

    It knows more than a deployable policy (every width's drafts of this step before drafting one, a calibration
    fitted on the outcomes it is judged on) and less than the ``oracle`` (not which drafts verification accepts):
    the ceiling of what D-Cut's signals can buy, where the oracle is the ceiling of anything.
    """
    import torch

    from dcut.calibration import Calibrator
    from dcut.selection import prefix_scores

    calibrators = {}
    for w in pools.widths:
        conf, accepted = pools.pool(w)
        calibrators[w] = c = Calibrator(w, prior=0.0)
        c.update(torch.from_numpy(conf), torch.full((len(accepted),), w), torch.from_numpy(accepted))
    widths = [0, *pools.widths]
    options, outcomes = [], []  # per step and width, per budget: (expected tokens, ms); (true tokens, ms)
    for n in range(steps):
        row, truth = [], []
        context = pools.context(warmup + n, bs)
        zero = min(cost.none(bs, context), cost.verify(bs, bs, context) + cost.draft(bs, 0))
        for w in widths:
            if w == 0:
                tokens = np.full(1, float(bs))
                ms = np.full(1, zero) + cost.overhead(tokens)
                row.append((tokens, ms))
                truth.append((tokens, ms))
                continue
            conf, accepted = pools.rows(w, warmup + n, bs)
            scores = prefix_scores(calibrators[w].calibrate(torch.from_numpy(conf))).reshape(-1).numpy()
            order = np.argsort(-scores, kind="stable")  # the global top-B for every B: a prefix of each request
            expected = bs + np.concatenate([[0.0], np.cumsum(scores[order])])
            hit = (order % w) < accepted[order // w]  # the draft is one verification accepts
            true = bs + np.concatenate([[0.0], np.cumsum(hit)])
            verify = cost.table.lookup_many(bs, bs + np.arange(bs * w + 1, dtype=np.int64), context)
            if verify is None:
                raise ValueError(f"cost model {cost.name} does not cover batch size {bs}")
            base = verify + cost.draft(bs, w)
            row.append((expected, base + cost.overhead(expected)))
            truth.append((true, base + cost.overhead(true)))
        options.append(row)
        outcomes.append(truth)
    return _picked("oracle-conf", bs, widths, _best_ratio(options), outcomes)


def _picked(name: str, bs: int, widths: list[int], picks: list[tuple[int, int]],
            outcomes: list[list[tuple[np.ndarray, np.ndarray]]]) -> Cell:
    """The cell of one (width index, budget) pick per step, at what each pick yields (``outcomes``: per step and
    width, tokens and ms per budget)."""
    tokens = sum(outcomes[n][j][0][b] for n, (j, b) in enumerate(picks))
    ms = sum(outcomes[n][j][1][b] for n, (j, b) in enumerate(picks))
    hist = Counter(widths[j] for j, _ in picks)
    return Cell(name, bs, len(picks), float(tokens), float(ms), dict(sorted(hist.items())),
                int(sum(b for _, b in picks)), int(sum(bs * widths[j] for j, _ in picks)))


def _best_ratio(options: list[list[tuple[np.ndarray, np.ndarray]]]) -> list[tuple[int, int]]:
    """Per step, the (width index, budget) maximising total tokens over total ms across all steps: Dinkelbach's
    iteration on ``tokens - rate * ms`` per step converges to the best ratio in a few rounds."""
    rate, picks = 0.0, []
    for _ in range(50):
        picks = []
        for row in options:
            best = max(((j, int(np.argmax(t - rate * m))) for j, (t, m) in enumerate(row)),
                       key=lambda jb: row[jb[0]][0][jb[1]] - rate * row[jb[0]][1][jb[1]])
            picks.append(best)
        tokens = sum(options[n][j][0][b] for n, (j, b) in enumerate(picks))
        ms = sum(options[n][j][1][b] for n, (j, b) in enumerate(picks))
        new = float(tokens / ms)
        if math.isclose(new, rate, rel_tol=1e-12):
            break
        rate = new
    return picks

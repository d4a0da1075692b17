"""The replay loop: a steady batch of ``bs`` requests stepped through a trace under one policy.

Step n verifies what step n-1 kept (each request accepts ``min(true accepted, kept)`` and emits one
more token), then the policy chooses a width, the trace supplies that width's drafts, and the
policy keeps a prefix of each request's drafts. The step costs ``verify(bs, bs + kept) +
draft(bs, width) + overhead(emitted)`` on the cost model (for ``none``: a step without speculation, no drafter), and
for a policy that decides with D-Cut (``decides``) its hooks' host work too (``CostModel.host_ms``).

Each request slot walks through a recorded request by the tokens it emits (``Walk``): it reads, at the width
drafted, the row its request recorded where the slot is in the request's text, so a request's acceptance drifts,
and runs in phases, as it did when recorded, whatever the policy's pace. Every policy starts from the same places:
two policies that emit the same tokens see the same drafts, and a difference between their figures is a difference
between their decisions.

The batch's context at a step is its slots' mean position (their recorded contexts; or a fixed one,
``Pools(context=...)``); every verify step and every decision of the step is priced at it where the cost model has
a context term (``dcut.context_cost``).

The project's own policies run as they do in an engine: ``RunnerPolicy`` drives the runner
(``dcut.vllm.state.RunnerDCut``: width choice, probes, realized rates, calibration, selection, cost
refinement) on a simulated clock that advances by the modelled times, so what it measures is what
the cost model says.
"""

from __future__ import annotations

import copy
import functools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dcut.replay.costs import CostModel
from dcut.replay.policy import Policy, Verified
from dcut.settings import DCutSettings
from dcut.trace import Trace

GOLDEN = (5 ** 0.5 - 1) / 2  # each start's stage phase: start * GOLDEN mod 1 (``Walk``)
JITTER_STEPS = 1 << 16  # a drift's jitter draws (``Drift``)


class Pools:
    """Each width's rows of a trace, by recorded request: what replay draws a request's drafts and true acceptance
    from (``Walk``)."""

    def __init__(self, trace: Trace, context: float | None = None) -> None:
        """``context``: every step's mean context, instead of the trace's recorded ones."""
        self.k = trace.k
        self._pools = {w: trace.pool(w) for w in trace.widths()}
        if not self._pools:
            raise ValueError("the trace holds no fully verified rows")
        self._fixed_context = context
        self.recorded_context = bool((trace.ctx_len > 0).any())
        # Per width: each row's sort key (request * SPAN + its position in the request: its context, or its row
        # number where none was recorded), sorted, and the pool rows in that order.
        self._keys: dict[int, np.ndarray] = {}
        self._index: dict[int, np.ndarray] = {}
        positions = {w: trace.pool_context(w) if self.recorded_context else np.arange(len(self._pools[w][1]))
                     for w in self._pools}
        owners = {w: trace.pool_requests(w) for w in self._pools}
        # Requests with rows at every width (a slot may draft any); one request of every row where none qualify.
        common = set.intersection(*(set(o.tolist()) for o in owners.values()))
        if not common:
            owners = {w: np.zeros_like(o) for w, o in owners.items()}
            positions = {w: np.arange(len(self._pools[w][1])) for w in self._pools}
            common = {0}
        self._requests = np.asarray(sorted(common), dtype=np.int64)
        rank = {q: i for i, q in enumerate(self._requests.tolist())}
        self._span = int(max(int(p.max(initial=0)) for p in positions.values())) + 1
        starts, ends = np.full(len(rank), np.iinfo(np.int64).max), np.zeros(len(rank), dtype=np.int64)
        for w in self._pools:
            keep = np.isin(owners[w], self._requests)
            r = np.asarray([rank[q] for q in owners[w][keep].tolist()], dtype=np.int64)
            pos = positions[w][keep].astype(np.int64)
            keys = r * self._span + pos
            order = np.argsort(keys, kind="stable")
            self._keys[w], self._index[w] = keys[order], np.flatnonzero(keep)[order]
            np.minimum.at(starts, r, pos)
            np.maximum.at(ends, r, pos)
        self._starts, self._ends = starts, ends

    @property
    def widths(self) -> list[int]:
        return sorted(self._pools)

    @property
    def requests(self) -> int:
        """How many recorded requests a walk steps through (those with rows at every width)."""
        return len(self._requests)

    def span(self, request: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        """Each request's (by index, ``0 .. requests - 1``; one index gives scalars) first and last recorded
        position."""
        return self._starts[request], self._ends[request]

    def row_at(self, width: int, request: np.ndarray, position: np.ndarray) -> np.ndarray:
        """Each request's row of ``pool(width)`` at ``position``: its last row recorded at or before it (its first
        where none is)."""
        keys, index = self._keys[width], self._index[width]
        j = np.searchsorted(keys, request * self._span + position, side="right") - 1
        first = np.searchsorted(keys, request * self._span, side="left")
        return index[np.maximum(j, first).clip(max=len(keys) - 1)]

    def context(self, positions: np.ndarray) -> float | None:
        """A batch's mean context at ``positions``: the fixed one where given, None where the trace recorded
        none (synthetic traces)."""
        if self._fixed_context is not None:
            return self._fixed_context
        return float(positions.mean()) if self.recorded_context else None

    def pool(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """``(log_conf [n, width], accepted [n])``: every fully verified row drafted at ``width``."""
        return self._pools[width]

    def mean_accepted(self, width: int) -> float:
        return float(self._pools[width][1].mean())

    def walk(self, bs: int, start: int = 0) -> Walk:
        """``bs`` request slots in requests spread over the trace, each at its own stage of its request (``Walk``);
        ``start`` picks another set of requests and stages (0: the first)."""
        return Walk(self, bs, start)


class Walk:
    """A steady batch's request slots, each stepping through a recorded request by the tokens it emits.

    A request's acceptance depends on where it is in its text (the MoE pair's requests reject every block for
    their first 8-20 tokens, then accept whole blocks), so a slot reads, at the width drafted, the row its request
    recorded at the slot's position, and moves on by what it emits: a policy that emits 16 tokens a step leaves a
    phase in a step, one that emits 1 stays in it for as many steps as it has tokens. Past its request's last
    recorded row a slot starts the next request. Every policy's walk starts from the same places and moves the
    same way, so two policies emitting the same tokens see the same drafts.
    """

    def __init__(self, pools: Pools, bs: int, start: int = 0) -> None:
        self._pools, self.bs = pools, bs
        n = pools.requests
        self._request = (np.arange(bs) * max(1, n // bs) + start) % n
        # Slot i starts (i + phase) / bs of the way into its request (one request of all rows, where no context was
        # recorded: spread along it): a steady batch's requests are at every stage of their text, not all at their
        # start. Another ``start`` moves every slot to the next request and to another stage (a golden-ratio
        # phase: starts spread evenly, whatever their number).
        phase = (start * GOLDEN) % 1.0
        starts, ends = pools.span(self._request)
        self._position = starts + ((np.arange(bs) + phase) * (ends - starts + 1) // bs).astype(np.int64)

    def rows(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """``(log_conf [bs, width], accepted [bs])``: each slot's request's row at its position."""
        if width == 0:
            return np.zeros((self.bs, 0)), np.zeros(self.bs, dtype=np.int64)
        rows = self.row_index(width)
        conf, accepted = self._pools.pool(width)
        return conf[rows], accepted[rows]

    def row_index(self, width: int) -> np.ndarray:
        """Each slot's row of ``pool(width)``: its request's last row recorded at or before the slot's position
        (the request's first where none is)."""
        return self._pools.row_at(width, self._request, self._position)

    def advance(self, emitted: np.ndarray) -> None:
        """Each slot emitted ``emitted[i]`` tokens; a slot past its request's last row starts the next request."""
        pools = self._pools
        self._position = self._position + np.asarray(emitted, dtype=np.int64)
        over = self._position > pools.span(self._request)[1]
        if over.any():
            if pools.requests == 1:  # one request of all rows: wrap around it
                first, last = pools.span(0)
                self._position[over] = first + (self._position[over] - first) % (last - first + 1)
            else:
                self._request[over] = (self._request[over] + 1) % pools.requests
                self._position[over] = pools.span(self._request[over])[0]

    def context(self) -> float | None:
        """The batch's mean context (None where the trace recorded none, as synthetic ones do)."""
        return self._pools.context(self._position)


@dataclass(frozen=True)
class Drift:
    """The machine's speed wandering while a policy runs: every cost of a step multiplied by ``factor`` on alternate
    stretches of ``period`` steps (the first stretch at speed), and by a mean-one lognormal of spread ``jitter``,
    drawn anew each step (``seed``). This box ran ~1.5x slower for an hour and back (docs/results/floor): a policy
    that compares widths measured at different moments must not take the machine's moods for the widths' worth. And
    its steps scatter: live at bs 64 a width's pure cycles spread 13-31 % about their mean, so a live policy
    needs cycles to tell widths 5-10 % apart, where a replay without jitter tells them apart in a few (and does not
    see what exploring costs). Every policy, the oracles included, meets the same stretches and draws at the same
    steps."""

    factor: float = 1.0
    period: int = 1
    jitter: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.period < 1:
            raise ValueError("a drift needs factor > 0 and period >= 1 steps")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("a jitter is a lognormal's spread, in [0, 1]")

    def __call__(self, step: int) -> float:
        stretch = self.factor if (step // self.period) % 2 else 1.0
        return stretch * (_jittered(self.jitter, self.seed, step) if self.jitter else 1.0)

    def __str__(self) -> str:
        parts = []
        if self.factor != 1.0:
            parts.append(f"every cost {self.factor:g}x on alternate stretches of {self.period} steps")
        if self.jitter:
            parts.append(f"each step's every cost times a lognormal of spread {self.jitter:g} (seed {self.seed})")
        return "; ".join(parts) or "steady"


@functools.lru_cache(maxsize=4)
def _draws(seed: int) -> np.ndarray:
    """Standard normals, one per step (a cell walks fewer than ``JITTER_STEPS``; past them they repeat)."""
    return np.random.default_rng(seed).standard_normal(JITTER_STEPS)


def _jittered(sigma: float, seed: int, step: int) -> float:
    """A mean-one lognormal factor of spread ``sigma``, the same for every policy at ``step``."""
    return math.exp(sigma * float(_draws(seed)[step % JITTER_STEPS]) - 0.5 * sigma * sigma)


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


def pooled(cells: list[Cell]) -> Cell:
    """One policy's replays from several starts (``Pools.walk``) as one cell: their sums, so its rate is over all
    of them, with each start's rate in ``extra["by_start"]`` (what a comparison pairs: two policies from one start
    meet the same requests) and the first start's ``extra`` besides (``converged_at_step`` becomes each start's)."""
    first = cells[0]
    ms = sum(c.ms for c in cells)
    widths: Counter[int] = Counter()
    for c in cells:
        widths.update(c.widths)
    predicted = None if any(c.predicted_tokens_per_s is None for c in cells) or ms <= 0 else \
        sum(c.predicted_tokens_per_s * c.ms for c in cells if c.predicted_tokens_per_s is not None) / ms
    extra = {**first.extra, "by_start": [round(c.tokens_per_s, 3) for c in cells]}
    if "converged_at_step" in first.extra:
        extra["converged_at_step"] = [c.extra.get("converged_at_step") for c in cells]
    return Cell(first.policy, first.bs, sum(c.steps for c in cells), sum(c.tokens for c in cells), ms,
                dict(sorted(widths.items())), sum(c.verified_drafts for c in cells), sum(c.drafted for c in cells),
                predicted, extra)


def run_cell(policy: Policy, bs: int, pools: Pools, cost: CostModel, steps: int, warmup: int,
             clock: SimClock | None = None, none: bool = False, drift: Drift | None = None, start: int = 0) -> Cell:
    """Replay ``warmup + steps`` steps; the figures count the last ``steps`` (steady state).
    ``none``: no speculation, an engine without a drafter (every step costs ``cost.none``); ``drift``: the
    machine's speed over the steps (None: steady); ``start``: where in the trace the walk starts (``Pools.walk``)."""
    clock = clock or SimClock()
    begin = getattr(policy, "begin", None)
    decides = getattr(policy, "decides", False)  # pays D-Cut's host work (CostModel.host_ms)
    kept = np.zeros(bs, dtype=np.int64)
    true = np.zeros(bs, dtype=np.int64)
    width_prev, last = 0, None
    tokens = ms = 0.0
    widths: Counter[int] = Counter()
    verified = drafted = 0
    step_ms = 0.0
    walk = pools.walk(bs, start)
    for n in range(warmup + steps):
        slow = 1.0 if drift is None else drift(n)
        accepted = np.minimum(true, kept)
        emitted = bs + int(accepted.sum())
        walk.advance(1 + accepted)
        context = walk.context()
        if n:  # what this step's verification shows, before the next width is chosen (as in the engine)
            last = Verified(width_prev, kept, accepted, step_ms)
        if begin is not None:
            begin(bs, kept, context)
        if none:
            verify_ms, draft_ms, w = slow * cost.none(bs, context), 0.0, 0
        else:
            verify_ms = slow * cost.verify(bs, bs + int(kept.sum()), context)
            clock.advance(verify_ms)
            w = policy.width(bs, last)
            draft_ms = slow * cost.draft(bs, w)
            clock.advance(draft_ms)
        conf, true = walk.rows(w)
        new_kept = np.asarray(policy.keep(conf), dtype=np.int64)  # at width 0 too: an engine's hooks run every step
        host_ms = cost.host_ms(bs, w) if decides else 0.0
        step_ms = verify_ms + draft_ms + slow * (cost.overhead(emitted) + host_ms)
        clock.advance(step_ms - verify_ms - draft_ms)  # (the runner times its hooks' work in the gap, as in an engine)
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
        # Modes that choose what to verify spend host time on it each step (``CostModel.host_ms``); ``full`` verifies
        # everything, as vLLM's own speculation does.
        self.decides = settings.mode != "full"
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
        self.runner.settle()  # the steps still held
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


@dataclass
class _Option:
    """One width at one step of a walk: per verify budget B, the tokens and ms a picker believes, what they truly
    are, and (``emitted(B)``) what each slot truly emits."""

    tokens: np.ndarray
    ms: np.ndarray
    true_tokens: np.ndarray
    true_ms: np.ndarray
    emitted: Callable[[int], np.ndarray]


def oracle(bs: int, pools: Pools, cost: CostModel, steps: int, warmup: int, drift: Drift | None = None,
           start: int = 0) -> Cell:
    """The best any policy could do on these requests: knowing each request's true acceptance at every width,
    draft the width that pays best and verify only drafts that will be accepted (all of them, or fewer where the
    cost table's steps make the last few dearer than they are worth; the first drafts of each request first).

    Width 0 costs the cheaper of a ``none`` step (no drafter) and a width-0 step, so the oracle is at least
    ``none``. Each step is priced at its context, as the policies' are.
    """
    widths = [0, *pools.widths]

    def options(walk: Walk) -> list[_Option]:
        context = walk.context()
        zero = min(cost.none(bs, context), cost.verify(bs, bs, context) + cost.draft(bs, 0))
        out = []
        for w in widths:
            accepted = walk.rows(w)[1]
            tokens = bs + np.arange(int(accepted.sum()) + 1, dtype=np.float64)
            verify = _verify(cost, bs, tokens.astype(np.int64), context)
            ms = (np.full_like(tokens, zero) if w == 0 else verify + cost.draft(bs, w)) + cost.overhead(tokens)
            out.append(_Option(tokens, ms, tokens, ms, lambda b, a=accepted: 1 + _first_drafts_first(a, b)))
        return out

    return _walked_best("oracle", bs, pools, widths, steps, warmup, options, drift, start)


def confidence_oracle(bs: int, pools: Pools, cost: CostModel, steps: int, warmup: int,
                      drift: Drift | None = None, start: int = 0) -> Cell:
    """The best a policy deciding on the drafter's confidences could do: each step it sees every width's drafts
    with their confidences calibrated in hindsight (per width, position and confidence bin, fitted on the whole
    trace: ``dcut.calibration.Calibrator``), drafts the width and keeps the global top-B that maximise expected
    tokens over time, and gets what those drafts truly yield.

    It knows more than a deployable policy (every width's drafts of this step before drafting one, a calibration
    fitted on the outcomes it is judged on) and less than the ``oracle`` (not which drafts verification accepts):
    the ceiling of what D-Cut's signals can buy, where the oracle is the ceiling of anything.
    """
    from dcut.calibration import Calibrator
    from dcut.selection import prefix_scores

    scored = {}  # per width: every pool row's calibrated prefix scores
    for w in pools.widths:
        conf, accepted = pools.pool(w)
        c = Calibrator(w, prior=0.0)
        c.update(conf, np.full(len(accepted), w), accepted)
        scored[w] = prefix_scores(c.calibrate(conf))
    widths = [0, *pools.widths]

    def options(walk: Walk) -> list[_Option]:
        context = walk.context()
        zero = min(cost.none(bs, context), cost.verify(bs, bs, context) + cost.draft(bs, 0))
        tokens = np.full(1, float(bs))
        ms = np.full(1, zero) + cost.overhead(tokens)
        out = [_Option(tokens, ms, tokens, ms, lambda b: np.ones(bs, dtype=np.int64))]
        for w in widths[1:]:
            rows = walk.row_index(w)
            accepted = pools.pool(w)[1][rows]
            scores = scored[w][rows].reshape(-1)
            order = np.argsort(-scores, kind="stable")  # the global top-B for every B: a prefix of each request
            expected = bs + np.concatenate([[0.0], np.cumsum(scores[order])])
            hit = (order % w) < accepted[order // w]  # the draft is one verification accepts
            true = bs + np.concatenate([[0.0], np.cumsum(hit)])
            base = _verify(cost, bs, bs + np.arange(bs * w + 1, dtype=np.int64), context) + cost.draft(bs, w)

            def emitted(b: int, order: np.ndarray = order, accepted: np.ndarray = accepted, w: int = w) -> np.ndarray:
                return 1 + np.minimum(np.bincount(order[:b] // w, minlength=bs), accepted)

            out.append(_Option(expected, base + cost.overhead(expected), true, base + cost.overhead(true), emitted))
        return out

    return _walked_best("oracle-conf", bs, pools, widths, steps, warmup, options, drift, start)


def _verify(cost: CostModel, bs: int, tokens: np.ndarray, context: float | None) -> np.ndarray:
    verify = cost.table.lookup_many(bs, tokens, context)
    if verify is None:
        raise ValueError(f"cost model {cost.name} does not cover batch size {bs}")
    return verify


def _first_drafts_first(accepted: np.ndarray, budget: int) -> np.ndarray:
    """Per slot, how many of its accepted drafts the first ``budget`` take, every slot's first draft before any
    slot's second."""
    _, slot = np.nonzero(np.arange(int(accepted.max(initial=0)))[:, None] < accepted[None, :])
    return np.bincount(slot[:budget], minlength=len(accepted))


def _walked_best(name: str, bs: int, pools: Pools, widths: list[int], steps: int, warmup: int,
                 options: Callable[[Walk], list[_Option]], drift: Drift | None = None, start: int = 0,
                 rounds: int = 30) -> Cell:
    """Maximise believed tokens over ms along a walk: Dinkelbach's iteration, each round walking from the start and
    taking at every step the (width, budget) with the most ``tokens - rate * ms`` at the last round's rate, until
    the rate holds still. A pick moves the slots on by what it truly emits, so the path follows the picks. The
    cell counts the last ``steps`` steps, at what the picks truly yield; ``drift`` slows the steps it names, and the
    oracle knows it."""
    rate, cell = 0.0, None
    for _ in range(rounds):
        walk = pools.walk(bs, start)
        believed = np.zeros(2)
        tokens = ms = 0.0
        hist: Counter[int] = Counter()
        verified = drafted = 0
        for n in range(warmup + steps):
            slow = 1.0 if drift is None else drift(n)
            opts = options(walk)
            gain = [o.tokens - rate * slow * o.ms for o in opts]
            j = max(range(len(opts)), key=lambda i: float(gain[i].max()))
            b = int(np.argmax(gain[j]))
            o = opts[j]
            if n >= warmup:
                believed += (o.tokens[b], slow * o.ms[b])
                tokens, ms = tokens + float(o.true_tokens[b]), ms + slow * float(o.true_ms[b])
                hist[widths[j]] += 1
                verified, drafted = verified + b, drafted + bs * widths[j]
            walk.advance(o.emitted(b))
        cell = Cell(name, bs, steps, tokens, ms, dict(sorted(hist.items())), verified, drafted)
        new = float(believed[0] / believed[1])
        if math.isclose(new, rate, rel_tol=1e-9):
            break
        rate = new
    assert cell is not None
    return cell

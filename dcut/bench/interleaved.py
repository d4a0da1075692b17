"""An interleaved live comparison (``dcut compare``): modes ranked only where their intervals separate.

Runs of one mode after another meet different moments of a shared machine (on the 2-core box two
runs of one cell differed by 2x). Here every engine is built first and kept; at each batch size,
repeat after repeat, every mode runs once in a freshly shuffled order, so drift hits every mode
alike. Each cell is the median of its repeats with a 95% bootstrap interval; each mode is compared
with ``joint`` by the paired ratio of its repeats (same round, same prompts), and the verdict is
faster or slower only where the ratio's interval excludes 1.

Two kinds of traffic (``TRAFFIC``):

- ``steady`` (the default): concurrency held at b, as a server under load holds it. ``steady_requests(b)``
  requests, a new one admitted the moment one finishes: ``BURN_IN`` waves of b, then ``WAVES`` waves (and at
  least ``MIN_WINDOW`` requests) admitted inside the window. The cell's rate is the tokens emitted from the step
  that gives the first request after the burn-in its first token to the step that gives the last request its
  first, over that time. Both ends are the same moment of a prefill (one just done, in admission order, which is
  the scheduler's), so the window holds the same prefills in every mode, however its scheduler chunks them.
  Windows bounded by finishes did not: where a speculative engine's token budget (room kept for every running
  request's drafts) chunked prefills finer, the next wave's first prefills fell inside its window and not inside
  plain decoding's (width 0 pinned measured 0.93x plain decoding with decode steps 3 % dearer).
  The window must also hold what a server long under load holds: prompts in the proportion they are admitted
  (one per request's tokens), and in flight the prompts that hold slots longest. A burst of b prompts started
  together has neither, so:
  - the first wave's lengths are staggered (request i of b gets (i + 1) / b of the tokens, ``first_wave``), so
    it finishes evenly over one request's life. Started as one length, plain decoding's requests finished
    together for good, and every wave was prefilled at once;
  - the window opens after a burn-in of ``BURN_IN`` waves, long enough for slow prompts to gather in the slots.
  Opened on the second wave of a first wave of one length and closed on the third wave's first prefill, the
  window favoured speculation where prompts accept unevenly (in flight: one of each prompt, the fast ones
  over-counted) and held a quarter more prefills per token than a server does where they finish unevenly (the
  third wave starts on the second's first finish, its fastest request's). Live at bs 64 (deep pair, width 2
  pinned, 2026-12-05) it measured width 2 at 0.87-0.89x plain decoding; a window of ten waves, 0.92-0.96x. On an
  engine of prompts at 1-16 tokens a step it measured 1.04-1.56x a hundred waves at bs 16-64, the window here
  0.98-1.01x (``tests/unit/test_interleaved.py``).
  The window holds at least ``MIN_WINDOW`` admissions because greedy requests are the same in every repeat:
  a window of a few requests measures those prompts, and repeats cannot average them out. Three waves at bs 4 on
  the MoE pair (12 requests, 4 admitted in the window) put `full` at 1,373 tok/s and `joint` at 1,419 against
  `none`'s 1,682; sixteen waves (56 admitted) put them at 1,778 / 1,756 / 1,679. The short window was half held by
  prompts 3 and 4, whose first 24-27 steps accepted no draft.
- ``batch``: ``max(b, 8)`` prompts decoded b at a time, each batch to its last token; the rate is all
  tokens over the wall time. A fixed batch drains: with speculation requests finish at different steps
  and the last ones run at a batch size far below b (a ramp and a tail that steady traffic does not have).

Every cell runs after one untimed warm-up of the same shape (a closed batch).

Sampling (``SAMPLING``): ``greedy`` (temperature 0, every output checked against ``none``'s), ``sampled`` (every
request at temperature 1, the OpenAI default, unseeded as a client that sets nothing: a seeded one would be decoded
plainly under D-Cut, ``dcut.speculation``) or ``mixed`` (every other request of each kind, so each batch holds both
and an engine's learned state sees both, as a server's does; the greedy half still checked against ``none``).

Arms a user would run instead of D-Cut: ``none`` (no drafter), ``vllm`` (vLLM's own speculation, every draft
verified, no D-Cut hooks in the engine) and ``vllm-dynamic`` (the same with vLLM's per-batch-size K from the
schedule). ``full`` and ``dynamic`` are those with D-Cut in mode full: what its hooks cost, counted.

Build order. Engines share one process, and an engine's place in it might move its rate: two identical plain
engines, built one after the other, once ran the second at 0.972x the first at bs 1 (paired, 5 repeats, interval
0.94-1.02), about the 3 % the width-0 floor is judged on. So the engines are built in an order shuffled by the seed
(``build_order="shuffled"``, recorded), not always in the order the modes are named; ``given`` builds them as named,
for a balanced design such as ``none,joint-w0,joint-w0#2,none#2`` (A B B A, ``make compare-floor``), whose floor is
also reported over both engines of each mode. A copy ``mode#N`` is one more engine of ``mode``, an arm of its own;
beside ``none`` it is the control that measures placement (in the A B B A run of 2026-12-03, ``none#2`` built
fourth ran at 0.975-1.013x ``none`` built first, paired, no interval excluding 1: no placement effect seen).
"""

from __future__ import annotations

import random
import re
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from dcut.bench.breakdown import PARTS, StepBreakdown
from dcut.bench.generate import _build_engine, dynamic_settings, settings_for_mode, token_ids_sha256, unknown_mode
from dcut.machine import machine_info, provenance
from dcut.memory import on_this_gpu
from dcut.settings import EngineSettings

TRAFFIC = ("steady", "batch")
BURN_IN = 2  # steady traffic: waves of requests before the window (module docstring: why)
WAVES = 3  # steady traffic: the window's admissions, in units of the batch size (and MIN_WINDOW at least)
COMPARE_MODES = ("none", "none-sync", "vllm", "vllm-dynamic", "full", "dynamic", "joint", "joint-w0", "joint-blind",
                 "joint-noshift", "joint-mixed")
# what the requests sample with: module docstring, sampling
SAMPLING = ("greedy", "sampled", "mixed")
SAMPLED_TEMPERATURE = 1.0  # the OpenAI API's default
SAMPLING_SAID = {"greedy": "greedy", "sampled": "every request sampled", "mixed": "every other request sampled"}
# joint with one of its mechanisms off: what that mechanism is worth
JOINT_VARIANTS = {"joint-blind": {"context_cost": False}, "joint-noshift": {"speed_shift": None},
                  "joint-mixed": {"count_mixed_steps": True}}
PINNED = re.compile(r"joint-w(\d+)")  # joint pinned to one width: joint-w0 is the floor, joint-w3 a fixed width
# a second (third...) engine of a mode, built and run as one more arm: ``none#2`` against ``none`` measures what an
# engine's place in the process alone does (module docstring: build order)
COPY = re.compile(r"(.+)#(\d+)")
BUILD_ORDERS = ("shuffled", "given")
MIN_PROMPTS = 8
MIN_WINDOW = 32  # steady traffic: requests admitted inside the window, at least (module docstring: why)
# steady traffic's window, as a report says it: "staggered" since the first wave's lengths are staggered and the
# window ends at the last admission (``_steady``), "first tokens" when it was bounded by prefills but began with a
# wave of one length, and "finishes" in records from before (no "window" field)
WINDOWS = {"staggered": "first token of the first request after the burn-in to that of the last request admitted; "
                        "the first wave's lengths staggered (1/b to b/b of the tokens)",
           "first tokens": "first token of the request admitted on the first finish to that of the request the "
                           "last wave starts with",
           "finishes": "batch size-th finish to the finish that admits the last request"}
BOOTSTRAP = 2000


@dataclass(frozen=True)
class Sampling:
    """What each request of a run samples with: ``kind`` greedy (every request at temperature 0), sampled (every
    one at ``SAMPLED_TEMPERATURE``, unseeded, as a client that sets nothing) or mixed (every other request, so that
    every batch holds both and an engine learns from both)."""

    kind: str
    greedy: Any  # vLLM SamplingParams at temperature 0
    sampled: Any  # the same at SAMPLED_TEMPERATURE

    @classmethod
    def only(cls, params: Any) -> Sampling:
        """Every request with ``params``."""
        return cls("greedy", params, params)

    def is_greedy(self, i: int) -> bool:
        return self.kind == "greedy" or (self.kind == "mixed" and i % 2 == 0)

    def of(self, i: int) -> Any:
        """Request ``i``'s sampling parameters."""
        return self.greedy if self.is_greedy(i) else self.sampled

    def greedy_sha256(self, token_ids: list[list[int]]) -> str | None:
        """The hash of the greedy requests' outputs (None when none is greedy): what must equal ``none``'s."""
        greedy = [ids for i, ids in enumerate(token_ids) if self.is_greedy(i)]
        return token_ids_sha256(greedy) if greedy else None


@dataclass(frozen=True)
class Arm:
    """One engine of the comparison."""

    name: str
    settings: EngineSettings


def base_mode(mode: str) -> str:
    """``none#2`` -> ``none``: the mode a copy is an engine of."""
    copy = COPY.fullmatch(mode)
    return copy.group(1) if copy else mode


def arms_for(base: EngineSettings, modes: list[str], schedule: list[tuple[int, int, int]] | None) -> list[Arm]:
    """``none`` (no speculation: no drafter, vLLM's default asynchronous scheduling), ``none-sync`` (no drafter,
    synchronous scheduling, as every speculative engine here runs: a diagnostic of the floor), ``full`` (every
    draft verified: D-Cut in mode full), ``dynamic`` (vLLM's per-batch-size K, from ``schedule``, every draft
    verified), ``joint`` (D-Cut as shipped), ``joint-w0`` (joint pinned to width 0: the floor; ``joint-wN`` pins
    width N), ``joint-blind`` (joint deciding at the profiled context, not the batch's: what the context axis
    changes), ``joint-noshift`` (joint never noticing the machine change speed: what ``speed_shift`` is worth),
    ``joint-mixed`` (joint measuring widths on the steps that also prefilled too: ``count_mixed_steps``); all
    built by ``dcut.bench.generate``'s ``settings_for_mode`` / ``dynamic_settings``, as ``dcut
    sweep`` builds them. ``mode#N`` is another engine of ``mode``."""
    arms = []
    for name in modes:
        mode = base_mode(name)
        if mode in ("dynamic", "vllm-dynamic"):
            s = dynamic_settings(base, schedule or [])
            s = s if mode == "dynamic" else s.model_copy(update={"dcut": None})
        elif mode == "vllm":  # what a user runs instead: vLLM's own speculation, no D-Cut hooks in the engine
            s = settings_for_mode("full", base).model_copy(update={"dcut": None})
        elif (pinned := PINNED.fullmatch(mode)) is not None:
            s = settings_for_mode("joint", base)
            assert s.dcut is not None
            s = s.model_copy(update={"dcut": s.dcut.model_copy(update={"widths": [int(pinned.group(1))]})})
        elif mode in JOINT_VARIANTS:
            s = settings_for_mode("joint", base)
            assert s.dcut is not None
            s = s.model_copy(update={"dcut": s.dcut.model_copy(update=JOINT_VARIANTS[mode])})
        elif mode == "none-sync":
            s = settings_for_mode("none", base).model_copy(update={"async_scheduling": False})
        elif mode in ("none", "full", "joint"):
            s = settings_for_mode(mode, base)
        else:
            raise ValueError(unknown_mode(mode, COMPARE_MODES))
        arms.append(Arm(name, s))
    return arms


def bootstrap_median(values: list[float], rng: np.random.Generator) -> tuple[float, float, float]:
    """Median and its 95% bootstrap interval."""
    data = np.asarray(values, dtype=np.float64)
    medians = np.median(rng.choice(data, size=(BOOTSTRAP, len(data)), replace=True), axis=1)
    return float(np.median(data)), float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def verdict(low: float, high: float, against: str = "joint") -> str:
    """Of a ratio other/``against``: ``joint faster`` where the whole interval is below 1, and so on."""
    if high < 1.0:
        return f"{against} faster"
    if low > 1.0:
        return f"{against} slower"
    return "within noise"


def compare(base: EngineSettings, modes: list[str], batch_sizes: list[int], prompts: list, max_tokens: int,
            repeats: int, schedule: list[tuple[int, int, int]] | None = None, seed: int = 0,
            traffic: str = "steady", breakdown: bool = False, build_order: str = "shuffled",
            sampling: str = "greedy") -> dict[str, Any]:
    """Build every arm's engine (in ``build_order``: module docstring), then run the interleaved rounds; the record
    the report is made of. ``breakdown``: also time the parts of each engine step in the timed runs
    (``dcut.bench.breakdown``)."""
    if traffic not in TRAFFIC:
        raise ValueError(f"traffic {traffic!r}: choose from {', '.join(TRAFFIC)}")
    if build_order not in BUILD_ORDERS:
        raise ValueError(f"build order {build_order!r}: choose from {', '.join(BUILD_ORDERS)}")
    if sampling not in SAMPLING:
        raise ValueError(f"sampling {sampling!r}: choose from {', '.join(SAMPLING)}")
    from vllm import LLM, SamplingParams

    from dcut.vllm.engine import engine_kwargs

    # No prefix caching in any arm (EngineSettings.prefix_caching says why): every repeat sends the same prompts.
    base = base.model_copy(update={"max_num_seqs": max(batch_sizes), "prefix_caching": False})
    arms = arms_for(base, modes, schedule)
    shares = on_this_gpu([(a.name, a.settings) for a in arms])  # one GPU, several engines: dcut.memory, before any
    arms = [Arm(a.name, s) for a, s in zip(arms, shares, strict=True)]
    order_rng, boot = random.Random(seed), np.random.default_rng(seed)
    builds = list(arms)
    if build_order == "shuffled":
        order_rng.shuffle(builds)
    engines = {}
    for arm in tqdm(builds, desc="building engines", unit="engine"):
        start = time.perf_counter()
        engines[arm.name] = (_build_engine(LLM, engine_kwargs(arm.settings)), time.perf_counter() - start)
    params = Sampling(sampling, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                      SamplingParams(max_tokens=max_tokens, temperature=SAMPLED_TEMPERATURE, ignore_eos=True))
    bar = tqdm(total=len(batch_sizes) * repeats * len(arms), desc="interleaved", unit="run")
    timers = StepBreakdown() if breakdown else None
    with timers or nullcontext():
        runs, stats = _rounds(engines, arms, batch_sizes, prompts, repeats, params, traffic, order_rng, timers, bar)
    bar.close()
    cells, comparisons, controls = _summaries(runs, arms, batch_sizes, boot)
    for c in cells:
        c.update(stats.get((c["mode"], c["bs"]), {}))
    return {"machine": machine_info(), **provenance(), "engine": base.model_dump(mode="json"),
            "modes": [a.name for a in arms],
            "batch_sizes": batch_sizes, "max_tokens": max_tokens, "repeats": repeats, "seed": seed,
            "traffic": traffic, "sampling": sampling,
            "sampled_temperature": SAMPLED_TEMPERATURE if sampling != "greedy" else None,
            "waves": WAVES if traffic == "steady" else None,
            "burn_in": BURN_IN if traffic == "steady" else None,
            "min_window": MIN_WINDOW if traffic == "steady" else None,
            "window": "staggered" if traffic == "steady" else None,
            "schedule": schedule, "build_order": [a.name for a in builds],
            "startup_s": {name: round(s, 1) for name, (_, s) in engines.items()},
            "cells": cells, "comparisons": comparisons, "controls": controls, "runs": runs}


def _rounds(engines: dict[str, tuple[Any, float]], arms: list[Arm], batch_sizes: list[int], prompts: list,
            repeats: int, params: Sampling, traffic: str, order_rng: random.Random, timers: StepBreakdown | None,
            bar: tqdm) -> tuple[list[dict[str, Any]], dict[tuple[str, int], dict[str, Any]]]:
    """Per batch size: a warm-up per arm, then ``repeats`` rounds of every arm in shuffled order. Every timed run,
    and per (arm, batch size) what is known after its last round: a D-Cut arm's engine figures and, with ``timers``,
    its step parts."""
    from dcut.vllm.api import read_snapshot, reset_stats

    runs: list[dict[str, Any]] = []
    stats: dict[tuple[str, int], dict[str, Any]] = {}
    for bs in batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(max(bs, MIN_PROMPTS))]
        for arm in arms:  # warm-up: shapes first seen, D-Cut learning this batch size
            llm = engines[arm.name][0]
            _decode(llm, batch, bs, params)
            if arm.settings.with_dcut:
                reset_stats(llm)
        for r in range(repeats):
            order = list(arms)
            order_rng.shuffle(order)
            for position, arm in enumerate(order):
                llm = engines[arm.name][0]
                if timers is not None:
                    timers.measuring(f"{arm.name}/{bs}")
                if traffic == "steady":
                    token_ids, tokens, wall = _steady(llm, prompts, bs, steady_requests(bs), params)
                else:
                    start = time.perf_counter()
                    token_ids = _decode(llm, batch, bs, params)
                    wall = time.perf_counter() - start
                    tokens = sum(map(len, token_ids))
                if timers is not None:
                    timers.measuring(None)
                runs.append({"mode": arm.name, "bs": bs, "repeat": r, "position": position, "wall_s": wall,
                             "tokens_per_s": tokens / wall, "token_ids_sha256": params.greedy_sha256(token_ids)})
                bar.update()
        for arm in arms:
            figures = stats[(arm.name, bs)] = {} if timers is None else {"step_ms": timers.per_step(f"{arm.name}/{bs}")}
            snap = read_snapshot(engines[arm.name][0]) if arm.settings.with_dcut else None
            if snap is not None:
                figures.update(width_histogram=snap.window.width_histogram, mean_keep_ratio=snap.window.mean_keep_ratio,
                               mean_accepted_length=snap.window.mean_accepted_length,
                               width_realized=snap.width_realized, speed_shifts=snap.speed_shifts)
    return runs, stats


def _decode(llm: Any, batch: list, bs: int, params: Sampling) -> list[list[int]]:
    """``batch`` decoded ``bs`` prompts at a time; every request's token ids, in order."""
    out = []
    for start in range(0, len(batch), bs):
        chunk = range(start, min(start + bs, len(batch)))
        out += [list(o.outputs[0].token_ids) for o in llm.generate([batch[i] for i in chunk],
                                                                   [params.of(i) for i in chunk], use_tqdm=False)]
    return out


def _shifts_at(figures: dict[str, Any], bs: int) -> int:
    """A joint arm's speed shifts noticed at bucket ``bs`` (snapshot keys are ints, or strings once through JSON)."""
    return {str(k): v for k, v in (figures.get("speed_shifts") or {}).items()}.get(str(bs), 0)


def _realized_at(width_realized: dict[str, dict[str, float]], bs: int) -> str:
    """``width_realized`` entries of bucket ``bs`` (keys ``"bucket/width"``): realized / predicted (cycles), and a
    cycle's tokens in its ms, realized / predicted, where the snapshot has them."""
    found = sorted((int(k.split("/")[1]), v) for k, v in width_realized.items() if k.split("/")[0] == str(bs))
    return ", ".join(f"width {w}: {v['tokens_per_s']:.0f} / {v['predicted_tokens_per_s']:.0f} ({v['samples']:.0f}"
                     + (f"; {v['tokens']:.1f} / {v['predicted_tokens']:.1f} tokens in {v['ms']:.1f} / "
                        f"{v['predicted_ms']:.1f} ms" if "ms" in v else "") + ")"
                     for w, v in found)


def steady_requests(bs: int) -> int:
    """Requests in a steady-traffic cell at ``bs``: ``BURN_IN`` waves before the window, then ``WAVES`` waves and
    ``MIN_WINDOW`` requests at least admitted inside it."""
    return window_start(bs) + 1 + max(WAVES * bs, MIN_WINDOW)


def window_start(bs: int) -> int:
    """The request whose first token opens a steady-traffic window: the first of the wave after the burn-in."""
    return BURN_IN * bs


def _steady(llm: Any, prompts: list, bs: int, requests: int, params: Sampling) -> tuple[list[list[int]], int, float]:
    """``requests`` prompts (cycling ``prompts``) with ``bs`` in flight, one admitted as one finishes: every
    request's token ids in order, and the tokens emitted and seconds from the step that gives request
    ``window_start(bs)`` its first token to the one that gives the last request its first: the window of steady
    concurrency, bounded by prefills in admission order so that every mode's holds the same ones, after a burn-in
    begun with a first wave of staggered lengths (``first_wave``) so that it holds them, and the prompts in flight,
    in a server's proportions (``dcut.bench.interleaved`` says why)."""
    from vllm.sampling_params import RequestOutputKind

    first = window_start(bs)
    if requests <= first + 1:
        raise RuntimeError(f"no window of steady concurrency: {requests} requests at bs {bs} (need more than "
                           f"{first + 1})")
    engine = llm.llm_engine
    def delta(kind: Any) -> Any:
        kind = kind.clone()
        kind.output_kind = RequestOutputKind.DELTA
        return kind

    deltas = Sampling(params.kind, delta(params.greedy), delta(params.sampled))
    out: list[list[int]] = [[] for _ in range(requests)]
    admitted = tokens = 0
    start = end = None

    def admit() -> None:
        nonlocal admitted
        request = deltas.of(admitted)
        engine.add_request(f"steady-{admitted}", prompts[admitted % len(prompts)],
                           first_wave(request, admitted, bs) if admitted < bs else request)
        admitted += 1

    while admitted < bs:
        admit()
    while engine.has_unfinished_requests():
        emitted = 0
        for o in engine.step():
            ids = o.outputs[0].token_ids if o.outputs else []
            out[int(o.request_id.split("-")[1])] += ids
            emitted += len(ids)
            if o.finished and admitted < requests:
                admit()
        now = time.perf_counter()
        if start is not None and end is None:
            tokens += emitted
        if start is None and out[first]:
            start = now
        if end is None and out[requests - 1]:
            end = now
    assert start is not None and end is not None
    return out, tokens, end - start


def first_wave(params: Any, i: int, bs: int) -> Any:
    """Request ``i`` of the first wave: ``(i + 1) / bs`` of the tokens, so that the first wave finishes evenly
    over one request's life and every later request is admitted as in a server long under load (module
    docstring: steady, why)."""
    short = params.clone()
    short.max_tokens = max(1, -(-params.max_tokens * (i + 1) // bs))
    return short


def control_of(mode: str) -> str | None:
    """The arm a diagnostic arm is paired with: a copy with its original, width 0 pinned and ``none-sync`` with
    ``none`` (what they are a floor or a control of); None for a rival."""
    if COPY.fullmatch(mode):
        return base_mode(mode)
    return "none" if mode in ("joint-w0", "none-sync") else None


def _summaries(runs: list[dict[str, Any]], arms: list[Arm], batch_sizes: list[int],
               rng: np.random.Generator) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Per cell: median tokens/s with its interval, and whether greedy output matched ``none``'s;
    per (bs, mode): the paired ratio mode/joint with its interval and the verdict; per (bs, diagnostic arm): its
    paired ratio to what it is a control of (``control_of``)."""
    by = {(r["mode"], r["bs"], r["repeat"]): r for r in runs}
    repeats = sorted({r["repeat"] for r in runs})
    names = {a.name for a in arms}

    def rate(modes: list[str], bs: int, r: int) -> float:  # one round's rate of a mode's engines, their mean
        return float(np.mean([by[(m, bs, r)]["tokens_per_s"] for m in modes]))

    def paired(mode: list[str], against: list[str], bs: int) -> tuple[float, float, float]:
        return bootstrap_median([rate(mode, bs, r) / rate(against, bs, r) for r in repeats], rng)

    engines: dict[str, list[str]] = {}  # a mode's engines: itself and its copies
    for a in arms:
        engines.setdefault(base_mode(a.name), []).append(a.name)
    # a floor whose both sides have copies (A B B A) is also measured on all of them: placement averaged out
    pooled = [(m, ref) for m, ref in ((m, control_of(m)) for m in engines) if ref in engines
              and len(engines[m]) > 1 and len(engines[ref]) > 1]

    cells, comparisons, controls = [], [], []
    for bs in batch_sizes:
        # (no hash where no request was greedy: sampled traffic has nothing to compare)
        reference = {r["token_ids_sha256"] for r in runs if r["bs"] == bs and r["mode"] == "none"} - {None}
        for arm in arms:
            rates = [by[(arm.name, bs, r)]["tokens_per_s"] for r in repeats]
            median, low, high = bootstrap_median(rates, rng)
            shas = {by[(arm.name, bs, r)]["token_ids_sha256"] for r in repeats}
            cells.append({"mode": arm.name, "bs": bs, "tokens_per_s": median, "ci95": [low, high],
                          "runs": rates, "identical_to_none": (shas == reference) if reference else None})
        for arm in arms:
            if "joint" in names and arm.name != "joint":
                median, low, high = paired([arm.name], ["joint"], bs)
                comparisons.append({"bs": bs, "mode": arm.name, "ratio_to_joint": median, "ci95": [low, high],
                                    "verdict": verdict(low, high)})
        pairs = [([a.name], [ref]) for a in arms if (ref := control_of(a.name)) in names]
        for mode, against in pairs + [(engines[m], engines[ref]) for m, ref in pooled]:
            median, low, high = paired(mode, against, bs)
            controls.append({"bs": bs, "mode": _label(mode), "against": _label(against), "ratio": median,
                             "ci95": [low, high], "verdict": verdict(low, high, against[0])})
    return cells, comparisons, controls


def _label(engines: list[str]) -> str:
    """An arm's name, or for a mode's engines together ``joint-w0 (2 engines)``."""
    return engines[0] if len(engines) == 1 else f"{engines[0]} ({len(engines)} engines)"


def markdown(record: dict[str, Any]) -> str:
    """Medians with intervals per cell, joint against every other mode, and the floor of width 0."""
    sizes, modes = record["batch_sizes"], record["modes"]
    cell = {(c["mode"], c["bs"]): c for c in record["cells"]}
    head = "| mode | " + " | ".join(f"bs {b}" for b in sizes) + " |\n|---|" + "---|" * len(sizes)
    lines = [f"## Output tokens/s: median [95% bootstrap interval] of {record['repeats']} interleaved repeats", "",
             head]
    for m in modes:
        lines.append(f"| {m} | " + " | ".join(
            f"{cell[(m, b)]['tokens_per_s']:.0f} [{cell[(m, b)]['ci95'][0]:.0f}–{cell[(m, b)]['ci95'][1]:.0f}]"
            for b in sizes) + " |")
    comp = {(c["mode"], c["bs"]): c for c in record["comparisons"]}
    if comp:
        lines += ["", "## Each mode ÷ `joint`, paired by round: median [95% interval], verdict", "", head]
    for m in modes:
        if m == "joint" or not comp:
            continue
        lines.append(f"| {m} | " + " | ".join(
            f"{comp[(m, b)]['ratio_to_joint']:.2f} [{comp[(m, b)]['ci95'][0]:.2f}–{comp[(m, b)]['ci95'][1]:.2f}] "
            f"{comp[(m, b)]['verdict']}" for b in sizes) + " |")
    best = []
    for b in sizes:
        others = [cell[(m, b)]["tokens_per_s"] for m in modes  # diagnostics and joint's variants are not rivals
                  if m != "joint" and control_of(m) is None and not m.startswith("joint-")]
        if others and ("joint", b) in cell:
            best.append(f"bs {b}: {cell[('joint', b)]['tokens_per_s'] / max(others):.3f}")
    if best:
        lines += ["", "`joint`'s median ÷ the best other mode's median: " + ", ".join(best) + "."]
    if "joint-w0" in modes and "none" in modes:
        floor = [f"bs {b}: {cell[('joint-w0', b)]['tokens_per_s'] / cell[('none', b)]['tokens_per_s']:.3f}"
                 for b in sizes]
        lines += ["", "Width 0 pinned (`joint-w0`) ÷ no speculation (`none`), medians: " + ", ".join(floor) + "."]
    control = {(c["mode"], c["bs"]): c for c in record.get("controls", [])}
    if control:
        lines += ["", "## Floors and controls: each ÷ what it is measured against, paired by round: median "
                  "[95% interval], verdict", "", "| arm | " + head[len("| mode | "):]]
        lines += [f"| {m} ÷ {control[(m, sizes[0])]['against']} | " + " | ".join(
            f"{control[(m, b)]['ratio']:.3f} [{control[(m, b)]['ci95'][0]:.2f}–{control[(m, b)]['ci95'][1]:.2f}] "
            f"{control[(m, b)]['verdict']}" for b in sizes) + " |"
            for m in dict.fromkeys(c["mode"] for c in record["controls"])]
    same = all(c["identical_to_none"] in (True, None) for c in record["cells"])
    lines += ["", f"Greedy outputs identical to `none` in every run: **{'yes' if same else 'NO'}**."]
    widths = [f"bs {b}: {j.get('width_histogram')}, speed shifts noticed {_shifts_at(j, b)}"
              for b in sizes if (j := cell.get(("joint", b))) is not None]
    if widths:
        lines += ["", "`joint`'s drafted widths (steps per width, last window) and the changes of speed it noticed "
                  "at the batch size's bucket (over the engine's life):", "", *[f"- {w}" for w in widths]]
    realized = [f"- bs {b}: " + (_realized_at(cell[("joint", b)].get("width_realized") or {}, b) or "–")
                for b in sizes if ("joint", b) in cell]
    if realized:
        lines += ["", "`joint` at each batch size's own bucket, per width: tokens/s realized / predicted "
                  "(cycles measured), the engine's estimates after the cell:", "", *realized]
    lines += _breakdown_tables(cell, sizes, modes)
    m = record["machine"]
    traffic = record.get("traffic", "batch")
    lines += ["", f"Traffic: {traffic} (" + (
        "concurrency held at the batch size, "
        + (f"{record['burn_in']} waves of requests before the window, {record.get('waves')} waves admitted in it"
           if record.get("burn_in") else f"{record.get('waves')} waves of requests per cell")
        + (f" and at least {record['min_window']} admitted in the window" if record.get("min_window") else "")
        + "; rate from the "
        + WINDOWS[record.get("window", "finishes")] if traffic == "steady" else
        "closed batches, each to its last token; rate over the wall time") + ")."]
    built = f"engines built in the order {', '.join(record['build_order'])}" if "build_order" in record else \
        "engines built in the order the modes are named"  # a record from before the shuffled build order
    kind = record.get("sampling", "greedy")
    sampled = f"at temperature {record['sampled_temperature']}" if kind != "greedy" else ""
    lines += ["", f"Machine: {m['cpu']} ({m['cores']} cores), torch {m['torch']}. {record['max_tokens']} tokens per "
              f"request, {SAMPLING_SAID[kind]} {sampled}".rstrip() + f"; seed {record['seed']}; dynamic schedule "
              f"{record['schedule']}; {built}; engine start-up {record['startup_s']} s."]
    return "\n".join(lines) + "\n"


def _breakdown_tables(cell: dict[tuple[str, int], dict[str, Any]], sizes: list[int], modes: list[str]) -> list[str]:
    """Per batch size, each mode's step parts in ms per engine step (``dcut.bench.breakdown``; none unless asked)."""
    lines: list[str] = []
    for b in sizes:
        parts = {m: cell[(m, b)].get("step_ms") or {} for m in modes}
        names = [n for _, _, _, n in PARTS if any(n in p for p in parts.values())]
        if not names:
            continue
        if not lines:
            lines += ["", "## Where a step's time goes: ms per engine step in the timed runs (parts nest: the engine "
                      "step holds all, execute_model the target forward)"]
        lines += ["", f"bs {b}:", "", "| part | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
        lines += [f"| {n} | " + " | ".join(f"{parts[m][n]:.3f}" if n in parts[m] else "–" for m in modes) + " |"
                  for n in names]
    return lines

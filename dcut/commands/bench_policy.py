"""``dcut bench-policy``: how long the D-Cut decision itself takes per engine step.

A third-party port lost 1-2% at low batch size to selection overhead, so
the decision must stay in the tens of microseconds. Times ``select`` on random confidences with a
synthetic cost table shaped like the CPU measurements (a(bs) + 0.6 ms per verify token).

``--step --cold`` evicts the caches before every step, as an engine's forward pass does: in a CPU engine D-Cut's
hooks run at about four times their warm cost (live, deep pair, bs 1: 0.66 ms in ``on_drafted``, where the warm
loop measured 0.22), and what matters there is how many distinct operations a step runs, not their size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from dcut.cli import CommandError
from dcut.cost_table import CostTable, Fingerprint, current_hardware, profile_token_points
from dcut.machine import machine_info, provenance
from dcut.selection import select
from dcut.settings import DCutSettings

HELP = "Median time of one D-Cut selection (reference, continuous) and of D-Cut's whole per-step work."
BATCH_SIZES = (1, 4, 16, 64, 256)
KS = (7, 15)
MODES = ("reference", "continuous")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
    parser.add_argument("--repeats", type=int, default=200, help="Timed calls per case (default 200).")
    parser.add_argument("--step", action="store_true",
                        help="Time D-Cut's whole per-step work in an engine (the runner state's hooks: width "
                             "choice, selection, calibration, stats) instead of the selection alone.")
    parser.add_argument("--cold", action="store_true",
                        help="With --step: evict the CPU caches before each step, as the engine's forward pass does "
                             "(a matrix product over a buffer larger than the last-level cache).")


def synthetic_cost_table(k: int) -> CostTable:
    """Cost like the measured CPU steps: a per-batch base plus 0.6 ms per verify token."""
    fingerprint = Fingerprint(hardware=current_hardware(), model="synthetic", k=k)
    points = {bs: [(t, 20.0 + 0.5 * bs + 0.6 * t, 1) for t in profile_token_points(bs, k)]
              for bs in BATCH_SIZES}
    return CostTable(fingerprint, points)


def time_select(mode: str, bs: int, k: int, repeats: int) -> float:
    """Median microseconds of one ``select`` call (after warm-up, which fills the caches)."""
    generator = torch.Generator().manual_seed(bs * 100 + k)
    log_conf = torch.rand(bs, k, generator=generator).pow(0.3).log().numpy()
    settings, cost = DCutSettings(mode=mode), synthetic_cost_table(k)
    for _ in range(10):
        select(log_conf, settings, cost)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        select(log_conf, settings, cost)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def time_step(mode: str, bs: int, k: int, width: int, repeats: int, cold: bool = False) -> dict[str, float]:
    """Microseconds of D-Cut's hooks for one engine step that verifies ``width`` drafts per request and drafts
    ``width`` more (the calls the vLLM patches make, on synthetic tensors): the median step, and the mean of the
    step and of each hook (means count the accounting every few steps, ``dcut.vllm.state.ACCOUNT_STEPS``)."""
    from dcut.vllm.state import RunnerDCut

    table = synthetic_cost_table(k)
    table.draft = {b: {w: (1.0 + 0.1 * b * w, 1) for w in (0, 1, 3, 7, k)} for b in BATCH_SIZES}
    state = RunnerDCut(DCutSettings(mode=mode, probe_share=0.0), table.fingerprint, k)
    state.cost_table = table
    req_ids = [f"r{i}" for i in range(bs)]
    generator = torch.Generator().manual_seed(bs)
    scheduled = {r: 1 + width for r in req_ids}
    spec = {r: [0] * width for r in req_ids}
    sampled = torch.full((bs, width + 1), -1)
    sampled[:, : 1 + width // 2] = 1
    evict = _cache_evictor() if cold else None
    hooks: list[tuple[float, float, float]] = []
    for step in range(repeats + 10):
        log_conf = torch.rand(bs, width, generator=generator).pow(0.3).log() if width else None
        if evict is not None:
            evict()
        start = time.perf_counter()
        state.begin_step(scheduled, spec)
        state.choose_width(bs, k, req_ids)
        chosen = time.perf_counter()
        state.width = width  # what the step drafts, whatever the estimate says
        state.on_drafted(req_ids, log_conf, sampled if width and step else None, [width] * bs if step else None)
        drafted = time.perf_counter()
        state.cut(req_ids, [[0] * width for _ in req_ids])
        hooks.append((chosen - start, drafted - chosen, time.perf_counter() - drafted))
    hooks = hooks[10:]
    totals = [sum(h) for h in hooks]
    return {"median_us": statistics.median(totals) * 1e6, "mean_us": statistics.mean(totals) * 1e6,
            **{f"{name}_us": statistics.mean(h[i] for h in hooks) * 1e6
               for i, name in enumerate(("choose", "drafted", "cut"))}}


def _cache_evictor() -> Callable[[], None]:
    """What a forward pass does to the caches between two steps: a matrix product over 64 MiB of weights."""
    weights, activations = torch.randn(4096, 4096), torch.randn(4096, 8)

    def evict() -> None:
        weights.mul_(1.0)
        torch.mm(weights, activations)
    return evict


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise CommandError("--repeats must be at least 1")
    if args.cold and not args.step:
        raise CommandError("--cold times the per-step work: give it with --step")
    if args.step:
        cases = [(mode, bs, w) for mode in ("reference", "joint") for bs in (1, 16, 64)
                 for w in ((15,) if mode == "reference" else (0, 7, 15))]
        results = [{"mode": mode, "bs": bs, "k": 15, "width": w, "cold": args.cold,
                    **{key: round(v, 1) for key, v in time_step(mode, bs, 15, w, args.repeats, args.cold).items()}}
                   for mode, bs, w in tqdm(cases, desc="cases", disable=args.json)]
        columns = ("mode", "bs", "width")
    else:
        results = [{"mode": mode, "bs": bs, "k": k, "median_us": round(time_select(mode, bs, k, args.repeats), 1)}
                   for mode in MODES for k in KS for bs in BATCH_SIZES]
        columns = ("mode", "bs", "k")
    if args.json:
        print(json.dumps({"machine": machine_info(), **provenance(), "results": results}))
        return 0
    extra = ("mean_us", "choose_us", "drafted_us", "cut_us") if args.step else ()
    print(f"{columns[0]:<11} {columns[1]:>4} {columns[2]:>5} {'median us':>10}"
          + "".join(f" {c.replace('_us', ' us'):>12}" for c in extra))
    for r in results:
        print(f"{r[columns[0]]:<11} {r[columns[1]]:>4} {r[columns[2]]:>5} {r['median_us']:>10.1f}"
              + "".join(f" {r[c]:>12.1f}" for c in extra))
    if args.step:
        machine = machine_info()
        print(f"{machine['cpu']} x{machine['cores']}; caches {'evicted before each step' if args.cold else 'warm'}; "
              "means include the accounting every few steps")
    return 0

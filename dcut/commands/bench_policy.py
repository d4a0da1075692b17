"""``dcut bench-policy``: how long the D-Cut decision itself takes per engine step.

A third-party port lost 1-2% at low batch size to selection overhead (DESIGN.md section 1), so
the decision must stay in the tens of microseconds. Times ``select`` on random confidences with a
synthetic cost table shaped like the CPU measurements (a(bs) + 0.6 ms per verify token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dcut.cli import CommandError
from dcut.cost_table import CostTable, Fingerprint, current_hardware, profile_token_points
from dcut.machine import machine_info
from dcut.selection import select
from dcut.settings import DCutSettings

HELP = "Median time of one D-Cut selection (auto and continuous) per batch size and K."
BATCH_SIZES = (1, 4, 16, 64, 256)
KS = (7, 15)
MODES = ("auto", "continuous")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
    parser.add_argument("--repeats", type=int, default=200, help="Timed calls per case (default 200).")


def synthetic_cost_table(k: int) -> CostTable:
    """Cost like the measured CPU steps: a per-batch base plus 0.6 ms per verify token."""
    fingerprint = Fingerprint(hardware=current_hardware(), model="synthetic", k=k)
    points = {bs: [(t, 20.0 + 0.5 * bs + 0.6 * t, 1) for t in profile_token_points(bs, k)]
              for bs in BATCH_SIZES}
    return CostTable(fingerprint, points)


def time_select(mode: str, bs: int, k: int, repeats: int) -> float:
    """Median microseconds of one ``select`` call (after warm-up, which fills the caches)."""
    generator = torch.Generator().manual_seed(bs * 100 + k)
    log_conf = torch.rand(bs, k, generator=generator).pow(0.3).log()
    settings, cost = DCutSettings(mode=mode), synthetic_cost_table(k)
    for _ in range(10):
        select(log_conf, settings, cost)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        select(log_conf, settings, cost)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise CommandError("--repeats must be at least 1")
    results = [{"mode": mode, "bs": bs, "k": k, "median_us": round(time_select(mode, bs, k, args.repeats), 1)}
               for mode in MODES for k in KS for bs in BATCH_SIZES]
    if args.json:
        print(json.dumps({"machine": machine_info(), "results": results}))
        return 0
    print(f"{'mode':<11} {'bs':>4} {'K':>3} {'median us':>10}")
    for r in results:
        print(f"{r['mode']:<11} {r['bs']:>4} {r['k']:>3} {r['median_us']:>10.1f}")
    return 0

"""dcut replay: every decision policy on recorded or synthetic traces against cost models, deterministically."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from dcut.cli import CommandError

HELP = "Replay policies (ours, other engines' rules, the oracle) on traces and cost models; write docs/results/replay."


def configure(parser: argparse.ArgumentParser) -> None:
    from dcut.replay.cases import CASES

    parser.add_argument("--case", action="append", choices=sorted(CASES),
                        help="a built-in case (repeatable; default: all of them)")
    parser.add_argument("--trace", help="a custom case: trace .npz file or folder of them (with --costs)")
    parser.add_argument("--costs", help="a custom case: cost model / cost table JSON (with --trace)")
    parser.add_argument("--bs", help="batch sizes of a custom case, e.g. 1,4,16,64 (default: the cost model's)")
    parser.add_argument("--context", type=float, help="a custom case: every step's mean context length instead of "
                        "the trace's (priced where the cost table has a context term)")
    parser.add_argument("--drift", help="FACTOR:STEPS: every case on a machine whose every cost is FACTOR times "
                        "slower on alternate stretches of STEPS steps, e.g. 1.5:150 (default: steady)")
    parser.add_argument("--jitter", type=float, default=0.0, help="SIGMA: every step's every cost times a mean-one "
                        "lognormal of this spread, drawn anew each step (default 0: steady; "
                        "docs/experiments/2026-12-07-replay-jitter)")
    parser.add_argument("--steps", type=int, default=400, help="measured steps per cell (steady state)")
    parser.add_argument("--warmup", type=int, default=100, help="steps replayed before measuring")
    parser.add_argument("--starts", type=int, default=5, help="replay each cell from this many starts in the trace "
                        "(other requests, at other stages) and pool them; a comparison is paired per start")
    parser.add_argument("--no-host-work", action="store_true", help="charge no policy for D-Cut's host work a step "
                        "(the cost models' host term, dcut.replay.host): what the decisions alone are worth")
    parser.add_argument("--out", default="docs/results/replay", help="report folder (replay.json, replay.md, plots)")
    parser.add_argument("--json", action="store_true", help="print the report JSON to stdout too")


def run(args: argparse.Namespace) -> int:
    import torch

    from dcut.replay.cases import CASES, custom_case
    from dcut.replay.write import write_report

    torch.set_num_threads(1)  # tiny tensors; one thread is faster and the figures cannot depend on it
    if args.steps < 1 or args.warmup < 0 or args.starts < 1:
        raise CommandError("--steps and --starts must be >= 1 and --warmup >= 0")
    if (args.trace is None) != (args.costs is None):
        raise CommandError("--trace and --costs go together")
    if args.context is not None and (args.trace is None or args.context < 1):
        raise CommandError("--context is a custom case's (with --trace and --costs), at least 1")
    drift = _drift(args.drift, args.jitter)
    try:
        if args.trace is not None:
            cases = [custom_case(Path(args.trace), Path(args.costs), args.bs, args.context)]
        else:
            cases = [CASES[name]() for name in (args.case or sorted(CASES))]
    except (OSError, ValueError, KeyError) as e:
        raise CommandError(str(e)) from e
    if drift is not None:
        cases = [dataclasses.replace(c, drift=drift) for c in cases]
    if args.no_host_work:
        cases = [dataclasses.replace(c, cost=dataclasses.replace(c.cost, host=None)) for c in cases]
    report = write_report(cases, Path(args.out), args.steps, args.warmup, args.starts)
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


def _drift(text: str | None, jitter: float):  # -> Drift | None (imported here: the command line starts without numpy)
    """``--drift FACTOR:STEPS`` and ``--jitter SIGMA``; None for a steady machine."""
    from dcut.replay.simulate import Drift

    try:
        scatter = Drift(jitter=jitter)  # (``Drift`` bounds the spread)
    except ValueError as e:
        raise CommandError(f"--jitter takes a spread in [0, 1], e.g. 0.15 (got {jitter})") from e
    if text is None:
        return scatter if jitter else None
    factor, _, period = text.partition(":")
    try:
        return Drift(float(factor), int(period), jitter)
    except ValueError as e:
        raise CommandError(f"--drift takes FACTOR:STEPS with FACTOR > 0 and STEPS >= 1, e.g. 1.5:150 (got {text!r})"
                           ) from e

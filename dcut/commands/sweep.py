"""dcut sweep: every mode at every batch size on the same engine settings, in one run."""

from __future__ import annotations

import argparse
from pathlib import Path

from dcut.bench.sweep import REPEATS, SWEEP_MODES, SweepError, sweep
from dcut.cli import CommandError
from dcut.commands.engine_args import add_engine_flags, batch_sizes_and_modes, prompts_and_engine
from dcut.prompts import DEFAULT_PROMPTS

HELP = "Batch-size sweep of none/full/dynamic/per_request/reference/continuous/joint; table, JSON and plots."


def configure(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser)
    parser.add_argument("--bs", default="1,4,8,16,32,64", help="batch sizes")
    parser.add_argument("--modes", default=",".join(SWEEP_MODES),
                        help=f"comma-separated, from {', '.join(SWEEP_MODES)}")
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed runs per cell (median and spread)")
    parser.add_argument("--out", default="docs/experiments/2026-11-29-sweep-dense")


def run(args: argparse.Namespace) -> int:
    sizes, modes = batch_sizes_and_modes(args.bs, args.modes, SWEEP_MODES)
    if args.repeats < 1:
        raise CommandError("--repeats must be >= 1")
    prompts, base = prompts_and_engine(args)
    try:
        record = sweep(base, sizes, modes, prompts, args.max_tokens, Path(args.out), repeats=args.repeats)
    except SweepError as e:
        raise CommandError(f"an engine failed: {e}") from e
    print((Path(args.out) / "sweep.md").read_text())
    print(f"written: {args.out}/sweep.json, sweep.md, speedup.png, cost_table.png ({len(record['results'])} cells)")
    return 0

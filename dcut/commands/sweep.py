"""dcut sweep: every mode at every batch size on the same engine settings, in one run."""

from __future__ import annotations

import argparse
from pathlib import Path

from dcut.cli import CommandError
from dcut.vllm.offline import DEFAULT_PROMPTS, load_prompts

HELP = "Batch-size sweep of none/full/dynamic/fixed-per-request/auto/continuous; table, JSON and plots."


def configure(parser: argparse.ArgumentParser) -> None:
    from dcut.settings import EMBEDDED_MODELS

    dense, dense_draft = EMBEDDED_MODELS["dense"]
    parser.add_argument("--bs", default="1,4,8,16,32,64", help="batch sizes")
    parser.add_argument("--modes", default="none,full,dynamic,fixed-per-request,auto,continuous")
    parser.add_argument("--model", default=dense)
    parser.add_argument("--draft", default=dense_draft)
    parser.add_argument("--method", default="dflash", choices=["dflash", "draft_model"])
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", default="docs/sweep")


def run(args: argparse.Namespace) -> int:
    from loadtest.sweep import SWEEP_MODES, SweepError, sweep

    try:
        sizes = sorted({int(b) for b in args.bs.split(",") if b.strip()})
    except ValueError as e:
        raise CommandError(f"--bs: {e}") from e
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(SWEEP_MODES))
    if unknown or not modes:
        raise CommandError(f"unknown modes {unknown}; choose from {', '.join(SWEEP_MODES)}")
    if not sizes or sizes[0] < 1:
        raise CommandError("--bs must be positive integers")
    for path in (args.model, args.draft):
        if not Path(path).is_dir():
            raise CommandError(f"model folder not found: {path}")
    try:
        load_prompts(args.prompts)
    except (ValueError, FileNotFoundError) as e:
        raise CommandError(str(e)) from e
    engine = ["--model", args.model, "--draft", args.draft, "--method", args.method,
              "--max-model-len", str(args.max_model_len)]
    common = ["--prompts", args.prompts, "--max-tokens", str(args.max_tokens)]
    try:
        record = sweep(engine, args.k, sizes, modes, common, Path(args.out))
    except SweepError as e:
        raise CommandError(f"an engine failed:\n{e}") from e
    print((Path(args.out) / "sweep.md").read_text())
    print(f"written: {args.out}/sweep.json, sweep.md, speedup.png, cost_table.png ({len(record['results'])} cells)")
    return 0

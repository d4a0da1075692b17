"""dcut trace: record replay traces of a pair with a real vLLM engine (every draft verified)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dcut.cli import CommandError
from dcut.commands.engine_args import add_engine_flags, prompts_and_engine
from dcut.prompts import DEFAULT_PROMPTS

HELP = "Record replay traces (confidences and true acceptance per width, step timings) for `dcut replay`."


def configure(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser)
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help=".jsonl ({'prompt': ...}) or .txt")
    parser.add_argument("--batch-sizes", default="1,4,8,16,32,64", help="comma-separated batch sizes")
    parser.add_argument("--trace-widths", default="1,3,7,15", help="widths the engine rotates over")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, help="use only the first N prompts")
    parser.add_argument("--out", required=True, help="output folder (bs<N>.npz per batch size)")


def run(args: argparse.Namespace) -> int:
    from dcut.bench.trace import record

    try:
        sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
        widths = sorted({int(w) for w in args.trace_widths.split(",") if w.strip()})
    except ValueError as e:
        raise CommandError(str(e)) from e
    prompts, settings = prompts_and_engine(args)
    prompts = prompts[: args.limit]
    if not sizes or sizes[0] < 1 or not widths or widths[0] < 1 or args.max_tokens < 1:
        raise CommandError("--batch-sizes, --trace-widths and --max-tokens must be >= 1")
    if any(w > settings.num_speculative_tokens for w in widths):
        raise CommandError(f"--trace-widths must be <= K ({settings.num_speculative_tokens})")
    paths = record(settings, prompts, sizes, args.max_tokens, Path(args.out), widths, pair=args.pair)
    print(json.dumps({"written": [str(p) for p in paths]}))
    return 0

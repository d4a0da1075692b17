"""dcut generate: offline generation on a real vLLM engine, with D-Cut in any mode."""

from __future__ import annotations

import argparse
import json

from dcut.bench.generate import GENERATE_MODES, generate, settings_for_mode
from dcut.cli import CommandError
from dcut.commands.engine_args import add_engine_flags, mode_arg, prompts_and_engine
from dcut.prompts import DEFAULT_PROMPTS
from dcut.settings import DCutSettings

HELP = "Generate offline with vLLM (modes none/full/fixed/reference/continuous/per_request/joint); report the figures."

DEFAULT_MODE = DCutSettings.model_fields["mode"].default


def configure(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser)
    parser.add_argument("--mode", type=mode_arg(GENERATE_MODES), choices=GENERATE_MODES, default=DEFAULT_MODE,
                        help=f"none: no speculation; full: every draft verified; the others: D-Cut's modes "
                        f"(default: {DEFAULT_MODE}, DCutSettings' default)")
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help=".jsonl ({'prompt': ...}) or .txt")
    parser.add_argument("--batch-size", default="8",
                        help="requests decoded together; a comma list runs each on one engine")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        batch_sizes = [int(b) for b in str(args.batch_size).split(",") if b.strip()]
    except ValueError as e:
        raise CommandError(f"--batch-size: {e}") from e
    if not batch_sizes or min(batch_sizes) < 1 or args.max_tokens < 1:
        raise CommandError("--batch-size and --max-tokens must be >= 1")
    prompts, base = prompts_and_engine(args, need_draft=args.mode != "none")
    settings = settings_for_mode(args.mode, base)
    for result in generate(settings, prompts, batch_sizes, args.max_tokens, temperature=args.temperature):
        if args.json:  # one object per batch size (one line each)
            print(json.dumps(result), flush=True)
        else:
            for key, value in result.items():
                if key not in ("keep_ratio_histogram", "calibration", "mean_step_ms"):
                    print(f"{key:>24}: {value}")
            print()
    return 0

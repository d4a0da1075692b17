"""dcut specexit: the reasoning pair on its held-out problems, with no exit, thinking caps and SpecExit."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pydantic import ValidationError

from dcut.cli import CommandError
from dcut.commands.engine_args import add_engine_flags, engine_settings

HELP = "SpecExit benchmark: accuracy, tokens, tokens/s and latency of no exit, thinking caps and SpecExit."
DEFAULT_ARMS = ("none", "cap:96", "cap:128", "cap:160", "cap:192", "specexit", "specexit:confidence_min=0.9",
                "specexit:confidence_min=0.6")
COLUMNS = ("arm", "bs", "accuracy", "mean_tokens", "mean_thinking_tokens", "exits", "tokens_per_s",
           "latency_mean_s", "latency_p50_s", "latency_p90_s")


def configure(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser)
    parser.set_defaults(pair="reasoning")
    parser.add_argument("--problems", default="models/reasoning_heldout.jsonl",
                        help="held-out problems, .jsonl of {prompt, answer}")
    parser.add_argument("--num-problems", type=int, default=64)
    parser.add_argument("--arm", action="append", dest="arms",
                        help="none, cap:N (thinking tokens) or specexit[:key=value,...]; repeat for more "
                        f"(default: {' '.join(DEFAULT_ARMS)})")
    parser.add_argument("--bs", default="1,16", help="batch sizes")
    parser.add_argument("--max-tokens", type=int, default=460)
    parser.add_argument("--out", default="docs/experiments/2026-11-29-specexit")


def run(args: argparse.Namespace) -> int:
    from dcut.bench.specexit import evaluate, load_problems, parse_arm
    from dcut.machine import machine_info, provenance
    from dcut.plots import plot_specexit

    try:
        sizes = sorted({int(b) for b in args.bs.split(",") if b.strip()})
        arms = [parse_arm(a) for a in args.arms or DEFAULT_ARMS]
        problems = load_problems(args.problems)[: args.num_problems]
        settings = engine_settings(args)
    except (ValueError, FileNotFoundError, ValidationError) as e:
        raise CommandError(str(e)) from e
    if not sizes or sizes[0] < 1 or args.max_tokens < 1 or args.num_problems < 1:
        raise CommandError("--bs, --max-tokens and --num-problems must be positive")
    rows = evaluate(settings, problems, arms, sizes, args.max_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine_info(), **provenance(), "settings": settings.model_dump(mode="json"),
              "problems": args.problems, "num_problems": len(problems), "max_tokens": args.max_tokens,
              "rows": rows}
    (out / "specexit.json").write_text(json.dumps(record, indent=2) + "\n")
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    (out / "specexit.md").write_text("\n".join(table) + "\n")
    plot_specexit(rows, out / "accuracy_vs_tokens.png")
    print("\n".join(table))
    print(f"written: {out}/specexit.json, specexit.md, accuracy_vs_tokens.png")
    return 0

"""Command-line flags for the engine and D-Cut settings, shared by generate, profile and sweep."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dcut.cli import CommandError
from dcut.settings import DEFAULT_PAIR, EMBEDDED_MODELS, DCutSettings, EngineSettings, engine_env


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pair", choices=sorted(EMBEDDED_MODELS), default=DEFAULT_PAIR,
                        help=f"embedded target/drafter pair (default: {DEFAULT_PAIR}); --model/--draft override it")
    parser.add_argument("--model", help="target model folder (default: the --pair's target)")
    parser.add_argument("--draft", help="drafter folder (default: the --pair's DFlash drafter)")
    parser.add_argument("--method", default="dflash", choices=["dflash", "draft_model"])
    parser.add_argument("--k", type=int, default=15, help="drafts per request per step")
    parser.add_argument("--spec-schedule", type=parse_schedule, default=None,
                        help="vLLM dynamic speculation, e.g. '1-4:15,5-16:7,17-64:3' (bs range: K)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--fixed-ratio", type=float, default=0.5, help="keep ratio of --mode fixed")
    parser.add_argument("--per-request-depth", type=int, default=4, help="drafts per request of --mode per_request")
    parser.add_argument("--count-bonus", action=argparse.BooleanOptionalAction, default=True,
                        help="count bonus tokens in U's numerator (--no-count-bonus: the reference's U)")
    parser.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                        help="calibrate confidences online against observed acceptance (--no-calibrate: raw)")
    parser.add_argument("--cost-table", help="cost table JSON to use instead of profiling")
    parser.add_argument("--cache-dir", help="where profiled cost tables are cached")
    parser.add_argument("--zero-width", choices=["catch_up", "vllm"], default="catch_up",
                        help="--mode joint: how a width-0 step keeps the drafter in sync")
    parser.add_argument("--widths", type=lambda t: [int(w) for w in t.split(",")], default=None,
                        help="--mode joint: the widths it may draft, e.g. 0 to pin width 0 (default 0,1,2,3,5,7,11,15)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run eagerly (vLLM's default, used otherwise, compiles: slower start, faster steps)")


def parse_schedule(text: str) -> list[tuple[int, int, int]]:
    """'1-4:15,5-16:7' -> [(1, 4, 15), (5, 16, 7)]."""
    try:
        out = []
        for part in text.split(","):
            span, k = part.split(":")
            lo, hi = span.split("-")
            out.append((int(lo), int(hi), int(k)))
        return out
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected 'lo-hi:K,...', got {text!r}") from e


def engine_environment(tensor_parallel_size: int) -> None:
    """`dcut.settings.engine_env` for engines started from the command line (the user's environment
    wins); engine logs on stderr, as stdout carries the --json output."""
    for key, value in {**engine_env(tensor_parallel_size), "VLLM_LOGGING_STREAM": "ext://sys.stderr"}.items():
        os.environ.setdefault(key, value)


def engine_settings(args: argparse.Namespace, need_draft: bool = True) -> EngineSettings:
    """Validated settings from the flags (pydantic errors name the setting); sets engine_environment.
    The model folders must exist (the drafter's only when ``need_draft``)."""
    pair_model, pair_draft = EMBEDDED_MODELS[args.pair]
    args.model, args.draft = args.model or pair_model, args.draft or pair_draft
    for path in (args.model, args.draft) if need_draft else (args.model,):
        if not Path(path).is_dir():
            raise CommandError(f"model folder not found: {path}")
    engine_environment(args.tp)
    dcut = DCutSettings(fixed_ratio=args.fixed_ratio, per_request_depth=args.per_request_depth,
                        count_bonus=args.count_bonus, calibrate=args.calibrate,
                        cost_table=args.cost_table, cache_dir=args.cache_dir, zero_width=args.zero_width,
                        widths=args.widths)
    return EngineSettings(model=args.model, draft=args.draft, method=args.method, num_speculative_tokens=args.k,
                          spec_schedule=args.spec_schedule, tensor_parallel_size=args.tp, dtype=args.dtype,
                          max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
                          dcut=dcut)

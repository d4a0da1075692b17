"""Command-line flags for the engine and D-Cut settings, shared by generate, profile and sweep."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pydantic import BaseModel, ValidationError

from dcut.cli import CommandError
from dcut.prompts import load_prompts
from dcut.settings import DEFAULT_PAIR, EMBEDDED_MODELS, DCutSettings, EngineSettings, engine_env, renamed_mode

# Flags that set a field of EngineSettings / DCutSettings: unset flags stay None, so the pydantic
# defaults (named in each flag's help) are the only defaults.
_ENGINE_FIELDS = {"method": "method", "k": "num_speculative_tokens", "spec_schedule": "spec_schedule",
                  "tp": "tensor_parallel_size", "dtype": "dtype", "max_model_len": "max_model_len",
                  "enforce_eager": "enforce_eager"}
_DCUT_FIELDS = ("fixed_ratio", "per_request_depth", "count_bonus", "calibrate", "cost_table", "cache_dir",
                "zero_width", "widths")


def _default(model: type[BaseModel], field: str) -> str:
    return f" (default: {model.model_fields[field].get_default(call_default_factory=True)})"


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    e = lambda field: _default(EngineSettings, field)  # noqa: E731
    d = lambda field: _default(DCutSettings, field)  # noqa: E731
    parser.add_argument("--pair", choices=sorted(EMBEDDED_MODELS), default=DEFAULT_PAIR,
                        help=f"embedded target/drafter pair (default: {DEFAULT_PAIR}); --model/--draft override it")
    parser.add_argument("--model", help="target model folder (default: the --pair's target)")
    parser.add_argument("--draft", help="drafter folder (default: the --pair's DFlash drafter)")
    parser.add_argument("--method", choices=["dflash", "draft_model"], help="speculative method" + e("method"))
    parser.add_argument("--k", type=int, help="drafts per request per step" + e("num_speculative_tokens"))
    parser.add_argument("--spec-schedule", type=parse_schedule,
                        help="vLLM dynamic speculation, e.g. '1-4:15,5-16:7,17-64:3' (bs range: K)")
    parser.add_argument("--tp", type=int, help="tensor-parallel size" + e("tensor_parallel_size"))
    parser.add_argument("--dtype", help="model dtype" + e("dtype"))
    parser.add_argument("--max-model-len", type=int, help="context length" + e("max_model_len"))
    parser.add_argument("--fixed-ratio", type=float, help="keep ratio of --mode fixed" + d("fixed_ratio"))
    parser.add_argument("--per-request-depth", type=int,
                        help="drafts per request of --mode per_request" + d("per_request_depth"))
    parser.add_argument("--count-bonus", action=argparse.BooleanOptionalAction,
                        help="count bonus tokens in U's numerator (--no-count-bonus: the reference's U)"
                        + d("count_bonus"))
    parser.add_argument("--calibrate", action=argparse.BooleanOptionalAction,
                        help="calibrate confidences online against observed acceptance (--no-calibrate: raw)"
                        + d("calibrate"))
    parser.add_argument("--cost-table", help="cost table JSON to use instead of profiling")
    parser.add_argument("--cache-dir", help="where profiled cost tables are cached")
    parser.add_argument("--zero-width", choices=["catch_up", "vllm"],
                        help="--mode joint: how a width-0 step keeps the drafter in sync" + d("zero_width"))
    parser.add_argument("--widths", type=lambda t: [int(w) for w in t.split(",")],
                        help="--mode joint: the widths it may draft, e.g. 0 to pin width 0 (default 0,1,2,3,5,7,11,15)")
    parser.add_argument("--enforce-eager", action="store_true", default=None,
                        help="run eagerly (vLLM's default, used otherwise, compiles: slower start, faster steps)")


def prompts_and_engine(args: argparse.Namespace, need_draft: bool = True) -> tuple[list[str], EngineSettings]:
    """``--prompts`` read and the engine flags validated (``engine_settings``), or a CommandError saying why."""
    try:
        return load_prompts(args.prompts), engine_settings(args, need_draft=need_draft)
    except (ValueError, FileNotFoundError, ValidationError) as e:
        raise CommandError(str(e)) from e


def batch_sizes_and_modes(bs: str, modes: str, allowed: tuple[str, ...]) -> tuple[list[int], list[str]]:
    """``--bs`` (positive integers, sorted, unique) and ``--modes`` (each one of ``allowed``), or a CommandError."""
    try:
        sizes = sorted({int(b) for b in bs.split(",") if b.strip()})
    except ValueError as e:
        raise CommandError(f"--bs: {e}") from e
    if not sizes or sizes[0] < 1:
        raise CommandError("--bs must be positive integers")
    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(allowed))
    renamed = [why for m in unknown if (why := renamed_mode(m))]
    if renamed:
        raise CommandError("; ".join(renamed))
    if unknown or not chosen:
        raise CommandError(f"unknown modes {unknown}; choose from {', '.join(allowed)}")
    return sizes, chosen


def mode_arg(allowed: tuple[str, ...]):
    """An argparse ``type`` for one mode: a renamed mode (``dcut.settings.RENAMED_MODES``) is refused naming the
    new name, not as an unknown choice."""
    def parse(text: str) -> str:
        if (why := renamed_mode(text)) is not None:
            raise argparse.ArgumentTypeError(why)
        return text
    return parse


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
    dcut = DCutSettings(**{f: v for f in _DCUT_FIELDS if (v := getattr(args, f)) is not None})
    settings = EngineSettings(model=args.model, draft=args.draft, dcut=dcut, **{
        field: v for flag, field in _ENGINE_FIELDS.items() if (v := getattr(args, flag)) is not None})
    engine_environment(settings.tensor_parallel_size)
    return settings

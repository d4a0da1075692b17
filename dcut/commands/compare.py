"""dcut compare: modes ranked live, interleaved, with intervals (``dcut.bench.interleaved``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dcut.bench.interleaved import BUILD_ORDERS, COMPARE_MODES, PINNED, SAMPLING, TRAFFIC, base_mode
from dcut.cli import CommandError
from dcut.commands.engine_args import add_engine_flags, batch_sizes_and_modes, parse_schedule, prompts_and_engine
from dcut.memory import GpuMemoryError
from dcut.prompts import DEFAULT_PROMPTS, token_prompts

HELP = ("Interleaved live comparison of none/vllm/vllm-dynamic/full/dynamic/joint and diagnostic arms: medians, 95% "
        "intervals, verdicts.")


def configure(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser)
    parser.add_argument("--bs", default="1,4,8,16,32,64", help="batch sizes")
    parser.add_argument("--modes", default="none,full,dynamic,joint,joint-w0",
                        help=f"comma-separated, from {', '.join(COMPARE_MODES)}, or joint-wN (joint pinned to width "
                        "N); MODE#N is one more engine of MODE (none#2 beside none: what an engine's place in the "
                        "process alone does)")
    parser.add_argument("--dynamic-schedule", type=parse_schedule,
                        help="vLLM dynamic speculation for modes dynamic and vllm-dynamic, e.g. '1-1:15,2-4:7,5-64:3' "
                        "(bs range: K)")
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="every prompt exactly this many tokens (cut from --prompts with the target's tokenizer): "
                        "a context length set exactly; default: the prompts as they are")
    parser.add_argument("--traffic", choices=TRAFFIC, default="steady",
                        help="steady: concurrency held at each batch size, one request admitted as one finishes, rate "
                        "over that window (a server under load); batch: closed batches, each to its last token "
                        "(prefill and a draining tail in every cell)")
    parser.add_argument("--sampling", choices=SAMPLING, default="greedy",
                        help="greedy: every request at temperature 0; sampled: every request at temperature 1 (the "
                        "OpenAI default, unseeded); mixed: every other request of each kind, so each batch holds both")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds per batch size (>= 5)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the shuffled order and the bootstrap")
    parser.add_argument("--build-order", choices=BUILD_ORDERS, default="shuffled",
                        help="shuffled (by --seed): engines built in a random order, so no mode always gets the first "
                        "place in the process; given: in the order of --modes (e.g. none,joint-w0,joint-w0#2,none#2 "
                        "for A B B A)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the parts of each engine step (target forward, drafting, D-Cut's hooks, "
                        "scheduler) in the timed runs, in ms per step per mode (dcut.bench.breakdown)")
    parser.add_argument("--out", required=True, help="folder for compare.json and compare.md")


def run(args: argparse.Namespace) -> int:
    from dcut.bench.interleaved import compare, markdown

    named = [m.strip() for m in args.modes.split(",")]
    pinned = tuple(m for m in named if PINNED.fullmatch(base_mode(m)))
    copies = tuple(m for m in named if m != base_mode(m) and base_mode(m) in COMPARE_MODES + pinned)
    sizes, modes = batch_sizes_and_modes(args.bs, args.modes, COMPARE_MODES + pinned + copies)
    if len(set(modes)) < len(modes):
        raise CommandError("--modes names a mode twice; a second engine of a mode is MODE#2")
    if {"dynamic", "vllm-dynamic"} & set(map(base_mode, modes)) and not args.dynamic_schedule:
        raise CommandError("modes dynamic and vllm-dynamic need --dynamic-schedule")
    if args.repeats < 2 or args.max_tokens < 1:
        raise CommandError("--repeats must be >= 2 and --max-tokens positive")
    prompts, base = prompts_and_engine(args)
    if args.prompt_tokens is not None:
        if not 1 <= args.prompt_tokens <= base.max_model_len - args.max_tokens:
            raise CommandError(f"--prompt-tokens must be 1..max_model_len - max_tokens "
                               f"({base.max_model_len - args.max_tokens})")
        prompts = token_prompts(prompts, Path(base.model) / "tokenizer.json", args.prompt_tokens,
                                max(64, len(prompts)))
    try:
        record = compare(base, modes, sizes, prompts, args.max_tokens, args.repeats, args.dynamic_schedule,
                         args.seed, args.traffic, args.breakdown, args.build_order, args.sampling)
    except GpuMemoryError as e:  # raised before any engine starts
        raise CommandError(str(e)) from e
    record["prompt_tokens"] = args.prompt_tokens  # None: the prompt file's own lengths
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "compare.md").write_text(markdown(record))
    print((out / "compare.md").read_text())
    return 0

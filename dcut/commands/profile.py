"""dcut profile: measure a cost table with the engine's own dummy steps; write JSON and a PNG plot."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from pydantic import ValidationError

from dcut.cli import CommandError
from dcut.commands.engine_args import add_engine_flags, engine_settings

HELP = "Profile the two-part cost table (verify by tokens, drafter by width) for a model/drafter/K/TP."


def configure(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser)
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="comma-separated batch sizes")
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context-lens", type=lambda t: [int(c) for c in t.split(",") if c.strip()],
                        help="context lengths to profile the verify cost's growth with context at, e.g. 256,512,1007 "
                             "('' for none; default: about max-model-len/4 and /2 and max-model-len - K - 2)")
    parser.add_argument("--out", default="docs/experiments/2026-11-29-profile-dense", help="output folder")


def run(args: argparse.Namespace) -> int:
    from vllm import LLM

    from dcut.plots import plot_cost_table
    from dcut.vllm.api import read_cost_table
    from dcut.vllm.engine import engine_kwargs

    try:
        sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
        base = engine_settings(args)
    except (ValueError, ValidationError) as e:
        raise CommandError(f"bad setting: {e}") from e
    if not sizes or sizes[0] < 1:
        raise CommandError("--batch-sizes must be positive integers")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as fresh_cache:  # always measure, never read a cached table
        dcut = base.dcut.model_copy(update={"mode": "reference", "cost_table": None, "cache_dir": fresh_cache,
                                            "profile_batch_sizes": sizes, "profile_warmups": args.warmups,
                                            "profile_repeats": args.repeats,
                                            "profile_context_lens": args.context_lens})
        settings = base.model_copy(update={"dcut": dcut, "max_num_seqs": max(sizes)})
        llm = LLM(**engine_kwargs(settings))  # profiles the verify rows and the drafter at every width
        table = read_cost_table(llm)
    if table is None:
        raise CommandError("the engine did not produce a cost table")
    (out / "cost_table.json").write_text(json.dumps(table, indent=1))
    fp = table["fingerprint"]
    plot_cost_table(table, out / "cost_table.png",
                    title=f"{Path(fp['model']).name} + {Path(fp['drafter'] or '-').name}, K={fp['k']}, "
                          f"TP={fp['tensor_parallel_size']}, {fp['hardware']}")
    print(json.dumps({"table": str(out / "cost_table.json"), "plot": str(out / "cost_table.png"),
                      "batch_sizes": sorted(int(b) for b in table["points"]), "context": table.get("context")}))
    return 0

"""dcut pool: several ``dcut compare`` reports of the same modes, pooled round by round (``dcut.bench.pool``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dcut.cli import CommandError

HELP = "Pool several dcut compare reports of the same modes: one paired verdict per batch size from all their rounds."


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reports", nargs="+", help="compare.json files written by dcut compare (at least two)")
    parser.add_argument("--mode", default="joint", help="the mode judged (default: joint)")
    parser.add_argument("--against", default="none,full,dynamic", help="the modes it is judged against")
    parser.add_argument("--seed", type=int, default=0, help="seeds the bootstrap")
    parser.add_argument("--bs", help="pool only these batch sizes, e.g. 1 or 1,8 (every report must have run them; "
                        "default: the batch sizes all the reports ran alike)")
    parser.add_argument("--out", help="a folder to write pooled.json and pooled.md to")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")


def run(args: argparse.Namespace) -> int:
    from dcut.bench.pool import markdown, pool
    from dcut.machine import provenance

    try:
        reports = [json.loads(Path(p).read_text()) for p in args.reports]
        sizes = None if args.bs is None else [int(b) for b in args.bs.split(",") if b.strip()]
        pooled = pool(reports, args.mode, tuple(m for m in args.against.split(",") if m), args.seed, sizes)
    except (OSError, ValueError, KeyError) as e:
        raise CommandError(f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)) from e
    pooled["reports"] = list(args.reports)
    pooled.update(provenance())  # when and on which code the pool was made (each report records its own run)
    table = markdown(pooled)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "pooled.json").write_text(json.dumps(pooled, indent=1) + "\n")
        (out / "pooled.md").write_text(table + "\nReports: " + ", ".join(f"`{p}`" for p in args.reports) + "\n")
    print(json.dumps(pooled, indent=1) if args.json else table)
    return 0

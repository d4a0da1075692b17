"""dcut report: figures computed from the committed result files (``dcut.status_report``)."""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

from dcut.cli import CommandError

HELP = ("Print figures computed from the committed result files (status: the README's status block; acceptance: "
        "mean accepted drafts per width in a trace, as the model cards quote).")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["status", "acceptance"],
                        help="status: the README's status block, from docs/results/; acceptance: a trace's, per width")
    parser.add_argument("--trace", default="docs/results/replay/traces/deep", help="acceptance: a dcut trace folder")
    parser.add_argument("--root", default=".", help="the repository's root (default: here)")
    parser.add_argument("--check", metavar="README", help="exit 1, with a diff, when README's block differs")
    parser.add_argument("--write", metavar="README", help="replace README's block with the computed one")


def run(args: argparse.Namespace) -> int:
    from dcut.status_report import block, readme_block, trace_acceptance, with_block

    try:
        if args.what == "acceptance":
            print("| width | mean accepted per request step | rows |\n|---|---|---|")
            for width, (mean, n) in trace_acceptance(Path(args.trace)).items():
                print(f"| {width} | {mean:.2f} | {n} |")
            return 0
        computed = block(Path(args.root))
        if args.write:
            path = Path(args.write)
            path.write_text(with_block(path.read_text(), computed))
            return 0
        if args.check:
            held = readme_block(Path(args.check).read_text())
            if held != computed:
                print("".join(difflib.unified_diff(held.splitlines(True), computed.splitlines(True),
                                                   args.check, "dcut report status")))
                return 1
            return 0
    except (OSError, KeyError, ValueError) as e:
        raise CommandError(f"{type(e).__name__}: {e}") from e
    print(computed)
    return 0

"""The ``dcut`` command line: each subcommand lives in ``dcut/commands/<name>.py``.

A command module defines ``HELP`` (one line), ``configure(parser)`` and ``run(args) -> int``.
Modules are imported only when their command runs, so ``dcut bench-policy`` never imports vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "bench-policy": "dcut.commands.bench_policy",
    "profile": "dcut.commands.profile",
    "generate": "dcut.commands.generate",
    "sweep": "dcut.commands.sweep",
    "specexit": "dcut.commands.specexit",
    "trace": "dcut.commands.trace",
    "replay": "dcut.commands.replay",
    "compare": "dcut.commands.compare",
    "pool": "dcut.commands.pool",
    "report": "dcut.commands.report",
}


class CommandError(Exception):
    """A user error: printed as one line, exit status 2."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="dcut", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    for name, module_path in COMMANDS.items():
        if name == chosen:
            module = importlib.import_module(module_path)
            module.configure(sub.add_parser(name, help=module.HELP, description=module.HELP))
        else:
            sub.add_parser(name, help=f"(see `dcut {name} --help`)")
    args = parser.parse_args(argv)
    try:
        return int(module.run(args) or 0)
    except CommandError as e:
        print(f"dcut {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Run the imported module's main so that commands' CommandError is this module's class.
    from dcut.cli import main as _main

    sys.exit(_main())

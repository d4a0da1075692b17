"""The trainer of the embedded models (``python -m train STAGE``), a tool beside the runtime, not part of it.

It builds what ``models/`` ships (BPE tokenizer, Qwen3 Dense/deep/MoE targets, DFlash drafters, the reasoning
pair with SpecExit's signal head) and the model cards, from a checkout: run it from the repository root. It
imports ``dcut`` (settings, prompts, cost tables, SpecExit's rule); nothing in ``dcut``, ``deployments`` or ``app``
imports it.
"""

from __future__ import annotations

import shlex
import sys

PROG = "python -m train"


class TrainError(Exception):
    """A user error: printed as one line, exit status 2."""


def command_line() -> str:
    """The running command as the stage records and model cards state it ('' without arguments)."""
    args = sys.argv[1:]
    return f"{PROG} {shlex.join(args)}" if args else ""

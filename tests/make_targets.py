"""What the Makefile's targets run, read from it (so that tests check the arms a user's `make` builds)."""

from __future__ import annotations

import re
from pathlib import Path

MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"


def compare_modes(target: str = "compare") -> list[str]:
    """The ``--modes`` a ``dcut compare`` target names."""
    found = re.search(rf"^{re.escape(target)}:.*?--modes (\S+)", MAKEFILE.read_text(), re.M | re.S)
    assert found is not None, f"no --modes in the Makefile's {target} target"
    return found[1].split(",")

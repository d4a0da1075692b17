"""A description of the machine a measurement ran on, for every benchmark's JSON output."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """CPU/GPU, cores and software versions: numbers from different machines are not comparable."""
    import torch  # here, not at the top: the cost table's fingerprint reads `cpu_model` in processes without torch

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def provenance() -> dict[str, Any]:
    """When and on which code a result was measured: ``date`` (UTC, ISO 8601) and ``commit`` (``git rev-parse
    --short HEAD``, ``-dirty`` when tracked files differ from it; None outside a git checkout). Every result JSON
    records these beside ``machine``, so a figure quoted from it can say what it is (docs/README.md)."""
    date = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"date": date, "commit": None}
    return {"date": date, "commit": commit + ("-dirty" if dirty else "")}

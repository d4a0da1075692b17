"""The Serve control plane (ingress, controller, autoscaling policy, router) loads without torch: every app
starts one ingress and one controller, and torch costs each ~1.2 s of CPU and ~180 MB of memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_control_plane_does_not_import_torch():
    code = ("import sys; import deployments.ingress, deployments.controller, deployments.autoscaling, "
            "deployments.routing; print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout

"""The Serve control plane (ingress, controller, autoscaling policy) loads without torch: every app
starts one ingress and one controller, and torch costs each ~1.2 s of CPU and ~180 MB of memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _imported_heavy(modules: str) -> str:
    """Which of torch and vLLM importing ``modules`` (comma-separated) pulls in, in a fresh interpreter."""
    code = f"import sys; import {modules}; print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_control_plane_does_not_import_torch():
    assert _imported_heavy("deployments.ingress, deployments.controller, deployments.autoscaling") == "[]"


def test_engine_replica_imports_vllm_only_when_its_engine_starts():
    """The replica, the engine door, the vLLM adapter and the builder import neither vLLM nor torch: vLLM's
    engine brings both when it starts (``deployments.vllm_engine.VLLMEngine.start``), a mock engine never does
    (``tests/unit/test_engine_seam_mock.py``)."""
    assert _imported_heavy("deployments.engine_replica, deployments.engine, deployments.vllm_engine, "
                           "app.builder") == "[]"


def test_the_runtime_does_not_import_the_tools():
    """The wheel ships `dcut`, `deployments` and `app` only: the tools beside them (`loadtest`, `simulator`, `train`)
    and the tests may import the runtime, never the reverse."""
    import ast

    tools = {"loadtest", "simulator", "train", "tests"}
    found = []
    for path in sorted(p for package in ("dcut", "deployments", "app") for p in (REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            found += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in tools]
    assert not found, found


def test_only_the_vllm_adapter_of_the_deployments_knows_vllm():
    """``deployments/vllm_engine.py`` is the engine adapter: no other deployment module imports vLLM or the
    plugin's vLLM side (``dcut.vllm``), not even inside a function; they talk to ``deployments.engine.Engine``."""
    import ast

    found = []
    for path in sorted((REPO / "deployments").rglob("*.py")):
        if path.name == "vllm_engine.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            found += [f"{path.relative_to(REPO)}: {n}" for n in names
                      if n == "vllm" or n.startswith(("vllm.", "dcut.vllm"))]
    assert not found, found

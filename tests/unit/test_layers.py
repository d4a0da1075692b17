"""The folder tree is the architecture: every import points down a layer, and no module-level import circles.

Layers, lowest first: the algorithm (``dcut`` itself: selection, costs, widths, telemetry, records), the vLLM
plugin (``dcut.vllm``), what runs on the plugin (``dcut.replay``, ``dcut.bench``), the command line
(``dcut.commands``, ``dcut.cli``), the Serve deployments (``deployments``), the application (``app``), and the
tools outside the wheel (``loadtest``, ``simulator``, ``train``). Imports inside functions count for the layers
(they are still dependencies), not for circles (they run after every module has loaded).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("dcut", "deployments", "app", "loadtest", "simulator", "train")
LAYERS = [("dcut",), ("dcut.vllm",), ("dcut.replay", "dcut.bench"), ("dcut.commands", "dcut.cli"), ("deployments",),
          ("app",), ("loadtest", "simulator", "train")]


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    """The highest layer whose prefix names the module (``dcut.vllm.state`` is the plugin, not the algorithm)."""
    found = [i for i, prefixes in enumerate(LAYERS)
             if any(module == p or module.startswith(p + ".") for p in prefixes)]
    return max(found)


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """The project modules ``path`` imports: (at module level, anywhere)."""
    tree = ast.parse(path.read_text())
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    top, every = set(), set()
    body_level = {id(n) for n in tree.body} | {id(n) for s in tree.body if isinstance(s, (ast.If, ast.Try))
                                               for n in ast.walk(s)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module or ""
            names = [root] + [f"{root}.{a.name}" for a in node.names]
        else:
            continue
        names = [n for n in names if n.split(".")[0] in PACKAGES]
        every.update(names)
        if id(node) in body_level:
            top.update(names)
    return top, every


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    files = {_module(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    top, every = {}, {}
    for name, path in files.items():
        t, e = _imports(path)
        top[name] = {m for m in t if m in files and m != name}
        every[name] = {m for m in e if m in files and m != name}
    return top, every


def test_every_import_points_down_a_layer() -> None:
    _, every = _graph()
    upward = sorted(f"{m} -> {d}" for m, deps in every.items() for d in deps if _layer(d) > _layer(m))
    assert not upward, upward


def test_no_module_level_import_circles() -> None:
    top, _ = _graph()
    done: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            circles.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for dep in sorted(top[node]):
            visit(dep, path + [node])
        done.add(node)

    for module in sorted(top):
        visit(module, [])
    assert not circles, circles


def test_the_layer_map_reads_the_tree() -> None:
    """The check itself: an upward import and a circle are found where they exist."""
    assert _layer("dcut.vllm.state") == 1 and _layer("dcut.selection") == 0 and _layer("train.cli") == 6
    assert _layer("dcut.commands.replay") == 3 and _layer("deployments.engine") == 4
    top, every = _graph()
    assert "dcut.selection" in every["dcut.vllm.state"]  # the graph sees real imports
    assert "deployments.engine" in top["deployments.vllm_engine"]

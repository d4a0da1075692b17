"""Training data: the running interpreter's own standard-library source (PSF License).

Files are split deterministically by a hash of their relative path into a training split and a
held-out split; the held-out split provides benchmark prompts that no model saw in training.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

LICENCE = (
    "Python Software Foundation License Version 2 (the CPython standard library source, "
    "https://docs.python.org/3/license.html)"
)

# Folders of the stdlib that are tests, third-party packages, data tables or build artefacts.
EXCLUDED_DIRS = {
    "test", "tests", "site-packages", "idle_test", "__pycache__", "pydoc_data", "encodings",
    "lib2to3", "ensurepip", "turtledemo",
}
HELDOUT_PERCENT = 5


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str) -> bool:
    h = int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16)
    return h % 100 < HELDOUT_PERCENT


@dataclass
class SourceFile:
    rel: str
    text: str


def list_sources(root: Path | None = None, max_bytes: int = 400_000) -> list[SourceFile]:
    """All eligible .py files, sorted by relative path (deterministic)."""
    root = root or stdlib_dir()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        parts = rel.split("/")
        if any(d in EXCLUDED_DIRS or d.startswith("config-") for d in parts[:-1]):
            continue
        if parts[-1].startswith("_sysconfigdata"):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip() or len(text) > max_bytes:
            continue
        out.append(SourceFile(rel, text))
    return out


def split_sources(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not is_heldout(f.rel)]
    held = [f for f in files if is_heldout(f.rel)]
    return train, held


def heldout_prompts(held: list[SourceFile], tokenizer, n: int = 64, min_tokens: int = 100,
                    max_tokens: int = 300, seed: int = 0) -> list[str]:
    """Prompts = the first lines of held-out functions (their signature, docstring, first body lines)."""
    rng = random.Random(seed)
    candidates: list[str] = []
    for f in held:
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        lines = f.text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
                body = "".join(lines[node.lineno - 1: node.end_lineno])
                if len(body) > 200:
                    candidates.append(body)
    rng.shuffle(candidates)
    prompts: list[str] = []
    for body in candidates:
        ids = tokenizer.encode(body).ids if hasattr(tokenizer, "encode") else tokenizer(body)
        if len(ids) < min_tokens + 32:
            continue
        # Cut at a line boundary between min_tokens and max_tokens tokens.
        target = rng.randint(min_tokens, min(max_tokens, len(ids) - 32))
        text_lines = body.splitlines(keepends=True)
        acc = ""
        for line in text_lines:
            cand = acc + line
            if len(tokenizer.encode(cand).ids) > target:
                break
            acc = cand
        if len(tokenizer.encode(acc).ids) >= min_tokens:
            prompts.append(acc)
        if len(prompts) >= n:
            break
    return prompts


def write_prompts(path: Path, prompts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": p}) + "\n")


def corpus_fingerprint(files: list[SourceFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.rel.encode())
        h.update(hashlib.sha256(f.text.encode()).digest())
    return h.hexdigest()[:16]

"""The one prompt reader: ``.jsonl`` files of ``{"prompt": ...}`` (the held-out prompts) or plain text."""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_PROMPTS = Path("models/heldout_prompts.jsonl")


def load_prompts(path: str | Path) -> list[str]:
    """Prompts from a ``.jsonl`` file (``{"prompt": ...}`` per line) or a text file (one per line)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if path.suffix == ".jsonl":
        prompts = []
        for i, ln in enumerate(lines, 1):
            try:
                prompts.append(json.loads(ln)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i}: expected a JSON object with a 'prompt' string ({e})") from e
        lines = prompts
    if not lines:
        raise ValueError(f"no prompts in {path}")
    return lines

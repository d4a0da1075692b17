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


def token_prompts(texts: list[str], tokenizer_file: str | Path, length: int, count: int) -> list[dict[str, list[int]]]:
    """``count`` prompts of exactly ``length`` tokens (vLLM's ``{"prompt_token_ids": ...}``), cut from ``texts``
    tokenized one after another and cycled, each starting where the last ended: a context length set exactly,
    whatever the prompts' own lengths."""
    from tokenizers import Tokenizer

    if length < 1 or count < 1:
        raise ValueError("length and count must be >= 1")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    stream = [t for text in texts for t in tokenizer.encode(text).ids]
    if not stream:
        raise ValueError("the prompts tokenize to nothing")
    out = []
    for i in range(count):
        start = (i * length) % len(stream)
        ids = (stream[start:] + stream * (length // len(stream) + 1))[:length]
        out.append({"prompt_token_ids": ids})
    return out

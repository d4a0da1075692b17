"""Request limits the ingress enforces before any engine work (:class:`deployments.settings.RequestLimits`):
the body's size while it is read, its shape (strict JSON: finite numbers, valid Unicode, bounded nesting), then the
parameters with which one request could occupy a replica (choices, stop sequences, tokens to generate). Prompt
tokens are counted by the engine replica, which has the tokenizer.

Values of the wrong type pass here untouched: the engine's own validation answers them with a 400.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

from deployments.settings import RequestLimits


class BodyTooLarge(ValueError):
    """A request body over ``RequestLimits.max_body_bytes``."""


async def read_body(chunks: AsyncIterator[bytes], content_length: str | None, limit: int) -> bytes:
    """The body, refused (`BodyTooLarge`) from a declared Content-Length over ``limit`` before a byte is read, or
    as soon as the bytes read pass it (a chunked upload declares none): never held whole in memory."""
    if content_length is not None and content_length.strip().isdigit() and int(content_length) > limit:
        raise BodyTooLarge(f"Content-Length {int(content_length)} > {limit}")
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"more than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


def _count(value: Any) -> int | None:
    """An integer parameter's value (bools, though ints in Python, are not counts)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:24]} is out of range")
    return value


def _constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_json(raw: bytes) -> Any:
    """``raw`` parsed as strict JSON: ``NaN``/``Infinity`` and numbers that overflow a float are refused
    (``ValueError``): vLLM checks most sampling fields for them, not all (a ``NaN`` ``logit_bias`` became -100).
    Deep nesting raises ``RecursionError``."""
    return json.loads(raw, parse_float=_finite, parse_constant=_constant)


def _not_unicode(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate (a ``\\ud800`` escape without its pair): not encodable as UTF-8,
    so no answer that echoes it (an error naming the model, an echoed prompt) could be written."""
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def json_problem(value: Any, max_depth: int) -> str | None:
    """Why a parsed JSON body cannot be served, else None: nested deeper than ``max_depth`` (the body object: 1),
    or a string (key or value) that is not valid Unicode. Walked level by level, without recursion."""
    depth, level = 0, [value]
    while level:
        if any(isinstance(v, str) and _not_unicode(v) for v in level):
            return "The JSON body holds a string that is not valid Unicode (an unpaired surrogate escape)."
        level = [v for v in level if isinstance(v, list | dict)]
        if not level:
            return None
        depth += 1
        if depth > max_depth:
            return f"The JSON body is nested more than {max_depth} levels deep."
        level = [item for v in level for item in ([*v.keys(), *v.values()] if isinstance(v, dict) else v)]
    return None


def violation(body: dict, limits: RequestLimits) -> tuple[str, str] | None:
    """``(param, message)`` of the first limit ``body`` exceeds, else None."""
    if (problem := json_problem(body, limits.max_depth)) is not None:
        return "body", problem
    for param, ceiling in (("n", limits.max_n), ("best_of", limits.max_n), ("max_tokens", limits.max_tokens),
                           ("max_completion_tokens", limits.max_tokens)):
        value = _count(body.get(param))
        if value is not None and value > ceiling:
            return param, f"'{param}' is {value}; this server allows at most {ceiling}."
    for param in ("stop", "stop_token_ids"):
        value = body.get(param)
        if isinstance(value, list) and len(value) > limits.max_stop:
            return param, f"'{param}' has {len(value)} entries; this server allows at most {limits.max_stop}."
    return None

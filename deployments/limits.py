"""Request limits the ingress enforces before any engine work (:class:`deployments.settings.RequestLimits`):
the body's size while it is read, then the parameters with which one request could occupy a replica (choices,
stop sequences, tokens to generate). Prompt tokens are counted by the engine replica, which has the tokenizer.

Values of the wrong type pass here untouched: the engine's own validation answers them with a 400.
"""

from __future__ import annotations

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


def nesting_depth(value: Any, stop: int) -> int:
    """Nesting depth of a parsed JSON value (a scalar: 0, ``[]``: 1, ``{"a": [1]}``: 2), counted level by level
    without recursion, and only up to ``stop + 1``."""
    depth, level = 0, [value]
    while depth <= stop:
        level = [v for v in level if isinstance(v, list | dict)]
        if not level:
            break
        depth += 1
        level = [item for v in level for item in (v.values() if isinstance(v, dict) else v)]
    return depth


def violation(body: dict, limits: RequestLimits) -> tuple[str, str] | None:
    """``(param, message)`` of the first limit ``body`` exceeds, else None."""
    if nesting_depth(body, limits.max_depth) > limits.max_depth:
        return "body", f"The JSON body is nested more than {limits.max_depth} levels deep."
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

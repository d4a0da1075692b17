"""Read D-Cut state from a running engine: ``vllm.LLM`` (sync) or ``AsyncLLM`` (async).

Tensor-parallel ranks take the same decision; rank 0's view is returned.
"""

from __future__ import annotations

from typing import Any

from dcut.snapshot import DCutSnapshot


def _snapshot(raw: dict[str, Any] | None) -> DCutSnapshot | None:
    return None if raw is None else DCutSnapshot.model_validate(raw)


def read_snapshot(llm: Any) -> DCutSnapshot | None:
    """D-Cut's snapshot (recent steps, cost source, estimates) of an offline ``vllm.LLM``; None when off."""
    return _snapshot(llm.collective_rpc("dcut_stats")[0])


def read_cost_table(llm: Any) -> dict[str, Any] | None:
    """The cost table in use (JSON form with its fingerprint); None when there is none."""
    return llm.collective_rpc("dcut_cost_table")[0]


def reset_stats(llm: Any) -> None:
    llm.collective_rpc("dcut_reset_stats")


def save_trace(llm: Any) -> str | None:
    """Write the replay trace an engine recorded so far (``DCutSettings.trace``); its path."""
    return llm.collective_rpc("dcut_save_trace")[0]


def clear_trace(llm: Any) -> None:
    llm.collective_rpc("dcut_clear_trace")


async def aread_snapshot(engine: Any) -> DCutSnapshot | None:
    """As ``read_snapshot``, for an ``AsyncLLM``."""
    return _snapshot((await engine.collective_rpc("dcut_stats"))[0])


async def aread_cost_table(engine: Any) -> dict[str, Any] | None:
    """As ``read_cost_table``, for an ``AsyncLLM``."""
    return (await engine.collective_rpc("dcut_cost_table"))[0]


async def aread_specexit(engine: Any) -> dict[str, Any] | None:
    """SpecExit's counters and settings of an ``AsyncLLM``; None when off."""
    return (await engine.collective_rpc("dcut_specexit_stats"))[0]


def read_specexit_usage(llm: Any, prefix: str = "") -> dict[str, dict[str, Any]]:
    """What SpecExit did per request (engine id -> usage) in an offline ``vllm.LLM``."""
    return llm.collective_rpc("dcut_specexit_usage", args=(prefix,))[0]


async def aread_specexit_usage(engine: Any, prefix: str) -> dict[str, dict[str, Any]]:
    """As ``read_specexit_usage``, for an ``AsyncLLM`` and the requests of one response id."""
    return (await engine.collective_rpc("dcut_specexit_usage", args=(prefix,)))[0]


def read_request_usage(llm: Any, prefix: str = "") -> dict[str, dict[str, Any]]:
    """What speculation did per request (engine id -> ``dcut.speculation.SpeculationUsage``) in a ``vllm.LLM``."""
    return llm.collective_rpc("dcut_request_usage", args=(prefix,))[0]


async def aread_request_usage(engine: Any, prefix: str) -> dict[str, dict[str, Any]]:
    """As ``read_request_usage``, for an ``AsyncLLM`` and the requests of one response id."""
    return (await engine.collective_rpc("dcut_request_usage", args=(prefix,)))[0]

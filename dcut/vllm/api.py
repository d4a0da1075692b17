"""Read D-Cut state from a running engine: ``vllm.LLM`` (sync) or ``AsyncLLM`` (async).

Tensor-parallel ranks take the same decision; rank 0's view is returned.
"""

from __future__ import annotations

from typing import Any


def read_stats(llm: Any) -> dict[str, Any] | None:
    """Recent D-Cut step telemetry of an offline ``vllm.LLM``; None when D-Cut is off."""
    return llm.collective_rpc("dcut_stats")[0]


def read_cost_table(llm: Any) -> dict[str, Any] | None:
    """The cost table in use (JSON form with its fingerprint); None when there is none."""
    return llm.collective_rpc("dcut_cost_table")[0]


def reset_stats(llm: Any) -> None:
    llm.collective_rpc("dcut_reset_stats")


async def aread_stats(engine: Any) -> dict[str, Any] | None:
    """As ``read_stats``, for an ``AsyncLLM``."""
    return (await engine.collective_rpc("dcut_stats"))[0]


async def aread_cost_table(engine: Any) -> dict[str, Any] | None:
    """As ``read_cost_table``, for an ``AsyncLLM``."""
    return (await engine.collective_rpc("dcut_cost_table"))[0]

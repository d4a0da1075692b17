"""D-Cut's Prometheus metrics, named in vLLM's style (``vllm:dcut_*``).

They live in the process that runs the model runner: the API server's registry with the
in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the worker's otherwise. The Serve
replica re-exports the same figures through Ray's metrics (see ``deployments/``).
"""

from __future__ import annotations

import functools
from typing import Any

from prometheus_client import Counter, Histogram

from dcut.telemetry import StepRecord


@functools.cache
def _metrics() -> dict[str, Any]:
    labels = ["model_name"]
    return {
        "steps": Counter("vllm:dcut_steps", "Engine steps that drafted with D-Cut on.", labels),
        "proposed": Counter("vllm:dcut_drafts_proposed", "Draft tokens proposed.", labels),
        "kept": Counter("vllm:dcut_drafts_kept", "Draft tokens kept for verification.", labels),
        "verify": Counter("vllm:dcut_verify_tokens", "Tokens verified (bs + kept drafts).", labels),
        "accepted": Counter("vllm:dcut_drafts_accepted", "Kept draft tokens accepted.", labels),
        "accepted_pos": Counter("vllm:dcut_drafts_accepted_per_pos", "Accepted drafts by position.",
                                [*labels, "position"]),
        "ratio": Histogram("vllm:dcut_keep_ratio", "Chosen keep ratio per step.", labels,
                           buckets=[0.1 * i for i in range(1, 11)]),
        "budget": Histogram("vllm:dcut_budget", "Drafts kept per step across the batch.", labels,
                            buckets=[0, 4, 8, 16, 32, 64, 128, 256, 512, 1024]),
        "shifts": Counter("vllm:dcut_speed_shifts", "Changes of the machine's speed noticed (mode joint): each "
                          "sent a batch size's other widths back to be measured.", labels),
        "selection": Histogram("vllm:dcut_selection_seconds", "Time to decide keep depths.", labels,
                               buckets=[5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2]),
    }


@functools.cache
def _children(model_name: str) -> dict[str, Any]:
    """The metrics labelled with ``model_name`` (a label lookup per step and metric cost more than the counting)."""
    return {name: metric.labels(model_name) for name, metric in _metrics().items() if name != "accepted_pos"}


@functools.cache
def _position(model_name: str, position: int) -> Any:
    return _metrics()["accepted_pos"].labels(model_name, str(position))


def observe(records: list[StepRecord], model_name: str, shifts: int = 0) -> None:
    """Count some steps (a few at a time: a counter's increment takes a lock, and a step's accounting is
    on the step's critical path), and the changes of speed noticed while they ran."""
    m = _children(model_name)
    if shifts:
        m["shifts"].inc(shifts)
    m["steps"].inc(len(records))
    m["proposed"].inc(sum(r.proposed for r in records))
    m["kept"].inc(sum(r.kept for r in records))
    m["verify"].inc(sum(r.batch_size + sum(r.kept_per_position) for r in records))
    m["accepted"].inc(sum(r.accepted for r in records))
    for pos, n in enumerate(map(sum, zip(*(r.accepted_per_position for r in records), strict=True)), 1):
        if n:
            _position(model_name, pos).inc(n)
    for r in records:
        if r.proposed:
            m["ratio"].observe(r.ratio)
            m["budget"].observe(r.budget or 0)
        if r.selection_us:
            m["selection"].observe(r.selection_us / 1e6)

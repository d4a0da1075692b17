"""Offline generation with a real vLLM engine, measured: what ``dcut generate`` and the sweep run."""

from __future__ import annotations

import gc
import hashlib
import json
import statistics
import time
from typing import Any

from dcut.settings import DCutSettings, EngineSettings, renamed_mode
from dcut.snapshot import DCutSnapshot, WindowSummary
from dcut.speculation import EXTRA_ARG

GENERATE_MODES = ("none", "full", "fixed", "reference", "continuous", "per_request", "joint")


def settings_for_mode(mode: str, base: EngineSettings) -> EngineSettings:
    """The one construction of every benchmark's modes. ``none``: no speculation (no drafter); ``full``: every
    draft verified (D-Cut in mode full: it counts, cuts nothing); ``fixed``/``reference``/``continuous``/
    ``per_request``/``joint``: D-Cut in that mode, with base's D-Cut settings."""
    if mode not in GENERATE_MODES:
        raise ValueError(unknown_mode(mode, GENERATE_MODES))
    dcut = base.dcut or DCutSettings()
    if mode == "none":
        return base.model_copy(update={"method": "none", "draft": None, "dcut": None})
    return base.model_copy(update={"dcut": dcut.model_copy(update={"mode": mode})})


def dynamic_settings(base: EngineSettings, schedule: list[tuple[int, int, int]]) -> EngineSettings:
    """``dynamic``: vLLM's own dynamic speculation (K per batch size from ``schedule``: (bs from, bs to, K)
    ranges), every draft verified as in ``full`` (D-Cut counts, cuts nothing)."""
    if not schedule:
        raise ValueError("mode dynamic needs a schedule (bs ranges to K)")
    return settings_for_mode("full", base).model_copy(update={
        "spec_schedule": [tuple(r) for r in schedule], "num_speculative_tokens": max(k for _, _, k in schedule)})


def unknown_mode(mode: str, allowed: tuple[str, ...]) -> str:
    """Why ``mode`` is not one of ``allowed``: renamed (``dcut.settings.RENAMED_MODES``) or unknown."""
    return renamed_mode(mode) or f"unknown mode {mode!r}; choose from {', '.join(allowed)}"


def run_mode(settings: EngineSettings) -> str:
    """The mode a result row is labelled with: ``none`` without speculation, D-Cut's mode with D-Cut, and ``vllm``
    for vLLM's own speculation without D-Cut (``dcut: None`` with a drafter: every draft verified, no D-Cut
    figures; no benchmark mode builds it, ``full`` is D-Cut in mode full)."""
    if settings.method == "none":
        return "none"
    return settings.dcut.mode if settings.dcut is not None else "vllm"


def _dcut_fields(stats: DCutSnapshot | None, window: WindowSummary | None) -> dict[str, Any]:
    """The snapshot's figures a benchmark row carries (all None without D-Cut)."""
    w = window.model_dump(mode="json") if window else {}
    s = stats.model_dump(mode="json") if stats else {}
    return {
        "mean_accepted_length": w.get("mean_accepted_length"), "mean_keep_ratio": w.get("mean_keep_ratio"),
        "keep_ratio_histogram": w.get("keep_ratio_histogram"), "per_position_acceptance": w.get("position_acceptance"),
        "mean_step_ms": w.get("mean_step_ms"), "selection_us_median": s.get("selection_us_median"),
        "steps": w.get("steps"), "width_histogram": w.get("width_histogram"), "probe_steps": w.get("probe_steps"),
        "mean_verify_ms": w.get("mean_verify_ms"), "mean_draft_ms": w.get("mean_draft_ms"),
        "overhead_ms": s.get("overhead"), "width_survival": s.get("width_survival"),
        "cost_table": s.get("cost_table"), "cost_source": s.get("cost_source"), "dcut_settings": s.get("settings"),
        "calibration": s.get("calibration"),
    }


def token_ids_sha256(token_ids: list[list[int]]) -> str:
    """One hash over all generated token ids, in prompt order: equal hashes, identical outputs."""
    return hashlib.sha256(json.dumps(token_ids, separators=(",", ":")).encode()).hexdigest()


def generate(settings: EngineSettings, prompts: list[str], batch_sizes: list[int], max_tokens: int,
             temperature: float = 0.0, seed: int = 0, repeats: int = 1) -> list[dict[str, Any]]:
    """For each batch size: ``max_tokens`` for that many prompts (cycled) at a steady batch; measured.

    One engine serves every batch size (max_num_seqs = the largest), so they share one cost table.
    Each batch size is first run once untimed on other prompts (one-time work: compilation of new
    shapes, first-use kernels, D-Cut learning acceptance), then ``repeats`` timed runs; tokens/s
    is their median, with the spread. The stats cover the timed runs.
    """
    from vllm import LLM, SamplingParams

    from dcut.vllm.api import read_snapshot, reset_stats
    from dcut.vllm.engine import engine_kwargs

    settings = settings.model_copy(update={"max_num_seqs": max(batch_sizes)})
    with_dcut = settings.with_dcut
    start = time.perf_counter()
    llm = _build_engine(LLM, engine_kwargs(settings))
    startup_s = time.perf_counter() - start
    # sampled and seeded: the engine's cap given as the request's own, or D-Cut decodes it plainly (dcut.speculation)
    default = settings.dcut.default_max_width if settings.dcut else None
    cap = {EXTRA_ARG: settings.num_speculative_tokens if default is None else default} \
        if with_dcut and temperature > 0 else None
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True,
                            extra_args=cap)
    results = []
    for bs in batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(bs)]
        warmup = [prompts[(len(prompts) // 2 + i) % len(prompts)] for i in range(bs)]
        llm.generate(warmup, params, use_tqdm=False)
        if with_dcut:
            reset_stats(llm)
        walls = []
        for _ in range(repeats):
            start = time.perf_counter()
            outputs = llm.generate(batch, params, use_tqdm=False)
            walls.append(time.perf_counter() - start)
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        produced = sum(len(t) for t in token_ids)
        rates = sorted(produced / w for w in walls if w > 0)
        wall = statistics.median(walls)
        stats = read_snapshot(llm) if with_dcut else None
        window = stats.window if stats else None
        results.append({
            "model": settings.model,
            "draft": settings.draft,
            "method": settings.method,
            "mode": run_mode(settings),
            "k": settings.num_speculative_tokens if settings.method != "none" else 0,
            "batch_size": bs,
            "max_tokens": max_tokens,
            "generated_tokens": produced,
            "wall_s": wall,
            "startup_s": startup_s,
            "repeats": repeats,
            "tokens_per_s": statistics.median(rates) if rates else 0.0,
            "tokens_per_s_min": rates[0] if rates else 0.0,
            "tokens_per_s_max": rates[-1] if rates else 0.0,
            **_dcut_fields(stats, window),
            "token_ids_sha256": token_ids_sha256(token_ids),
        })
    del llm
    return results


def _build_engine(llm_cls: Any, kwargs: dict[str, Any]) -> Any:
    """``LLM(**kwargs)`` with the garbage collector held off while it compiles.

    vLLM's CPU GEMM handles (``vllm._custom_ops.CPUDNNLGEMMHandler``) call ``.item()`` in
    ``__del__``; when an earlier engine's handles are collected while dynamo traces the new engine
    under fake-tensor mode, that raises inside ``__del__``, prints a recursive repr, and once in a
    while overflows the stack and aborts the process. Collect first, then build with GC off.
    """
    gc.collect()
    gc.disable()
    try:
        return llm_cls(**kwargs)
    finally:
        gc.enable()


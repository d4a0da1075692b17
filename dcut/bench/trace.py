"""Record replay traces with a real vLLM engine (``dcut trace``): one file per batch size.

The engine verifies every draft and rotates the drafted width step by step (``DCutSettings.trace``),
so each request's true accepted length is known at every width it drafted. Each batch size runs
every prompt once (in batches of that size, ``max_tokens`` each) after one untimed warm-up batch.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from tqdm import tqdm

from dcut.bench.generate import _build_engine, settings_for_mode
from dcut.machine import machine_info, provenance
from dcut.settings import EngineSettings
from dcut.trace import Trace


def record(settings: EngineSettings, prompts: list[str], batch_sizes: list[int], max_tokens: int,
           out: Path, widths: list[int], pair: str | None = None) -> list[Path]:
    """Write ``out/bs<N>.npz`` for each batch size (and the engine's cost table); the traces' paths."""
    from vllm import LLM, SamplingParams

    from dcut.vllm.api import clear_trace, read_cost_table, save_trace
    from dcut.vllm.engine import engine_kwargs

    tmp = Path(tempfile.mkdtemp(prefix="dcut-trace-"))
    settings = settings_for_mode("full", settings)  # every draft verified, D-Cut counting: the benchmarks' full
    assert settings.dcut is not None
    dcut = settings.dcut.model_copy(update={"trace": str(tmp), "trace_widths": widths})
    settings = settings.model_copy(update={"dcut": dcut, "max_num_seqs": max(batch_sizes)})
    llm = _build_engine(LLM, engine_kwargs(settings))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    written = []
    for bs in tqdm(batch_sizes, desc="dcut trace", unit="batch size"):
        llm.generate(prompts[:bs], params, use_tqdm=False)  # warm-up: shapes first seen here
        clear_trace(llm)
        for start in range(0, len(prompts), bs):
            llm.generate(prompts[start:start + bs], params, use_tqdm=False)
        raw = save_trace(llm)
        if raw is None:
            raise RuntimeError("the engine recorded no trace (is the D-Cut plugin installed?)")
        trace = Trace.load(raw)
        trace.meta.update({"source": "vllm", "pair": pair, "model": settings.model, "draft": settings.draft,
                           "batch_size": bs, "max_tokens": max_tokens, "prompts": len(prompts),
                           "widths": widths, "machine": machine_info(), **provenance()})
        path = out / f"bs{bs}.npz"
        trace.save(path)
        written.append(path)
        clear_trace(llm)
    table = read_cost_table(llm)
    if table is not None:  # the engine's own table, profiled on this machine: the replay's cost model
        (out / "cost_table.json").write_text(json.dumps(table, indent=1) + "\n")
    del llm
    return written

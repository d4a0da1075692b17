"""The built-in replay cases: which trace meets which cost model.

- ``deep-cpu``: the deep pair's recorded trace (``docs/replay/traces/deep``) against the cost table the
  recording engine profiled on this kind of machine, with the engine overhead fitted from the trace;
- ``h20-paper``: synthetic traces calibrated to the source document (``dcut.replay.synthetic``) against the
  Qwen3-8B-on-H20 roofline fitted to its verify costs (``dcut.replay.roofline``): the paper check;
- ``deep-h20``: the deep pair's trace against the H20 roofline (our drafter's acceptance, a GPU's costs);
- ``gpu-script-tiny``: synthetic traces against the cost table written by ``dcut/bench/gpu_costs.py`` run on
  this CPU at a tiny shape: the measured-GPU path end to end (format, not figures).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dcut.replay.costs import CostModel, linear_fit
from dcut.replay.report import Case
from dcut.trace import Trace

DOCS = Path("docs/replay")
DEEP_TRACE = DOCS / "traces" / "deep"
GPU_TINY = DOCS / "costs" / "gpu-script-tiny-cpu.json"
PAPER_SIZES = [4, 8, 16, 32, 64]
SIZES = [1, 4, 8, 16, 32, 64]


def load_traces(path: Path) -> Trace:
    """A trace file, or every ``*.npz`` of a folder (sorted by name) as one trace."""
    files = sorted(path.glob("*.npz")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no trace (.npz) in {path}")
    traces = [Trace.load(f) for f in files]
    return traces[0] if len(traces) == 1 else Trace.concat(traces, {**traces[0].meta, "files": [f.name for f in files]})


def engine_overhead(trace: Trace) -> tuple[float, float]:
    """``(per_step_ms, per_token_ms)`` of the engine's time between steps, fitted on a recorded trace.

    The gap before step s follows step s-1, which emitted ``bs + accepted drafts of step s-2``; gaps
    over 50 ms (an idle engine between batches) are not overhead, as in ``EngineOverhead``. Medians
    per batch size first, so a few slow steps do not tilt the line.
    """
    accepted = np.add.reduceat(np.maximum(trace.accepted, 0), trace.step_offsets[:-1]).astype(np.float64)
    accepted[np.diff(trace.step_offsets) == 0] = 0.0
    emitted = trace.step_bs[1:-1] + accepted[:-2]
    gap = trace.overhead_ms[2:].astype(np.float64)
    ok = np.isfinite(gap) & (gap <= 50.0)
    bs = trace.step_bs[1:-1][ok]
    x = np.asarray([np.median(emitted[ok][bs == b]) for b in np.unique(bs)])
    y = np.asarray([np.median(gap[ok][bs == b]) for b in np.unique(bs)])
    return linear_fit(x, y)


def recorded_cost_model(trace_dir: Path) -> CostModel:
    """The recording engine's profiled table plus the engine overhead fitted from its trace."""
    data = json.loads((trace_dir / "cost_table.json").read_text())
    per_step, per_token = engine_overhead(load_traces(trace_dir))
    notes = [f"verify and drafter costs: the cost table the recording engine profiled at start "
             f"({data['fingerprint']['hardware']}), before any live refinement",
             f"engine overhead fitted on the trace's gaps between steps: {per_step:.3f} ms + {per_token:.4f} ms "
             "per emitted token",
             "plain decoding step: the table's verify cost at bs tokens (the drafter engine's plain path)"]
    data.update({"name": f"{trace_dir.name}-cpu", "offsets": {}, "plain_offsets": {},
                 "overhead": {"per_step_ms": per_step, "per_token_ms": per_token}, "notes": notes})
    return CostModel.from_json(data)


def deep_cpu() -> Case:
    return Case("deep-cpu", load_traces(DEEP_TRACE), recorded_cost_model(DEEP_TRACE), SIZES,
                "deep pair, recorded on this CPU; this CPU's profiled costs")


def h20_paper() -> Case:
    from dcut.replay.roofline import h20_cost_model
    from dcut.replay.synthetic import paper_trace

    return Case("h20-paper", paper_trace(), h20_cost_model(), PAPER_SIZES,
                "synthetic drafts calibrated to the source document; Qwen3-8B on one H20 (roofline fit)")


def deep_h20() -> Case:
    from dcut.replay.roofline import h20_cost_model

    return Case("deep-h20", load_traces(DEEP_TRACE), h20_cost_model(), SIZES,
                "deep pair's recorded drafts; Qwen3-8B on one H20 (roofline fit): a projection")


def gpu_script_tiny() -> Case:
    from dcut.replay.synthetic import paper_trace

    return Case("gpu-script-tiny", paper_trace(), CostModel.load(GPU_TINY), [1, 2, 4],
                "dcut/bench/gpu_costs.py's output format, run at a tiny shape on this CPU (format check, not figures)")


CASES: dict[str, Callable[[], Case]] = {"deep-cpu": deep_cpu, "h20-paper": h20_paper, "deep-h20": deep_h20,
                                        "gpu-script-tiny": gpu_script_tiny}


def custom_case(trace: Path, costs: Path, batch_sizes: str | None) -> Case:
    cost = CostModel.load(costs)
    sizes = [int(b) for b in batch_sizes.split(",")] if batch_sizes else cost.batch_sizes()
    return Case(trace.stem, load_traces(trace), cost, sizes, f"{trace} against {costs}")

"""The built-in replay cases: which trace meets which cost model.

- ``deep-cpu``: the deep pair's recorded trace (``docs/results/replay/traces/deep``) against what the recording
  engine's steps cost on this kind of machine (``recorded_cost_model``);
- ``deep-intel``: the same pair's trace recorded on the Intel Xeon box (``docs/results/replay/traces/deep-intel``,
  widths 1 / 3 / 7 / 15) against that box's own steps: another machine's costs;
- ``moe-cpu``: the same for the MoE pair (``docs/results/replay/traces/moe``, bs 1 and 4): a drafter under-confident
  deep in its block, where a policy's calibration and width pricing are tested hardest;
- ``h20-paper``: synthetic traces calibrated to the source document (``dcut.replay.synthetic``) against the
  Qwen3-8B-on-H20 roofline fitted to its verify costs (``dcut.replay.roofline``): the paper check;
- ``deep-h20``: the deep pair's trace against the H20 roofline (our drafter's acceptance, a GPU's costs);
- ``gpu-script-tiny``: synthetic traces against the cost table written by ``dcut/bench/gpu_costs.py`` run on
  this CPU at a tiny shape: the measured-GPU path end to end (format, not figures).

D-Cut's own host work a step (``dcut.replay.host``) is charged to the policies that decide with it: on the CPU
cases what ``joint``'s hooks cost live over a speculating engine's (``CPU_HOST``), on the H20 cases its whole step
work with warm caches (``WARM_HOST``), measured on this CPU: a GPU host's may be faster.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dcut.cost_table import CostTable
from dcut.overhead import linear_fit
from dcut.replay.costs import CostModel
from dcut.replay.host import HostWork
from dcut.replay.report import Case
from dcut.trace import Trace

DOCS = Path("docs/results/replay")
DEEP_TRACE = DOCS / "traces" / "deep"
DEEP_INTEL_TRACE = DOCS / "traces" / "deep-intel"
MOE_TRACE = DOCS / "traces" / "moe"
GPU_TINY = DOCS / "costs" / "gpu-script-tiny-cpu.json"
CPU_HOST = DOCS / "costs" / "dcut-host-cpu.json"  # python -m dcut.replay.host --compare (a live breakdown)
WARM_HOST = DOCS / "costs" / "dcut-host-warm.json"  # python -m dcut.replay.host --bench (dcut bench-policy --step)
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


def live_costs(trace: Trace, sizes: list[int], min_steps: int = 3) -> tuple[dict[int, list[tuple[int, float, int]]],
                                                                           dict[int, dict[int, tuple[float, int]]]]:
    """Verify and drafter costs of the recorded engine's own steps, medians per (batch size, width).

    A traced step verifies every draft of the step before it, so its verify time is the cost of
    ``bs * (1 + previous width)`` tokens; its drafter time, the cost of drafting its width."""
    previous = np.concatenate([[0], trace.step_width[:-1]])
    points: dict[int, list[tuple[int, float, int]]] = {}
    draft: dict[int, dict[int, tuple[float, int]]] = {}
    for b in sizes:
        for w in trace.widths():
            verify = trace.verify_ms[(trace.step_bs == b) & (previous == w)]
            drafter = trace.draft_ms[(trace.step_bs == b) & (trace.step_width == w)]
            if np.isfinite(verify).sum() >= min_steps:
                points.setdefault(b, []).append((b * (1 + w), float(np.nanmedian(verify)), int(len(verify))))
            if np.isfinite(drafter).sum() >= min_steps:
                draft.setdefault(b, {})[w] = (float(np.nanmedian(drafter)), int(len(drafter)))
    return points, draft


def recorded_cost_model(trace_dir: Path, host: HostWork | None = None) -> CostModel:
    """What the recording engine's steps cost, measured live; the table it profiled at start as the prior.

    Verify and drafter costs: medians of the trace's own steps (``live_costs``). A step verifying no
    drafts, and the drafter at width 0 (which a trace never runs): from a measured run without speculation
    (``plain-generate.jsonl``: ``dcut generate --mode none``; the committed file's name) and the profile.
    Engine overhead: fitted on the trace's gaps between steps. ``host``: D-Cut's decision's host work a step."""
    profiled = json.loads((trace_dir / "cost_table.json").read_text())
    trace = load_traces(trace_dir)
    per_step, per_token = engine_overhead(trace)
    none = {}  # ms per step of none (no speculation), overhead excluded
    for line in (trace_dir / "plain-generate.jsonl").read_text().splitlines():
        row = json.loads(line)
        b = int(row["batch_size"])
        none[b] = 1000.0 * b / row["tokens_per_s"] - (per_step + per_token * b)
    points, draft = live_costs(trace, sorted(none))
    prior = CostTable.from_json({**profiled, "offsets": {}, "plain_offsets": {}})
    for b in points:
        points[b].append((b, none[b], 1))
        draft[b][0] = prior.draft[prior.covering(b)][0]
    table = CostTable(prior.fingerprint, points, draft=draft).smoothed()
    notes = [f"verify and drafter costs: medians of the recorded engine's steps "
             f"({prior.fingerprint.hardware}), per batch size and width; the drafter at width 0 from its profile",
             "a step of none (no speculation): its measured tokens/s (plain-generate.jsonl), less the overhead",
             f"engine overhead fitted on the trace's gaps between steps: {per_step:.3f} ms + {per_token:.4f} ms "
             "per emitted token",
             "policies start from the engine's profiled table (dummy steps at start), as a live engine does"]
    return CostModel(f"{trace_dir.name}-cpu", table, per_step, per_token, none, notes, prior, host)


def _h20(cost: CostModel) -> CostModel:
    """The H20 roofline's cost model, charging D-Cut's warm host work (its engine ran no hooks of ours)."""
    return dataclasses.replace(cost, host=HostWork.load(WARM_HOST))


def _recorded(name: str, trace_dir: Path, sizes: list[int], description: str) -> Case:
    """A trace against what its recording engine's steps cost (``recorded_cost_model``), D-Cut's hooks at
    ``CPU_HOST``."""
    return Case(name, load_traces(trace_dir), recorded_cost_model(trace_dir, HostWork.load(CPU_HOST)), sizes,
                description)


def deep_cpu() -> Case:
    return _recorded("deep-cpu", DEEP_TRACE, SIZES, "deep pair, recorded on this CPU (AMD EPYC); its costs")


def deep_intel() -> Case:
    return _recorded("deep-intel", DEEP_INTEL_TRACE, SIZES, "deep pair, recorded on the Intel Xeon box; its costs")


def moe_cpu() -> Case:
    return _recorded("moe-cpu", MOE_TRACE, [1, 4], "MoE pair, recorded on this CPU (AMD EPYC); its costs")


def h20_paper() -> Case:
    from dcut.replay.roofline import h20_cost_model
    from dcut.replay.synthetic import paper_trace

    return Case("h20-paper", paper_trace(), _h20(h20_cost_model()), PAPER_SIZES,
                "synthetic drafts calibrated to the source document; Qwen3-8B on one H20 (roofline fit)")


def deep_h20() -> Case:
    from dcut.replay.roofline import h20_cost_model

    return Case("deep-h20", load_traces(DEEP_TRACE), _h20(h20_cost_model()), SIZES,
                "deep pair's recorded drafts; Qwen3-8B on one H20 (roofline fit): a projection")


def gpu_script_tiny() -> Case:
    from dcut.replay.synthetic import paper_trace

    return Case("gpu-script-tiny", paper_trace(), CostModel.load(GPU_TINY), [1, 2, 4],
                "dcut/bench/gpu_costs.py's output format, run at a tiny shape on this CPU (format check, not figures)")


CASES: dict[str, Callable[[], Case]] = {"deep-cpu": deep_cpu, "deep-intel": deep_intel, "moe-cpu": moe_cpu,
                                        "h20-paper": h20_paper, "deep-h20": deep_h20,
                                        "gpu-script-tiny": gpu_script_tiny}


def custom_case(trace: Path, costs: Path, batch_sizes: str | None, context: float | None = None) -> Case:
    cost = CostModel.load(costs)
    sizes = [int(b) for b in batch_sizes.split(",")] if batch_sizes else cost.batch_sizes()
    at = "" if context is None else f", every step at context {context:g}"
    return Case(trace.stem, load_traces(trace), cost, sizes, f"{trace} against {costs}{at}", context)

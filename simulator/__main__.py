"""``python -m simulator --out docs/experiments/2026-12-01-autoscaling``: every trace at every fleet size under the
app's knobs, a knob sweep at one fleet size, the knobs chosen from it; results.json, README.md and plots in
``--out``."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml
from ray.serve._private.constants import CONTROL_LOOP_INTERVAL_S
from ray.serve.config import AutoscalingConfig
from tqdm import tqdm

from dcut.cost_table import CostTable
from dcut.machine import machine_info, provenance
from deployments.settings import AutoscalingSettings
from simulator.report import choose, main_table, plot_runs, plot_sweep, plotted, readme, summarize
from simulator.run import (
    ReplicaModel,
    RunResult,
    full_mode_acceptance,
    knobs_of,
    load_settings,
    replica_capacity,
    simulate,
)
from simulator.serve import metric_intervals
from simulator.traces import TRACES, Trace, make_trace


def run_trace(trace: Trace, fleet: int, settings: AutoscalingSettings, replica: ReplicaModel, reference: float,
              step_tick_s: float, long_tick_s: float, keep_series: bool) -> list[RunResult]:
    """A long trace once; the step once per phase of the handle's push, whose timing decides the reaction."""
    if trace.step_at_s is None:
        return [simulate(trace, fleet, settings, replica, reference, long_tick_s, 1, keep_series)]
    push_s = metric_intervals(AutoscalingConfig(**settings.serve_config()))[1]
    phases = range(1, int(push_s) + 1)
    return [simulate(trace, fleet, settings, replica, reference, step_tick_s, p, keep_series) for p in phases]


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _fleets(text: str) -> list[int]:
    values = _floats(text)
    if any(v < 1 or v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1, got {text!r}")
    return [int(v) for v in values]


def _delays(text: str) -> list[tuple[float, float]]:
    try:
        pairs = [tuple(float(x) for x in pair.split(":")) for pair in text.split(",") if pair.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected up:down pairs of seconds, got {text!r}") from e
    if not pairs or any(len(p) != 2 or min(p) < 0 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected up:down pairs of non-negative seconds, got {text!r}")
    return pairs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m simulator", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="folder for results.json, README.md and the plots")
    p.add_argument("--config", type=Path, default=Path("app.config.yaml"), help="app config: knobs, replica")
    p.add_argument("--cost-table", type=Path, default=Path("docs/experiments/2026-12-01-profile-deep/cost_table.json"))
    p.add_argument("--acceptance", type=Path, default=Path("docs/experiments/2026-12-01-sweep-deep/sweep.json"),
                   help="a `dcut sweep` JSON: the acceptance per position of its mode=full rows")
    p.add_argument("--fleets", type=_fleets, default=[1, 10, 100, 500], help="replicas the peak needs")
    p.add_argument("--traces", type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
                   default=list(TRACES), help=f"any of {','.join(TRACES)}")
    p.add_argument("--noise", type=float, default=0.03, help="relative demand noise of the long traces")
    p.add_argument("--seed", type=int, default=0, help="seed of the noise and the bursts")
    p.add_argument("--long-tick", type=float, default=1.0, help="control period (s) of the long traces")
    p.add_argument("--sweep-fleet", type=int, default=500, help="fleet of the knob sweep (0: no sweep)")
    p.add_argument("--target-utilization", type=_floats, default=[0.6, 0.7, 0.8])
    p.add_argument("--hysteresis", type=_floats, default=[0.1, 0.2, 0.3])
    p.add_argument("--delays", type=_delays, default=[(5, 60), (5, 120), (10, 120), (30, 300)],
                   help="upscale:downscale delay pairs (s), comma-separated")
    p.add_argument("--sweep-step-tick", type=float, default=1.0, help="control period (s) of the sweep's step")
    p.add_argument("--sweep-tick", type=float, default=2.0, help="control period (s) of the sweep's long traces")
    args = p.parse_args(argv)
    bad = [t for t in args.traces if t not in TRACES]
    if bad or not args.traces:
        p.error(f"--traces: unknown {bad or 'none given'}; choose from {', '.join(TRACES)}")
    if min(args.long_tick, args.sweep_step_tick, args.sweep_tick) <= 0 or args.sweep_fleet < 0 or args.noise < 0:
        p.error("ticks must be > 0, --sweep-fleet and --noise >= 0")
    for path in (args.config, args.cost_table, args.acceptance):
        if not path.is_file():
            p.error(f"no such file: {path}")
    return args


def replica_model(args: argparse.Namespace) -> tuple[ReplicaModel, AutoscalingSettings]:
    """The simulated replica and the app's knobs, from the files the command line names."""
    replica_settings, max_num_seqs = load_settings(args.config)
    base = replica_settings.autoscaling
    acceptance = full_mode_acceptance(json.loads(args.acceptance.read_text()), max_num_seqs)
    replica = ReplicaModel(
        capacity_tokens_per_s=replica_capacity(CostTable.load(args.cost_table), acceptance, max_num_seqs,
                                               base.request_tokens_per_s),
        default_capacity_tokens_per_s=replica_settings.default_capacity_tokens_per_s,
        estimates_after_s=replica_settings.telemetry_interval_s, request_tokens_per_s=base.request_tokens_per_s,
        max_ongoing_requests=replica_settings.max_ongoing_requests, max_num_seqs=max_num_seqs)
    return replica, base


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        replica, base = replica_model(args)
    except (ValueError, KeyError, TypeError, yaml.YAMLError) as e:  # malformed config, table or sweep JSON
        print(f"python -m simulator: cannot build the replicas: {e!r}", file=sys.stderr)
        return 2
    traces = {name: make_trace(name, args.seed, args.noise) for name in args.traces}

    def settings(fleet: int, **knobs: float) -> AutoscalingSettings:
        return base.model_copy(update={"min_replicas": 1, "initial_replicas": None, "max_replicas": 2 * fleet,
                                       **knobs})

    results: list[RunResult] = []
    for fleet, name in tqdm(list(itertools.product(args.fleets, args.traces)), desc="traces x fleets"):
        results += run_trace(traces[name], fleet, settings(fleet), replica, base.target_utilization,
                             CONTROL_LOOP_INTERVAL_S, args.long_tick, fleet == max(args.fleets))
    sweep_runs: list[RunResult] = []
    if args.sweep_fleet:
        grid = [{"target_utilization": tu, "hysteresis": h, "upscale_delay_s": up, "downscale_delay_s": down}
                for tu, h, (up, down) in itertools.product(args.target_utilization, args.hysteresis, args.delays)]
        if knobs_of(base) not in grid:  # the app's own knobs set the bursty bar (`choose`)
            grid.append(knobs_of(base))
        for knobs, name in tqdm(list(itertools.product(grid, args.traces)), desc="knob sweep"):
            sweep_runs += run_trace(traces[name], args.sweep_fleet, settings(args.sweep_fleet, **knobs), replica,
                                    base.target_utilization, args.sweep_step_tick, args.sweep_tick, False)
    summaries, sweep = summarize(results), summarize(sweep_runs)
    choice = choose(sweep, knobs_of(base)) if sweep else None

    panels = plotted(results, summaries)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m simulator " + " ".join(argv if argv is not None else sys.argv[1:])
    machine = machine_info()
    (args.out / "results.json").write_text(json.dumps({
        "command": command, "machine": machine, **provenance(), "replica": replica.model_dump(),
        "base_knobs": base.model_dump(),
        "summaries": [s.model_dump() for s in summaries], "sweep": [s.model_dump() for s in sweep],
        "choice": choice.model_dump() if choice else None,
        "series": [r.model_dump(include={"trace", "fleet", "phase_s", "series"}) for _, r in panels]},
        indent=1) + "\n")
    plot_runs(panels, args.out / "replicas.png")
    if choice is not None:
        plot_sweep(sweep, choice, args.out / "sweep.png")
    (args.out / "README.md").write_text(readme(args, command, machine, replica, base, summaries, sweep, choice))
    print(main_table(summaries))
    if choice is not None:
        print(f"\nchosen: {choice.knobs} (passes: {choice.passed})")
    return 0

if __name__ == "__main__":
    sys.exit(main())

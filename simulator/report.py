"""What the runs add up to: summaries over a step's phases, the bars a knob setting must pass and the choice among
those that do, the tables, the plots and the README of ``docs/experiments/2026-12-01-autoscaling/``."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from pydantic import BaseModel
from ray.serve._private.constants import CONTROL_LOOP_INTERVAL_S

from deployments.settings import AutoscalingSettings
from simulator.run import ReplicaModel, RunResult
from simulator.traces import TRACES, TraceName

SMOOTH_TRACES: tuple[TraceName, ...] = ("ramp", "diurnal")  # demand a fleet should follow without losing any
MAX_UNSERVED_PCT = 0.5  # of the smooth traces' demand, above the ready replicas' full capacity


class Summary(BaseModel):
    """One trace at one fleet size and knob setting; the step over every phase of the handle's metric push."""

    trace: TraceName
    fleet: int
    knobs: dict[str, float]
    runs: int
    decision_period_s: float
    reaction_s_worst: float | None  # None: some phase never got within 10%
    reaction_s_median: float | None
    ready_reaction_s_worst: float | None
    over_provisioning_pct: float
    under_provisioning_pct: float
    unserved_pct: float
    cost_vs_minimum: float
    direction_changes_per_h: float
    ideal_direction_changes_per_h: float
    flaps: int  # the most over the runs

    @property
    def reaction_periods_worst(self) -> float | None:
        return None if self.reaction_s_worst is None else self.reaction_s_worst / self.decision_period_s


def summarize(results: list[RunResult]) -> list[Summary]:
    groups: dict[tuple, list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.trace, r.fleet, tuple(r.knobs.items())), []).append(r)
    out = []
    for (trace, fleet, knobs), runs in groups.items():
        s = [r.scores for r in runs]
        reactions = [x.reaction_s for x in s]
        ready = [x.ready_reaction_s for x in s]
        known = [x for x in reactions if x is not None]
        out.append(Summary(
            trace=trace, fleet=fleet, knobs=dict(knobs), runs=len(runs), decision_period_s=s[0].decision_period_s,
            reaction_s_worst=None if None in reactions or not known else max(known),
            reaction_s_median=statistics.median(known) if known else None,
            ready_reaction_s_worst=None if None in ready or not ready else max(ready),
            over_provisioning_pct=statistics.mean(x.over_provisioning_pct for x in s),
            under_provisioning_pct=statistics.mean(x.under_provisioning_pct for x in s),
            unserved_pct=statistics.mean(x.unserved_pct for x in s),
            cost_vs_minimum=statistics.mean(x.cost_vs_minimum for x in s),
            direction_changes_per_h=statistics.mean(x.direction_changes / x.hours for x in s),
            ideal_direction_changes_per_h=statistics.mean(x.ideal_direction_changes / x.hours for x in s),
            flaps=max(x.flaps for x in s)))
    return out


def passes(by_trace: dict[str, Summary], bursty_unserved_pct: float = float("inf")) -> bool:
    """The issue's bar and two service bars: the step reached within 2 decision periods in every phase, no flap on
    any trace, at most MAX_UNSERVED_PCT of the smooth traces' demand above the ready capacity, and no more of the
    bursty trace's than ``bursty_unserved_pct`` (what the app's knobs leave: cost is not bought with bursts)."""
    step = by_trace.get("step")
    bursty = by_trace.get("bursty")
    return (step is None or (step.reaction_periods_worst is not None and step.reaction_periods_worst <= 2)) \
        and all(s.flaps == 0 for s in by_trace.values()) \
        and all(s.unserved_pct <= MAX_UNSERVED_PCT for t, s in by_trace.items() if t in SMOOTH_TRACES) \
        and (bursty is None or bursty.unserved_pct <= bursty_unserved_pct)


def cost(by_trace: dict[str, Summary]) -> float:
    """Replica-seconds held over those the demand needs at 100% utilisation, averaged over the long traces."""
    long = [s.cost_vs_minimum for t, s in by_trace.items() if t != "step"] or \
        [s.cost_vs_minimum for s in by_trace.values()]
    return statistics.mean(long)


class Choice(BaseModel):
    knobs: dict[str, float]
    passed: bool
    rule: str
    bursty_unserved_pct: float  # the bar: what the app's knobs leave unserved of the bursty trace


def by_knobs(sweep: list[Summary]) -> dict[tuple, dict[str, Summary]]:
    out: dict[tuple, dict[str, Summary]] = {}
    for s in sweep:
        out.setdefault(tuple(s.knobs.items()), {})[s.trace] = s
    return out


def choose(sweep: list[Summary], base: dict[str, float]) -> Choice:
    """The cheapest setting that passes (`passes`, `cost`), the bursty bar set by the ``base`` knobs' run; the
    cheapest of all when none passes."""
    settings = by_knobs(sweep)
    baseline = settings.get(tuple(base.items()), {}).get("bursty")
    bar = baseline.unserved_pct if baseline is not None else float("inf")
    passing = [k for k, v in settings.items() if passes(v, bar)]
    best = min(passing or settings, key=lambda k: cost(settings[k]))
    rule = (f"lowest mean cost over the long traces among the settings that reach the step within 2 decision "
            f"periods in every phase, never flap, leave at most {MAX_UNSERVED_PCT}% of the ramp's and the "
            f"diurnal's demand unserved and no more of the bursty trace's than the app's knobs ({bar:.2f}%)")
    return Choice(knobs=dict(best), passed=bool(passing), rule=rule if passing else "none passes: " + rule,
                  bursty_unserved_pct=bar)


# ---- tables, plots, README -------------------------------------------------------------------------------------------


def _s(x: float | None, fmt: str = "{:.0f}") -> str:
    return "never" if x is None else fmt.format(x)


def main_table(summaries: list[Summary]) -> str:
    rows = ["| trace | fleet | reaction s: worst (median) | worst, decision periods | ready s: worst | "
            "over % | under % | unserved % | cost | direction changes /h (ideal) | flaps |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        step = s.trace == "step"
        rows.append(
            f"| {s.trace} | {s.fleet} | {f'{_s(s.reaction_s_worst)} ({_s(s.reaction_s_median)})' if step else ''} | "
            f"{_s(s.reaction_periods_worst, '{:.1f}') if step else ''} | "
            f"{_s(s.ready_reaction_s_worst) if step else ''} | {s.over_provisioning_pct:.1f} | "
            f"{s.under_provisioning_pct:.1f} | {s.unserved_pct:.2f} | {s.cost_vs_minimum:.2f} | "
            f"{s.direction_changes_per_h:.2f} ({s.ideal_direction_changes_per_h:.2f}) | {s.flaps} |")
    return "\n".join(rows)


def sweep_table(sweep: list[Summary], choice: Choice) -> str:
    settings = by_knobs(sweep)
    traces = [t for t in TRACES if any(t in v for v in settings.values())]
    rows = [f"| target | hyst. | up s | down s | step worst s (periods) | flaps {'/'.join(traces)} | unserved % "
            f"{'/'.join(traces)} | cost | passes |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for knobs, by in settings.items():
        k = dict(knobs)
        step = by.get("step")
        reaction = "" if step is None else \
            f"{_s(step.reaction_s_worst)} ({_s(step.reaction_periods_worst, '{:.1f}')})"
        chosen = " **chosen**" if choice.knobs == k else ""
        rows.append(f"| {k['target_utilization']} | {k['hysteresis']} | {k['upscale_delay_s']:.0f} | "
                    f"{k['downscale_delay_s']:.0f} | {reaction} | {'/'.join(str(by[t].flaps) for t in traces)} | "
                    f"{'/'.join(f'{by[t].unserved_pct:.2f}' for t in traces)} | {cost(by):.3f} | "
                    f"{'yes' if passes(by, choice.bursty_unserved_pct) else 'no'}{chosen} |")
    return "\n".join(rows)


def plotted(results: list[RunResult], summaries: list[Summary]) -> list[tuple[Summary, RunResult]]:
    """The runs kept with their series, one a trace: the step's slowest phase."""
    panels = []
    for s in summaries:
        runs = [r for r in results if r.series is not None and r.trace == s.trace and r.fleet == s.fleet]
        if runs:
            panels.append((s, max(runs, key=lambda r: r.scores.reaction_s if r.scores.reaction_s is not None
                                  else float("inf"))))
    return panels


def plot_runs(panels: list[tuple[Summary, RunResult]], path: Path) -> None:
    """Serve's target and the ready replicas against the ideal, one panel a trace."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.7 * len(panels)), squeeze=False)
    for ax, (s, r) in zip(axes[:, 0], panels, strict=True):
        hours = s.trace != "step"
        t = [x / 3600 if hours else x for x in r.series.t_s]
        ax.plot(t, r.series.ideal, color="black", lw=0.8, label="ideal (demand now, no lag)")
        ax.step(t, r.series.target, where="post", color="tab:blue", lw=1, label="Serve's target")
        ax.step(t, r.series.ready, where="post", color="tab:orange", lw=1, alpha=0.8, label="ready replicas")
        extra = f"reaction {_s(s.reaction_s_worst)} s (worst phase), " if s.trace == "step" else ""
        ax.set_title(f"{s.trace}, fleet {s.fleet}: {extra}over {s.over_provisioning_pct:.1f}%, "
                     f"under {s.under_provisioning_pct:.1f}%, flaps {s.flaps}", fontsize=9)
        ax.set_xlabel("hours" if hours else "seconds")
        ax.set_ylabel("replicas")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(sweep: list[Summary], choice: Choice, path: Path) -> None:
    """Cost against unserved demand for every setting (passing ones in blue), and the step's worst reaction
    against the upscale delay."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for knobs, by in by_knobs(sweep).items():
        k = dict(knobs)
        unserved = by["bursty"].unserved_pct if "bursty" in by else 0.0
        ok = passes(by, choice.bursty_unserved_pct)
        color, z = ("tab:blue", 3) if ok else ("tab:red", 2)
        marker = "*" if k == choice.knobs else "o"
        a.scatter(cost(by), unserved, c=color, marker=marker, s=90 if marker == "*" else 16, zorder=z)
        a.annotate(f"{k['target_utilization']}/{k['hysteresis']}/{k['upscale_delay_s']:.0f}/"
                   f"{k['downscale_delay_s']:.0f}", (cost(by), unserved), fontsize=5)
        if "step" in by and by["step"].reaction_s_worst is not None:
            b.scatter(k["upscale_delay_s"], by["step"].reaction_s_worst, c=color, s=16, zorder=z)
    a.set_xlabel("cost: replica-seconds / those of the demand at 100%, mean over ramp, diurnal, bursty")
    a.set_ylabel("unserved demand of the bursty trace (%)")
    a.set_title("every setting (target/hysteresis/up/down); blue: passes, red: fails, star: chosen", fontsize=9)
    b.axhline(2 * sweep[0].decision_period_s, color="grey", lw=0.8, ls="--")
    b.set_xlabel("upscale_delay_s")
    b.set_ylabel("step: worst reaction over the push phases (s)")
    b.set_title("reaction to the step (dashed: 2 decision periods)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def readme(args: argparse.Namespace, command: str, machine: dict, replica: ReplicaModel, base: AutoscalingSettings,
           summaries: list[Summary], sweep: list[Summary], choice: Choice | None) -> str:
    knobs = {k: getattr(base, k) for k in ("target_utilization", "hysteresis", "upscale_delay_s",
                                           "downscale_delay_s", "look_back_period_s", "request_tokens_per_s")}
    parts = [
        "# The autoscaler at scale, simulated",
        "",
        "Made by `simulator/` (what it replays and how: its docstrings; the findings: "
        "`docs/history.md`, section 7):",
        "",
        f"```bash\n{command}\n```",
        "",
        f"Machine (the simulation's CPU, not the replicas'): {machine['cpu']}, {machine['cores']} cores, "
        f"Python {machine['python']}. Deterministic: same command, same numbers.",
        "",
        f"Replicas: `{args.cost_table}` (batch sizes up to max_num_seqs = {replica.max_num_seqs}) and the acceptance "
        f"of `{args.acceptance}` (mode full) give **{replica.capacity_tokens_per_s:.0f} tokens/s** per replica at "
        f"{replica.request_tokens_per_s:g} tokens/s per request; a replica holds at most "
        f"{replica.max_ongoing_requests} requests, reports {replica.default_capacity_tokens_per_s:g} tokens/s until "
        f"{replica.estimates_after_s:g} s after it got ready, and gets ready {replica.startup_s:g} s (+-15%) after "
        f"Serve starts it. Knobs of `{args.config}`: {knobs}; min 1, max 2 x fleet replicas. Demand noise "
        f"{args.noise:.0%} (relative, correlated over 2 min) on all but the step.",
        "",
        "Definitions:",
        "- **ideal**: `replicas_needed(demand, capacity, target_utilization)` for the demand of that second, no lag.",
        "- **decision period**: Serve's metric push interval, `metrics_interval_s` (10 s in Ray 2.60): the "
        "controller gets new evidence to decide on this often. Fixed across the sweep, "
        "so that a setting cannot pass the step's bar by lengthening its own period.",
        "- **reaction** (step, 10% -> 100% at 300 s): seconds until Serve's target is within 10% of the ideal; "
        "**ready**: until the ready replicas are. Worst and median over the 10 phases of the handle's metric push.",
        "- **over**: replica-seconds held (starting or ready) above the ideal, % of the ideal's; **under**: ready "
        "replica-seconds missing below the ideal, %; **unserved**: demand above the ready replicas' full capacity, "
        "% of all demand; **cost**: replica-seconds held / replica-seconds of the demand at 100% utilisation.",
        "- **direction changes**: reversals of Serve's target (up then down or down then up); ideal: those of the "
        "ideal for the noise-free demand; **flaps**: the excess.",
        "",
        f"Control tick: Serve's {CONTROL_LOOP_INTERVAL_S} s for the step, {args.long_tick} s for the long traces "
        f"(every metric event falls on a whole second). The sweep: {args.sweep_fleet} replicas, step tick "
        f"{args.sweep_step_tick} s, long traces {args.sweep_tick} s.",
        "",
        "## Every trace at every fleet size (the app's knobs)",
        "",
        main_table(summaries),
        "",
        "![replicas over time](replicas.png)",
    ]
    if sweep and choice is not None:
        parts += ["", f"## Knob sweep ({args.sweep_fleet} replicas)", "", sweep_table(sweep, choice), "",
                  f"**Chosen**: {choice.knobs} — {choice.rule}.", "", "![knob sweep](sweep.png)"]
    return "\n".join(parts) + "\n"

"""The load-test report: ``results.json`` (every run and every point's median/min/max), ``results.md`` (tables,
where each speculative arm stops paying against ``none``) and two plots, with portable paths only."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from loadtest.arms import ARMS
from loadtest.figures import (
    LATENCIES,
    PERCENTILES,
    PointFigures,
    StopsPaying,
    stops_paying,
    stops_paying_line,
    summarize_repeats,
)
from loadtest.results import portable

KINDS = {"users": ("Fixed concurrency (closed loop)", "users", "concurrent users"),
         "rate": ("Open-loop Poisson request rate", "req/s", "offered requests/s")}
# The figure each sweep is judged on (name, higher is better): closed loop, what the server delivers; open loop,
# where every arm delivers what is offered until it saturates, how long a request takes (queueing included).
PAYS_ON = {"users": ("output_tokens_per_s", True), "rate": ("e2e_p50_ms", False)}
STYLE = {"none": ("black", "o"), "full": ("tab:red", "s"), "dynamic": ("tab:orange", "^"), "joint": ("tab:blue", "D")}


def points(runs: list[dict]) -> list[dict[str, Any]]:
    """One record per (arm, kind, load): its repeats' figures summarised (median, min, max)."""
    grouped: dict[tuple[str, str, float], list[PointFigures]] = defaultdict(list)
    for run in runs:
        grouped[(run["arm"], run["kind"], run["load"])].append(PointFigures(**run["figures"]))
    order = {a: i for i, a in enumerate(ARMS)}
    return [{"arm": arm, "kind": kind, "load": load, "repeats": len(figs), "summary": summarize_repeats(figs)}
            for (arm, kind, load), figs in sorted(grouped.items(), key=lambda kv: (kv[0][1], order.get(kv[0][0], 9),
                                                                                  kv[0][2]))]


def stops_paying_all(pts: list[dict], kind: str, baseline: str = "none") -> list[StopsPaying]:
    metric, higher = PAYS_ON[kind]
    curve = lambda arm: {p["load"]: p["summary"][metric] for p in pts if p["arm"] == arm and p["kind"] == kind}  # noqa: E731
    arms = [a for a in ARMS if a != baseline and any(p["arm"] == a for p in pts)]
    return [stops_paying(arm, metric, curve(baseline), curve(arm), higher) for arm in arms]


def _cell(s: dict, fmt: str = "{:.1f}") -> str:
    if s["median"] is None:
        return "–"
    text = fmt.format(s["median"])
    if s["min"] != s["max"]:
        text += f" ({fmt.format(s['min'])}–{fmt.format(s['max'])})"
    return text


def _pcts(summary: dict, name: str) -> str:
    values = [summary[f"{name}_p{q}_ms"]["median"] for q in PERCENTILES]
    return " / ".join("–" if v is None else f"{v:.0f}" for v in values)


def tables(pts: list[dict], kind: str) -> list[str]:
    rows = [p for p in pts if p["kind"] == kind]
    if not rows:
        return []
    title, unit, _ = KINDS[kind]
    load = "users" if kind == "users" else "offered req/s"
    lines = [f"## {title}", "", "Median over the repeats, (min–max) when they differ.", "",
             f"| arm | {load} | requests | failed | unfinished | completed req/s | output tok/s | goodput req/s "
             "| goodput tok/s | accepted length | keep ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in rows:
        s = p["summary"]
        lines.append(f"| {p['arm']} | {p['load']:g} | {_cell(s['requests'], '{:.0f}')} | "
                     f"{_cell(s['failures'], '{:.0f}')} | {_cell(s['unfinished'], '{:.0f}')} | "
                     f"{_cell(s['requests_per_s'], '{:.2f}')} | {_cell(s['output_tokens_per_s'])} | "
                     f"{_cell(s['goodput_requests_per_s'], '{:.2f}')} | {_cell(s['goodput_tokens_per_s'])} | "
                     f"{_cell(s['mean_accepted_length'], '{:.2f}')} | {_cell(s['keep_ratio'], '{:.2f}')} |")
    lines += ["", "Latency percentiles p50 / p90 / p99 (ms), medians over the repeats:", "",
              f"| arm | {load} | TTFT | TPOT | ITL | E2E |", "|---|---:|---:|---:|---:|---:|"]
    for p in rows:
        lines.append(f"| {p['arm']} | {p['load']:g} | " + " | ".join(_pcts(p["summary"], n) for n in LATENCIES) + " |")
    return lines + [""]


def markdown(meta: dict, pts: list[dict], paying: dict[str, list[StopsPaying]], plots: list[Path]) -> str:
    setup = meta.get("setup", {})
    obj = setup.get("objectives", {})
    md = ["# Load test: " + " / ".join(f"`{a}`" for a in ARMS), ""]
    if setup.get("runs_done", 0) < setup.get("runs_planned", 0):
        md += [f"**Incomplete**: {setup['runs_done']} of {setup['runs_planned']} runs measured (the run stopped "
               "early; see its log).", ""]
    if setup.get("quick"):
        md += ["**The quick variant** (`--quick`: few points, one repeat, short runs): a look, not the full report "
               "(`make loadtest`).", ""]
    md += [f"Command: `{setup.get('command', '')}`. Started {meta.get('started')}, finished {meta.get('finished')}.",
           "", "Arms (same app, same prompts, request lengths and arrival times, same seeds):", ""]
    for arm, info in meta.get("arms", {}).items():
        e = info.get("engine", {})
        what = {"none": "no speculation, no drafter", "full": "every draft verified (D-Cut mode full)",
                "dynamic": f"vLLM dynamic speculation, K per batch size {e.get('spec_schedule')}, every draft "
                           "verified", "joint": f"D-Cut as shipped (D-Cut mode {e.get('dcut_mode')})"}.get(arm, "")
        md.append(f"- `{arm}`: {what}; ready after {info.get('ready_s')} s, {info.get('replicas_at_end')} "
                  "replicas at the end")
    if setup.get("spec_schedule_source"):
        md += ["", f"`dynamic`'s schedule: {setup['spec_schedule_source']}."]
    md += ["", f"Goodput objectives: TTFT ≤ {obj.get('ttft_ms', 0):g} ms and TPOT ≤ {obj.get('tpot_ms', 0):g} ms. "
           f"{setup.get('repeats')} repeat(s) per point; {setup.get('ramp_s', 0):g} s ramp/warm-up (not measured), "
           f"then {setup.get('duration_s', 0):g} s measured. Requests: {setup.get('max_tokens')} output tokens "
           f"(ignore_eos), prompts of {setup.get('prompt_chars')} characters from `{setup.get('prompt_file')}`, "
           f"{setup.get('chat_fraction')} chat, greedy, seed {setup.get('seed')}. Definitions: `loadtest/figures.py`; "
           "accepted length = drafts accepted per request-step (bonus token not counted) and keep ratio = drafts "
           "verified / drafted, both over the steps the replicas ran during the point (their step totals in "
           "`/dcut/status` before and after it).", ""]
    m = meta.get("machine", {})
    md += [f"Machine: {m.get('cpu')} ({m.get('cores')} cores), torch {m.get('torch')}, Python {m.get('python')}; "
           "Locust runs on the same machine (127.0.0.1) and shares its cores with the server."]
    md += [*meta.get("notes", []), "", "## Where speculation stops paying", ""]
    for kind, results in paying.items():
        if results:
            md.append("- " + stops_paying_line(KINDS[kind][0], KINDS[kind][1], results, setup.get("repeats", 1)))
    md += ["", "At fixed concurrency the arms are compared on output tokens/s; in the open loop every arm serves "
           "what is offered until it saturates, so there they are compared on the median end-to-end latency "
           "(queueing included; goodput is in the tables and plots). \"Stops paying\": the lowest load at which "
           "the arm's median is worse than `none`'s.", ""]
    md += tables(pts, "users") + tables(pts, "rate")
    md += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(md) + "\n"


def write_report(out: Path, runs: list[dict], meta: dict) -> dict:
    """``results.json``, ``results.md``, ``throughput.png`` and ``latency.png`` under ``out``; returns the JSON."""
    out.mkdir(parents=True, exist_ok=True)
    meta = portable(meta)
    pts = points(runs)
    paying = {kind: stops_paying_all(pts, kind) for kind in KINDS if any(p["kind"] == kind for p in pts)}
    record = {**meta, "points": pts, "runs": runs,
              "stops_paying": {kind: [vars(s) for s in results] for kind, results in paying.items()}}
    (out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    plots = write_plots(out, pts)
    (out / "results.md").write_text(markdown(meta, pts, paying, plots))
    return record


def write_plots(out: Path, pts: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, ScalarFormatter

    kinds = [k for k in KINDS if any(p["kind"] == k for p in pts)]
    arms = [a for a in ARMS if any(p["arm"] == a for p in pts)]

    def load_axis(ax, kind: str) -> None:
        """Users on a log-2 axis ticked at the points measured, in plain numbers."""
        ax.set_xlabel(KINDS[kind][2])
        if kind == "users":
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({p["load"] for p in pts if p["kind"] == kind}))
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())

    def series(arm: str, kind: str, name: str):
        rows = [p for p in pts if p["arm"] == arm and p["kind"] == kind and p["summary"][name]["median"] is not None]
        x = [p["load"] for p in rows]
        s = [p["summary"][name] for p in rows]
        return x, [v["median"] for v in s], [[v["median"] - v["min"] for v in s], [v["max"] - v["median"] for v in s]]

    fig, axes = plt.subplots(2, len(kinds), figsize=(5.5 * len(kinds), 7), squeeze=False)
    for col, kind in enumerate(kinds):
        for row, (name, label) in enumerate((("output_tokens_per_s", "output tokens/s"),
                                             ("goodput_tokens_per_s", "goodput (tokens/s within objectives)"))):
            ax = axes[row][col]
            for arm in arms:
                color, marker = STYLE.get(arm, ("gray", "x"))
                x, y, err = series(arm, kind, name)
                if x:
                    ax.errorbar(x, y, yerr=err, color=color, marker=marker, capsize=3, label=arm)
            load_axis(ax, kind)
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("Throughput and goodput vs load (median, bars: min–max over repeats)")
    fig.tight_layout()
    paths = [out / "throughput.png"]
    fig.savefig(paths[0], dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(len(LATENCIES), len(kinds), figsize=(5.5 * len(kinds), 3 * len(LATENCIES)),
                             squeeze=False)
    for col, kind in enumerate(kinds):
        for row, lat in enumerate(LATENCIES):
            ax = axes[row][col]
            for arm in arms:
                color, marker = STYLE.get(arm, ("gray", "x"))
                for q, style in zip(PERCENTILES, ("-", "--", ":"), strict=True):
                    x, y, _ = series(arm, kind, f"{lat}_p{q}_ms")
                    if x:
                        ax.plot(x, y, style, color=color, marker=marker, markersize=4,
                                label=f"{arm} p{q}" if row == 0 else None)
            load_axis(ax, kind)
            ax.set_ylabel(f"{lat.upper()} (ms)")
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.grid(alpha=0.3, which="both")
        axes[0][col].legend(fontsize=7, ncol=2)
    fig.suptitle("Latency percentiles vs load (p50 solid, p90 dashed, p99 dotted; medians over repeats)")
    fig.tight_layout()
    paths.append(out / "latency.png")
    fig.savefig(paths[1], dpi=90)
    plt.close(fig)
    return paths

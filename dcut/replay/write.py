"""Write the replay report: ``replay.json``, ``replay.md`` (a table per case, the paper check, joint's
widths) and one speedup plot per case."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dcut.machine import machine_info, provenance
from dcut.plots import plot_speedup
from dcut.replay.paper import paper_check, paper_check_markdown
from dcut.replay.report import PINNED, STARTS, Case, markdown_table, replay_case, summarize


def write_report(cases: list[Case], out: Path, steps: int, warmup: int, starts: int = STARTS) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    # the replay is deterministic, but its figures are this code's: date and commit say which (docs/README.md)
    report: dict[str, Any] = {"steps": steps, "warmup": warmup, "starts": starts, "cases": {},
                              "machine": machine_info(), **provenance()}
    md = [f"# Replay ({steps} measured steps after {warmup} warm-up steps per cell, from each of {starts} starts "
          "in the trace, pooled; deterministic)\n"]
    for case in cases:
        summary = summarize(case, replay_case(case, steps, warmup, starts=starts))
        if case.name == "h20-paper":
            summary["paper_check"] = paper_check(summary)
        report["cases"][case.name] = summary
        plot_speedup([{"mode": r["policy"], "bs": r["bs"], "speedup_vs_none": r["speedup_vs_none"]}
                      for r in summary["rows"] if r["policy"] != "dynamic" and not r["policy"].startswith(PINNED)],
                     out / f"{case.name}.png", f"replay: {case.name}")
        drift = f" The machine's speed: {case.drift}." if case.drift else ""
        host = "" if case.cost.host is None else \
            f" D-Cut's host work, charged to the policies that decide with it: {case.cost.host.describe()}."
        md += [f"## {case.name}\n", f"{case.description}. Cost model `{case.cost.name}`.{drift}{host}\n",
               markdown_table(summary), joint_widths_markdown(summary), pinned_markdown(summary),
               f"![{case.name}]({case.name}.png)\n"]
        if "paper_check" in summary:
            md.append(paper_check_markdown(summary["paper_check"]))
    (out / "replay.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    (out / "replay.md").write_text("\n".join(md))
    return report


BASELINES = ("none", "dynamic", "vllm-adaptive")  # with every fixed-K: what `joint` must never lose to


def joint_widths_markdown(summary: dict[str, Any]) -> str:
    """What ``joint`` drafted at each batch size (steps per width), beside the oracle's choice; what it predicted
    against what it got; ``joint`` over the best baseline (``BASELINES`` and every fixed width), pooled and per start
    (paired: both met the same requests); and from which measured step its width stayed the one it ends on (steps to
    converge), per start."""
    lines = ["| bs | joint: steps per width | oracle: steps per width | joint / oracle | oracle-conf: steps per "
             "width | joint / oracle-conf | joint / best baseline (per start) | joint: predicted / realized tok/s "
             "| converged at step (per start) |",
             "|---|---|---|---|---|---|---|---|---|"]
    cell = {(r["policy"], r["bs"]): r for r in summary["rows"]}
    for b in summary["batch_sizes"]:
        j, o, c = cell[("joint", b)], cell[("oracle", b)], cell[("oracle-conf", b)]
        predicted, got = j.get("predicted_tokens_per_s"), j["tokens_per_s"]
        vs = "–" if predicted is None else f"{predicted:.0f} / {got:.0f} ({predicted / got:.2f})"
        converged = j.get("converged_at_step", "–")
        steps = ", ".join(map(str, converged)) if isinstance(converged, list) else str(converged)
        lines.append(f"| {b} | {_hist(j['widths'])} | {_hist(o['widths'])} | {j['fraction_of_oracle']:.3f} | "
                     f"{_hist(c['widths'])} | {j['fraction_of_confidence_oracle']:.3f} | "
                     f"{_against_best(j, [r for r in summary['rows'] if r['bs'] == b])} | {vs} | {steps} |")
    return "\n".join(lines) + "\n"


def _against_best(joint: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """``joint`` over the best baseline at one batch size: pooled over the starts, then each start's range."""
    best = max((r for r in rows if r["policy"] in BASELINES or r["policy"].startswith("fixed-")),
               key=lambda r: r["tokens_per_s"])
    text = f"{joint['tokens_per_s'] / best['tokens_per_s']:.3f} vs {best['policy']}"
    mine, theirs = joint.get("by_start"), best.get("by_start")
    if mine and theirs and len(mine) == len(theirs) > 1:
        ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
        text += f" ({min(ratios):.3f}–{max(ratios):.3f})"
    return text


def _hist(widths: dict[str, int]) -> str:
    return ", ".join(f"{w}: {n}" for w, n in widths.items())


def pinned_markdown(summary: dict[str, Any]) -> str:
    """Per batch size, ``joint`` pinned at each width over ``fixed`` at that width (both draft it; the fixed width
    verifies every draft): what D-Cut's cut is worth there; and ``joint`` over the best pinned width: what its width
    choice is worth. Live, ``dcut compare``'s ``joint-wN`` arms against ``dynamic`` and ``joint`` measure the same."""
    cell = {(r["policy"], r["bs"]): r for r in summary["rows"]}
    widths = [int(r["policy"][len(PINNED):]) for r in summary["rows"]
              if r["policy"].startswith(PINNED) and r["bs"] == summary["batch_sizes"][0]]
    if not widths:
        return ""
    lines = ["| bs | " + " | ".join(f"{PINNED}{w} / fixed-{w}" for w in widths) + " | joint / best pinned |",
             "|---|" + "---|" * (len(widths) + 1)]
    for b in summary["batch_sizes"]:
        pinned = [cell[(f"{PINNED}{w}", b)] for w in widths]
        cut = [f"{p['tokens_per_s'] / cell[(f'fixed-{w}', b)]['tokens_per_s']:.3f}" for w, p in zip(widths, pinned,
                                                                                                       strict=True)]
        best = max(pinned, key=lambda r: r["tokens_per_s"])
        lines.append(f"| {b} | " + " | ".join(cut) +
                     f" | {cell[('joint', b)]['tokens_per_s'] / best['tokens_per_s']:.3f} vs {best['policy']} |")
    return ("`joint` pinned at one width: over `fixed` at that width, what D-Cut's cut is worth there; `joint` over "
            "the best pinned width, what its width choice is worth.\n\n" + "\n".join(lines) + "\n")

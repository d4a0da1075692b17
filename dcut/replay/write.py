"""Write the replay report: ``replay.json``, ``replay.md`` (a table per case, the paper check, joint's
widths) and one speedup plot per case."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dcut.plots import plot_speedup
from dcut.replay.paper import paper_check, paper_check_markdown
from dcut.replay.report import Case, markdown_table, replay_case, summarize


def write_report(cases: list[Case], out: Path, steps: int, warmup: int) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"steps": steps, "warmup": warmup, "cases": {}}
    md = [f"# Replay ({steps} measured steps after {warmup} warm-up steps per cell; deterministic)\n"]
    for case in cases:
        summary = summarize(case, replay_case(case, steps, warmup))
        if case.name == "h20-paper":
            summary["paper_check"] = paper_check(summary)
        report["cases"][case.name] = summary
        plot_speedup([{"mode": r["policy"], "bs": r["bs"], "speedup_vs_none": r["speedup_vs_none"]}
                      for r in summary["rows"] if r["policy"] != "dynamic"],
                     out / f"{case.name}.png", f"replay: {case.name}")
        drift = f" The machine drifts: every cost {case.drift}." if case.drift else ""
        md += [f"## {case.name}\n", f"{case.description}. Cost model `{case.cost.name}`.{drift}\n",
               markdown_table(summary), joint_widths_markdown(summary), f"![{case.name}]({case.name}.png)\n"]
        if "paper_check" in summary:
            md.append(paper_check_markdown(summary["paper_check"]))
    (out / "replay.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    (out / "replay.md").write_text("\n".join(md))
    return report


def joint_widths_markdown(summary: dict[str, Any]) -> str:
    """What ``joint`` drafted at each batch size (steps per width), beside the oracle's choice; what it predicted
    against what it got; and from which measured step its width stayed the one it ends on (steps to converge)."""
    lines = ["| bs | joint: steps per width | oracle: steps per width | joint / oracle | oracle-conf: steps per "
             "width | joint / oracle-conf | joint: predicted / realized tok/s | converged at step |",
             "|---|---|---|---|---|---|---|---|"]
    cell = {(r["policy"], r["bs"]): r for r in summary["rows"]}
    for b in summary["batch_sizes"]:
        j, o, c = cell[("joint", b)], cell[("oracle", b)], cell[("oracle-conf", b)]
        predicted, got = j.get("predicted_tokens_per_s"), j["tokens_per_s"]
        vs = "–" if predicted is None else f"{predicted:.0f} / {got:.0f} ({predicted / got:.2f})"
        lines.append(f"| {b} | {_hist(j['widths'])} | {_hist(o['widths'])} | {j['fraction_of_oracle']:.3f} | "
                     f"{_hist(c['widths'])} | {j['fraction_of_confidence_oracle']:.3f} | {vs} | "
                     f"{j.get('converged_at_step', '–')} |")
    return "\n".join(lines) + "\n"


def _hist(widths: dict[str, int]) -> str:
    return ", ".join(f"{w}: {n}" for w, n in widths.items())

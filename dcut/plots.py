"""PNG plots of cost tables and sweeps (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_cost_table(table_json: dict[str, Any], out: Path, title: str = "") -> Path:
    """The two costs, one line per profiled batch size: verification against verify tokens (left)
    and the drafter's pass against drafted width (right)."""
    fig, (verify, draft) = plt.subplots(1, 2, figsize=(11, 4.5))
    for bs, points in sorted(table_json["points"].items(), key=lambda kv: int(kv[0])):
        verify.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"bs={bs}")
    verify.set_xlabel("verify tokens per step (bs + kept drafts)")
    verify.set_ylabel("verify cost (ms)")
    for bs, cells in sorted(table_json.get("draft", {}).items(), key=lambda kv: int(kv[0])):
        widths = sorted(cells, key=int)
        draft.plot([int(w) for w in widths], [cells[w][0] for w in widths], marker="o", label=f"bs={bs}")
    draft.set_xlabel("drafted width (positions per request)")
    draft.set_ylabel("drafter cost (ms)")
    draft.grid(alpha=0.3)
    draft.legend(fontsize=8)
    return _finish(fig, verify, out, title or "D-Cut cost table")


def plot_speedup(rows: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    """Throughput relative to no speculation (``none``) against batch size, one line per mode."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for mode in modes:
        pts = sorted((r["bs"], r["speedup_vs_none"]) for r in rows if r["mode"] == mode and r.get("speedup_vs_none"))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("batch size")
    ax.set_ylabel("throughput / none (no speculation)")
    return _finish(fig, ax, out, title or "Speedup vs no speculation (none)")


def _finish(fig: plt.Figure, ax: plt.Axes, out: Path, title: str) -> Path:
    """Shared look (log2 x axis, grid, legend) and save."""
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_specexit(rows: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    """Accuracy against mean generated tokens, one point per arm, one series per batch size (the arms' accuracy
    does not depend on it; their latency does)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for bs in sorted({r["bs"] for r in rows}):
        pts = [r for r in rows if r["bs"] == bs]
        ax.scatter([r["mean_tokens"] for r in pts], [r["accuracy"] for r in pts], label=f"bs={bs}")
        for r in pts:
            ax.annotate(r["arm"], (r["mean_tokens"], r["accuracy"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xlabel("mean generated tokens per request")
    ax.set_ylabel("accuracy on held-out problems")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "SpecExit: accuracy vs tokens")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

"""Where a pair sits: the engine's own cost figures (a step of ``none``, no speculation; full-width verification;
drafter per width) and acceptance per position at several drafted widths, for the model cards (issue 11's bar:
the target's forward dominates a ``none`` step at bs 1, full-width verification at bs 64 is >= 5x a ``none``
step, the drafter at width 15 is <= 1.5 ``none`` steps at bs 16)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from dcut.cost_table import CostTable
from dcut.prompts import load_prompts

BATCH_SIZES = (1, 16, 64)
WIDTHS = (1, 3, 7, 15)
SHORT, LONG = 8, 72  # decode lengths whose difference times LONG - SHORT pure decode steps
REPEATS = 3  # timed (SHORT, LONG) pairs per batch size, after one warm-up pair


def none_steps(target: str, prompts: list[str], batch_sizes=BATCH_SIZES, repeats: int = REPEATS) -> dict[int, float]:
    """Live step of ``none`` (no speculation: the target alone) in ms per batch size, prefill excluded: the same
    batch generates SHORT and LONG tokens (greedy, EOS ignored) on an engine at vLLM's default compilation; prefill and
    start-up cancel in the difference, ``(T_long - T_short) / (LONG - SHORT)``, the median of
    ``repeats`` pairs after one warm-up pair (one pair swings by a third on a shared VM).
    Run in a ``__main__``."""
    from vllm import SamplingParams

    from train.verify import check_engine

    llm = check_engine(target, max_num_seqs=max(batch_sizes), eager=False)

    def timed(batch: list[str], n: int) -> float:
        start = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    out = {}
    for bs in batch_sizes:
        batch = (prompts * bs)[:bs]
        timed(batch, SHORT), timed(batch, LONG)  # warms the batch shape up
        steps = [(timed(batch, LONG) - timed(batch, SHORT)) / (LONG - SHORT) for _ in range(repeats)]
        out[bs] = 1000.0 * statistics.median(steps)
    return out


def cost_figures(table: CostTable, none_step_ms: dict[int, float], k: int = 15) -> dict[int, dict]:
    """Per batch size: the profiled forward of a step without drafts and of full-width verification, the drafter's
    pass per width (ms), and the live step of ``none`` (`none_steps`) whose remainder over the forward is the
    engine's fixed per-step overhead."""
    rows = {}
    for bs in BATCH_SIZES:
        forward = table.lookup(bs, bs)
        full = table.lookup(bs, bs * (1 + k))
        if forward is None or full is None:
            continue
        row = {"forward_ms": forward, "full_verify_ms": full,
               "draft_ms": {w: table.draft_cost(bs, w) for w in WIDTHS}}
        step = none_step_ms.get(bs)
        if step:
            row |= {"none_step_ms": step, "overhead_ms": max(0.0, step - forward), "forward_share": forward / step,
                    "full_over_none": full / step, "draft15_over_none": (row["draft_ms"][15] or 0.0) / step}
        rows[bs] = row
    return rows


def in_regime(rows: dict[int, dict]) -> dict[str, bool | None]:
    """Issue 11's three conditions, each None when its figures are missing."""
    def cond(bs: int, key: str, test) -> bool | None:
        v = rows.get(bs, {}).get(key)
        return None if v is None else bool(test(v))

    return {"forward_dominates_bs1": cond(1, "forward_share", lambda v: v > 0.5),
            "full_verify_ge_5x_none_bs64": cond(64, "full_over_none", lambda v: v >= 5.0),
            "draft15_le_1.5x_none_bs16": cond(16, "draft15_over_none", lambda v: v <= 1.5)}


def regime_section(rows: dict[int, dict], acceptance: dict[int, dict], source: str) -> str:
    """Markdown for the cards: the cost table, the three conditions, acceptance per position per width."""
    fmt = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    lines = ["## Cost regime (measured)\n", source + "\n",
             "| bs | `none` step (live) | forward (profiled) | fixed overhead | full-width verify | "
             + " | ".join(f"drafter W={w}" for w in WIDTHS) + " |",
             "|---|---|---|---|---|" + "---|" * len(WIDTHS)]
    for bs, r in sorted(rows.items()):
        lines.append(f"| {bs} | {fmt(r.get('none_step_ms'))} | {fmt(r['forward_ms'])} | {fmt(r.get('overhead_ms'))} | "
                     f"{fmt(r['full_verify_ms'])} | " + " | ".join(fmt(r['draft_ms'][w]) for w in WIDTHS) + " |")
    lines.append("\nAll in ms per engine step.")
    ok = in_regime(rows)
    verdict = {True: "yes", False: "**no**", None: "not measured"}
    r1, r16, r64 = rows.get(1, {}), rows.get(16, {}), rows.get(64, {})
    lines += [
        f"- target forward share of a `none` step (no speculation) at bs 1: {fmt(r1.get('forward_share'))} "
        f"(> 0.5: {verdict[ok['forward_dominates_bs1']]})",
        f"- full-width verification over a `none` step at bs 64: {fmt(r64.get('full_over_none'))}× "
        f"(≥ 5: {verdict[ok['full_verify_ge_5x_none_bs64']]})",
        f"- drafter at width 15 over a `none` step at bs 16: {fmt(r16.get('draft15_over_none'))}× "
        f"(≤ 1.5: {verdict[ok['draft15_le_1.5x_none_bs16']]})\n"]
    if acceptance:
        n = max(acceptance)
        lines += ["Acceptance per draft position when vLLM drafts W positions per step (greedy, "
                  "held-out prompts; fraction of steps whose draft k was accepted), and mean accepted per step:\n",
                  "| W | mean | " + " | ".join(str(k) for k in range(1, n + 1)) + " |",
                  "|---|---|" + "---|" * n]
        for w, a in sorted(acceptance.items()):
            per = list(a["acceptance_per_pos"]) + [None] * (n - len(a["acceptance_per_pos"]))
            lines.append(f"| {w} | {a['mean_accepted_per_step']:.2f} | "
                         + " | ".join("" if v is None else f"{v:.2f}" for v in per) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m train.regime --target DIR --prompts FILE --json OUT``: `none_steps` as JSON."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True, help="jsonl with {'prompt': ...}")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    steps = none_steps(a.target, load_prompts(a.prompts))
    with open(a.json, "w") as fh:
        json.dump({str(bs): ms for bs, ms in steps.items()}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())

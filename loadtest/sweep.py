"""The batch-size sweep: every mode at every batch size, on the same engine settings, in one run.

Each engine runs in its own ``dcut generate`` process (clean memory, no state shared between
modes); one engine serves all batch sizes of a mode. Modes:

- ``none`` plain decoding, no drafter;           ``full`` every draft verified;
- ``dynamic`` vLLM's own ``num_speculative_tokens_per_batch_size``, with the best K per batch
  size found by the sweep itself (fixed K in {1, 3, 7, K} first, full width);
- ``fixed-per-request`` the same number of drafts for every request, at the budget ``auto`` chose;
- ``auto`` / ``continuous`` D-Cut.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dcut.commands.engine_args import schedule_text
from dcut.machine import machine_info

SWEEP_MODES = ("none", "full", "dynamic", "fixed-per-request", "auto", "continuous")
DYNAMIC_KS = (1, 3, 7)  # plus the sweep's own K


class SweepError(RuntimeError):
    """A cell's engine failed; carries its stderr tail."""


def run_cell(engine_flags: list[str], mode: str, batch_sizes: list[int], extra: list[str],
             common: list[str]) -> list[dict[str, Any]]:
    """One engine (one ``dcut generate`` process) over several batch sizes."""
    cmd = [sys.executable, "-m", "dcut.cli", "generate", *engine_flags, *common, "--mode", mode,
           "--batch-size", ",".join(map(str, batch_sizes)), "--json", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise SweepError(f"{' '.join(cmd)}\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def best_k_schedule(by_k: dict[int, dict[int, float]], batch_sizes: list[int]) -> list[tuple[int, int, int]]:
    """vLLM dynamic-speculation ranges from the fastest K measured at each batch size."""
    schedule, lo = [], 1
    for i, bs in enumerate(sorted(batch_sizes)):
        best = max(by_k, key=lambda k: by_k[k].get(bs, 0.0))
        hi = bs if i < len(batch_sizes) - 1 else 4096
        schedule.append((lo, hi, best))
        lo = hi + 1
    return schedule


def sweep(engine_flags: list[str], k: int, batch_sizes: list[int], modes: list[str], common: list[str],
          out: Path) -> dict[str, Any]:
    """Run every requested mode; returns the sweep record (also written to ``out/sweep.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    flags = [*engine_flags, "--cache-dir", str(out / "cost_cache")]
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    notes: list[str] = []
    plan = [m for m in ("none", "full", "auto", "continuous") if m in modes]
    if "fixed-per-request" in modes and "auto" not in plan:
        plan.append("auto")  # fixed-per-request needs auto's budget
    dynamic_ks = [kk for kk in DYNAMIC_KS if kk < k] + [k]
    bar = tqdm(total=len(plan) + ("dynamic" in modes) * (len(dynamic_ks) + 1) + ("fixed-per-request" in modes),
               desc="sweep", unit="engine")
    for mode in plan:
        bar.set_postfix_str(mode)
        for r in run_cell(flags, mode, batch_sizes, ["--k", str(k)], common):
            rows[(mode, r["batch_size"])] = r
        bar.update()

    if "fixed-per-request" in modes:
        bar.set_postfix_str("fixed-per-request")
        depths: dict[int, list[int]] = {}
        for bs in batch_sizes:
            ratio = rows[("auto", bs)].get("mean_keep_ratio") or 1.0
            depths.setdefault(max(0, min(k, round(ratio * k))), []).append(bs)
        for depth, sizes in sorted(depths.items()):
            for r in run_cell(flags, "per_request", sizes, ["--k", str(k), "--per-request-depth", str(depth)],
                              common):
                r["mode"], r["per_request_depth"] = "fixed-per-request", depth
                rows[("fixed-per-request", r["batch_size"])] = r
        bar.update()

    if "dynamic" in modes:
        by_k: dict[int, dict[int, float]] = {}
        fixed_rows: dict[tuple[int, int], dict[str, Any]] = {}
        for kk in dynamic_ks:
            bar.set_postfix_str(f"fixed K={kk}")
            cells = ([rows[("full", bs)] for bs in batch_sizes] if kk == k and "full" in modes
                     else run_cell(flags, "full", batch_sizes, ["--k", str(kk)], common))
            by_k[kk] = {r["batch_size"]: r["tokens_per_s"] for r in cells}
            fixed_rows.update({(kk, r["batch_size"]): r for r in cells})
            bar.update()
        schedule = best_k_schedule(by_k, batch_sizes)
        bar.set_postfix_str("dynamic")
        try:
            cells = run_cell(flags, "full", batch_sizes,
                             ["--k", str(max(s[2] for s in schedule)), "--spec-schedule", schedule_text(schedule)],
                             common)
            for r in cells:
                r["mode"] = "dynamic"
                rows[("dynamic", r["batch_size"])] = r
            notes.append(f"dynamic: vLLM num_speculative_tokens_per_batch_size = {schedule}")
        except SweepError as e:
            notes.append(f"dynamic: vLLM's dynamic speculation failed here, so the best fixed K per batch "
                         f"size stands in for it (the same thing). Error: {str(e).splitlines()[-1]}")
            for lo, hi, kk in schedule:
                for bs in batch_sizes:
                    if lo <= bs <= hi:
                        rows[("dynamic", bs)] = {**fixed_rows[(kk, bs)], "mode": "dynamic", "k": kk}
        bar.update()
    bar.close()

    results = []
    for (mode, bs), r in sorted(rows.items(), key=lambda kv: (SWEEP_MODES.index(kv[0][0]), kv[0][1])):
        if mode not in modes:
            continue
        base = rows.get(("none", bs))
        results.append({
            "mode": mode, "bs": bs, "k": r.get("k"), "tokens_per_s": r["tokens_per_s"],
            "speedup_vs_none": r["tokens_per_s"] / base["tokens_per_s"] if base else None,
            "mean_keep_ratio": r.get("mean_keep_ratio"), "mean_accepted_length": r.get("mean_accepted_length"),
            "per_position_acceptance": r.get("per_position_acceptance"),
            "selection_us_median": r.get("selection_us_median"), "token_ids_sha256": r["token_ids_sha256"],
            "per_request_depth": r.get("per_request_depth"),
        })
    record = {"machine": machine_info(), "engine_flags": engine_flags, "k": k, "batch_sizes": batch_sizes,
              "common": common, "notes": notes, "results": results}
    (out / "sweep.json").write_text(json.dumps(record, indent=1))
    (out / "sweep.md").write_text(markdown(record))
    _plots(record, out)
    return record


def geo_mean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def markdown(record: dict[str, Any]) -> str:
    """Speedup table shaped like DESIGN §1, then keep ratio and accepted length per cell."""
    sizes = record["batch_sizes"]
    modes = list(dict.fromkeys(r["mode"] for r in record["results"]))
    cell = {(r["mode"], r["bs"]): r for r in record["results"]}
    head = "| mode | " + " | ".join(f"bs {b}" for b in sizes) + " | geo |\n|---|" + "---|" * (len(sizes) + 1)
    lines = ["## Throughput relative to plain decoding (`none`)", "", head]
    for m in modes:
        sp = [cell.get((m, b), {}).get("speedup_vs_none") for b in sizes]
        g = geo_mean([s for s in sp if s])
        lines.append(f"| {m} | " + " | ".join("-" if s is None else f"{s:.2f}" for s in sp)
                     + f" | {'-' if g is None else f'{g:.2f}'} |")
    lines += ["", "## Output tokens/s", "", head.replace(" geo |", "").replace("---|---|", "---|", 1)]
    for m in modes:
        lines.append(f"| {m} | " + " | ".join(f"{cell[(m, b)]['tokens_per_s']:.1f}" if (m, b) in cell else "-"
                                               for b in sizes) + " |")
    lines += ["", "## Chosen keep ratio / mean accepted drafts per request-step", "",
              head.replace(" geo |", "").replace("---|---|", "---|", 1)]
    for m in modes:
        if m == "none":
            continue
        vals = []
        for b in sizes:
            r = cell.get((m, b))
            kr, al = (r or {}).get("mean_keep_ratio"), (r or {}).get("mean_accepted_length")
            vals.append("-" if r is None else f"{'-' if kr is None else f'{kr:.2f}'} / "
                        f"{'-' if al is None else f'{al:.2f}'}")
        lines.append(f"| {m} | " + " | ".join(vals) + " |")
    lossless = {r["bs"]: r["token_ids_sha256"] for r in record["results"] if r["mode"] == "none"}
    same = all(r["token_ids_sha256"] == lossless.get(r["bs"]) for r in record["results"] if r["bs"] in lossless)
    lines += ["", f"Greedy outputs identical to `none` in every cell: **{'yes' if same else 'NO'}**."]
    lines += ["", *[f"- {n}" for n in record["notes"]]]
    m = record["machine"]
    lines += ["", f"Machine: {m.get('cpu', m)}; engine flags: `{' '.join(record['engine_flags'])}`; "
              f"`{' '.join(record['common'])}`"]
    return "\n".join(lines) + "\n"


def _plots(record: dict[str, Any], out: Path) -> None:
    from dcut.plots import plot_cost_table, plot_speedup

    plot_speedup(record["results"], out / "speedup.png")
    for path in sorted((out / "cost_cache").glob("*.json")):
        table = json.loads(path.read_text())
        if table["fingerprint"]["k"] == record["k"]:
            plot_cost_table(table, out / "cost_table.png")
            (out / "cost_table.json").write_text(json.dumps(table, indent=1))

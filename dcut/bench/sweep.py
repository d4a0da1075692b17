"""The batch-size sweep: every mode at every batch size, on the same engine settings, in one run.

Engines run one after another in this process (in-process vLLM engines start in seconds); one
engine serves all batch sizes of a mode. Modes:

- ``none`` no speculation (no drafter);       ``full`` every draft verified (D-Cut in mode full);
- ``dynamic`` vLLM's own ``num_speculative_tokens_per_batch_size``, with the best K per batch
  size found by the sweep itself (fixed K in {1, 3, 7, K} first, each in mode ``full``);
- ``per_request`` the same number of drafts for every request, at the budget ``reference`` chose;
- ``reference`` / ``continuous`` D-Cut choosing what to verify (the drafter always drafts K);
- ``joint`` D-Cut choosing the drafted width each step, then what to verify (``dcut.width``).

Every engine runs at vLLM's default compilation unless ``--enforce-eager`` is given, so ``none``
and ``dynamic`` are measured as users run them.
"""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dcut.bench.generate import dynamic_settings, generate, settings_for_mode
from dcut.machine import machine_info, provenance
from dcut.settings import EngineSettings

SWEEP_MODES = ("none", "full", "dynamic", "per_request", "reference", "continuous", "joint")
DYNAMIC_KS = (1, 3, 7)  # plus the sweep's own K
REPEATS = 3


class SweepError(RuntimeError):
    """An engine of the sweep failed."""


def run_cell(base: EngineSettings, mode: str, batch_sizes: list[int], prompts: list[str], max_tokens: int,
             repeats: int = REPEATS, schedule: list[tuple[int, int, int]] | None = None,
             **update: Any) -> list[dict[str, Any]]:
    """One engine over several batch sizes; ``update`` changes engine or D-Cut settings; ``schedule``: mode
    ``dynamic``'s K per batch size."""
    settings = dynamic_settings(base, schedule or []) if mode == "dynamic" else settings_for_mode(mode, base)
    dcut_update = {k: update.pop(k) for k in list(update) if k in ("per_request_depth",)}
    if dcut_update and settings.dcut is not None:
        update["dcut"] = settings.dcut.model_copy(update=dcut_update)
    try:
        return generate(settings.model_copy(update=update), prompts, batch_sizes, max_tokens, repeats=repeats)
    except Exception as e:  # an engine that cannot run this configuration
        raise SweepError(f"{mode} {update}: {type(e).__name__}: {e}") from e
    finally:
        gc.collect()


def best_k_schedule(by_k: dict[int, dict[int, float]], batch_sizes: list[int]) -> list[tuple[int, int, int]]:
    """vLLM dynamic-speculation ranges from the fastest K measured at each batch size."""
    schedule, lo = [], 1
    for i, bs in enumerate(sorted(batch_sizes)):
        best = max(by_k, key=lambda k: by_k[k].get(bs, 0.0))
        hi = bs if i < len(batch_sizes) - 1 else 4096
        schedule.append((lo, hi, best))
        lo = hi + 1
    return schedule


def sweep(base: EngineSettings, batch_sizes: list[int], modes: list[str], prompts: list[str], max_tokens: int,
          out: Path, repeats: int = REPEATS) -> dict[str, Any]:
    """Run every requested mode; returns the sweep record (also written to ``out/``)."""
    out.mkdir(parents=True, exist_ok=True)
    k = base.num_speculative_tokens
    # No prefix caching in any mode (EngineSettings.prefix_caching says why): every repeat sends the same prompts.
    base = base.model_copy(update={"dcut": base.dcut.model_copy(update={"cache_dir": str(out / "cost_cache")}),
                                   "prefix_caching": False})
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    notes: list[str] = []
    dynamic: dict[str, Any] | None = None  # what the dynamic mode ran: vLLM's dynamic speculation or its stand-in
    plan = [m for m in ("none", "full", "reference", "continuous", "joint") if m in modes]
    if "per_request" in modes and "reference" not in plan:
        plan.append("reference")  # per_request needs reference's budget
    dynamic_ks = [kk for kk in DYNAMIC_KS if kk < k] + [k]
    bar = tqdm(total=len(plan) + ("dynamic" in modes) * (len(dynamic_ks) + 1) + ("per_request" in modes),
               desc="sweep", unit="engine")
    for mode in plan:
        bar.set_postfix_str(mode)
        for r in run_cell(base, mode, batch_sizes, prompts, max_tokens, repeats):
            rows[(mode, r["batch_size"])] = r
        bar.update()

    if "per_request" in modes:
        bar.set_postfix_str("per_request")
        depths: dict[int, list[int]] = {}
        for bs in batch_sizes:
            ratio = rows[("reference", bs)].get("mean_keep_ratio") or 1.0
            depths.setdefault(max(0, min(k, round(ratio * k))), []).append(bs)
        for depth, sizes in sorted(depths.items()):
            for r in run_cell(base, "per_request", sizes, prompts, max_tokens, repeats, per_request_depth=depth):
                r["mode"], r["per_request_depth"] = "per_request", r["dcut_settings"]["per_request_depth"]
                rows[("per_request", r["batch_size"])] = r
        bar.update()

    if "dynamic" in modes:
        by_k: dict[int, dict[int, float]] = {}
        fixed_rows: dict[tuple[int, int], dict[str, Any]] = {}
        for kk in dynamic_ks:
            bar.set_postfix_str(f"fixed K={kk}")
            cells = ([rows[("full", bs)] for bs in batch_sizes] if kk == k and "full" in modes
                     else run_cell(base, "full", batch_sizes, prompts, max_tokens, repeats, num_speculative_tokens=kk))
            by_k[kk] = {r["batch_size"]: r["tokens_per_s"] for r in cells}
            fixed_rows.update({(kk, r["batch_size"]): r for r in cells})
            bar.update()
        schedule = best_k_schedule(by_k, batch_sizes)
        bar.set_postfix_str("dynamic")
        try:
            cells = run_cell(base, "dynamic", batch_sizes, prompts, max_tokens, repeats, schedule=schedule)
            for r in cells:
                rows[("dynamic", r["batch_size"])] = {**r, "mode": "dynamic", "spec_schedule": schedule}
            dynamic = {"schedule": schedule, "ran": "vllm"}
            notes.append(f"dynamic: vLLM num_speculative_tokens_per_batch_size = {schedule}, picked from the "
                         f"fixed-K runs in `dynamic_fixed_k`")
        except SweepError as e:
            notes.append(f"dynamic: vLLM's dynamic speculation failed here, so the best fixed K per batch "
                         f"size stands in for it (the same thing). Error: {e}")
            dynamic = {"schedule": schedule, "ran": "best_fixed_k", "error": str(e)}
            for lo, hi, kk in schedule:
                for bs in batch_sizes:
                    if lo <= bs <= hi:
                        rows[("dynamic", bs)] = {**fixed_rows[(kk, bs)], "mode": "dynamic"}
        bar.update()
    bar.close()

    fixed_k = [] if "dynamic" not in modes else [
        {"k": kk, "bs": bs, "tokens_per_s": r["tokens_per_s"], "tokens_per_s_min": r.get("tokens_per_s_min"),
         "tokens_per_s_max": r.get("tokens_per_s_max"), "mean_accepted_length": r.get("mean_accepted_length")}
        for (kk, bs), r in sorted(fixed_rows.items())]
    tables = out / "cost_tables"
    for (mode, bs), r in rows.items():
        if r.get("cost_table") and bs == max(batch_sizes):  # the refined table after the engine's last cell
            tables.mkdir(exist_ok=True)
            (tables / f"{mode}.json").write_text(json.dumps(r["cost_table"], indent=1))
    results = []
    for (mode, bs), r in sorted(rows.items(), key=lambda kv: (SWEEP_MODES.index(kv[0][0]), kv[0][1])):
        if mode not in modes:
            continue
        none = rows.get(("none", bs))
        results.append({
            "mode": mode, "bs": bs, "k": r.get("k"), "tokens_per_s": r["tokens_per_s"],
            "tokens_per_s_min": r.get("tokens_per_s_min"), "tokens_per_s_max": r.get("tokens_per_s_max"),
            "repeats": r.get("repeats"), "steps": r.get("steps"), "wall_s": r.get("wall_s"),
            "mean_step_ms": _mean_step(r), "mean_verify_ms": r.get("mean_verify_ms"),
            "mean_draft_ms": r.get("mean_draft_ms"), "width_histogram": r.get("width_histogram"),
            "probe_steps": r.get("probe_steps"), "keep_ratio_histogram": r.get("keep_ratio_histogram"),
            "speedup_vs_none": r["tokens_per_s"] / none["tokens_per_s"] if none else None,
            "mean_keep_ratio": r.get("mean_keep_ratio"), "mean_accepted_length": r.get("mean_accepted_length"),
            "per_position_acceptance": r.get("per_position_acceptance"),
            "selection_us_median": r.get("selection_us_median"), "token_ids_sha256": r["token_ids_sha256"],
            "per_request_depth": r.get("per_request_depth"), "spec_schedule": r.get("spec_schedule"),
            "engine_startup_s": r.get("startup_s"), "cost_source": r.get("cost_source"),
        })
    record = {"machine": machine_info(), **provenance(), "engine": base.model_dump(), "k": k,
              "batch_sizes": batch_sizes,
              "max_tokens": max_tokens, "repeats": repeats, "notes": notes, "results": results,
              "dynamic": dynamic, "dynamic_fixed_k": fixed_k}
    (out / "sweep.json").write_text(json.dumps(record, indent=1))
    (out / "sweep.md").write_text(markdown(record))
    _plots(record, out)
    return record


def _mean_step(r: dict[str, Any]) -> float | None:
    """Mean step time over the cell's timed steps (``mean_step_ms`` is kept per batch size seen)."""
    per_bs = r.get("mean_step_ms") or {}
    return per_bs.get(str(r["batch_size"])) or (max(per_bs.values()) if per_bs else None)


def geo_mean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def markdown(record: dict[str, Any]) -> str:
    """Speedup vs no speculation (``none``) per mode and batch size, then keep ratio and accepted length per cell."""
    sizes = record["batch_sizes"]
    modes = list(dict.fromkeys(r["mode"] for r in record["results"]))
    cell = {(r["mode"], r["bs"]): r for r in record["results"]}
    head = "| mode | " + " | ".join(f"bs {b}" for b in sizes) + " | geo |\n|---|" + "---|" * (len(sizes) + 1)
    lines = ["## Throughput relative to no speculation (`none`)", "", head]
    for m in modes:
        sp = [cell.get((m, b), {}).get("speedup_vs_none") for b in sizes]
        g = geo_mean([s for s in sp if s])
        lines.append(f"| {m} | " + " | ".join("-" if s is None else f"{s:.2f}" for s in sp)
                     + f" | {'-' if g is None else f'{g:.2f}'} |")
    lines += ["", "## Output tokens/s", "", head.replace(" geo |", "").replace("---|---|", "---|", 1)]
    for m in modes:
        lines.append(f"| {m} | " + " | ".join(_rate(cell.get((m, b))) for b in sizes) + " |")
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
    if "joint" in modes:
        lines += ["", "## `joint`: steps per drafted width (probe steps) / mean step, verify, drafter ms", ""]
        for b in sizes:
            r = cell.get(("joint", b))
            if r:
                lines.append(f"- bs {b}: widths {r.get('width_histogram')} ({r.get('probe_steps')} probes); "
                             f"step {_ms(r.get('mean_step_ms'))}, verify {_ms(r.get('mean_verify_ms'))}, "
                             f"drafter {_ms(r.get('mean_draft_ms'))} ms")
    lossless = {r["bs"]: r["token_ids_sha256"] for r in record["results"] if r["mode"] == "none"}
    same = all(r["token_ids_sha256"] == lossless.get(r["bs"]) for r in record["results"] if r["bs"] in lossless)
    lines += ["", f"Greedy outputs identical to `none` in every cell: **{'yes' if same else 'NO'}**."]
    lines += ["", *[f"- {n}" for n in record["notes"]]]
    m, e = record["machine"], record["engine"]
    lines += ["", f"Machine: {m['cpu']} ({m['cores']} cores), torch {m['torch']}. Target `{e['model']}`, "
              f"drafter `{e['draft']}` ({e['method']}), K={record['k']}, {e['dtype']}, "
              f"{'eager' if e.get('enforce_eager') else 'compiled (vLLM default)'}, "
              f"{record['max_tokens']} greedy tokens per request; median of {record.get('repeats', 1)} timed runs "
              f"per cell (min–max in brackets), each after an untimed warm-up run."]
    return "\n".join(lines) + "\n"


def _rate(r: dict[str, Any] | None) -> str:
    """Median tokens/s with the spread of the repeats."""
    if r is None:
        return "-"
    lo, hi = r.get("tokens_per_s_min"), r.get("tokens_per_s_max")
    spread = f" ({lo:.0f}–{hi:.0f})" if lo is not None and hi is not None and (r.get("repeats") or 1) > 1 else ""
    return f"{r['tokens_per_s']:.1f}{spread}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _plots(record: dict[str, Any], out: Path) -> None:
    from dcut.plots import plot_cost_table, plot_speedup

    plot_speedup(record["results"], out / "speedup.png")
    for path in sorted((out / "cost_cache").glob("*.json")):
        table = json.loads(path.read_text())
        if table["fingerprint"]["k"] == record["k"]:
            plot_cost_table(table, out / "cost_table.png")
            (out / "cost_table.json").write_text(json.dumps(table, indent=1))

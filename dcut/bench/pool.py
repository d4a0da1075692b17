"""Several interleaved comparisons (``dcut compare``) of the same modes, pooled: one verdict from all their rounds.

One run of five rounds cannot rank modes within a few percent of each other on a shared box: the same code's
``joint`` over the best other mode read 1.008, 0.973, 0.924 and 1.057 at bs 8 in four runs. Each round of each run
is already a pair (every mode ran in it, in shuffled order), so rounds from several runs pool without bias from the
box's slow hours: per batch size, ``mode``'s rate (the mean of its engines, where a run built copies ``MODE#N``) over
each other mode's in the same round, and over the best of them in that round, median and 95 % bootstrap interval over
every round of every run. Each run's own ratio of medians is kept beside it (what a single run would have said).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dcut.bench.interleaved import base_mode, bootstrap_median, verdict


def pool(reports: list[dict[str, Any]], mode: str = "joint", against: tuple[str, ...] = ("none", "full", "dynamic"),
         seed: int = 0, batch_sizes: list[int] | None = None) -> dict[str, Any]:
    """``mode`` against each of ``against`` and the best of them per round, over every round of ``reports``; at
    ``batch_sizes`` only, where given (every report must have run them: a run of one batch size pools with the full
    runs' rounds there), else at the batch sizes they all ran alike."""
    if len(reports) < 2:
        raise ValueError("pooling takes at least two compare reports")
    if batch_sizes is None:
        sizes = _common(reports, "batch_sizes")
    else:
        sizes = batch_sizes
        missing = sorted({bs for r in reports for bs in sizes if bs not in r["batch_sizes"]})
        if missing:
            raise ValueError(f"not every report ran batch size {', '.join(map(str, missing))}")
    modes = {base_mode(m) for m in _common(reports, "modes")}
    missing = sorted({mode, *against} - modes)
    if missing:
        raise ValueError(f"the reports did not run {', '.join(missing)} (they ran {', '.join(sorted(modes))})")
    rows = []
    for bs in sizes:
        ratios: dict[str, list[float]] = {m: [] for m in (*against, "best")}
        per_run = []
        for report in reports:
            # a mode's rate in a round: the mean of its engines (MODE and its copies MODE#N, as dcut compare pairs them)
            engines: dict[tuple[str, int], list[float]] = {}
            for r in report["runs"]:
                if r["bs"] == bs:
                    engines.setdefault((base_mode(r["mode"]), r["repeat"]), []).append(r["tokens_per_s"])
            by = {key: float(np.mean(rates)) for key, rates in engines.items()}
            rounds = sorted({r for _, r in by})
            for r in rounds:
                for m in against:
                    ratios[m].append(by[(mode, r)] / by[(m, r)])
                ratios["best"].append(by[(mode, r)] / max(by[(m, r)] for m in against))
            medians = {m: float(np.median([by[(m, r)] for r in rounds])) for m in (mode, *against)}
            per_run.append(medians[mode] / max(medians[m] for m in against))
        row: dict[str, Any] = {"bs": bs, "rounds": len(ratios["best"]), "per_run": per_run}
        for m, values in ratios.items():
            # (one draw per column, the same for each: equal ratios get equal intervals)
            median, low, high = bootstrap_median(values, np.random.default_rng([seed, bs]))
            # (a ratio mode/other: ``verdict`` reads other/mode, so its sides swap)
            row[m] = {"ratio": median, "ci95": [low, high], "verdict": verdict(1 / high, 1 / low, mode)}
        rows.append(row)
    return {"mode": mode, "against": list(against), "runs": len(reports), "rows": rows}


def _common(reports: list[dict[str, Any]], key: str) -> list[Any]:
    first = reports[0][key]
    if any(r[key] != first for r in reports[1:]):
        raise ValueError(f"the reports differ in {key} ({', '.join(str(r[key]) for r in reports)}): not one "
                         "comparison repeated")
    return first


def markdown(pooled: dict[str, Any]) -> str:
    """Per batch size: ``mode`` over each other mode and over the best per round, with intervals and verdicts; each
    run's ratio of medians."""
    mode, against = pooled["mode"], pooled["against"]
    columns = [*against, "best"]
    head = (f"`{mode}` ÷ each mode, paired by round, pooled over {pooled['runs']} runs: median [95 % interval], "
            "verdict (best: the best of the others in each round)\n\n"
            "| bs | rounds | " + " | ".join(f"÷ {c}" for c in columns) + " | each run: median ÷ best median |\n"
            "|---|---|" + "---|" * len(columns) + "---|\n")
    lines = []
    for row in pooled["rows"]:
        cells = [f"{row[c]['ratio']:.3f} [{row[c]['ci95'][0]:.3f}–{row[c]['ci95'][1]:.3f}] {row[c]['verdict']}"
                 for c in columns]
        runs = " / ".join(f"{x:.3f}" for x in row["per_run"])
        lines.append(f"| {row['bs']} | {row['rounds']} | " + " | ".join(cells) + f" | {runs} |")
    return head + "\n".join(lines) + "\n"

"""The README's status block, computed from the committed result files (``dcut report status``).

Every figure in the block is read from a JSON file under ``docs/results/``; the README holds the block between
``<!-- status:begin -->`` and ``<!-- status:end -->``, and ``tests/unit/test_readme_status.py`` fails when the two
differ, so a figure in the README cannot drift from its data. Reads JSON only (no torch, no vLLM).
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- status:begin -->", "<!-- status:end -->"
BATCH_SIZES = (1, 4, 8, 16, 32, 64)
REPLAY = "docs/results/replay/replay.json"
LIVE = "docs/results/live/compare.json"
LIVE_POOLED = "docs/results/live/pooled/pooled.json"
FLOOR_POOLED = "docs/results/floor/pooled/pooled.json"
FLOOR_BS1 = "docs/results/floor/pooled/bs1-six-runs.json"
MOE = "docs/results/moe/compare.json"
# what `joint` must never lose to in the replay (dcut.replay.write.BASELINES), with every fixed width
REPLAY_BASELINES = ("none", "dynamic", "vllm-adaptive")
WIDTH = 118  # the README's prose lines stay short


@dataclass(frozen=True)
class Row:
    """One bar: a label, the bar's threshold, each batch size's figure (None: not run) and the file they came from."""

    label: str
    bar: float
    figures: dict[int, float]
    source: str

    def cells(self) -> list[str]:
        return [f"{self.figures[b]:.3f} {'✓' if round(self.figures[b], 3) >= self.bar else '✗'}"
                if b in self.figures else "–" for b in BATCH_SIZES]


def _load(root: Path, path: str) -> dict[str, Any]:
    return json.loads((root / path).read_text())


def _replay(root: Path, case: str, figure: Callable[[dict, list[dict]], float]) -> dict[int, float]:
    """``figure(joint_row, rows_at_that_bs)`` per batch size of one replayed case."""
    data = _load(root, REPLAY)["cases"][case]
    out = {}
    for bs in data["batch_sizes"]:
        rows = [r for r in data["rows"] if r["bs"] == bs]
        out[bs] = figure(next(r for r in rows if r["policy"] == "joint"), rows)
    return out


def _over_best_baseline(joint: dict, rows: list[dict]) -> float:
    best = max((r for r in rows if r["policy"] in REPLAY_BASELINES or r["policy"].startswith("fixed-")),
               key=lambda r: r["tokens_per_s"])
    return joint["tokens_per_s"] / best["tokens_per_s"]


def _medians(root: Path, path: str, mode: str, others: tuple[str, ...]) -> dict[int, float]:
    """``mode``'s median tokens/s over the best of ``others``' medians, per batch size of a compare report."""
    data = _load(root, path)
    out = {}
    for bs in data["batch_sizes"]:
        cell = {c["mode"]: c["tokens_per_s"] for c in data["cells"] if c["bs"] == bs}
        out[bs] = cell[mode] / max(cell[m] for m in others if m in cell)
    return out


def _pooled(root: Path, path: str, against: str = "best") -> dict[int, float]:
    return {r["bs"]: r[against]["ratio"] for r in _load(root, path)["rows"]}


def rows(root: Path) -> list[Row]:
    live_runs = _load(root, LIVE_POOLED)["runs"]
    floor_runs = _load(root, FLOOR_POOLED)["runs"]
    bs1_runs = _load(root, FLOOR_BS1)["runs"]
    return [
        Row("replay, this CPU: ÷ best baseline", 0.97,
            _replay(root, "deep-cpu", _over_best_baseline), REPLAY),
        Row("replay, H20 projection: ÷ best baseline", 0.97,
            _replay(root, "deep-h20", _over_best_baseline), REPLAY),
        Row("replay, this CPU: ÷ the oracle", 0.9,
            _replay(root, "deep-cpu", lambda j, _: j["fraction_of_oracle"]), REPLAY),
        Row(f"live, {live_runs} runs pooled: ÷ best other", 0.97, _pooled(root, LIVE_POOLED), LIVE_POOLED),
        Row("live, latest run (medians): ÷ best other", 0.97,
            _medians(root, LIVE, "joint", ("none", "full", "dynamic")), LIVE),
        Row(f"width 0, {floor_runs} runs pooled: ÷ plain", 0.97, _pooled(root, FLOOR_POOLED), FLOOR_POOLED),
        Row(f"width 0, {bs1_runs} runs pooled: ÷ plain", 0.97, _pooled(root, FLOOR_BS1), FLOOR_BS1),
        Row("MoE pair, latest run (medians): ÷ `full`", 0.9, _medians(root, MOE, "joint", ("full",)), MOE),
    ]


def _interval(entry: dict[str, Any]) -> str:
    low, high = entry["ci95"]
    return f"{entry['ratio']:.3f} [{low:.3f}–{high:.3f}]"


def _slower(root: Path, path: str, what: str) -> list[str]:
    """``what`` at each batch size where the pooled rounds' paired interval says slower, with its interval."""
    data = _load(root, path)
    return [f"{what.format(runs=data['runs'], bs=r['bs'])} ({_interval(r['best'])})" for r in data["rows"]
            if r["best"]["verdict"].endswith("slower")]


def _wrap(text: str) -> list[str]:
    """A paragraph, or a list item (its later lines indented under it), in lines of at most ``WIDTH``."""
    indent = "  " if text.startswith("- ") else ""
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def _unmeasured(root: Path) -> list[str]:
    """What the committed live results lack that a user's day has: the stock arms, sampled traffic."""
    missing = []
    if "vllm" not in _load(root, LIVE)["modes"]:
        missing.append("vLLM's own speculation as a live rival (the rivals above run D-Cut's hooks: `full`, "
                       "`dynamic`)")
    if not any((root / LIVE.replace("/live/", f"/live-{kind}/")).exists() for kind in ("sampled", "mixed")):
        missing.append("sampled traffic (temperature 1, the OpenAI default): every live figure is greedy")
    return missing


def block(root: Path) -> str:
    """The README's status block, markers excluded: one headline per regime, the table, the paired verdicts and the
    data each figure came from (a Markdown reference per file, with the date and commit it records)."""
    pooled = {r["bs"]: r for r in _load(root, LIVE_POOLED)["rows"]}
    runs = len(next(iter(pooled.values()))["per_run"])
    every = sum(all(r["per_run"][i] >= 0.97 for r in pooled.values()) for i in range(runs))
    machine = _load(root, LIVE)["machine"]
    small, large = pooled[min(pooled)], pooled[max(pooled)]
    h20 = _replay(root, "deep-h20", _over_best_baseline).values()
    lines = _wrap(f"Measured on {machine['cores']}-core CPUs only ({machine['cpu']} in the latest runs), the embedded "
                  "deep pair unless named.")
    lines += _wrap(f"- **Small batches** (bs {small['bs']}, live, {small['rounds']} rounds pooled): `joint` is "
                   f"{small['none']['ratio']:.2f}× plain decoding, {small['best']['ratio']:.2f}× the best other mode.")
    lines += _wrap(f"- **Large batches** (bs {large['bs']}, the same pool): {large['none']['ratio']:.2f}× plain "
                   f"decoding, {large['full']['ratio']:.2f}× verifying every draft, {large['best']['ratio']:.3f}× the "
                   f"best other mode ({large['best']['verdict']}).")
    lines += _wrap(f"- **GPU: not measured.** Replayed on a roofline fitted to an H20's costs (a projection), "
                   f"{min(h20):.3f}–{max(h20):.3f}× the best baseline at bs 1–64.")
    lines += _wrap(f"- **Not measured yet:** {'; '.join(missing)}.") if (missing := _unmeasured(root)) else []
    lines += ["", "| bar: `joint` ÷ … | ≥ | " + " | ".join(f"bs {b}" for b in BATCH_SIZES) + " | data |",
              "|---|---|" + "---|" * len(BATCH_SIZES) + "---|"]
    sources: list[str] = []
    for row in rows(root):
        if row.source not in sources:
            sources.append(row.source)
        key = sources.index(row.source) + 1
        lines.append(f"| {row.label} | {row.bar:g} | " + " | ".join(row.cells()) + f" | [{key}][s{key}] |")
    slower = _slower(root, LIVE_POOLED, "live at bs {bs}, slower than the best other mode") \
        + _slower(root, FLOOR_POOLED, "width 0 at bs {bs}, slower than plain decoding") \
        + _slower(root, FLOOR_BS1, "width 0 at bs {bs} over {runs} runs, slower too")
    lines += [""] + _wrap("Paired over the pooled rounds (median [95 % interval]), faster or within noise everywhere "
                          "except: " + ("; ".join(slower) if slower else "nowhere") + ". Live runs that met 0.97 at "
                          f"every bs on their own: {every} of {runs}.")
    data = []
    for key, path in enumerate(sources, 1):
        record = _load(root, path)
        data.append(f"[{key}: `{path.removeprefix('docs/results/')}`][s{key}] {record['date'][:10]} at "
                    f"{record['commit']}")
    lines += [""] + _wrap("Data (each file's date and commit): " + "; ".join(data) + ".") + [""]
    lines += [f"[s{key}]: {path}" for key, path in enumerate(sources, 1)]
    return "\n".join(lines)


def readme_block(text: str, begin: str = BEGIN, end: str = END) -> str:
    """What a README holds between two markers (stripped of the newlines next to them)."""
    if begin not in text or end not in text:
        raise ValueError(f"no {begin} ... {end} block")
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def with_block(text: str, new: str) -> str:
    """``text`` with its status block replaced by ``new``."""
    head, rest = text.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{new}\n{END}{rest.split(END, 1)[1]}"


def trace_acceptance(folder: Path) -> dict[int, tuple[float, int]]:
    """Mean accepted drafts per request step at each traced width, over every ``bs*.npz`` of a ``dcut trace`` folder
    (every draft verified, so a row's ``accepted`` is what that width would have had accepted): ``{width: (mean,
    rows)}``. The model cards quote these (``dcut report acceptance --trace docs/results/replay/traces/deep``)."""
    import numpy as np

    accepted: dict[int, list[Any]] = {}
    for path in sorted(folder.glob("bs*.npz")):
        with np.load(path, allow_pickle=False) as trace:
            widths = np.repeat(trace["step_width"], np.diff(trace["step_offsets"]))
            for w in np.unique(widths).tolist():
                accepted.setdefault(int(w), []).append(trace["accepted"][widths == w])
    if not accepted:
        raise ValueError(f"no bs*.npz trace in {folder}")
    return {w: (float(np.concatenate(a).mean()), int(sum(len(x) for x in a))) for w, a in sorted(accepted.items())}

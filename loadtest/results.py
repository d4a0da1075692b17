"""Locust CSV output -> one record per (D-Cut mode, users) -> comparison table, JSON and plots.

A run's numbers come from Locust's ``<prefix>_stats.csv`` (and ``<prefix>_failures.csv``), written
by ``locust --csv <prefix>`` with the entries of ``loadtest/locustfile.py``:

- request rows (``POST /v1/completions``, ``POST /v1/chat/completions``): finished requests and
  failures; Locust's ``Requests/s`` is count over the stats window (from the start, or from
  ``--reset-stats``, to the last recorded entry), the same window for every row;
- ``SSE`` rows: ``TTFT`` and ``ITL`` are recorded as tokens arrive, with content size = tokens,
  so output tokens/s = sum over both rows of Requests/s x average content size (tokens of
  requests still streaming when the run ends included); ``TPOT`` percentiles in ms and
  ``TOKENS_PER_S`` (tokens/s per request, held in Locust's response-time columns).

Locust keeps response times rounded to 2 significant digits above 100 (ms), so percentiles are
approximate to that degree.
"""

from __future__ import annotations

import csv
import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REQUEST_TYPE = "POST"
SSE_TYPE = "SSE"


@dataclass
class RunResult:
    """One Locust run: one D-Cut mode at one number of users."""

    mode: str
    users: int
    requests: int
    failures: int
    requests_per_s: float            # successful requests per second of the stats window
    output_tokens_per_s: float       # tokens streamed back per second of the window (all requests)
    output_tokens: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    tpot_p50_ms: float | None
    request_tokens_per_s_p50: float | None
    window_s: float | None
    user_errors: int = 0             # exceptions inside the Locust users (a bug in the load test itself)
    errors: list[dict] = field(default_factory=list)  # [{"name", "error", "occurrences"}]

    def to_json(self) -> dict:
        return asdict(self)


def _float(text: str | None) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if value == value else None  # NaN -> None


def read_stats(prefix: str | Path) -> dict[tuple[str, str], dict[str, str]]:
    """Rows of ``<prefix>_stats.csv`` keyed by (Type, Name)."""
    with open(f"{prefix}_stats.csv", newline="") as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


def read_failures(prefix: str | Path) -> list[dict]:
    path = Path(f"{prefix}_failures.csv")
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [{"name": f"{r['Method']} {r['Name']}", "error": r["Error"], "occurrences": int(r["Occurrences"])}
                for r in csv.DictReader(f)]


def read_user_errors(prefix: str | Path) -> int:
    path = Path(f"{prefix}_exceptions.csv")
    if not path.exists():
        return 0
    with open(path, newline="") as f:
        return sum(int(r["Count"]) for r in csv.DictReader(f))


def run_result(prefix: str | Path, mode: str, users: int) -> RunResult:
    """Summarise one Locust run from its CSV files."""
    stats = read_stats(prefix)
    request_rows = [r for (kind, name), r in stats.items() if kind == REQUEST_TYPE and name.startswith("/v1/")]
    requests = sum(int(r["Request Count"]) for r in request_rows)
    failures = sum(int(r["Failure Count"]) for r in request_rows)
    rps = sum(_float(r["Requests/s"]) or 0.0 for r in request_rows)
    token_rows = [r for (kind, name), r in stats.items() if kind == SSE_TYPE and name in ("TTFT", "ITL")]
    tokens_per_s = sum((_float(r["Requests/s"]) or 0.0) * (_float(r["Average Content Size"]) or 0.0)
                       for r in token_rows)
    tokens = round(sum(int(r["Request Count"]) * (_float(r["Average Content Size"]) or 0.0) for r in token_rows))

    def pct(name: str, column: str) -> float | None:
        row = stats.get((SSE_TYPE, name))
        if row is None or int(row["Request Count"]) == 0:
            return None
        return _float(row[column])

    return RunResult(
        mode=mode, users=users, requests=requests, failures=failures,
        requests_per_s=rps * (requests - failures) / requests if requests else 0.0,
        output_tokens_per_s=tokens_per_s, output_tokens=tokens,
        ttft_p50_ms=pct("TTFT", "50%"), ttft_p99_ms=pct("TTFT", "99%"),
        itl_p50_ms=pct("ITL", "50%"), itl_p99_ms=pct("ITL", "99%"),
        tpot_p50_ms=pct("TPOT", "50%"), request_tokens_per_s_p50=pct("TOKENS_PER_S", "50%"),
        window_s=_window(stats),
        user_errors=read_user_errors(prefix),
        errors=read_failures(prefix),
    )


def _window(stats: dict) -> float | None:
    """Seconds of the stats window: any row's count / its Requests/s (they share the window)."""
    for row in stats.values():
        rps = _float(row["Requests/s"])
        if rps and row["Name"] != "Aggregated":
            return int(row["Request Count"]) / rps
    return None


# ---- the comparison table -------------------------------------------------------------------------

COLUMNS = [  # (header, attribute, format)
    ("D-Cut", "mode", "{}"),
    ("users", "users", "{}"),
    ("requests", "requests", "{}"),
    ("failed", "failures", "{}"),
    ("req/s", "requests_per_s", "{:.2f}"),
    ("output tok/s", "output_tokens_per_s", "{:.1f}"),
    ("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.0f}"),
    ("ITL p50 (ms)", "itl_p50_ms", "{:.0f}"),
    ("ITL p99 (ms)", "itl_p99_ms", "{:.0f}"),
    ("TPOT p50 (ms)", "tpot_p50_ms", "{:.0f}"),
    ("tok/s per request p50", "request_tokens_per_s_p50", "{:.0f}"),
]


def markdown_table(results: list[RunResult]) -> str:
    lines = ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
             "|" + "|".join("---" if a == "mode" else "---:" for _, a, _ in COLUMNS) + "|"]
    for r in sorted(results, key=lambda r: (r.users, r.mode != "dcut")):
        cells = []
        for _, attr, fmt in COLUMNS:
            value = getattr(r, attr)
            cells.append("–" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_lines(results: list[RunResult]) -> list[str]:
    """D-Cut / full-width output tokens/s and TTFT p99 at each number of users where both ran."""
    by = {(r.mode, r.users): r for r in results}
    lines = []
    for users in sorted({r.users for r in results}):
        cut, full = by.get(("dcut", users)), by.get(("full", users))
        if not cut or not full or not full.output_tokens_per_s:
            continue
        gain = cut.output_tokens_per_s / full.output_tokens_per_s
        text = f"- {users} users: output tokens/s D-Cut/full = {gain:.2f}x"
        if cut.ttft_p99_ms and full.ttft_p99_ms:
            text += f", TTFT p99 D-Cut/full = {cut.ttft_p99_ms / full.ttft_p99_ms:.2f}x"
        lines.append(text)
    return lines


REPO = Path(__file__).resolve().parent.parent


def portable(value: Any) -> Any:
    """``value`` (strings inside lists and dicts too) without this machine's paths: the repository
    root becomes relative, the home folder ``~``, the temp folder ``$TMPDIR``. Reports are committed."""
    if isinstance(value, str):
        prefixes = ((f"{REPO}/", ""), (f"{Path.home()}/", "~/"), (f"{tempfile.gettempdir()}/", "$TMPDIR/"))
        for prefix, replacement in prefixes:  # the repository first: it may sit under the home folder
            value = value.replace(prefix, replacement)
        return value
    if isinstance(value, list):
        return [portable(v) for v in value]
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    return value


def write_report(out: Path, results: list[RunResult], meta: dict) -> None:
    """``results.json``, ``results.md`` and the PNG plots under ``out``, with portable paths."""
    out.mkdir(parents=True, exist_ok=True)
    meta = portable(meta)
    (out / "results.json").write_text(json.dumps({**meta, "runs": [r.to_json() for r in results]}, indent=1) + "\n")
    plots = write_plots(out, results)
    md = ["# Load test: D-Cut ON vs OFF", ""]
    md += meta.get("notes_md", [])
    md += ["", markdown_table(results), ""]
    md += ratio_lines(results)
    failures = [(r, e) for r in results for e in r.errors]
    failures += [(r, {"occurrences": r.user_errors, "name": "Locust user", "error": "exceptions (see the run's log)"})
                 for r in results if r.user_errors]
    if failures:
        md += ["", "## Failures", ""]
        md += [f"- {r.mode}, {r.users} users: {e['occurrences']} x {e['name']}: {e['error']}" for r, e in failures]
    md += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    md += ["", "## Setup", "", "```json", json.dumps(meta.get("setup", {}), indent=1), "```", ""]
    (out / "results.md").write_text("\n".join(md))


def write_plots(out: Path, results: list[RunResult]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for attr, label, name in (("output_tokens_per_s", "output tokens/s", "tokens_per_s.png"),
                              ("ttft_p99_ms", "TTFT p99 (ms)", "ttft_p99.png")):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for mode, style in (("dcut", "o-"), ("full", "s--")):
            rows = sorted((r for r in results if r.mode == mode and getattr(r, attr) is not None),
                          key=lambda r: r.users)
            if rows:
                ax.plot([r.users for r in rows], [getattr(r, attr) for r in rows], style, label=mode)
        ax.set_xlabel("concurrent users")
        ax.set_ylabel(label)
        ax.set_xticks(sorted({r.users for r in results}))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        paths.append(out / name)
    return paths

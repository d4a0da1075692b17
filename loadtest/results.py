"""Locust's CSV output -> one summary per run (the runner's progress lines), and portable paths for reports.

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


def read_locust_stats(prefix: str | Path) -> dict[tuple[str, str], dict[str, str]]:
    """Rows of Locust's ``<prefix>_stats.csv`` keyed by (Type, Name)."""
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
    stats = read_locust_stats(prefix)
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

"""What one load point measured, from the locustfile's requests log and two readings of ``/dcut/status``.

Pure computations (no HTTP, no Locust): percentiles, goodput at stated objectives, the replicas'
acceptance between two readings, median and spread over repeats, and where a speculative arm stops
paying against no speculation (``none``).

Definitions (those of ``vllm bench serve``, per request, over the measured window):

- the window runs from the end of the ramp (closed loop: every user started; open loop: ``warmup_s``
  after the start) to the end of the run;
- a request counts when it *finished* in the window (``ok``; ``failed`` and ``dropped`` count as
  failures); one still streaming at the end is ``unfinished`` (its tokens count, its latency does not);
- output tokens/s: every token chunk that arrived in the window, of any request, over the window;
- TTFT: start to first token; TPOT: (last token − first token) / (tokens − 1); ITL: the gap between
  two chunks that carry tokens (a speculative step can deliver several tokens in one chunk);
  E2E: start to end of stream; percentiles are exact (linear interpolation between order statistics);
- goodput: requests finished in the window with TTFT ≤ ``ttft_ms`` and TPOT ≤ ``tpot_ms`` (a
  one-token request has no TPOT and meets that objective), per second, and their output tokens that arrived
  in the window per second (so goodput tokens/s ≤ output tokens/s).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True)
class Objectives:
    """The service-level objectives goodput counts against."""

    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0

    def met(self, ttft_ms: float, tpot_ms: float | None) -> bool:
        return ttft_ms <= self.ttft_ms and (tpot_ms is None or tpot_ms <= self.tpot_ms)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation (numpy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class RequestRecord:
    """One line of the requests log: times in seconds after ``start`` (a wall-clock time)."""

    start: float
    status: Literal["ok", "failed", "cut", "dropped"]
    end: float
    chunks: tuple[tuple[float, int], ...]
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    def ttft_ms(self) -> float | None:
        return self.chunks[0][0] * 1000 if self.chunks else None

    def tpot_ms(self) -> float | None:
        tokens = self.output_tokens
        if tokens < 2:
            return None
        return (self.chunks[-1][0] - self.chunks[0][0]) * 1000 / (tokens - 1)

    def itl_ms(self) -> list[float]:
        return [(b[0] - a[0]) * 1000 for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


def read_requests_log(path: str | Path) -> tuple[dict[str, float], list[RequestRecord]]:
    """The test events (name -> wall time) and the requests of a locustfile ``--requests-log``."""
    events: dict[str, float] = {}
    records = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "event" in row:
            events.setdefault(row["event"], row["t"])
        else:
            records.append(RequestRecord(start=row["start"], status=row["status"], end=row["end"],
                                         chunks=tuple((t, n) for t, n in row["chunks"]), error=row.get("error")))
    return events, records


def measured_window(events: dict[str, float], warmup_s: float) -> tuple[float, float]:
    """(start, stop) wall times of the measured window: after the ramp (every user started) and at least
    ``warmup_s`` after the test started, until the test stopped."""
    begin = events["test_start"]
    start = max(events.get("spawning_complete", begin), begin + warmup_s)
    stop = events.get("test_stop")
    if stop is None or stop <= start:
        raise ValueError(f"no measured window in events {events} (warm-up {warmup_s} s)")
    return start, stop


@dataclass
class PointFigures:
    """One run of one load point (one repeat)."""

    window_s: float
    offered: int                 # requests that arrived (were sent or dropped) in the window
    requests: int                # requests that finished in the window, failures included
    failures: int
    unfinished: int              # arrived in the window, still streaming at the end
    requests_per_s: float        # successful requests finished per second
    output_tokens_per_s: float
    goodput_requests_per_s: float
    goodput_tokens_per_s: float
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p90_ms: float | None = None
    tpot_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p90_ms: float | None = None
    itl_p99_ms: float | None = None
    e2e_p50_ms: float | None = None
    e2e_p90_ms: float | None = None
    e2e_p99_ms: float | None = None
    mean_accepted_length: float | None = None  # from the replicas' totals (None: no drafter)
    keep_ratio: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def point_figures(records: Iterable[RequestRecord], window: tuple[float, float],
                  objectives: Objectives) -> PointFigures:
    """Everything one run measured in ``window`` (module docstring for the definitions)."""
    start, stop = window
    span = stop - start
    inside = lambda t: start <= t <= stop  # noqa: E731
    tokens = good_tokens = good = offered = unfinished = failures = 0
    done: list[RequestRecord] = []
    for r in records:
        tokens += sum(n for t, n in r.chunks if inside(r.start + t))
        offered += inside(r.start)
        if r.status == "cut":
            unfinished += inside(r.start)
            continue
        if not inside(r.start + r.end):
            continue
        if r.status != "ok":
            failures += 1
            continue
        done.append(r)
        if r.chunks and objectives.met(r.ttft_ms(), r.tpot_ms()):
            good += 1
            good_tokens += sum(n for t, n in r.chunks if inside(r.start + t))
    lat: dict[str, list[float]] = {
        "ttft": [v for r in done if (v := r.ttft_ms()) is not None],
        "tpot": [v for r in done if (v := r.tpot_ms()) is not None],
        "itl": [v for r in done for v in r.itl_ms()],
        "e2e": [r.end * 1000 for r in done],
    }
    pct = {f"{name}_p{q}_ms": percentile(values, q) for name, values in lat.items() for q in PERCENTILES}
    return PointFigures(window_s=span, offered=offered, requests=len(done) + failures, failures=failures,
                        unfinished=unfinished, requests_per_s=len(done) / span, output_tokens_per_s=tokens / span,
                        goodput_requests_per_s=good / span, goodput_tokens_per_s=good_tokens / span, **pct)


# ---- the replicas' telemetry -----------------------------------------------------------------------

def acceptance_between(before: dict | None, after: dict | None) -> dict[str, float | int | None]:
    """Mean accepted length (drafts accepted per request-step, bonus token not counted) and mean keep ratio
    (kept / proposed drafts, per step) of the steps run between two ``/dcut/status`` readings, over every
    replica, from the step totals each replica reports. A replica that appeared in between counts from its
    start; one whose totals went down (restarted) counts from zero. None without D-Cut's telemetry
    (``none``: no speculation)."""
    old = {r["replica_id"]: r.get("totals") for r in (before or {}).get("replicas", [])}
    keys = ("steps", "request_steps", "accepted", "keep_ratio_sum", "keep_ratio_steps")
    sums = dict.fromkeys(keys, 0.0)
    seen = 0
    for r in (after or {}).get("replicas", []):
        now = r.get("totals")
        if not now:
            continue
        seen += 1
        prev = old.get(r["replica_id"]) or {}
        if any(now.get(k, 0) < prev.get(k, 0) for k in keys):
            prev = {}
        for k in keys:
            sums[k] += now.get(k, 0) - prev.get(k, 0)
    return {
        "replicas": seen,
        "steps": int(sums["steps"]),
        "mean_accepted_length": sums["accepted"] / sums["request_steps"] if sums["request_steps"] else None,
        # each step's ratio is at most 1; the difference of two running float sums can exceed it by an ulp
        "keep_ratio": min(1.0, sums["keep_ratio_sum"] / sums["keep_ratio_steps"]) if sums["keep_ratio_steps"] else None,
    }


# ---- repeats ---------------------------------------------------------------------------------------

def spread(values: Sequence[float | None]) -> dict[str, float | None]:
    """Median, min and max of the repeats that have a value."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}


def summarize_repeats(repeats: Sequence[PointFigures]) -> dict[str, dict[str, float | None]]:
    """Every figure of a point: median and spread (min-max) over its repeats."""
    return {f.name: spread([getattr(r, f.name) for r in repeats]) for f in fields(PointFigures)}


# ---- where speculation stops paying ------------------------------------------------------------------

@dataclass(frozen=True)
class StopsPaying:
    """Where ``arm`` stops beating ``baseline`` on ``metric`` along a load axis."""

    arm: str
    metric: str
    higher_is_better: bool
    load: float | None          # the first load (ascending) where the arm's median is worse than the baseline's
    verdict: Literal["never_pays", "stops", "always_pays", "no_data"]
    ratio: float | None         # arm / baseline median at ``load`` (or at the highest load when always_pays)
    clear: bool                 # at ``load``: even the arm's best repeat is worse than the baseline's worst


def stops_paying(arm: str, metric: str, baseline: dict[float, dict], candidate: dict[float, dict],
                 higher_is_better: bool = True) -> StopsPaying:
    """``baseline`` and ``candidate``: load -> ``spread`` of ``metric`` (median/min/max). The arm "stops
    paying" at the lowest load where its median is worse than the baseline's (below it, or above it for a
    latency); "never pays" when that is already the lowest load measured."""
    loads = sorted(x for x in candidate if x in baseline and baseline[x]["median"] and candidate[x]["median"]
                   is not None)
    if not loads:
        return StopsPaying(arm, metric, higher_is_better, None, "no_data", None, False)
    sign = 1 if higher_is_better else -1
    for i, x in enumerate(loads):
        a, b = candidate[x], baseline[x]
        if sign * (a["median"] - b["median"]) < 0:
            clear = a["max"] < b["min"] if higher_is_better else a["min"] > b["max"]
            return StopsPaying(arm, metric, higher_is_better, x, "never_pays" if i == 0 else "stops",
                               a["median"] / b["median"], clear)
    top = loads[-1]
    return StopsPaying(arm, metric, higher_is_better, top, "always_pays",
                       candidate[top]["median"] / baseline[top]["median"], False)


def stops_paying_line(axis: str, unit: str, results: Sequence[StopsPaying], repeats: int,
                      baseline: str = "none") -> str:
    """One sentence: where each speculative arm stops paying against ``baseline``."""
    parts = []
    for s in results:
        if s.verdict == "no_data":
            parts.append(f"`{s.arm}` not measured")
            continue
        load = f"{s.load:g} {unit}"
        if repeats < 2:
            note = ", one repeat"
        else:
            note = ", beyond the repeats' spread" if s.clear else ", within the repeats' spread"
        if s.verdict == "never_pays":
            parts.append(f"`{s.arm}` never pays (already {s.ratio:.2f}x at {load}{note})")
        elif s.verdict == "stops":
            parts.append(f"`{s.arm}` stops paying at {load} ({s.ratio:.2f}x{note})")
        else:
            parts.append(f"`{s.arm}` pays at every load measured ({s.ratio:.2f}x at {load})")
    metric = results[0].metric if results else ""
    direction = "higher" if not results or results[0].higher_is_better else "lower"
    return f"**{axis}** (`{metric}`, {direction} is better, median vs `{baseline}`): " + "; ".join(parts) + "."

"""Where one more request delivers most: D-Cut's throughput estimates as a routing signal.

A replica's estimates (``dcut.telemetry.ThroughputEstimate`` per profiled batch size: tokens/s of the whole
batch, from its cost table and the acceptance it sees) price one more request. At ``b`` running requests it adds
``T(b + 1) - T(b)`` tokens/s to what the replica delivers and gets ``T(b + 1) / (b + 1)`` itself; past the
engine's ``max_running`` it only waits and adds nothing. A replica that runs slower than its table says (another
tenant on its cores, a table shared by the controller from a faster machine) is scaled by ``speed``: its
estimated over its measured step times, from the steps it really ran.

The router (``deployments.routing``) ranks replicas by that marginal rate, and falls back to Serve's default
choice when any candidate's figures are missing or stale: a replica that has not reported is not taken for a
bad one. Two guards keep one replica from taking everything (what an earlier version did, measured at 0.61x
Serve's default): a replica that has run no steps yet is priced at the others' median speed, not at its table's
(else every replica that has run, and so measured itself faster than a conservative table, outbids the idle
ones forever); and marginal rates within ``TIE_TOLERANCE`` of each other are equal, decided by the shorter
queue (an engine whose step barely grows with the batch has a nearly straight curve, and the estimate's noise
would otherwise pick the winner).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from dcut.snapshot import DCutSnapshot

SPEED_BOUNDS = (0.1, 10.0)  # a measured speed outside this says more about the measurement than the replica
TIE_TOLERANCE = 0.1  # marginal rates closer than this (relative) are within the estimate's noise


@dataclass(frozen=True)
class RoutingStats:
    """What a replica tells the router (``record_routing_stats``), every few seconds."""

    batch_sizes: tuple[int, ...]  # profiled, ascending
    tokens_per_s: tuple[float, ...]  # T(b) at each, the whole batch
    max_running: int  # max_num_seqs
    speed: float | None  # estimated / measured step time: < 1 when slower than its table; None: no steps yet
    running: int  # requests in the engine when the stats were taken
    sent_at: float  # time.time()

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> RoutingStats | None:
        """The stats in a replica's routing-stats dict; None when it has none (no estimates yet) or is malformed."""
        try:
            speed = None if d["speed"] is None else float(d["speed"])
            stats = cls(tuple(int(b) for b in d["batch_sizes"]), tuple(float(t) for t in d["tokens_per_s"]),
                        int(d["max_running"]), speed, int(d["running"]), float(d["sent_at"]))
        except (KeyError, TypeError, ValueError):
            return None
        ok = stats.batch_sizes and len(stats.batch_sizes) == len(stats.tokens_per_s) and stats.max_running > 0
        return stats if ok else None


def measured_speed(snapshot: DCutSnapshot) -> float | None:
    """Estimated over measured step time, weighted by how many steps ran at each batch size; None with nothing
    to compare."""
    estimated = {e.batch_size: e.step_ms for e in snapshot.estimates}
    if not estimated:
        return None
    sizes = sorted(estimated)
    num = den = 0.0
    for bs, ms in snapshot.window.mean_step_ms.items():
        n = snapshot.window.batch_size_histogram.get(bs, 0)
        if n <= 0 or ms <= 0:
            continue
        num += n * _interpolate(sizes, [estimated[b] for b in sizes], bs)
        den += n * ms
    if den <= 0:
        return None
    return min(max(num / den, SPEED_BOUNDS[0]), SPEED_BOUNDS[1])


def routing_stats(snapshot: DCutSnapshot | None, max_running: int, running: int, now: float) -> RoutingStats | None:
    """A replica's routing figures from its latest D-Cut snapshot; None before it has estimates."""
    if snapshot is None or not snapshot.estimates:
        return None
    est = sorted(snapshot.estimates, key=lambda e: e.batch_size)
    return RoutingStats(tuple(e.batch_size for e in est), tuple(e.tokens_per_s for e in est), max_running,
                        measured_speed(snapshot), running, now)


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (0, 0) and the points; flat past the last (no extrapolated growth)."""
    return float(np.interp(x, [0, *xs], [0.0, *ys]))


def batch_tokens_per_s(stats: RoutingStats, running: int, speed: float | None = None) -> float:
    """T(b): what the replica delivers with ``running`` requests (at most ``max_running`` run at once), at its
    measured speed (``speed`` when it has none)."""
    scale = stats.speed if stats.speed is not None else (1.0 if speed is None else speed)
    return scale * _interpolate(stats.batch_sizes, stats.tokens_per_s, min(running, stats.max_running))


def marginal_tokens_per_s(stats: RoutingStats, running: int, speed: float | None = None) -> float:
    """What one more request adds at ``running``: T(b + 1) - T(b) (0 once the engine is full)."""
    return batch_tokens_per_s(stats, running + 1, speed) - batch_tokens_per_s(stats, running, speed)


def rank_replicas(candidates: Sequence[tuple[str, RoutingStats | None, int | None]], now: float,
                  stale_after_s: float) -> list[str] | None:
    """Replica ids, best first, by the marginal tokens/s of one more request; rates within ``TIE_TOLERANCE`` of
    the best remaining one are a tie, decided by the shorter queue, then the rate that request would get.
    ``candidates``: (id, stats, requests the router last saw there, None if it did not look) — that count,
    fresher than the stats', is the ``b`` priced. None when any candidate has no stats or stats older than
    ``stale_after_s``: the caller routes as it would without D-Cut."""
    if any(stats is None or now - stats.sent_at > stale_after_s for _, stats, _ in candidates):
        return None
    known = [stats.speed for _, stats, _ in candidates if stats.speed is not None]
    prior = float(np.median(known)) if known else 1.0  # a replica that has not run yet: as fast as the others
    scored = []
    for replica_id, stats, queue_len in candidates:
        b = stats.running if queue_len is None else queue_len
        own = batch_tokens_per_s(stats, b + 1, prior) / (b + 1) if b + 1 <= stats.max_running else 0.0
        scored.append((marginal_tokens_per_s(stats, b, prior), b, -own, replica_id))
    scored.sort(key=lambda s: -s[0])
    order: list[str] = []
    while scored:
        floor = scored[0][0] * (1.0 - TIE_TOLERANCE)
        ties = [s for s in scored if s[0] >= floor] if floor > 0 else scored  # all full: the shortest queue
        order += [replica_id for *_, replica_id in sorted(ties, key=lambda s: s[1:])]
        scored = [s for s in scored if s not in ties]
    return order

"""The controller's recent past, for the status page: one sample per replica report and one of the cluster,
kept for ``ControllerSettings.history_s``. A report carries only the present (and the D-Cut window's recent
steps); the page draws how batch size, keep ratio, drafted width, throughput and queue moved."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

from deployments.records import ReplicaReport

MAX_SAMPLES = 5000  # per series: a bound on memory whatever the report rate


class _Sample(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplicaSample(_Sample):
    """One replica report, reduced to what the page plots."""

    t: float  # unix time the replica sent it (its clock)
    batch_size: int  # requests inside the engine
    queued: int  # requests the replica holds that the engine has not taken yet
    tokens_per_s: float
    keep_ratio: float | None  # D-Cut window means (None with D-Cut off or before a step)
    drafted_width: float | None
    accepted_length: float | None
    capacity_tokens_per_s: float
    demand_tokens_per_s: float


class ClusterSample(_Sample):
    t: float
    replicas: int
    capacity_tokens_per_s: float
    demand_tokens_per_s: float


def mean_width(histogram: dict[int, int]) -> float | None:
    """Mean drafted width of the window's steps (``WindowSummary.width_histogram``)."""
    steps = sum(histogram.values())
    return sum(w * n for w, n in histogram.items()) / steps if steps else None


def replica_sample(report: ReplicaReport) -> ReplicaSample:
    window = report.dcut.window if report.dcut else None
    load = report.load
    return ReplicaSample(
        t=report.sent_at, batch_size=load.engine_requests,
        queued=max(load.ongoing_requests - load.engine_requests, 0), tokens_per_s=load.tokens_per_s,
        keep_ratio=window and window.mean_keep_ratio,
        drafted_width=window and mean_width(window.width_histogram),
        accepted_length=window and window.mean_accepted_length,
        capacity_tokens_per_s=report.capacity_tokens_per_s, demand_tokens_per_s=report.demand_tokens_per_s)


def cluster_sample(t: float, reports: Iterable[ReplicaReport]) -> ClusterSample:
    reports = list(reports)
    return ClusterSample(t=t, replicas=len(reports),
                         capacity_tokens_per_s=sum(r.capacity_tokens_per_s for r in reports),
                         demand_tokens_per_s=sum(r.demand_tokens_per_s for r in reports))


class History:
    """Bounded series of samples: per live replica, and of the cluster."""

    def __init__(self, span_s: float):
        self.span_s = span_s
        self.replicas: dict[str, deque[ReplicaSample]] = {}
        self.cluster: deque[ClusterSample] = deque(maxlen=MAX_SAMPLES)

    def add(self, report: ReplicaReport, live: list[ReplicaReport], now: float) -> None:
        """Record ``report`` and the cluster as ``live`` makes it up ``now`` (the controller's clock: replicas'
        reports may arrive out of order, the cluster's series may not)."""
        self.replicas.setdefault(report.replica_id, deque(maxlen=MAX_SAMPLES)).append(replica_sample(report))
        self.cluster.append(cluster_sample(now, live))
        self.prune({r.replica_id for r in live}, now)

    def prune(self, live: set[str], now: float) -> None:
        """Drop the series of replicas no longer live and samples older than the span."""
        for gone in [k for k in self.replicas if k not in live]:
            del self.replicas[gone]
        for series in (self.cluster, *self.replicas.values()):
            while series and series[0].t < now - self.span_s:
                series.popleft()

    def to_json(self) -> dict:
        return {"span_s": self.span_s,
                "replicas": {k: [s.model_dump() for s in v] for k, v in sorted(self.replicas.items())},
                "cluster": [s.model_dump() for s in self.cluster]}

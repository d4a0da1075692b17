"""D-Cut and serving metrics through Ray's metrics system (scraped from Ray's metrics port).

vLLM's own metrics are exported by vLLM's ``RayPrometheusStatLogger`` (label ``ReplicaId``); these add
what D-Cut and the replica know, labelled ``replica``.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

from deployments.records import ReplicaReport

_TAGS = ("replica", "model")


class ReplicaMetrics:
    def __init__(self, replica_id: str, model: str):
        self.tags = {"replica": replica_id, "model": model}
        g = lambda name, desc: Gauge(name, description=desc, tag_keys=_TAGS)  # noqa: E731
        self.capacity = g("dcut_capacity_tokens_per_s", "D-Cut throughput estimate of the replica")
        self.demand = g("dcut_demand_tokens_per_s", "Tokens/s asked of the replica now")
        self.keep_ratio = g("dcut_keep_ratio", "Mean fraction of drafts kept (recent steps)")
        self.accepted_length = g("dcut_accepted_length", "Mean accepted tokens per request per step")
        self.ongoing = g("dcut_ongoing_requests", "Requests in the replica")
        self.engine_requests = g("dcut_engine_requests", "Requests inside the vLLM engine")
        self.tokens_per_s = g("dcut_generated_tokens_per_s", "Generated tokens/s (10 s window)")
        self.start_seconds = g("dcut_replica_start_seconds", "Seconds from replica start to ready")
        self.generated = Counter("dcut_generated_tokens", description="Generated tokens", tag_keys=_TAGS)
        self.aborted = Counter("dcut_aborted_requests", description="Requests aborted (client gone)",
                               tag_keys=_TAGS)
        self.batch_size = Histogram("dcut_step_batch_size", description="Batch size of recent D-Cut steps",
                                    boundaries=[1, 2, 4, 8, 16, 32, 64, 128, 256], tag_keys=_TAGS)
        self._last_generated = 0
        self._last_aborted = 0

    def update(self, report: ReplicaReport) -> None:
        t, load, dcut = self.tags, report.load, report.dcut
        self.capacity.set(report.capacity_tokens_per_s, tags=t)
        self.demand.set(report.demand_tokens_per_s, tags=t)
        self.ongoing.set(load.ongoing_requests, tags=t)
        self.engine_requests.set(load.engine_requests, tags=t)
        self.tokens_per_s.set(load.tokens_per_s, tags=t)
        self.start_seconds.set(report.start_seconds, tags=t)
        if isinstance(dcut.get("mean_keep_ratio"), int | float):
            self.keep_ratio.set(float(dcut["mean_keep_ratio"]), tags=t)
        if isinstance(dcut.get("mean_accepted_length"), int | float):
            self.accepted_length.set(float(dcut["mean_accepted_length"]), tags=t)
        if load.generated_tokens_total > self._last_generated:
            self.generated.inc(load.generated_tokens_total - self._last_generated, tags=t)
            self._last_generated = load.generated_tokens_total
        if load.aborted_total > self._last_aborted:
            self.aborted.inc(load.aborted_total - self._last_aborted, tags=t)
            self._last_aborted = load.aborted_total
        hist = dcut.get("batch_size_histogram") or {}
        if isinstance(hist, dict):
            for bs, count in hist.items():
                try:
                    for _ in range(min(int(count), 64)):
                        self.batch_size.observe(float(bs), tags=t)
                except (TypeError, ValueError):
                    continue

"""D-Cut and serving metrics through Ray's metrics system (scraped from Ray's metrics port as ``ray_dcut_*``).

vLLM's own metrics are exported by vLLM's ``RayPrometheusStatLogger`` (``ray_vllm_*``, label ``ReplicaId``).
The plugin's ``vllm:dcut_*`` counters live in the engine core's process registry, which Ray does not
scrape, so the replica re-exports what D-Cut reports here, labelled ``replica`` like Serve's own metrics.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

from dcut.snapshot import DCutSnapshot
from deployments.records import ReplicaReport

_TAGS = ("replica", "model")


class ReplicaMetrics:
    def __init__(self, replica_id: str, model: str):
        self.tags = {"replica": replica_id, "model": model}

        def gauge(name: str, description: str, *extra: str) -> Gauge:
            return Gauge(name, description=description, tag_keys=(*_TAGS, *extra))

        def counter(name: str, description: str) -> Counter:
            return Counter(name, description=description, tag_keys=_TAGS)

        self.capacity = gauge("dcut_capacity_tokens_per_s", "Tokens/s the replica can give at the latency "
                              "objective (D-Cut estimate, or the default before one exists)")
        self.demand = gauge("dcut_demand_tokens_per_s", "Tokens/s asked of the replica now")
        self.estimate = gauge("dcut_estimated_tokens_per_s", "D-Cut's predicted tokens/s per batch size",
                              "batch_size")
        self.keep_ratio = gauge("dcut_keep_ratio", "Mean fraction of drafts kept (recent steps)")
        self.accepted_length = gauge("dcut_accepted_length", "Accepted drafts per request-step (recent steps)")
        self.position_acceptance = gauge("dcut_position_acceptance", "Acceptance of draft position t "
                                         "when verified (recent steps)", "position")
        self.batch_size = gauge("dcut_batch_size_mean", "Mean batch size of recent D-Cut steps")
        self.selection_us = gauge("dcut_selection_us", "Median time to choose keep depths (recent steps)")
        self.ongoing = gauge("dcut_ongoing_requests", "Requests in the replica")
        self.engine_requests = gauge("dcut_engine_requests", "Requests inside the vLLM engine")
        self.tokens_per_s = gauge("dcut_generated_tokens_per_s", "Generated tokens/s (10 s window)")
        self.start_seconds = gauge("dcut_replica_start_seconds", "Seconds from replica start to ready")
        self.steps = counter("dcut_steps", "Engine steps with D-Cut on")
        self.speed_shifts = counter("dcut_speed_shifts", "Changes of the machine's speed D-Cut noticed (mode "
                                    "joint): each sent a batch size's widths back to be measured")
        self.generated = counter("dcut_generated_tokens", "Generated tokens")
        self.aborted = counter("dcut_aborted_requests", "Requests aborted (client gone)")
        self.specexit_exits = counter("dcut_specexit_exits", "Thinking sections SpecExit ended")
        self.specexit_reasoning = counter("dcut_specexit_reasoning_tokens", "Tokens generated while thinking "
                                          "by requests SpecExit watched")
        self.specexit_saved = counter("dcut_specexit_predicted_saved_tokens", "Thinking tokens SpecExit's head "
                                      "estimated each exit saved, summed")
        self.acceptance = Histogram("dcut_request_acceptance_rate", description="Per request: drafts the target "
                                    "accepted / drafts it verified (requests that verified none are not observed)",
                                    boundaries=[0.1 * i for i in range(1, 10)], tag_keys=(*_TAGS, "route"))
        self.speculation_requests = Counter("dcut_speculation_requests", description="Responses whose speculation "
                                            "was measured (usage.speculation), by route",
                                            tag_keys=(*_TAGS, "route"))
        self._last = {"steps": 0, "shifts": 0, "generated": 0, "aborted": 0, "exits": 0, "reasoning": 0, "saved": 0}

    def observe_request(self, route: str, acceptance_rate: float | None) -> None:
        """One response's acceptance rate (``Engine.record_speculation``), labelled by its route."""
        tags = {**self.tags, "route": route}
        self.speculation_requests.inc(tags=tags)
        if acceptance_rate is not None:
            self.acceptance.observe(acceptance_rate, tags=tags)

    def _count(self, name: str, counter: Counter, total: float) -> None:
        if total > self._last[name]:
            counter.inc(total - self._last[name], tags=self.tags)
        self._last[name] = total  # the engine's step count restarts when its stats are reset

    def update(self, report: ReplicaReport) -> None:
        t, load, snap = self.tags, report.load, report.dcut
        self.capacity.set(report.capacity_tokens_per_s, tags=t)
        self.demand.set(report.demand_tokens_per_s, tags=t)
        self.ongoing.set(load.ongoing_requests, tags=t)
        self.engine_requests.set(load.engine_requests, tags=t)
        self.tokens_per_s.set(load.tokens_per_s, tags=t)
        self.start_seconds.set(report.start_seconds, tags=t)
        self._count("generated", self.generated, load.generated_tokens_total)
        self._count("aborted", self.aborted, load.aborted_total)
        if snap is not None:
            self._update_dcut(snap)
        if (se := report.specexit) is not None:
            self._count("exits", self.specexit_exits, se.exits)
            self._count("reasoning", self.specexit_reasoning, se.reasoning_tokens)
            self._count("saved", self.specexit_saved, se.predicted_saved_tokens)

    def _update_dcut(self, snap: DCutSnapshot) -> None:
        t, window = self.tags, snap.window
        for e in snap.estimates:
            self.estimate.set(e.tokens_per_s, tags={**t, "batch_size": str(e.batch_size)})
        for value, gauge in ((window.mean_keep_ratio, self.keep_ratio),
                             (window.mean_accepted_length, self.accepted_length),
                             (snap.selection_us_median, self.selection_us)):
            if value is not None:
                gauge.set(float(value), tags=t)
        for position, rate in enumerate(window.position_acceptance, 1):
            if rate is not None:
                self.position_acceptance.set(rate, tags={**t, "position": str(position)})
        if histogram := window.batch_size_histogram:
            steps = sum(histogram.values())
            self.batch_size.set(sum(b * n for b, n in histogram.items()) / steps, tags=t)
        self._count("steps", self.steps, snap.steps)
        self._count("shifts", self.speed_shifts, sum((snap.speed_shifts or {}).values()))


class IngressMetrics:
    """What the ingress does about engine replica faults (``ray_dcut_ingress_*``)."""

    def __init__(self):
        self.retries = Counter("dcut_ingress_retries", description="Requests tried again on another engine "
                               "replica because theirs died before the client got a byte")
        self.continuations = Counter("dcut_continuations", description="Requests whose engine replica died after "
                                     "it generated tokens, by route and outcome: completed (continued on another "
                                     "replica to its end), failed (a continuation failed too), refused (could not be "
                                     "continued faithfully: deployments.continuation)", tag_keys=("route", "outcome"))
        self.broken_streams = Counter("dcut_ingress_broken_streams", description="Streams ended with an error "
                                      "event because their engine replica failed after chunks were sent")

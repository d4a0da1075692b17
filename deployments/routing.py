"""DCutRequestRouter: Serve's request router for the engine replicas, on D-Cut's estimates (``dcut.routing``).

Each engine replica publishes its throughput curve, measured speed and running requests through Serve's
``record_routing_stats``; for every request the router ranks the candidates by the tokens/s one more request
adds there, each in its own rank, so Serve sends the request to the best replica that still has room (the
queue-length probe of the rank decides only between equals). With any candidate's figures missing or stale it
falls back to Serve's default, the power of two choices on queue length.

Enable with ``engine_replica.routing.policy: dcut`` (``deployments.settings.RoutingSettings``).
"""

from __future__ import annotations

import random
import time

from ray.serve.request_router import (
    FIFOMixin,
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from dcut.routing import RoutingStats, rank_replicas


class DCutRequestRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, stale_after_s: float = 6.0) -> None:
        """``request_router_kwargs``: figures older than ``stale_after_s`` are not trusted."""
        self.stale_after_s = stale_after_s
        self.fallbacks = 0
        self._parsed: dict[str, tuple[dict, RoutingStats | None]] = {}  # replica -> (its raw stats, parsed)

    def _stats(self, replica: RunningReplica) -> RoutingStats | None:
        """A replica's figures, parsed once per update Serve gives us (not once per request)."""
        raw = replica.routing_stats or {}
        key = replica.replica_id.unique_id
        cached = self._parsed.get(key)
        if cached is None or cached[0] is not raw:
            cached = self._parsed[key] = (raw, RoutingStats.from_dict(raw))
        return cached[1]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        cache = self.replica_queue_len_cache
        order = rank_replicas([(r.replica_id.unique_id, self._stats(r), cache.get(r.replica_id))
                               for r in candidate_replicas], time.time(), self.stale_after_s)
        if order is None:  # someone's figures are missing or stale: Serve's default choice
            self.fallbacks += 1
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[replica_id]] for replica_id in order]

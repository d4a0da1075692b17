"""DCutController: one per application. Keeps the replicas' cost tables merged per fingerprint and their
telemetry; hands a table to a starting replica (or tells it to profile, or to wait for the replica that
already profiles the same fingerprint); computes cluster estimates for ``GET /dcut/status``.
"""

from __future__ import annotations

import logging
import math
import time

from app.config import AppConfig
from deployments.records import CostTableOffer, ReplicaReport

logger = logging.getLogger("ray.serve")


def merge_cost_tables(current: dict | None, new: dict) -> dict:
    """Merge two JSON cost tables of one fingerprint (``dcut.cost_table``); the newer wins on failure."""
    if current is None:
        return new
    try:
        from dcut.cost_table import CostTable

        return CostTable.merge([CostTable.from_json(current), CostTable.from_json(new)]).to_json()
    except Exception as e:  # noqa: BLE001 - keep serving with the newest table
        logger.warning("cost table merge failed (%s); keeping the newest", e)
        return new


class DCutController:
    def __init__(self, config: dict):
        cfg = AppConfig.model_validate(config)
        self.settings = cfg.controller
        self.autoscaling = cfg.engine_replica.autoscaling
        self.tables: dict[str, dict] = {}
        self.table_sources: dict[str, list[str]] = {}
        self.leases: dict[str, tuple[str, float]] = {}  # fingerprint key -> (replica, expires)
        self.reports: dict[str, ReplicaReport] = {}

    # ---- cost tables --------------------------------------------------------------------------

    def offer_cost_table(self, key: str, fingerprint: dict, replica_id: str) -> dict:
        if key in self.tables:
            logger.info("cost table %s handed to replica %s", key, replica_id)
            return CostTableOffer(action="use", table=self.tables[key]).model_dump()
        holder = self.leases.get(key)
        now = time.monotonic()
        if holder is None or holder[1] < now or holder[0] == replica_id:
            self.leases[key] = (replica_id, now + self.settings.profile_lease_s)
            logger.info("replica %s profiles fingerprint %s", replica_id, key)
            return CostTableOffer(action="profile").model_dump()
        return CostTableOffer(action="wait").model_dump()

    def put_cost_table(self, key: str, table: dict | None, replica_id: str) -> None:
        if self.leases.get(key, ("",))[0] == replica_id:
            del self.leases[key]
        if not table:
            return
        fp = table.get("fingerprint")
        if key in self.tables and fp is not None and self.tables[key].get("fingerprint") not in (None, fp):
            logger.warning("replica %s sent a table whose fingerprint differs; ignored", replica_id)
            return
        self.tables[key] = merge_cost_tables(self.tables.get(key), table)
        self.table_sources.setdefault(key, []).append(replica_id)

    # ---- telemetry ----------------------------------------------------------------------------

    def report(self, report: dict) -> None:
        r = ReplicaReport.model_validate(report)
        self.reports[r.replica_id] = r

    def _live_reports(self) -> list[ReplicaReport]:
        now = time.time()
        stale = [k for k, r in self.reports.items() if now - r.sent_at > self.settings.stale_after_s]
        for k in stale:
            del self.reports[k]
        return sorted(self.reports.values(), key=lambda r: r.replica_id)

    def status(self) -> dict:
        reports = self._live_reports()
        capacity = sum(r.capacity_tokens_per_s for r in reports)
        demand = sum(r.demand_tokens_per_s for r in reports)
        per_replica = capacity / len(reports) if reports else 0.0
        u = self.autoscaling.target_utilization
        suggested = math.ceil(demand / (per_replica * u)) if per_replica > 0 else None
        replicas = []
        for r in reports:
            d = r.dcut
            replicas.append({
                "replica_id": r.replica_id,
                "model": r.served_model_name,
                "fingerprint": r.fingerprint_key,
                "cost_table_source": r.cost_table_source,
                "start_seconds": round(r.start_seconds, 2),
                "batch_size": r.load.engine_requests,
                "batch_size_histogram": d.get("batch_size_histogram"),
                "keep_ratio": d.get("mean_keep_ratio"),
                "chosen_ratios": d.get("keep_ratio_histogram", d.get("chosen_ratios")),
                "acceptance": {"mean_accepted_length": d.get("mean_accepted_length"),
                               "per_position": d.get("position_acceptance",
                                                     d.get("per_position_acceptance"))},
                "capacity_tokens_per_s": r.capacity_tokens_per_s,
                "demand_tokens_per_s": r.demand_tokens_per_s,
                "load": r.load.model_dump(),
                "dcut": d,
                "age_s": round(time.time() - r.sent_at, 2),
            })
        return {
            "replicas": replicas,
            "cluster": {"replicas": len(reports), "capacity_tokens_per_s": capacity,
                        "demand_tokens_per_s": demand,
                        "utilization": demand / capacity if capacity else 0.0,
                        "target_utilization": u, "suggested_replicas": suggested},
            "cost_tables": {k: {"table": t, "from_replicas": self.table_sources.get(k, [])}
                            for k, t in self.tables.items()},
            "profiling": {k: v[0] for k, v in self.leases.items()},
        }

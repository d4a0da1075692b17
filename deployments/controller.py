"""DCutController: one per application. Keeps every replica's latest cost table per fingerprint (handed out
merged), and the replicas' telemetry; hands a table to a starting replica (or tells it to profile, or to
wait for the replica that already profiles the same fingerprint); computes cluster estimates for
``GET /dcut/status``. Replicas only ask it things: when it is down they profile and keep serving.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

from ray import serve
from ray.serve.exceptions import RayServeException

from dcut.cost_table import CostTable
from dcut.learned import LearnedState, merge
from deployments.autoscaling import read_log, replicas_needed
from deployments.history import History
from deployments.records import CostTableOffer, ReplicaReport
from deployments.settings import AutoscalingSettings, ControllerSettings

logger = logging.getLogger("ray.serve")


class DCutController:
    def __init__(self, settings: ControllerSettings, autoscaling: AutoscalingSettings):
        self.settings = settings
        self.autoscaling = autoscaling
        self.tables: dict[str, dict[str, CostTable]] = {}  # fingerprint key -> replica -> its latest table
        self.learned: dict[str, dict[str, LearnedState]] = {}  # the same for what joint runners learned
        self.leases: dict[str, tuple[str, float]] = {}  # fingerprint key -> (profiling replica, expires)
        self.reports: dict[str, ReplicaReport] = {}
        self.recent = History(settings.history_s)
        try:
            self.app_name = serve.get_replica_context().app_name
        except RayServeException:  # a plain object (unit tests): no autoscaling policy publishes to it
            self.app_name = None

    # ---- cost tables --------------------------------------------------------------------------

    def cost_table(self, fingerprint: str) -> CostTable | None:
        """The replicas' tables of ``fingerprint`` merged (a replica that went away still counts)."""
        tables = self.tables.get(fingerprint)
        return CostTable.merge(list(tables.values())) if tables else None

    def learned_state(self, fingerprint: str) -> LearnedState | None:
        """What the replicas of ``fingerprint`` learned, merged (those of one K and width set as the latest)."""
        states = list(self.learned.get(fingerprint, {}).values())
        if not states:
            return None
        last = states[-1]
        return merge([s for s in states if (s.k, s.widths) == (last.k, last.widths)])

    def offer_cost_table(self, fingerprint: str, replica_id: str) -> dict:
        table = self.cost_table(fingerprint)
        if table is not None:
            learned = self.learned_state(fingerprint)
            logger.info("cost table %s handed to replica %s%s", fingerprint, replica_id,
                        " with learned state" if learned is not None else "")
            return CostTableOffer(action="use", table=table.to_json(),
                                  learned=None if learned is None else learned.model_dump()).model_dump()
        holder = self.leases.get(fingerprint)
        now = time.monotonic()
        if holder is None or holder[1] < now or holder[0] == replica_id:
            self.leases[fingerprint] = (replica_id, now + self.settings.profile_lease_s)
            logger.info("replica %s profiles fingerprint %s", replica_id, fingerprint)
            return CostTableOffer(action="profile").model_dump()
        return CostTableOffer(action="wait").model_dump()

    # ---- telemetry ----------------------------------------------------------------------------

    def report(self, report: dict) -> bool:
        """Keep a replica's report (its telemetry, its start-up phases, its cost table); True: accepted (the
        replica times its first report by this answer)."""
        r = ReplicaReport.model_validate(report)
        self.reports[r.replica_id] = r
        self.recent.add(r, self._live_reports(), time.time())
        if self.leases.get(r.fingerprint, ("",))[0] == r.replica_id:  # its engine runs: done profiling
            del self.leases[r.fingerprint]
        self._keep_tables(r)
        return True

    def _keep_tables(self, r: ReplicaReport) -> None:
        if r.dcut is None or r.dcut.cost_table is None:
            return
        table = CostTable.from_json(r.dcut.cost_table)
        if table.fingerprint.key() != r.fingerprint:
            logger.warning("replica %s sent a cost table of fingerprint %s as %s; ignored", r.replica_id,
                           table.fingerprint.key(), r.fingerprint)
            return
        self.tables.setdefault(r.fingerprint, {})[r.replica_id] = table
        if r.dcut.learned is not None and r.dcut.learned.fingerprint == r.fingerprint:
            self.learned.setdefault(r.fingerprint, {})[r.replica_id] = r.dcut.learned

    def _stale_after_s(self, report: ReplicaReport) -> float:
        """How long ``report``'s replica may stay silent before it leaves the cluster view (a killed replica
        should not count as capacity, nor show in the status, for long)."""
        return self.settings.stale_after_s or self.settings.stale_after_reports * report.interval_s

    def _live_reports(self) -> list[ReplicaReport]:
        now = time.time()
        for replica_id in [k for k, r in self.reports.items() if now - r.sent_at > self._stale_after_s(r)]:
            del self.reports[replica_id]
        return sorted(self.reports.values(), key=lambda r: r.replica_id)

    def status(self) -> dict:
        reports = self._live_reports()
        capacity = sum(r.capacity_tokens_per_s for r in reports)
        demand = sum(r.demand_tokens_per_s for r in reports)
        per_replica = capacity / len(reports) if reports else 0.0
        u = self.autoscaling.target_utilization
        suggested = replicas_needed(demand, per_replica, u) if per_replica > 0 else None
        replicas = []
        for r in reports:
            snap = r.dcut
            w = snap.window if snap else None
            replicas.append({
                "replica_id": r.replica_id,
                "model": r.served_model_name,
                "node_id": r.node_id,
                "pid": r.pid,
                "fingerprint": r.fingerprint,
                "cost_source": snap.cost_source if snap else None,
                "cost_path": snap.cost_path if snap else None,
                "start_seconds": round(r.start_seconds, 2),
                "startup": r.startup and r.startup.model_dump(),
                "batch_size": r.load.engine_requests,
                "batch_size_histogram": w and w.batch_size_histogram,
                "keep_ratio": w and w.mean_keep_ratio,
                "keep_ratio_histogram": w and w.keep_ratio_histogram,
                "width_histogram": w and w.width_histogram,
                "acceptance": {"mean_accepted_length": w and w.mean_accepted_length,
                               "per_position": w and w.position_acceptance,
                               "curve": w and w.acceptance_curve},
                "mean_step_ms": w and w.mean_step_ms,
                "steps": snap and snap.steps,
                "totals": snap and snap.totals.model_dump(),  # since start: loadtest diffs two readings
                "fallback_steps": w and w.fallback_steps,
                "selection_us_median": snap and snap.selection_us_median,
                "estimates": [asdict(e) for e in snap.estimates] if snap else [],
                "capacity_tokens_per_s": r.capacity_tokens_per_s,
                "capacity_from": r.capacity_from,
                "demand_tokens_per_s": r.demand_tokens_per_s,
                "load": r.load.model_dump(),
                "specexit": r.specexit and r.specexit.model_dump(),
                "request_acceptance": r.acceptance and r.acceptance.model_dump(),
                "age_s": round(time.time() - r.sent_at, 2),
            })
        return {
            "replicas": replicas,
            "cluster": {"replicas": len(reports), "capacity_tokens_per_s": capacity,
                        "demand_tokens_per_s": demand,
                        "utilization": demand / capacity if capacity else 0.0,
                        "target_utilization": u, "request_tokens_per_s": self.autoscaling.request_tokens_per_s,
                        "suggested_replicas": suggested},
            "cost_tables": {k: {"table": self.cost_table(k).to_json(), "from_replicas": sorted(t)}
                            for k, t in self.tables.items()},
            "profiling": {k: v[0] for k, v in self.leases.items()},
            "autoscaling": read_log(self.app_name).model_dump() if self.app_name else None,
        }

    def history(self) -> dict:
        """Recent samples per live replica and of the cluster (``GET /dcut/history``, the status page)."""
        self.recent.prune({r.replica_id for r in self._live_reports()}, time.time())
        return self.recent.to_json()

"""The D-Cut controller's cost-table hand-out and telemetry, as a plain object (no Ray instance)."""

from __future__ import annotations

import time

import pytest

from dcut.cost_table import CostTable, Fingerprint
from dcut.settings import DCutSettings
from dcut.snapshot import DCutSnapshot, Overhead, ThroughputEstimate, WindowSummary
from deployments.controller import DCutController
from deployments.records import EngineLoad, ReplicaReport
from deployments.settings import AutoscalingSettings, ControllerSettings

FP = Fingerprint(hardware="cpu x2", model="models/dense", drafter="models/dense-dflash", k=15)
KEY = FP.key()


def table(ms: float, fingerprint: Fingerprint = FP) -> dict:
    return CostTable(fingerprint, {1: [(1, ms, 1), (16, 2 * ms, 1)], 4: [(4, 2 * ms, 1), (64, 4 * ms, 1)]}).to_json()


def report(replica: str, cost_table: dict | None, fingerprint: str = KEY, **kw) -> dict:
    snapshot = DCutSnapshot(settings=DCutSettings(), fingerprint=FP, cost_source="profiled", steps=3,
                            window=WindowSummary(steps=3, mean_keep_ratio=0.5), overhead=Overhead(
                                per_step_ms=1.0, per_token_ms=0.01), cost_table=cost_table,
                            estimates=[ThroughputEstimate(4, 6.0, 10.0, 600.0, 150.0)])
    return ReplicaReport(replica_id=replica, served_model_name="dense", fingerprint=fingerprint,
                         start_seconds=1.0, sent_at=kw.pop("sent_at", time.time()),
                         interval_s=kw.pop("interval_s", 2.0),
                         load=EngineLoad(), capacity_tokens_per_s=kw.pop("capacity", 100.0), capacity_from="estimates",
                         demand_tokens_per_s=kw.pop("demand", 0.0), dcut=snapshot).model_dump(mode="json")


def test_first_replica_profiles_others_wait_then_get_the_table():
    c = DCutController(ControllerSettings(), AutoscalingSettings())
    assert c.offer_cost_table(KEY, "a")["action"] == "profile"
    assert c.offer_cost_table(KEY, "b")["action"] == "wait"
    assert c.offer_cost_table(KEY, "a")["action"] == "profile"  # the holder may ask again
    c.report(report("a", table(10.0)))
    assert c.status()["profiling"] == {}
    offer = c.offer_cost_table(KEY, "b")
    assert offer["action"] == "use"
    assert CostTable.from_json(offer["table"]).lookup(1, 1) == 10.0


def test_report_without_table_releases_the_lease():
    c = DCutController(ControllerSettings(), AutoscalingSettings())
    c.offer_cost_table(KEY, "a")
    c.report(report("a", None))
    assert c.offer_cost_table(KEY, "b")["action"] == "profile"


def test_tables_merge_latest_per_replica():
    c = DCutController(ControllerSettings(), AutoscalingSettings())
    c.report(report("a", table(10.0)))
    c.report(report("a", table(14.0)))  # a's refined table replaces its first one
    c.report(report("b", table(20.0)))
    merged = CostTable.from_json(c.offer_cost_table(KEY, "c")["table"])
    assert merged.lookup(1, 1) == 17.0  # (14 + 20) / 2, not (10 + 14 + 20) / 3
    assert c.status()["cost_tables"][KEY]["from_replicas"] == ["a", "b"]


def test_table_of_another_fingerprint_is_ignored():
    c = DCutController(ControllerSettings(), AutoscalingSettings())
    other = FP.model_copy(update={"hardware": "another cpu"})
    c.report(report("a", table(10.0, other)))
    assert c.tables == {}
    assert c.offer_cost_table(KEY, "b")["action"] == "profile"


def test_status_cluster_estimate_and_stale_replicas():
    c = DCutController(ControllerSettings(stale_after_s=5), AutoscalingSettings())
    c.report(report("a", None, capacity=100.0, demand=140.0))
    c.report(report("b", None, capacity=100.0, demand=70.0))
    c.report(report("gone", None, capacity=100.0, demand=500.0, sent_at=time.time() - 60))
    cluster = c.status()["cluster"]
    assert cluster["replicas"] == 2
    assert cluster["capacity_tokens_per_s"] == 200.0 and cluster["demand_tokens_per_s"] == 210.0
    assert cluster["suggested_replicas"] == 3  # ceil(210 / (100 x 0.7))


def test_status_reads_the_typed_snapshot_of_each_replica():
    c = DCutController(ControllerSettings(), AutoscalingSettings())
    c.report(report("a", None))
    (r,) = c.status()["replicas"]
    assert r["cost_source"] == "profiled" and r["keep_ratio"] == 0.5 and r["steps"] == 3
    assert r["estimates"] == [{"batch_size": 4, "tokens_per_step": 6.0, "step_ms": 10.0, "tokens_per_s": 600.0,
                               "request_tokens_per_s": 150.0}]


def test_replica_silent_for_three_of_its_intervals_leaves_the_cluster_view():
    """By default a replica is forgotten after 3 of its own report intervals, whatever their length; its age shows
    until then."""
    c = DCutController(ControllerSettings(), AutoscalingSettings())
    now = time.time()
    c.report(report("fast-late", None, interval_s=1.0, sent_at=now - 3.5))
    c.report(report("slow-fine", None, interval_s=2.0, sent_at=now - 3.5))
    c.report(report("fresh", None, interval_s=1.0, sent_at=now - 0.5))
    replicas = {r["replica_id"]: r for r in c.status()["replicas"]}
    assert sorted(replicas) == ["fresh", "slow-fine"]
    assert replicas["slow-fine"]["age_s"] == pytest.approx(3.5, abs=0.5)

"""What the status page reads: the controller's series (``/dcut/history``), the autoscaler's decisions with
their reasons, and the key a browser presents. Plain objects, no Ray instance."""

from __future__ import annotations

import base64
import time

import pytest

from deployments.autoscaling import DCutPolicy, DecisionLog, decide
from deployments.controller import DCutController
from deployments.history import History, mean_width
from deployments.ingress import presented_key
from deployments.records import ReplicaReport, ScalingDecision, StartupPhases
from deployments.settings import AutoscalingSettings, ControllerSettings
from tests.unit.test_autoscaling_policy import ctx
from tests.unit.test_controller import report


def test_replica_and_cluster_series():
    c = DCutController(ControllerSettings(stale_after_s=30), AutoscalingSettings())
    now = time.time()
    for i in range(3):
        a = report("a", None, sent_at=now - 4 + 2 * i, capacity=100.0, demand=10.0 * i)
        a["load"].update(engine_requests=2, ongoing_requests=5, tokens_per_s=40.0)
        a["dcut"]["window"]["width_histogram"] = {"0": 1, "7": 3}
        c.report(a)
    c.report(report("b", None, capacity=50.0, demand=5.0))
    history = c.history()
    (sample, *_), b = history["replicas"]["a"], history["replicas"]["b"]
    assert len(history["replicas"]["a"]) == 3 and len(b) == 1
    assert sample["batch_size"] == 2 and sample["queued"] == 3 and sample["tokens_per_s"] == 40.0
    assert sample["drafted_width"] == pytest.approx(21 / 4) and sample["keep_ratio"] == 0.5
    assert [s["replicas"] for s in history["cluster"]] == [1, 1, 1, 2]
    assert history["cluster"][-1]["capacity_tokens_per_s"] == 150.0
    assert history["cluster"][-1]["demand_tokens_per_s"] == 25.0


def test_history_forgets_silent_replicas_and_old_samples():
    c = DCutController(ControllerSettings(stale_after_s=7, history_s=10), AutoscalingSettings())
    now = time.time()
    c.report(report("gone", None, sent_at=now - 8))
    for t in (now - 20, now - 6, now):
        c.report(report("a", None, sent_at=t))
    history = c.history()
    assert list(history["replicas"]) == ["a"]
    assert [s["t"] for s in history["replicas"]["a"]] == [now - 6, now]  # older than history_s: gone
    assert [s["replicas"] for s in history["cluster"]] == [0, 0, 1, 1]  # stamped on arrival: all recent


def test_history_is_bounded_whatever_the_report_rate():
    from deployments.history import MAX_SAMPLES

    h = History(span_s=1e9)
    r = ReplicaReport.model_validate(report("a", None))
    for _ in range(MAX_SAMPLES + 10):
        h.add(r, [r], time.time())
    assert len(h.replicas["a"]) == MAX_SAMPLES and len(h.cluster) == MAX_SAMPLES


def test_start_up_phases_per_replica():
    """Each replica's start-up phases as it reported them (the page's stacked bars); a replica that reports none
    (an older one) shows none, and one whose first report is not accepted yet shows no total."""
    c = DCutController(ControllerSettings(stale_after_s=30), AutoscalingSettings())
    phases = StartupPhases(process_started_at=time.time() - 30, process_s=2.0, import_s=12.0, fingerprint_s=0.5,
                           cost_offer_s=0.1, engine_init_s=8.0, first_report_s=0.3, total_s=22.9, compile_s=None,
                           cost_table_s=None, cost_table_source="controller")
    c.report(report("a", None) | {"startup": phases.model_dump()})
    c.report(report("b", None))
    pending = phases.model_copy(update={"first_report_s": None, "total_s": None, "cost_table_source": "cache"})
    c.report(report("c", None) | {"startup": pending.model_dump()})
    shown = {r["replica_id"]: r["startup"] for r in c.status()["replicas"]}
    assert shown["a"] == phases.model_dump() and shown["b"] is None and shown["c"]["total_s"] is None
    assert StartupPhases.model_validate(shown["c"]).ready_s() == pytest.approx(22.6)
    assert phases.line() == ("process 2.0 s, import 12.0 s, fingerprint 0.5 s, cost table offer 0.1 s, engine 8.0 s "
                             "(compile ?, cost table ?; table from controller), first report 0.3 s")


def test_per_request_acceptance_per_replica():
    """The page's per-request acceptance chart reads each replica's histogram, by route, as it reported it."""
    from dcut.speculation import AcceptanceHistogram

    c = DCutController(ControllerSettings(stale_after_s=30), AutoscalingSettings())
    h = AcceptanceHistogram()
    for rate in (0.25, 0.95, None):
        h.add("chat", rate)
    c.report(report("a", None) | {"acceptance": h.model_dump()})
    c.report(report("b", None))
    shown = {r["replica_id"]: r["request_acceptance"] for r in c.status()["replicas"]}
    assert shown["b"] is None
    assert shown["a"]["counts"]["chat"][2] == shown["a"]["counts"]["chat"][9] == 1 and shown["a"]["unverified"] == {
        "chat": 1}


def test_mean_width():
    assert mean_width({}) is None
    assert mean_width({0: 2, 15: 2}) == 7.5


@pytest.mark.parametrize("current,demand,capacity,expected", [
    (2, 10.0, 0.0, (2, "no_estimates")),
    (0, 10.0, 100.0, (1, "cold")),
    (2, 141.0, 100.0, (3, "up")),
    (4, 100.0, 100.0, (2, "down")),
    (1, 10.0, 100.0, (1, "floor")),
    (2, 120.0, 100.0, (2, "hold")),
])
def test_decide_names_its_rule(current, demand, capacity, expected):
    assert decide(current, demand, capacity, 0.7, 0.2) == expected


def decision(**kw) -> ScalingDecision:
    base = dict(at=0.0, replicas=2, desired=3, bounded=3, rule="up", demand_tokens_per_s=150.0,
                capacity_per_replica=100.0, utilization=0.75, target_utilization=0.7, hysteresis=0.2)
    return ScalingDecision(**{**base, **kw})


def test_reason_states_the_figures_and_the_bounds():
    assert decision().reason == "utilisation 75% above the 70% target: up to 3"
    assert decision(bounded=2).reason.endswith("(bounds keep 2)")
    assert decision(rule="hold", desired=2, bounded=2, utilization=0.6).reason == \
        "utilisation 60% within 56%..70%: hold 2"
    assert "reason" in decision().model_dump()


def test_log_publishes_changes_and_a_refresh_only():
    log = DecisionLog(keep=3, refresh_s=2.0)
    assert log.add(decision(at=0.0))
    assert not log.add(decision(at=0.1, utilization=0.8))  # same decision, too soon
    assert log.add(decision(at=2.5, utilization=0.9))  # same decision, a refresh of the figures
    assert log.add(decision(at=2.6, desired=4, bounded=4))  # a change of mind
    for t, n in ((3.0, 5), (3.1, 6), (3.2, 7)):
        log.add(decision(at=t, desired=n, bounded=n))
    record = log.record()
    assert [d.desired for d in record.changes] == [5, 6, 7]  # the last `keep` changes
    assert record.latest.at == 3.2


def test_policy_state_carries_the_reason():
    desired, state = DCutPolicy(target_utilization=0.7)(ctx(2, [100.0, 100.0], [150.0, 150.0]))
    assert desired == 5 and state["rule"] == "up" and "up to 5" in state["reason"]


def test_presented_key_bearer_or_basic_password():
    basic = base64.b64encode(b"anyone:s3cret:with:colons").decode()
    assert presented_key("Bearer s3cret") == "s3cret"
    assert presented_key(f"Basic {basic}") == "s3cret:with:colons"
    assert presented_key("Basic not-base64!") == ""
    assert presented_key("Digest x") == presented_key("") == ""

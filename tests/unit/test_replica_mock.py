"""The engine replica on the mock engine, as plain objects in one event loop, with the controller behind a handle of
Serve's local testing mode: the cost table and learned state at start (from the controller, after waiting for the
replica that profiles, or alone when the controller is down), capacity and demand for the autoscaler, a slow
state read, health, and shutdown."""

from __future__ import annotations

import asyncio
import sys
import time
from types import SimpleNamespace

import pytest
from ray import serve

from dcut import telemetry
from dcut.cost_table import CostTable
from dcut.settings import EngineSettings
from deployments.controller import DCutController
from deployments.engine_replica import EngineReplica
from deployments.settings import AutoscalingSettings, ControllerSettings, EngineReplicaSettings
from tests.mock_app import MODEL, local_object
from tests.mock_engine import MockEngine

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ENGINE = EngineSettings(model="/models/mock", draft="/models/mock-dflash", served_model_name=MODEL, max_num_seqs=8,
                        num_speculative_tokens=7)
SETTINGS = EngineReplicaSettings(telemetry_interval_s=0.05)
BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 6}


class SlowStart(MockEngine):
    start_delay_s = 0.3


@pytest.fixture
def controller():
    """A `DCutController` behind a handle of Serve's local testing mode, and the object itself."""
    app = serve.deployment(DCutController).bind(ControllerSettings(), AutoscalingSettings())
    handle = serve.run(app, _local_testing_mode=True)
    return handle, local_object(handle)


@pytest.fixture
def names(monkeypatch):
    """Replicas started in the test get these ids (Serve's replica context names them; there is none here)."""
    queue: list[str] = []

    def context():
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=queue.pop(0)))

    monkeypatch.setattr(serve, "get_replica_context", context)
    return queue


async def start(controller=None, engine_cls: type = MockEngine, settings: EngineReplicaSettings = SETTINGS,
                engine: EngineSettings = ENGINE) -> EngineReplica:
    """An engine replica as Serve builds one: its (async) constructor on an object."""
    replica = EngineReplica.__new__(EngineReplica)
    await replica.__init__(engine, settings, controller, engine_cls=engine_cls)
    return replica


async def complete(replica: EngineReplica, body: dict = BODY) -> list:
    return [item async for item in replica.completions(body)]


async def until(condition, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def stop(*replicas: EngineReplica) -> None:
    for r in replicas:
        r.__del__()


# ---- start ---------------------------------------------------------------------------------

def test_engine_must_be_an_engine():
    with pytest.raises(TypeError, match="deployments.engine.Engine"):
        asyncio.run(start(engine_cls=dict))


def test_replica_waits_for_the_one_that_profiles_then_starts_from_its_table(controller, names):
    """Two replicas of one fingerprint start together: the first profiles, the second waits for its table instead
    of profiling again, and starts from it."""
    handle, ctrl = controller
    names += ["a", "b"]

    async def scenario():
        first = asyncio.ensure_future(start(handle, SlowStart))
        # b asks only once a holds the profiling lease: started together, which replica asks first is the event
        # loop's and the handle's threads' to decide (on a loaded box b sometimes did, and profiled instead of a)
        await until(lambda: ctrl.leases)
        a, b = await asyncio.gather(first, start(handle))
        try:
            await until(lambda: not ctrl.leases)  # a's first report ends its profiling lease
            return a, b
        finally:
            stop(a, b)

    a, b = asyncio.run(scenario())
    assert (a.replica_id, b.replica_id) == ("a", "b") and a.fingerprint == b.fingerprint
    assert a.engine.cost_source == "profiled" and a.engine.settings.dcut.cost_table is None
    given = b.engine.settings.dcut.cost_table
    assert b.engine.cost_source == "given" and a.fingerprint in given
    assert CostTable.load(given).points == a.engine.table.points
    assert b.engine.settings.dcut.learned is None, "a had generated nothing: no learned state yet"
    assert b.start_seconds >= SlowStart.start_delay_s


def test_report_carries_the_start_up_phases_and_the_controller_keeps_them(controller, names):
    """Consecutive wall-clock phases, none negative, that sum to the total; the first report's phase once the
    controller accepted it; the second replica's cost table is the controller's."""
    handle, ctrl = controller
    names += ["a", "b"]

    async def scenario():
        a = await start(handle, SlowStart)
        first = a.startup
        await until(lambda: "a" in ctrl.reports and ctrl.reports["a"].startup.total_s is not None)
        b = await start(handle)
        await until(lambda: "b" in ctrl.reports and ctrl.reports["b"].startup.total_s is not None)
        status = ctrl.status()
        stop(a, b)
        return first, a, b, status

    first, a, b, status = asyncio.run(scenario())
    assert (first.first_report_s, first.total_s) == (None, None), "the first report cannot carry its own answer"
    kept = ctrl.reports["a"].startup
    assert kept == a.startup and ctrl.reports["b"].startup == b.startup
    for p in (kept, b.startup):
        phases = [p.process_s, p.import_s, p.fingerprint_s, p.cost_offer_s, p.engine_init_s, p.first_report_s]
        assert all(x >= 0 for x in phases), p
        assert sum(phases) == pytest.approx(p.total_s, abs=1e-3) and p.ready_s() <= p.total_s
        assert p.process_started_at <= p.process_started_at + p.total_s <= time.time()
    assert kept.engine_init_s >= SlowStart.start_delay_s and kept.compile_s == SlowStart.start_delay_s / 2
    assert kept.compile_s <= kept.engine_init_s and kept.cost_table_s is None  # the mock says no table time
    assert (kept.cost_table_source, b.startup.cost_table_source) == ("profiled", "controller")
    assert b.startup.compile_s is None and b.startup.engine_init_s < SlowStart.start_delay_s
    shown = {r["replica_id"]: r["startup"] for r in status["replicas"]}
    assert shown["a"] == kept.model_dump() and shown["b"]["cost_table_source"] == "controller"


def test_process_start_from_proc_without_psutil(monkeypatch):
    from deployments.engine_replica import process_started_at

    with_psutil = process_started_at()
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    assert process_started_at() == pytest.approx(with_psutil, abs=1.0) and with_psutil <= time.time()


def test_late_replica_starts_from_the_fleet_learned_state(controller, names):
    handle, ctrl = controller
    names += ["a", "b"]

    async def scenario():
        a = await start(handle)
        await complete(a)
        done = a.engine.learned_state()
        await until(lambda: ctrl.learned.get(a.fingerprint, {}).get("a") == done)  # a reported what it learned
        b = await start(handle)
        await complete(b)
        await until(lambda: "b" in ctrl.learned.get(a.fingerprint, {}))
        stop(a, b)
        return a, b

    a, b = asyncio.run(scenario())
    learned = b.engine.learned
    assert learned is not None and b.engine.settings.dcut.learned.endswith("-learned.json")
    assert (learned.fingerprint, learned.reached) == (a.fingerprint, a.engine.learned_state().reached)
    assert sorted(ctrl.learned[a.fingerprint]) == ["a", "b"] and ctrl.learned_state(a.fingerprint) is not None


def test_controller_down_the_replica_profiles_and_serves():
    """A controller that fails or never answers costs ``controller_timeout_s`` at most: the replica profiles,
    serves and keeps trying to report."""
    class Silent:
        def __getattr__(self, method):
            return SimpleNamespace(remote=lambda *args: asyncio.Event().wait())

    class Broken:
        def __getattr__(self, method):
            def remote(*args):
                raise ConnectionError("controller gone")
            return SimpleNamespace(remote=remote)

    settings = SETTINGS.model_copy(update={"controller_timeout_s": 0.3})

    async def scenario(controller):
        t0 = time.monotonic()
        r = await start(controller, settings=settings)
        took = time.monotonic() - t0
        items = await complete(r)
        await asyncio.sleep(0.15)
        alive = not r._telemetry.done()
        stop(r)
        return r, took, items, alive

    for controller in (Silent(), Broken()):
        r, took, items, alive = asyncio.run(scenario(controller))
        assert took < settings.controller_timeout_s + 1.0 and r.engine.cost_source == "profiled"
        assert r.startup.total_s is None and r.startup.cost_table_source == "profiled"  # no report accepted
        assert items[0]["usage"]["completion_tokens"] == 6 and alive


# ---- telemetry -----------------------------------------------------------------------------

def test_capacity_is_the_default_until_dcut_estimates_it():
    async def scenario():
        r = await start()
        before = (await r.report(), await r.record_autoscaling_stats())
        await complete(r)
        after = (await r.report(), await r.record_autoscaling_stats())
        stop(r)
        return r, before, after

    r, (report, scaling), (report2, scaling2) = asyncio.run(scenario())
    assert (report.capacity_from, report.capacity_tokens_per_s) == ("default", SETTINGS.default_capacity_tokens_per_s)
    assert scaling == {"capacity_tokens_per_s": report.capacity_tokens_per_s, "demand_tokens_per_s": 0.0}
    rate = SETTINGS.autoscaling.request_tokens_per_s
    expected = telemetry.capacity(report2.dcut.estimates, rate, ENGINE.max_num_seqs)
    assert report2.capacity_from == "estimates" and report2.capacity_tokens_per_s == expected > 0
    assert scaling2["capacity_tokens_per_s"] == expected
    assert report2.load.generated_tokens_total == 6 and report2.dcut.cost_source == "profiled"


def test_demand_counts_the_requests_in_the_replica():
    async def scenario():
        r = await start(engine=ENGINE.model_copy(update={"max_num_seqs": 2}))
        r.engine.token_delay_s = 0.01
        requests = [asyncio.create_task(complete(r, {**BODY, "max_tokens": 10})) for _ in range(3)]
        await until(lambda: r.engine.load.engine_requests == 3)
        during = (await r.record_autoscaling_stats())["demand_tokens_per_s"]
        await asyncio.gather(*requests)
        after = r.demand()
        stop(r)
        return during, after

    during, after = asyncio.run(scenario())
    assert during == 3 * SETTINGS.autoscaling.request_tokens_per_s and after == 0.0  # 2 running + 1 waiting


def test_a_slow_state_read_reports_the_last_snapshot_on_time():
    async def scenario():
        r = await start()
        first = r._snapshot
        r.engine.snapshot_delay_s = 5.0
        t0 = time.monotonic()
        report = await r.report()
        took = time.monotonic() - t0
        stop(r)
        return first, report, took

    first, report, took = asyncio.run(scenario())
    assert report.dcut == first and took < 1.0, took  # the read takes 5 s; the report waits one interval


# ---- health and shutdown -------------------------------------------------------------------

def test_health_follows_the_engine():
    async def scenario():
        r = await start()
        await r.check_health()
        r.engine.healthy = False
        try:
            with pytest.raises(RuntimeError, match="unhealthy"):
                await r.check_health()
        finally:
            stop(r)

    asyncio.run(scenario())


def test_shutdown_stops_the_engine_and_the_reports(controller, names):
    """What Serve calls once a stopping replica's requests are done (its graceful shutdown): the engine stops,
    and so do the reports (the controller forgets the replica after a few missed intervals)."""
    handle, ctrl = controller
    names.append("a")

    async def scenario():
        r = await start(handle)
        await until(lambda: "a" in ctrl.reports)
        r.__del__()
        await asyncio.sleep(0.01)
        last = ctrl.reports["a"].sent_at
        await asyncio.sleep(3 * SETTINGS.telemetry_interval_s)
        return r, last

    r, last = asyncio.run(scenario())
    assert r.engine.shut_down and r._telemetry.cancelled()
    assert ctrl.reports["a"].sent_at == last, "a stopped replica still reports"

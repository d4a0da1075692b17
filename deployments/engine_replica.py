"""EngineReplica: one engine with D-Cut, fed by the ingress, reporting to the controller. The engine is a
`deployments.engine.Engine` of the class the builder passes (``deployments.vllm_engine.VLLMEngine`` in
production, a mock in the unit tests): nothing here knows vLLM.

Start: ask the controller for a cost table of this engine's fingerprint; use it, or wait while another
replica profiles the same fingerprint, or let the engine profile (or load its own cache). A controller
that is down only means this replica profiles and keeps serving.

Capacity and demand for the autoscaler come from the plugin's throughput estimates
(``dcut.telemetry``): capacity = best tokens/s at a batch size that still gives each request the
objective rate; demand = running and waiting requests x that rate.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.exceptions import RayServeException

from dcut import telemetry
from dcut.cost_table import CostTable, cached_table_path
from dcut.settings import EngineSettings
from deployments.continuation import CONTINUES
from deployments.engine import Engine, EngineDead, carried_tokens
from deployments.ray_metrics import ReplicaMetrics
from deployments.records import CAPACITY_KEY, DEMAND_KEY, CostTableOffer, ReplicaReport, StartupPhases
from deployments.settings import EngineReplicaSettings

logger = logging.getLogger("ray.serve")

READ_TIMEOUT_S = 5.0  # reading D-Cut state from the engine (an RPC to the engine core)


def process_started_at() -> float:
    """Unix time this process was created (psutil, which Ray brings; else ``/proc``)."""
    try:
        import psutil
    except ImportError:
        after_boot = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])  # field 22: starttime
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + after_boot / os.sysconf("SC_CLK_TCK")
    return psutil.Process().create_time()


class EngineReplica:
    async def __init__(self, engine: EngineSettings, settings: EngineReplicaSettings, controller: Any = None, *,
                       engine_cls: type[Engine]):
        """``engine``: what to build; ``controller``: a handle of the `DCutController` (None: alone);
        ``engine_cls``: the engine's class, built with the settings (and the controller's cost table)."""
        marks = {"process": process_started_at(), "constructor": time.time()}  # wall clock: StartupPhases
        if not (isinstance(engine_cls, type) and issubclass(engine_cls, Engine)):
            raise TypeError(f"engine_cls {engine_cls!r} is not a deployments.engine.Engine")
        t0 = time.monotonic()
        self.engine_settings = engine
        self.rs = settings
        self.served_model_name = engine.served_model_name or Path(engine.model).name
        self.controller = controller
        self._exiting = False  # the engine died: this process is ending (``_engine_died``)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except RayServeException:  # outside a Serve replica (a plain object, or Serve's local testing mode)
            self.replica_id = f"local-{os.getpid()}"
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        engine_cls.import_library()
        marks["import"] = time.time()
        self.fingerprint = engine_cls.fingerprint(engine)
        marks["fingerprint"] = time.time()
        self._cost_table_from_controller = False
        settings_with_table = await self._with_cost_table(engine)
        marks["cost_offer"] = time.time()
        self.engine = engine_cls(settings_with_table, max_prompt_tokens=self.rs.max_prompt_tokens)
        await self.engine.start()
        await self.engine.check_health()
        marks["ready"] = time.time()
        self._snapshot = await self.engine.dcut_snapshot()
        self.start_seconds = time.monotonic() - t0
        self.startup = self._startup_phases(marks)
        logger.info("EngineReplica %s ready in %.1f s; D-Cut cost table: %s (fingerprint %s)", self.replica_id,
                    self.start_seconds, self._snapshot.cost_source if self._snapshot else "off", self.fingerprint)
        self.metrics = ReplicaMetrics(self.replica_id, self.served_model_name)
        self.engine.on_speculation = self.metrics.observe_request
        self._telemetry = asyncio.create_task(self._report_forever())

    # ---- cost table at start ------------------------------------------------------------------

    async def _with_cost_table(self, settings: EngineSettings) -> EngineSettings:
        """``settings`` with the controller's table for this fingerprint, when it has one."""
        dcut = settings.dcut
        if dcut is None or dcut.cost_table:
            return settings
        start, waiting = time.monotonic(), False
        cached = cached_table_path(dcut.cache_dir, self.fingerprint).is_file()
        while True:
            answer = await self._ask_controller("offer_cost_table", self.fingerprint, self.replica_id)
            if answer is None:
                return settings  # controller down: the engine profiles (or loads its cache)
            offer = CostTableOffer.model_validate(answer)
            if offer.action == "use":
                path = Path(tempfile.gettempdir()) / "dcut-serve" / f"{self.fingerprint}-{self.replica_id}.json"
                CostTable.from_json(offer.table).save(path)
                update: dict[str, Any] = {"cost_table": str(path)}
                if offer.learned is not None and dcut.learned is None:  # start where the fleet is, not cold
                    learned = path.with_name(f"{path.stem}-learned.json")
                    learned.write_text(json.dumps(offer.learned))
                    update["learned"] = str(learned)
                self._cost_table_from_controller = True
                logger.info("EngineReplica %s: cost table %s%s from the controller (waited %.1f s)", self.replica_id,
                            self.fingerprint, " and learned state" if "learned" in update else "",
                            time.monotonic() - start)
                return settings.model_copy(update={"dcut": dcut.model_copy(update=update)})
            # This host's cache has the table: the engine loads it at once, no need to wait for another's profile.
            if offer.action == "profile" or cached or time.monotonic() - start > self.rs.profile_wait_s:
                return settings
            if not waiting:
                waiting = True
                logger.info("EngineReplica %s: another replica is profiling %s, waiting for its table",
                            self.replica_id, self.fingerprint)
            await asyncio.sleep(1.0)

    # ---- start-up phases ----------------------------------------------------------------------

    def _startup_phases(self, marks: dict[str, float]) -> StartupPhases:
        """The phases between the constructor's wall-clock marks; the first report's comes with its answer
        (``_first_report_accepted``). The compile and cost-table seconds are the D-Cut snapshot's (the plugin reads
        them in the engine core, the only process that knows them)."""
        names = ["process", "constructor", "import", "fingerprint", "cost_offer", "ready"]
        gaps = [max(0.0, marks[b] - marks[a]) for a, b in zip(names, names[1:], strict=False)]
        snap = self._snapshot
        if snap is None:
            source = None
        elif self._cost_table_from_controller:
            source = "controller"
        else:
            source = None if snap.cost_source == "pending" else snap.cost_source
        return StartupPhases(
            process_started_at=marks["process"], process_s=gaps[0],
            import_s=gaps[1], fingerprint_s=gaps[2], cost_offer_s=gaps[3], engine_init_s=gaps[4],
            compile_s=snap and snap.compile_s, cost_table_s=snap and snap.cost_table_s, cost_table_source=source)

    def _first_report_accepted(self, at: float) -> None:
        """The controller took this replica's first report at ``at`` (unix time): the start is complete."""
        first = max(0.0, at - self.startup.process_started_at - self.startup.ready_s())
        self.startup = self.startup.model_copy(update={
            "first_report_s": first, "total_s": max(0.0, at - self.startup.process_started_at)})
        logger.info("replica %s ready in %.1f s: %s", self.replica_id, self.startup.total_s, self.startup.line())

    async def _ask_controller(self, method: str, *args) -> Any:
        if self.controller is None:
            return None
        try:
            return await asyncio.wait_for(getattr(self.controller, method).remote(*args),
                                          timeout=self.rs.controller_timeout_s)
        except Exception as e:  # noqa: BLE001 - serving must not depend on the controller
            logger.warning("controller call %s failed (%s): carrying on alone", method, e)
            return None

    # ---- telemetry ----------------------------------------------------------------------------

    def capacity(self) -> tuple[float, str]:
        """Objective tokens/s this replica can serve (``dcut.telemetry.capacity``), and where the figure comes from."""
        estimates = self._snapshot.estimates if self._snapshot else []
        if not estimates:
            return self.rs.default_capacity_tokens_per_s, "default"
        return telemetry.capacity(estimates, self.rs.autoscaling.request_tokens_per_s,
                                  self.engine_settings.max_num_seqs), "estimates"

    def demand(self) -> float:
        """Tokens/s asked of this replica now: its running and waiting requests at the objective rate."""
        load = self.engine.load
        running = min(load.engine_requests, self.engine_settings.max_num_seqs)
        return telemetry.demand(running, load.ongoing_requests - running, self.rs.autoscaling.request_tokens_per_s)

    async def report(self) -> ReplicaReport:
        """Read D-Cut's state from the engine and summarise it with the replica's load. A read slower than the
        report interval keeps the last snapshot: the report still goes out, so a busy replica is not taken for
        a dead one."""
        try:
            self._snapshot = await asyncio.wait_for(
                self.engine.dcut_snapshot(), timeout=min(READ_TIMEOUT_S, self.rs.telemetry_interval_s))
        except TimeoutError:
            logger.warning("D-Cut state read took over %.1f s; reporting the last one", self.rs.telemetry_interval_s)
        capacity, capacity_from = self.capacity()
        return ReplicaReport(
            replica_id=self.replica_id, served_model_name=self.served_model_name, node_id=self.node_id,
            pid=os.getpid(), fingerprint=self.fingerprint, start_seconds=self.start_seconds,
            sent_at=time.time(), interval_s=self.rs.telemetry_interval_s,
            load=self.engine.load.model_copy(update={"tokens_per_s": self.engine.tokens_per_s()}),
            capacity_tokens_per_s=capacity, capacity_from=capacity_from, demand_tokens_per_s=self.demand(),
            dcut=self._snapshot, specexit=await self.engine.specexit_stats(), startup=self.startup,
            acceptance=self.engine.acceptance.model_copy(deep=True))

    async def _report_forever(self) -> None:
        """One report every ``telemetry_interval_s``, however long reading and sending take: the controller
        forgets a replica after a few missed intervals."""
        while True:
            started = time.monotonic()
            try:
                report = await self.report()
                self.metrics.update(report)
                accepted = await self._ask_controller("report", report.model_dump())
                if accepted and self.startup.total_s is None:
                    self._first_report_accepted(time.time())
            except Exception as e:  # noqa: BLE001 - telemetry must not stop the replica
                logger.warning("telemetry failed: %s", e)
            await asyncio.sleep(max(0.0, self.rs.telemetry_interval_s - (time.monotonic() - started)))

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Feeds the custom autoscaling policy (AutoscalingContext.aggregated_metrics): live demand,
        capacity from the estimates of the last telemetry read."""
        return {CAPACITY_KEY: self.capacity()[0], DEMAND_KEY: self.demand()}

    # ---- requests -----------------------------------------------------------------------------

    async def completions(self, body: dict) -> AsyncIterator[Any]:
        carried_tokens.set(self._continuing(body))  # this request's task only (Serve runs each in its own)
        async for item in self._unless_dead(self.engine.completions(body)):
            yield item

    async def chat(self, body: dict) -> AsyncIterator[Any]:
        carried_tokens.set(0)  # continuations go to /v1/completions
        async for item in self._unless_dead(self.engine.chat(body)):
            yield item

    async def _unless_dead(self, items: AsyncIterator[Any]) -> AsyncIterator[Any]:
        try:
            async for item in items:
                yield item
        except EngineDead:
            self._engine_died()
            raise

    # What ends this process when its engine died (``os._exit``; the mock app's tests record the call instead).
    exit_process = staticmethod(os._exit)

    def _engine_died(self) -> None:
        """The engine died inside this live replica: end the process. A replica that only failed its health checks
        answered every request routed to it at once with an error, and Serve's routers, which prefer the shortest
        queue, sent it more (measured: 169 of 634 requests failed in the 32-client drill); a dead process is
        noticed by every router and by Serve at once, and each of its requests is retried or continued elsewhere."""
        if self._exiting:
            return
        self._exiting = True
        logger.error("replica %s: its engine died (%s); ending the process so Serve replaces it", self.replica_id,
                     self.engine.dead)
        asyncio.get_running_loop().call_soon(self.exit_process, 1)

    def _continuing(self, body: dict) -> int:
        """The tokens a continuation carries over (0 for any other request), its mark
        (``deployments.continuation.CONTINUES``) taken off ``body``; counted and logged here: the replica a request
        moved to is the one that knows its own id."""
        if not isinstance(body, dict) or not isinstance(mark := body.pop(CONTINUES, None), dict):
            return 0
        self.engine.load.continued_total += 1
        logger.warning("continuation of request %s on replica %s: %s tokens carried over", mark.get("request_id"),
                       self.replica_id, mark.get("carried"))
        return int(mark.get("carried") or 0)

    async def models(self) -> dict:
        return await self.engine.models()

    async def check_health(self) -> None:
        try:
            await self.engine.check_health()
        except EngineDead:
            self._engine_died()
            raise

    def __del__(self):
        task = getattr(self, "_telemetry", None)
        if task is not None:
            task.cancel()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

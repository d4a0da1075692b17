"""EngineReplica: one vLLM engine with D-Cut, fed by the ingress, reporting to the controller.

Start: ask the controller for a cost table of this fingerprint; use it, or wait while another replica
profiles the same fingerprint, or profile here and hand the result back. A controller that is down
only means this replica profiles (or uses its own table) and keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from app.config import AppConfig
from deployments import plugin
from deployments.metrics import ReplicaMetrics
from deployments.records import (
    CAPACITY_KEY,
    DEMAND_KEY,
    CostTableOffer,
    CostTableSource,
    ReplicaReport,
    fingerprint_key,
)
from deployments.vllm_engine import VLLMEngine

logger = logging.getLogger("ray.serve")


class EngineReplica:
    async def __init__(self, config: dict, controller: Any = None):
        t0 = time.monotonic()
        self.config = AppConfig.model_validate(config)
        self.rs = self.config.engine_replica
        self.controller = controller
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (unit use)
            self.replica_id = f"local-{os.getpid()}"
        settings = self.config.engine
        self.fingerprint = plugin.fingerprint(settings)
        self.fingerprint_key = fingerprint_key(self.fingerprint)
        settings, self.cost_table_source = await self._cost_table_for(settings)

        self.engine = VLLMEngine(settings, fault_marker=self.rs.fault_injection_marker)
        await self.engine.start()
        if self.cost_table_source == "profiled":
            await self._hand_back_profile()
        self.start_seconds = time.monotonic() - t0
        logger.info("EngineReplica %s ready in %.1f s; cost table: %s (fingerprint %s)", self.replica_id,
                    self.start_seconds, self.cost_table_source, self.fingerprint_key)
        self.metrics = ReplicaMetrics(self.replica_id, self.config.served_model_name)
        self._last_report: ReplicaReport | None = None
        self._peak_tokens_per_s = 0.0
        self._telemetry = asyncio.create_task(self._report_forever())

    # ---- cost table at start ------------------------------------------------------------------

    async def _cost_table_for(self, settings) -> tuple[Any, CostTableSource]:
        dcut = settings.dcut
        if dcut is None or dcut.mode == "off":
            return settings, "none"
        if dcut.cost_table:
            return settings, "config"
        deadline = time.monotonic() + self.rs.profile_wait_s
        while True:
            offer = await self._ask_controller(
                "offer_cost_table", self.fingerprint_key, self.fingerprint, self.replica_id)
            if offer is None:
                break  # controller down: profile here
            offer = CostTableOffer.model_validate(offer)
            if offer.action == "use" and offer.table:
                path = self._write_table(offer.table)
                return settings.model_copy(update={"dcut": dcut.model_copy(update={"cost_table": path})}), \
                    "controller"
            if offer.action == "profile" or time.monotonic() > deadline:
                break
            logger.info("EngineReplica %s: another replica is profiling %s, waiting", self.replica_id,
                        self.fingerprint_key)
            await asyncio.sleep(1.0)
        return settings, ("profiled" if dcut.profile else "none")

    def _write_table(self, table: dict) -> str:
        fd, path = tempfile.mkstemp(prefix=f"dcut-cost-{self.fingerprint_key}-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f)
        return path

    async def _hand_back_profile(self) -> None:
        try:
            table = await plugin.read_cost_table(self.engine.engine)
        except Exception as e:  # noqa: BLE001
            logger.warning("reading the cost table failed: %s", e)
            table = None
        if table is None:
            self.cost_table_source = "none"
        await self._ask_controller("put_cost_table", self.fingerprint_key, table, self.replica_id)

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

    async def report(self) -> ReplicaReport:
        try:
            dcut = await asyncio.wait_for(plugin.read_stats(self.engine.engine), timeout=5.0) or {}
        except Exception as e:  # noqa: BLE001
            logger.debug("read_stats failed: %s", e)
            dcut = {}
        if isinstance(dcut, dict) and isinstance(dcut.get("window"), dict):  # plugin snapshot: flatten
            dcut = {**{k: v for k, v in dcut.items() if k != "window"}, **dcut["window"]}
        load = self.engine.load.model_copy(update={"tokens_per_s": self.engine.tokens_per_s()})
        self._peak_tokens_per_s = max(self._peak_tokens_per_s, load.tokens_per_s)
        capacity = dcut.get("capacity_tokens_per_s") if isinstance(dcut, dict) else None
        if not isinstance(capacity, int | float) or capacity <= 0:
            capacity = max(self.rs.default_capacity_tokens_per_s, self._peak_tokens_per_s)
        demand = load.ongoing_requests * self.rs.autoscaling.request_tokens_per_s
        self._last_report = ReplicaReport(
            replica_id=self.replica_id, fingerprint_key=self.fingerprint_key,
            served_model_name=self.config.served_model_name, cost_table_source=self.cost_table_source,
            start_seconds=self.start_seconds, sent_at=time.time(), load=load,
            capacity_tokens_per_s=float(capacity), demand_tokens_per_s=float(demand),
            dcut=dcut if isinstance(dcut, dict) else {})
        return self._last_report

    async def _report_forever(self) -> None:
        while True:
            try:
                report = await self.report()
                self.metrics.update(report)
                await self._ask_controller("report", report.model_dump())
            except Exception as e:  # noqa: BLE001
                logger.warning("telemetry failed: %s", e)
            await asyncio.sleep(self.rs.telemetry_interval_s)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Feeds the custom autoscaling policy (AutoscalingContext.aggregated_metrics)."""
        report = await self.report()
        return {CAPACITY_KEY: report.capacity_tokens_per_s, DEMAND_KEY: report.demand_tokens_per_s}

    # ---- requests -----------------------------------------------------------------------------

    async def completions(self, body: dict) -> AsyncIterator[Any]:
        async for item in self.engine.completions(body):
            yield item

    async def chat(self, body: dict) -> AsyncIterator[Any]:
        async for item in self.engine.chat(body):
            yield item

    async def models(self) -> dict:
        return await self.engine.models()

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self):
        task = getattr(self, "_telemetry", None)
        if task is not None:
            task.cancel()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

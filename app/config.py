"""The application's settings: one pydantic tree validated from ``app.config.yaml``'s ``args``.

The engine part is :class:`dcut.settings.EngineSettings` (shared with the CLI and the plugin); each
deployment's part is its own typed settings from :mod:`deployments.settings`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dcut.settings import EngineSettings
from deployments.settings import ControllerSettings, EngineReplicaSettings, IngressSettings

REPO_ROOT = Path(__file__).resolve().parent.parent


class AppConfig(BaseModel):
    """``args`` of the application in ``app.config.yaml``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineSettings = Field(default_factory=EngineSettings)
    engine_replica: EngineReplicaSettings = Field(default_factory=EngineReplicaSettings)
    controller: ControllerSettings = Field(default_factory=ControllerSettings)
    ingress: IngressSettings = Field(default_factory=IngressSettings)

    @model_validator(mode="after")
    def _resolve_paths(self) -> AppConfig:
        """Model folders relative to the repository root become absolute (replicas run elsewhere);
        the served model name defaults to the target folder's name."""
        updates = {}
        for name in ("model", "draft"):
            value = getattr(self.engine, name)
            if value and not Path(value).is_absolute():
                updates[name] = str(REPO_ROOT / value)
        if self.engine.method == "none":  # nothing drafted, nothing to cut
            updates.update(draft=None, dcut=None)
        if self.engine.served_model_name is None:
            updates["served_model_name"] = Path(self.engine.model).name
        if updates:
            object.__setattr__(self, "engine", self.engine.model_copy(update=updates))
        return self

    @model_validator(mode="after")
    def _tensor_parallel_needs_processes(self) -> AppConfig:
        """TP > 1 runs one worker process per rank: an in-process engine core (the TP=1 default environment)
        cannot host them, and would fail deep inside vLLM at start-up."""
        if (self.engine.tensor_parallel_size > 1
                and self.engine_replica.env.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"):
            raise ValueError(f"engine.tensor_parallel_size is {self.engine.tensor_parallel_size}: set "
                             "engine_replica.env.VLLM_ENABLE_V1_MULTIPROCESSING to \"1\" (and on CPU "
                             "VLLM_CPU_OMP_THREADS_BIND, e.g. \"0|1\"); see app.two-models.config.yaml")
        return self

    @model_validator(mode="after")
    def _ray_executor_has_its_bundles(self) -> AppConfig:
        """vLLM's Ray executor puts one TP worker in each bundle of the replica's placement group, and Serve starts
        the replica itself in the first bundle: both must fit, or the replica waits for ever to be scheduled."""
        rs, tp = self.engine_replica, self.engine.tensor_parallel_size
        bundles = rs.placement_group_bundles
        if self.engine.distributed_executor_backend == "ray" and (bundles is None or len(bundles) < tp):
            raise ValueError(f"engine.distributed_executor_backend 'ray' at tensor_parallel_size {tp} needs "
                             f"engine_replica.placement_group_bundles with at least {tp} bundles (one per rank)")
        if bundles:
            first = bundles[0]
            needs = {"CPU": rs.num_cpus, "GPU": rs.num_gpus, **rs.resources}
            short = {k: v for k, v in needs.items() if v > first.get(k, 0.0)}
            if short:
                raise ValueError(f"engine_replica.placement_group_bundles[0] ({first}) must hold the replica "
                                 f"itself: {short} (num_cpus / num_gpus / resources)")
        return self

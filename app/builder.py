"""Turn ``app.config.yaml``'s ``args`` (an :class:`AppConfig`) into the Serve application.

    Ingress --handle--> EngineReplica x N (autoscaled by deployments.autoscaling.DCutPolicy)
       \\                      |
        +----> DCutController <+   (cost tables, telemetry, /dcut/status)
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from app.config import AppConfig
from deployments.controller import DCutController
from deployments.engine import Engine
from deployments.engine_replica import EngineReplica
from deployments.ingress import Ingress
from deployments.settings import actor_options
from deployments.vllm_engine import VLLMEngine


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The ``import_path`` target of ``serve run app.config.yaml`` (``args`` is the config's ``args``): the app
    on vLLM engines. Serve calls a builder with exactly one argument, so the engine is chosen in ``compose_app``."""
    return compose_app(args)


def compose_app(args: dict[str, Any] | AppConfig | None = None, engine_cls: type[Engine] = VLLMEngine) -> Application:
    """The application of ``args`` on ``engine_cls`` engines: tests pass one that fails on purpose, or a mock
    without vLLM."""
    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    rs = cfg.engine_replica

    controller = serve.deployment(DCutController, name="DCutController", num_replicas=1,
                                  ray_actor_options=actor_options(cfg.controller.num_cpus, cfg.controller.resources),
                                  max_ongoing_requests=1000).bind(cfg.controller, rs.autoscaling)
    engine = serve.deployment(
        EngineReplica, name="EngineReplica", **rs.placement(),
        max_ongoing_requests=rs.max_ongoing_requests,
        max_queued_requests=rs.max_queued_requests,
        autoscaling_config=rs.autoscaling.serve_config(),
        # A replica whose engine died fails its health check at once (deployments.engine.EngineDead): Serve asks every
        # 2 s (a flag read, no engine call), so it stops routing to it and replaces it within ~2 s, not 10.
        health_check_period_s=2, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=rs.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=rs.graceful_shutdown_wait_loop_s,
    ).bind(cfg.engine, rs, controller, engine_cls=engine_cls)
    # The ingress drains as long as the replicas it forwards to, so `serve shutdown` cuts no request short.
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1,
                               ray_actor_options=actor_options(cfg.ingress.num_cpus, cfg.ingress.resources),
                               max_ongoing_requests=cfg.ingress.max_ongoing_requests,
                               graceful_shutdown_timeout_s=rs.graceful_shutdown_timeout_s)
    return ingress.bind(cfg.ingress, engine, controller)

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
from deployments.engine_replica import EngineReplica
from deployments.ingress import Ingress
from deployments.settings import actor_options


def build_app(args: dict[str, Any] | AppConfig | None = None) -> Application:
    """The ``import_path`` target of ``serve run app.config.yaml`` (``args`` is the config's ``args``)."""
    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    rs = cfg.engine_replica

    routing = rs.routing.serve_config()
    controller = serve.deployment(DCutController, name="DCutController", num_replicas=1,
                                  ray_actor_options=actor_options(cfg.controller.num_cpus, cfg.controller.resources),
                                  max_ongoing_requests=1000).bind(cfg.controller, rs.autoscaling)
    engine = serve.deployment(
        EngineReplica, name="EngineReplica", **rs.placement(),
        max_ongoing_requests=rs.max_ongoing_requests,
        max_queued_requests=rs.max_queued_requests,
        autoscaling_config=rs.autoscaling.serve_config(),
        health_check_period_s=10, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=rs.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=rs.graceful_shutdown_wait_loop_s,
        **({"request_router_config": routing} if routing else {}),
    ).bind(cfg.engine, rs, controller)
    # The ingress drains as long as the replicas it forwards to, so `serve shutdown` cuts no request short.
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1,
                               ray_actor_options=actor_options(cfg.ingress.num_cpus, cfg.ingress.resources),
                               max_ongoing_requests=cfg.ingress.max_ongoing_requests,
                               graceful_shutdown_timeout_s=rs.graceful_shutdown_timeout_s)
    return ingress.bind(cfg.ingress, engine, controller)

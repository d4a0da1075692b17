"""Typed settings of each Ray Serve deployment. ``app.config`` composes them with the engine's
:class:`dcut.settings.EngineSettings` into the application's configuration; each deployment receives
only its own section."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dcut.settings import engine_env

PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingSettings(_Strict):
    """Replicas from D-Cut throughput estimates: demand / (capacity x target_utilization)."""

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=1)
    target_utilization: float = Field(0.7, gt=0.0, le=1.0,
                                      description="Fraction of a replica's capacity to plan for.")
    hysteresis: float = Field(0.3, ge=0.0, lt=1.0,
                              description="Scale down only when utilisation falls below "
                              "target_utilization x (1 - hysteresis).")
    request_tokens_per_s: float = Field(20.0, gt=0.0,
                                        description="Latency objective: decode rate one request is owed; "
                                        "demand = ongoing requests x this rate.")
    upscale_delay_s: float = Field(5.0, ge=0.0, description="Defaults chosen by the simulator "
                                   "(docs/experiments/2026-12-01-autoscaling).")
    downscale_delay_s: float = Field(60.0, ge=0.0)
    look_back_period_s: float = Field(10.0, gt=0.0)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSettings:
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be >= min_replicas")
        if self.initial_replicas is not None and not (
                self.min_replicas <= self.initial_replicas <= self.max_replicas):
            raise ValueError("initial_replicas must lie in [min_replicas, max_replicas]")
        return self

    def serve_config(self) -> dict:
        """Ray Serve 2.60 ``autoscaling_config`` with our policy and its knobs."""
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": self.initial_replicas,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
            "policy": {
                "policy_function": "deployments.autoscaling:DCutPolicy",
                "policy_kwargs": {
                    "target_utilization": self.target_utilization,
                    "hysteresis": self.hysteresis,
                },
            },
        }


class EngineReplicaSettings(_Strict):
    """How one engine replica is placed, reports, and finds its cost table."""

    num_cpus: float = Field(0.5, gt=0.0, description="Ray CPUs per replica (fractional on small boxes).")
    num_gpus: float = Field(0.0, ge=0.0)
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources per replica: "
                                        "with nodes started as `ray start --resources '{\"dcut_engine\": 1}'`, "
                                        "{dcut_engine: 1} puts one replica on each node that declares it.")
    max_replicas_per_node: int | None = Field(None, ge=1, description="Serve's spread limit (None: no limit).")
    placement_group_bundles: list[dict[str, float]] | None = Field(
        None, description="Tensor parallelism on Ray (engine.distributed_executor_backend: ray): the replica's "
        "placement group, e.g. [{CPU: 1, GPU: 1}, {GPU: 1}] for TP=2 (the replica runs in the first bundle, "
        "vLLM's workers take one GPU bundle each). None: the replica holds num_cpus/num_gpus itself.")
    placement_group_strategy: PlacementStrategy = Field(
        "STRICT_PACK", description="STRICT_PACK keeps a TP group on one node; PACK lets it span nodes.")
    max_ongoing_requests: int = Field(32, ge=1, description="Requests one replica runs at once "
                                      "(match the engine's max_num_seqs).")
    max_queued_requests: int = Field(
        512, ge=-1, description="Requests an ingress replica queues for the engine replicas before it answers "
        "503 + Retry-After (-1: no cap). At least ingress.max_ongoing_requests means never 503 from a full queue "
        "with one ingress replica: queueing instead of failing.")
    telemetry_interval_s: float = Field(2.0, gt=0.0,
                                        description="How often a replica reports to the controller.")
    profile_wait_s: float = Field(120.0, ge=0.0,
                                  description="How long to wait for another replica's profile of the same "
                                  "fingerprint before profiling here.")
    controller_timeout_s: float = Field(5.0, gt=0.0)
    default_capacity_tokens_per_s: float = Field(100.0, gt=0.0,
                                                 description="Capacity assumed until D-Cut has a throughput "
                                                 "estimate (a cost table and some live steps).")
    env: dict[str, str] = Field(default_factory=lambda: engine_env(kv_cache_gib=1),
                                description="Environment of the replica process (vLLM settings).")
    allocator: Literal["system", "jemalloc"] = Field(
        "system", description="The replica's and its engine core's malloc: 'jemalloc' preloads the one Ray ships "
        "(ray/core/libjemalloc.so), which returns freed memory to the system where glibc's arenas keep it.")
    max_prompt_tokens: int | None = Field(None, ge=1, description="Refuse (400) a prompt of more tokens than "
                                          "this; None: only the engine's max_model_len bounds it. Checked here, "
                                          "where the tokenizer is, not at the ingress.")
    graceful_shutdown_timeout_s: float = Field(60.0, ge=0.0, description="On downscale or shutdown a replica "
                                               "takes no new requests and waits this long for its running ones.")
    graceful_shutdown_wait_loop_s: float = Field(1.0, gt=0.0, description="How often a draining replica checks "
                                                 "whether its requests are done.")
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)

    @model_validator(mode="before")
    @classmethod
    def _no_routing(cls, data: object) -> object:
        """``routing`` chose D-Cut's request router, removed because it lost to Serve's default router
        (docs/history.md §6): say so rather than just "extra inputs are not permitted"."""
        if isinstance(data, dict) and "routing" in data:
            raise ValueError("engine_replica.routing is no longer a setting: the D-Cut request router was removed "
                             "(it lost to Serve's default router, docs/history.md §6); delete routing: from the "
                             "config, the replicas use Serve's default routing (power of two choices)")
        return data

    def placement(self) -> dict:
        """Serve deployment options that place the replicas on the cluster's nodes."""
        env = dict(self.env)
        if self.allocator == "jemalloc":
            env["LD_PRELOAD"] = ":".join(p for p in (str(jemalloc_path()), env.get("LD_PRELOAD")) if p)
        actor = actor_options(self.num_cpus, self.resources, num_gpus=self.num_gpus, runtime_env={"env_vars": env})
        options: dict = {"ray_actor_options": actor}
        if self.max_replicas_per_node is not None:
            options["max_replicas_per_node"] = self.max_replicas_per_node
        if self.placement_group_bundles:
            options["placement_group_bundles"] = [dict(b) for b in self.placement_group_bundles]
            options["placement_group_strategy"] = self.placement_group_strategy
        return options


def actor_options(num_cpus: float, resources: dict[str, float], **more) -> dict:
    """Ray actor options of a deployment's replicas: CPUs, custom resources when any, and ``more``."""
    return {"num_cpus": num_cpus, **({"resources": dict(resources)} if resources else {}), **more}


def jemalloc_path() -> Path:
    """Ray's bundled jemalloc (the same path on every node that installed the same environment)."""
    import ray

    path = Path(ray.__file__).parent / "core" / "libjemalloc.so"
    if not path.is_file():
        raise FileNotFoundError(f"engine_replica.allocator 'jemalloc': {path} not found in the installed Ray")
    return path


class ControllerSettings(_Strict):
    """The controller's placement and how long it trusts a replica's report or profiling lease."""

    num_cpus: float = Field(0.05, ge=0.0)
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources, e.g. "
                                        "{\"node:__internal_head__\": 0.001} keeps it on the head node, which a "
                                        "worker node's death cannot take down.")
    stale_after_reports: float = Field(3.0, gt=0.0, description="Forget a replica that missed this many of its "
                                       "own report intervals (its reports say how often it reports).")
    stale_after_s: float | None = Field(None, gt=0.0, description="Forget a replica silent for this long "
                                        "instead (None: stale_after_reports decides).")
    profile_lease_s: float = Field(180.0, gt=0.0,
                                   description="A profiling replica's claim expires after this.")
    history_s: float = Field(600.0, gt=0.0, description="How far back the status page's series go "
                             "(GET /dcut/history).")


class RequestLimits(_Strict):
    """What one request may ask for, refused at the ingress (OpenAI-style 4xx) before any engine work: a single
    request must not be able to occupy a replica or the ingress's memory."""

    max_body_bytes: int = Field(1 << 20, ge=1, description="Larger bodies get 413, refused from Content-Length or "
                                "while reading, never read whole.")
    max_n: int = Field(16, ge=1, description="Ceiling on `n` and `best_of` (choices per request).")
    max_stop: int = Field(16, ge=0, description="Ceiling on the number of stop strings and of stop token ids.")
    max_tokens: int = Field(4096, ge=1, description="Ceiling on `max_tokens` / `max_completion_tokens`.")
    max_depth: int = Field(64, ge=2, description="Ceiling on the JSON body's nesting depth (the body object: 1). "
                           "Deeper bodies would reach Python's recursion limit when parsed, validated or pickled.")


class IngressSettings(_Strict):
    """The HTTP front: placement, concurrency, back-pressure, retries, request limits and the API key."""

    num_cpus: float = Field(0.1, ge=0.0)
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources (as the "
                                        "controller's).")
    max_ongoing_requests: int = Field(512, ge=1, description="HTTP requests one ingress replica holds at once; "
                                      "beyond it Serve's proxy queues them.")
    retry_after_s: int = Field(1, ge=0, description="Retry-After header on 503 when every replica is full.")
    max_attempts: int = Field(2, ge=1, description="Engine replicas one request may be tried on: a replica that "
                              "dies before the client got a byte costs a retry on another, never after.")
    limits: RequestLimits = Field(default_factory=RequestLimits)
    api_key: str | None = Field(None, repr=False, description="When set, every route but /health needs "
                                "'Authorization: Bearer <api_key>' (the status page, /dcut/, also takes it as "
                                "an HTTP Basic password: a browser asks for it).")

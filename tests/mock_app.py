"""The whole application in this process, on the mock engine (``tests.mock_engine``), for unit tests.

Serve's local testing mode (``serve.run(app, _local_testing_mode=True)``) builds the real composition of
``app.builder.compose_app`` (ingress -> engine replica -> controller, the replica also -> controller) with Serve's
in-process handles: each deployment is one object running on its own event loop thread, calls between them go
through Serve's handle code (arguments pickled, streams, cancellation), no Ray instance and no proxy. HTTP reaches
the ingress's FastAPI routes over ASGI in the test's own loop. What local testing mode does not have: several
replicas, Serve's back-pressure and routing, replica processes that die, a drain before shutdown.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from deployments.controller import DCutController
from deployments.engine_replica import EngineReplica
from deployments.ingress import Ingress, api
from tests.mock_engine import MockEngine

KEY = "test-key"
MODEL = "mock"


def app_args(**sections: dict) -> dict:
    """``app.config.yaml``'s ``args`` for a mock app: reports every 50 ms, an API key; ``sections`` update theirs."""
    args: dict[str, dict] = {
        "engine": {"model": "/models/mock", "draft": "/models/mock-dflash", "served_model_name": MODEL,
                   "max_num_seqs": 8, "num_speculative_tokens": 7},
        "engine_replica": {"telemetry_interval_s": 0.05, "autoscaling": {"look_back_period_s": 11}},
        "ingress": {"api_key": KEY},
        "controller": {},
    }
    for name, values in sections.items():
        args[name] = {**args[name], **values}
    return args


def local_object(handle: Any) -> Any:
    """The object behind a handle of local testing mode (Serve 2.60's in-process router holds it)."""
    return _wrapper(handle).user_callable


def _wrapper(handle: Any) -> Any:
    return handle._init_router()._user_callable_wrapper


def _servable_dependency() -> Any:
    """The FastAPI dependency through which Serve hands the ingress object to its routes (``self``): it reads
    Serve's replica context, which local testing mode does not set; a test overrides it with the ingress."""
    for route in api.routes:
        if getattr(getattr(route, "endpoint", None), "_serve_cls", None) is not None:
            return inspect.signature(route.endpoint).parameters["self"].default.dependency
    raise RuntimeError("no class-based route in deployments.ingress.api (did serve.ingress change?)")


@dataclass
class LocalApp:
    ingress: Ingress
    replica: EngineReplica
    controller: DCutController
    _handles: list = field(default_factory=list)

    @property
    def engine(self) -> MockEngine:
        return self.replica.engine

    def client(self, key: str | None = KEY) -> httpx.AsyncClient:
        """HTTP into the ingress (with the API key unless ``key`` is None)."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://mock", headers=headers,
                                 timeout=10)

    def shutdown(self) -> None:
        """Call each deployment's destructor, as Serve does at the end of a replica's graceful shutdown."""
        api.dependency_overrides.pop(_servable_dependency(), None)
        for handle in self._handles:
            _wrapper(handle).call_destructor().result(timeout=10)


def local_app(args: dict | None = None, engine_cls: type = MockEngine) -> LocalApp:
    from ray import serve

    from app.builder import compose_app

    ingress_handle = serve.run(compose_app(args or app_args(), engine_cls=engine_cls), _local_testing_mode=True)
    ingress = local_object(ingress_handle)
    api.dependency_overrides[_servable_dependency()] = lambda: ingress
    replica = local_object(ingress.engine)
    replica.exits = []  # a replica whose engine died ends its process (``EngineReplica.exit_process``): recorded here
    replica.exit_process = replica.exits.append
    return LocalApp(ingress, replica, local_object(ingress.controller),
                    [ingress_handle, ingress.engine, ingress.controller])


async def stream_until_gone(path: str, body: dict, chunks: int) -> list[str]:
    """POST ``body`` as a client that reads ``chunks`` chunks of the streamed answer and then disconnects (ASGI's
    ``http.disconnect``, what a proxy sends when the connection closes); the chunks it got. httpx's ASGI transport
    cannot do this: it reads a streamed answer to its end before returning."""
    got: list[str] = []
    gone = asyncio.Event()
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            got.append(message["body"].decode())
            if len(got) >= chunks:
                gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode())],
             "client": ("127.0.0.1", 1), "server": ("mock", 80)}
    await asyncio.wait_for(api(scope, receive, send), timeout=10)
    return got

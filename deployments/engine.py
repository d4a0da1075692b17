"""The door between an engine replica and its engine: what `deployments.engine_replica.EngineReplica` calls,
and the load accounting every engine shares, so the counts a test reads off a mock engine are the ones
production keeps.

``deployments.vllm_engine.VLLMEngine`` is the real engine (the only module of the deployments that knows
vLLM); ``tests.mock_engine.MockEngine`` serves without vLLM or torch, for the unit tests of the replica,
ingress and controller. The application builder (``app.builder.build_app``) chooses the class.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import aclosing, contextmanager
from typing import Any, TypeVar

from dcut.settings import EngineSettings
from dcut.snapshot import DCutSnapshot
from dcut.speculation import AcceptanceHistogram
from deployments.records import EngineLoad, SpecExitStats

Output = TypeVar("Output")
logger = logging.getLogger("ray.serve")
# Tokens a continuation's prompt carries beyond the client's (``deployments.continuation``), set by the replica for the
# request it serves: the prompt limit (``max_prompt_tokens``) bounds the client's prompt, not what it generated since.
carried_tokens: contextvars.ContextVar[int] = contextvars.ContextVar("carried_tokens", default=0)


class EngineDead(RuntimeError):
    """The engine behind a live replica is gone (vLLM's ``EngineDeadError``: its engine core process died). Raised out
    of a request instead of the engine's 500, it counts as the replica's death: the ingress tries the request again
    or continues it on another replica, and the replica fails every health check from then on, so Serve replaces it."""


class Throughput:
    """Generated tokens per second over a sliding window."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._events: list[tuple[float, int]] = []

    def add(self, n: int) -> None:
        if n > 0:
            self._events.append((time.monotonic(), n))

    def rate(self) -> float:
        now = time.monotonic()
        self._events = [(t, n) for t, n in self._events if now - t <= self.window_s]
        return sum(n for _, n in self._events) / self.window_s


class Engine(ABC):
    """An OpenAI-compatible engine with D-Cut's state, as one replica holds it.

    Requests in, OpenAI bodies out: ``completions`` and ``chat`` yield either one response (a dict, with
    ``"error"`` for an OpenAI-style error body: a client's 4xx or an engine fault's 500, the replica keeps
    serving) or, for streams, SSE strings (``"data: {...}\\n\\n"``, the last ``"data: [DONE]\\n\\n"``). An
    exception out of them is the replica's failure, not the request's (the ingress may try another replica).
    """

    def __init__(self, settings: EngineSettings, max_prompt_tokens: int | None = None):
        self.settings = settings
        self.max_prompt_tokens = max_prompt_tokens  # longer prompts are the client's error (400)
        self.load = EngineLoad()
        self._throughput = Throughput()
        self.acceptance = AcceptanceHistogram()  # per-request acceptance of the responses served, by route
        self.on_speculation: Callable[[str, float | None], None] | None = None  # the replica's metrics
        self.dead: str | None = None  # why the engine can serve no more (``EngineDead``); None while it can

    @classmethod
    def import_library(cls) -> None:
        """Import the engine's library (vLLM and what ``start`` uses of it): the replica calls it first and
        times it as a start-up phase of its own. Nothing by default."""
        return None

    # ---- what the replica calls -------------------------------------------------------------

    @classmethod
    @abstractmethod
    def fingerprint(cls, settings: EngineSettings) -> str:
        """``Fingerprint.key()`` of the cost table an engine built from ``settings`` will use; asked before it
        starts (the replica asks the controller for that table), so it must not need a running engine."""

    @abstractmethod
    async def start(self) -> None:
        """Load the model and, with D-Cut on, its cost table (``settings.dcut.cost_table``: a given file, else
        the fingerprint's cache or a profile) and learned state (``settings.dcut.learned``)."""

    @abstractmethod
    def completions(self, body: dict) -> AsyncIterator[Any]:
        """``POST /v1/completions``."""

    @abstractmethod
    def chat(self, body: dict) -> AsyncIterator[Any]:
        """``POST /v1/chat/completions``."""

    @abstractmethod
    async def models(self) -> dict:
        """``GET /v1/models``."""

    @abstractmethod
    async def check_health(self) -> None:
        """Raise when the engine cannot serve (Serve then replaces the replica); an engine found ``dead`` raises at
        once (``died``)."""

    def died(self, why: str) -> EngineDead:
        """Mark the engine dead (the health check fails from now on); the exception to raise out of the request."""
        if self.dead is None:
            logger.error("engine dead (%s): this replica fails its health checks from now on", why)
            self.dead = why
        return EngineDead(f"the engine of this replica died: {self.dead}")

    @abstractmethod
    async def dcut_snapshot(self) -> DCutSnapshot | None:
        """D-Cut's state (stats window, cost source and table, estimates, learned state); None when off."""

    @abstractmethod
    async def specexit_stats(self) -> SpecExitStats | None:
        """SpecExit's counters; None when this engine does not run it."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine (the replica is going away, its requests are done or cut off)."""

    def record_speculation(self, route: str, usage: dict[str, Any]) -> None:
        """What speculation did for one response (``dcut.speculation.merged``): into the acceptance histogram
        and the replica's metrics."""
        rate = usage.get("acceptance_rate")
        self.acceptance.add(route, rate)
        if self.on_speculation is not None:
            self.on_speculation(route, rate)

    def tokens_per_s(self) -> float:
        """Generated tokens/s over the last 10 s."""
        return self._throughput.rate()

    # ---- load accounting, for the engines ---------------------------------------------------

    def admit(self, prompt: Any, request_id: str) -> None:
        """Called with each request at the engine door; raising fails that request alone (counted in
        ``load.failed_total``). A seam for subclasses (the fault tests' engines raise here); admits everything."""
        return None

    def admitted(self, prompt: Any, request_id: str) -> None:
        """``admit``, counting a refusal."""
        try:
            self.admit(prompt, request_id)
        except Exception:
            self.load.failed_total += 1
            raise

    @contextmanager
    def serving(self) -> Iterator[None]:
        """One request in the replica (validated, until its last item is sent): ``load.ongoing_requests``."""
        self.load.ongoing_requests += 1
        try:
            yield
        finally:
            self.load.ongoing_requests -= 1

    async def generating(self, outputs: AsyncGenerator[Output, None],
                         new_tokens: Callable[[Output], int]) -> AsyncGenerator[Output, None]:
        """The outputs of one request inside the engine, passed on unchanged and counted: running
        (``load.engine_requests``), the tokens each output adds, an abort (the consumer cancelled or closed it:
        the client went away). Closing this closes ``outputs`` at once, so the engine aborts the request then,
        not when the garbage collector finalises it."""
        self.load.engine_requests += 1
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    n = new_tokens(out)
                    self.load.generated_tokens_total += n
                    self._throughput.add(n)
                    yield out
        except (asyncio.CancelledError, GeneratorExit):
            self.load.aborted_total += 1
            raise
        finally:
            self.load.engine_requests -= 1

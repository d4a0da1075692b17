"""OpenAI-compatible HTTP ingress: parses and authenticates requests, forwards bodies to the engine
replicas, turns their answers (vLLM's own response bodies and SSE chunks) into HTTP responses.

Errors are OpenAI-style JSON (vLLM's ErrorResponse): 400 malformed JSON / bad parameters / prompt too
long / a request limit passed (`deployments.limits`), 401 missing or wrong API key, 404 unknown model,
413 body too large, 503 + Retry-After when every replica is full, 500 on an engine fault (the replica keeps
serving).

Replica faults: a request whose engine replica dies before the client got a byte is tried again on another
(``max_attempts``); one whose replica dies after it generated tokens is continued on another from the tokens already
sent (``deployments.continuation``: streaming or not, within the same ``max_attempts``), or, where a continuation
could not be faithful, a stream ends with an error event and ``[DONE]`` as before; a client that goes away cancels
the engine request (vLLM aborts it and frees its KV cache).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from deployments import continuation, limits, status_page
from deployments.engine import EngineDead
from deployments.ray_metrics import IngressMetrics
from deployments.settings import IngressSettings

logger = logging.getLogger("ray.serve")
# No /docs, /redoc or /openapi.json: every route but /health needs the key (the schema is `api.openapi()`).
api = FastAPI(title="dcut-serve", docs_url=None, redoc_url=None, openapi_url=None)


def error_body(message: str, status: int, err_type: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(message: str, status: int, err_type: str, headers: dict | None = None,
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, err_type, param), status_code=status, headers=headers)


def replica_died(e: BaseException) -> bool:
    """Whether ``e`` says the engine replica itself is gone (killed, crashed, unreachable, or its engine dead inside
    it: `EngineDead`), not the request."""
    gone = (RayActorError, EngineDead)
    return isinstance(e, gone) or (isinstance(e, RayTaskError) and isinstance(e.cause, gone))


def presented_key(authorization: str) -> str:
    """The key an ``Authorization`` header carries: a Bearer token, or the password of Basic credentials (what a
    browser sends for the status page after its login prompt; any user name)."""
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except ValueError:  # bad base64 or not UTF-8
            return ""
    return ""


def _sse_error(chunk: str) -> dict | None:
    """The error object of an SSE chunk ``data: {"error": ...}``, else None."""
    if not chunk.startswith("data: {\"error\""):
        return None
    try:
        return json.loads(chunk[len("data: "):])["error"]
    except (ValueError, KeyError):
        return None


@serve.ingress(api)
class Ingress:
    def __init__(self, settings: IngressSettings, engine: Any, controller: Any):
        self.settings = settings
        self.engine = engine
        self.controller = controller
        self._key = self.settings.api_key.encode() if self.settings.api_key else None
        self.metrics = IngressMetrics()

    # ---- helpers ------------------------------------------------------------------------------

    def _unauthorized(self, request: Request, challenge: str = "Bearer") -> JSONResponse | None:
        """None when the request carries the API key (or none is set); ``challenge``: Basic makes a browser ask."""
        if self._key is None:
            return None
        if hmac.compare_digest(presented_key(request.headers.get("authorization", "")).encode(), self._key):
            return None
        return error_response("Missing or invalid API key (Authorization: Bearer <key>).", 401,
                              "AuthenticationError", headers={"WWW-Authenticate": challenge})

    def _unavailable(self, message: str) -> JSONResponse:
        return error_response(message, 503, "ServiceUnavailableError",
                              headers={"Retry-After": str(self.settings.retry_after_s)})

    async def _body(self, request: Request) -> dict | JSONResponse:
        """The JSON object of the request, or the error response for an oversized, malformed or over-limit one."""
        cap = self.settings.limits.max_body_bytes
        try:
            raw = await limits.read_body(request.stream(), request.headers.get("content-length"), cap)
        except limits.BodyTooLarge:
            return error_response(f"The request body is larger than this server accepts ({cap} bytes).", 413,
                                  "RequestEntityTooLargeError")
        try:
            body = limits.parse_json(raw)
        except ValueError as e:
            return error_response(f"Malformed JSON body: {e}", 400, "BadRequestError")
        except RecursionError:  # nested deeper than the parser recurses (a 500 before; found by loadtest.fuzz)
            return error_response("The JSON body is nested too deeply.", 400, "BadRequestError", param="body")
        if not isinstance(body, dict):
            return error_response("The JSON body must be an object.", 400, "BadRequestError")
        if (over := limits.violation(body, self.settings.limits)) is not None:
            return error_response(over[1], 400, "BadRequestError", param=over[0])
        return body

    async def _first(self, method: str, body: dict, attempt: int = 1) -> tuple[Any, Any, int]:
        """The engine's first item, the stream it came from and the try it took. Nothing has reached the client
        before it, so a replica that dies first costs a retry on another, up to ``max_attempts`` tries in all
        (``attempt``: this is that try)."""
        while True:
            stream = getattr(self.engine.options(stream=True), method).remote(body)
            try:
                return await stream.__anext__(), stream, attempt
            except asyncio.CancelledError:
                stream.cancel()  # the client went away: abort the engine request
                raise
            except Exception as e:
                if attempt >= self.settings.max_attempts or not replica_died(e):
                    raise
                attempt += 1
                self.metrics.retries.inc()
                logger.warning("engine replica died before answering (%s); try %d of %d on another",
                               type(e).__name__, attempt, self.settings.max_attempts)

    async def _forward(self, method: str, request: Request):
        if (denied := self._unauthorized(request)) is not None:
            return denied
        body = await self._body(request)
        if isinstance(body, JSONResponse):
            return body
        progress = continuation.Progress.plan("chat" if method == "chat" else "completions", body)
        try:
            first, stream, attempt = await self._first(method, body if progress is None else progress.engine_body())
        except StopAsyncIteration:
            return error_response("The engine returned nothing.", 500, "InternalServerError")
        except BackPressureError:
            return self._unavailable("Every engine replica is full; retry later.")
        except DeploymentUnavailableError as e:
            return self._unavailable(f"No engine replica available: {e}")
        except Exception as e:  # noqa: BLE001 - a replica died mid-request
            logger.exception("engine replica call failed")
            return error_response(f"Engine replica failed: {type(e).__name__}", 500, "InternalServerError")
        if isinstance(first, dict):
            stream.cancel()
            if "error" in first:
                return JSONResponse(first, status_code=int(first["error"].get("code") or 500))
            return JSONResponse(first)
        if (err := _sse_error(first)) is not None:
            stream.cancel()
            return JSONResponse({"error": err}, status_code=int(err.get("code") or 500))
        if progress is None:
            return StreamingResponse(self._chunks(first, stream), media_type="text/event-stream")
        events = self._continued(first, stream, attempt, progress)
        if progress.client_stream:
            return StreamingResponse(self._continued_chunks(events), media_type="text/event-stream")
        return await self._collected(method, body, events, progress)

    async def _collected(self, method: str, body: dict, events: AsyncIterator[dict | str],
                         progress: continuation.Progress) -> JSONResponse:
        """A non-streaming request's response from its streamed events. Where its replica died and it could not be
        continued, nothing reached the client yet: it is run again from the start while tries are left, as before."""
        try:
            async with aclosing(events):
                got = [event async for event in events]
        except Exception as e:  # noqa: BLE001 - its replica died and no continuation could finish it
            if replica_died(e) and progress.tries < self.settings.max_attempts:
                self.metrics.retries.inc()
                try:
                    answer, stream, _ = await self._first(method, body, progress.tries + 1)
                except Exception as again:  # noqa: BLE001
                    return error_response(f"Engine replica failed: {type(again).__name__}", 500, "InternalServerError")
                stream.cancel()
                if isinstance(answer, dict):
                    return JSONResponse(answer, status_code=int(answer["error"].get("code") or 500)
                                        if "error" in answer else 200)
            return error_response(f"Engine replica failed: {type(e).__name__}", 500, "InternalServerError")
        if errors := [e["error"] for e in got if isinstance(e, dict) and "error" in e]:  # the engine's own, as is
            return JSONResponse({"error": errors[0]}, status_code=int(errors[0].get("code") or 500))
        return JSONResponse(continuation.collected(got, progress))

    def _broken_stream(self, e: Exception) -> tuple[str, str]:
        """The end of a stream whose replica failed after chunks were sent: an OpenAI-style error event and
        ``[DONE]``, so the client sees the failure, not a silent cut."""
        logger.warning("engine replica failed mid-stream: %s", type(e).__name__)
        self.metrics.broken_streams.inc()
        err = error_body(f"Engine replica failed mid-stream: {type(e).__name__}", 500, "InternalServerError")
        return f"data: {json.dumps(err)}\n\n", "data: [DONE]\n\n"

    async def _chunks(self, first: str, rest) -> AsyncIterator[str]:
        """The engine's SSE chunks. A replica that fails after chunks were sent cannot be retried: the stream
        ends with an OpenAI-style error event and ``[DONE]``, so the client sees the failure, not a silent cut."""
        yield first
        try:
            async for chunk in rest:
                yield chunk
        except Exception as e:  # noqa: BLE001 - the replica died or failed mid-stream
            for line in self._broken_stream(e):
                yield line
        finally:
            rest.cancel()  # the client went away (or we are done): abort the engine request

    async def _continued(self, first: str, stream, attempt: int,
                         progress: continuation.Progress) -> AsyncIterator[dict | str]:
        """The client's events of a request that can be continued: the engine's chunks through ``progress``; when
        the replica dies (``replica_died``) after tokens were sent, a continuation on another replica (up to
        ``max_attempts`` tries in all) whose chunks go on the same stream. Raises what ended it otherwise."""
        route, pending = progress.route, first
        progress.tries = attempt
        try:
            while True:
                try:
                    if pending is not None:
                        for event in progress.take(pending):
                            yield event
                        pending = None
                    async for chunk in stream:
                        for event in progress.take(chunk):
                            yield event
                    if progress.continuations:
                        self.metrics.continuations.inc(tags={"route": route, "outcome": "completed"})
                    return
                except Exception as e:
                    if not replica_died(e):
                        raise
                    stream.cancel()
                    if progress.finished:  # every token was out: end the stream here
                        for event in progress.close():
                            yield event
                        return
                    why = progress.cannot_continue() or (
                        f"{attempt} of {self.settings.max_attempts} tries used"
                        if attempt >= self.settings.max_attempts else None)
                    if why is not None:
                        outcome = "failed" if progress.continuations else "refused"
                        self.metrics.continuations.inc(tags={"route": route, "outcome": outcome})
                        logger.warning("request %s not continued after its replica died (%s): %s",
                                       progress.identity.get("id"), type(e).__name__, why)
                        raise
                    method, body = progress.continuation()  # its replica logs it, naming itself
                    try:
                        pending, stream, attempt = await self._first(method, body, attempt + 1)
                        progress.tries = attempt
                    except Exception:
                        self.metrics.continuations.inc(tags={"route": route, "outcome": "failed"})
                        raise
                    if isinstance(pending, dict) or _sse_error(pending) is not None:
                        self.metrics.continuations.inc(tags={"route": route, "outcome": "failed"})
                        err = pending.get("error", pending) if isinstance(pending, dict) else _sse_error(pending)
                        raise RuntimeError(f"the continuation was refused: {err}") from e
        finally:
            stream.cancel()  # the client went away (or we are done): abort the engine request

    async def _continued_chunks(self, events: AsyncIterator[dict | str]) -> AsyncIterator[str]:
        """``_continued``'s events as SSE; a failure no continuation could mend ends the stream with an error event
        and ``[DONE]``, as ``_chunks``."""
        try:
            async with aclosing(events):  # closed with this stream, at once: its engine request is aborted then
                async for event in events:
                    yield continuation.sse(event)
        except Exception as e:  # noqa: BLE001 - the replica died or failed mid-stream
            for line in self._broken_stream(e):
                yield line

    # ---- routes -------------------------------------------------------------------------------

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._forward("completions", request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._forward("chat", request)

    @api.get("/v1/models")
    async def models(self, request: Request):
        if (denied := self._unauthorized(request)) is not None:
            return denied
        return JSONResponse(await self.engine.models.remote())

    async def _from_controller(self, request: Request, method: str):
        if (denied := self._unauthorized(request)) is not None:
            return denied
        try:
            return JSONResponse(await getattr(self.controller, method).remote())
        except Exception as e:  # noqa: BLE001
            return error_response(f"D-Cut controller unavailable: {e}", 503, "ServiceUnavailableError")

    @api.get("/dcut/status")
    async def dcut_status(self, request: Request):
        return await self._from_controller(request, "status")

    @api.get("/dcut/history")
    async def dcut_history(self, request: Request):
        return await self._from_controller(request, "history")

    def _page(self, request: Request, name: str):
        denied = self._unauthorized(request, challenge='Basic realm="dcut-serve", charset="UTF-8"')
        return denied if denied is not None else status_page.page_file(name)

    @api.get("/dcut/")
    async def dcut_page(self, request: Request):
        return self._page(request, "index.html")

    @api.get("/dcut/app.js")
    async def dcut_page_script(self, request: Request):
        return self._page(request, "app.js")

    @api.get("/health")
    async def health(self):
        return JSONResponse({"status": "ok"})

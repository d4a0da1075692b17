"""OpenAI-compatible HTTP ingress: parses and authenticates requests, forwards bodies to the engine
replicas, turns their answers (vLLM's own response bodies and SSE chunks) into HTTP responses.

Errors are OpenAI-style JSON (vLLM's ErrorResponse): 400 malformed JSON / bad parameters / prompt too
long, 401 missing or wrong API key, 404 unknown model, 503 + Retry-After when every replica is full,
500 on an engine fault (the replica keeps serving).
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from deployments import status_page
from deployments.settings import IngressSettings

logger = logging.getLogger("ray.serve")
api = FastAPI(title="dcut-serve")


def error_response(message: str, status: int, err_type: str, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


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
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return error_response(f"Malformed JSON body: {e}", 400, "BadRequestError")
        if not isinstance(body, dict):
            return error_response("The JSON body must be an object.", 400, "BadRequestError")
        return body

    async def _forward(self, method: str, request: Request):
        if (denied := self._unauthorized(request)) is not None:
            return denied
        body = await self._body(request)
        if isinstance(body, JSONResponse):
            return body
        stream = getattr(self.engine.options(stream=True), method).remote(body)
        try:
            first = await stream.__anext__()
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
        return StreamingResponse(self._chunks(first, stream), media_type="text/event-stream")

    @staticmethod
    async def _chunks(first: str, rest) -> AsyncIterator[str]:
        yield first
        try:
            async for chunk in rest:
                yield chunk
        finally:
            rest.cancel()  # the client went away (or we are done): abort the engine request

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

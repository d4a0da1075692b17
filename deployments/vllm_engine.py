"""The only module of the deployments that knows vLLM: an ``AsyncLLM`` built by the D-Cut plugin's
``dcut.vllm.engine.engine_kwargs`` plus vLLM's own OpenAI serving objects (prompt rendering, chat
templates, streaming chunks and error bodies are vLLM's), and D-Cut's view of the engine
(``dcut.vllm.api``).

Requests in, OpenAI bodies out: ``completions`` and ``chat`` yield either one response (a dict, with
``"error"`` for an ErrorResponse) or, for streams, the SSE strings vLLM produces.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from dcut.settings import EngineSettings
from dcut.snapshot import DCutSnapshot
from dcut.specexit import with_overrides
from dcut.vllm import api as dcut_api
from dcut.vllm.engine import engine_kwargs
from deployments.records import EngineLoad, SpecExitStats

logger = logging.getLogger(__name__)
_USAGE = re.compile(r'"usage":\s*\{')  # a stream chunk that carries the usage (vLLM's last, when asked for)


def error_body(message: str, status: int, err_type: str | None = None, param: str | None = None) -> dict:
    """An OpenAI-style error body, in vLLM's ErrorResponse schema."""
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    err_type = err_type or HTTPStatus(status).phrase.replace(" ", "")
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param,
                                         code=status)).model_dump()


class _Throughput:
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


class VLLMEngine:
    def __init__(self, settings: EngineSettings, stat_loggers: list | None = None,
                 max_prompt_tokens: int | None = None):
        self.settings = settings
        self.max_prompt_tokens = max_prompt_tokens
        self._stat_loggers = stat_loggers
        self.engine = None
        self.load = EngineLoad()
        self._throughput = _Throughput()
        self._chat = self._completion = self._models = None

    # ---- start -----------------------------------------------------------------------------

    async def start(self) -> None:
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        engine_args = AsyncEngineArgs(**engine_kwargs(self.settings), disable_log_stats=False)
        loggers = self._stat_loggers if self._stat_loggers is not None else [RayPrometheusStatLogger]
        self.engine = AsyncLLM.from_engine_args(engine_args, stat_loggers=loggers)
        self._wrap_generate()

        frontend = {f.name: getattr(FrontendArgs(), f.name) for f in dataclasses.fields(FrontendArgs)}
        args = argparse.Namespace(**(frontend | vars(engine_args)))
        if isinstance(args.served_model_name, str):  # vLLM's frontend wants the CLI's list
            args.served_model_name = [args.served_model_name]
        state = State()
        await init_app_state(self.engine, state, args,
                             supported_tasks=await self.engine.get_supported_tasks())
        self._models = state.openai_serving_models
        self._completion = state.openai_serving_completion
        self._chat = state.openai_serving_chat

    def admit(self, prompt: Any, request_id: str) -> None:
        """Called with each request at the engine door, before it reaches vLLM; raising fails that request
        alone. A seam for subclasses (the fault tests' engine raises here); admits everything."""

    def _check_prompt(self, prompt: Any) -> None:
        """Refuse a prompt over ``max_prompt_tokens`` (a 400 from vLLM's serving layer, not an engine fault)."""
        from vllm.exceptions import VLLMValidationError
        from vllm.renderers.inputs.preprocess import extract_prompt_len

        if self.max_prompt_tokens is None:
            return
        n = extract_prompt_len(self.engine.model_config, prompt)
        if n > self.max_prompt_tokens:
            raise VLLMValidationError(f"The prompt has {n} tokens; this server accepts at most "
                                      f"{self.max_prompt_tokens}.", parameter="prompt")

    def _wrap_generate(self) -> None:
        """Count tokens, running, failed and aborted requests at the engine door. Wraps this engine
        instance's ``AsyncLLM.generate`` (the serving classes call it), not the class."""
        from vllm.sampling_params import RequestOutputKind

        original = self.engine.generate
        load, throughput = self.load, self._throughput

        async def generate(prompt, sampling_params, request_id, *args, **kwargs):
            self._check_prompt(prompt)
            try:
                self.admit(prompt, request_id)
            except Exception:
                load.failed_total += 1
                raise
            delta = sampling_params.output_kind == RequestOutputKind.DELTA
            produced = 0
            load.engine_requests += 1
            try:
                async for out in original(prompt, sampling_params, request_id, *args, **kwargs):
                    n = sum(len(o.token_ids) for o in out.outputs)
                    new = n if delta else max(0, n - produced)
                    produced = produced + n if delta else max(produced, n)
                    load.generated_tokens_total += new
                    throughput.add(new)
                    yield out
            except (asyncio.CancelledError, GeneratorExit):
                load.aborted_total += 1
                raise
            finally:
                load.engine_requests -= 1

        self.engine.generate = generate

    # ---- requests --------------------------------------------------------------------------

    async def completions(self, body: dict) -> AsyncIterator[Any]:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        async for item in self._serve(CompletionRequest, body, self._completion.create_completion):
            yield item

    async def chat(self, body: dict) -> AsyncIterator[Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        async for item in self._serve(ChatCompletionRequest, body, self._chat.create_chat_completion):
            yield item

    async def _serve(self, request_cls, body: dict, create) -> AsyncIterator[Any]:
        from pydantic import ValidationError
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.exceptions import VLLMClientError

        try:
            body = self._specexit_args(body)
            request = request_cls.model_validate(body)
        except ValidationError as e:
            yield error_body(validation_message(e), 400, "BadRequestError")
            return
        except VLLMClientError as e:  # raised by vLLM's own validators, past pydantic (found by loadtest.fuzz)
            yield client_error(e)
            return
        except Exception as e:  # noqa: BLE001 - anything else a validator raises is still about the body
            yield error_body(f"Invalid request: {type(e).__name__}: {e}", 400, "BadRequestError")
            return
        self.load.ongoing_requests += 1
        try:
            try:
                result = await create(request, None)
            except Exception as e:  # noqa: BLE001 - a client error (4xx) or an engine fault (500)
                if (refused := client_error(e)) is not None:
                    yield refused
                    return
                logger.exception("engine fault")  # answer 500, keep the replica serving
                yield error_body(f"engine error: {e}", 500, "InternalServerError")
                return
            if isinstance(result, ErrorResponse):
                yield result.model_dump()
            elif hasattr(result, "model_dump"):
                yield await self._with_specexit_usage(result.model_dump(exclude_none=True))
            else:
                async for chunk in result:
                    yield await self._with_specexit_usage(chunk)
        finally:
            self.load.ongoing_requests -= 1

    async def models(self) -> dict:
        return (await self._models.show_available_models()).model_dump()

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def dcut_snapshot(self) -> DCutSnapshot | None:
        """The plugin's D-Cut snapshot (stats window, cost source and table, estimates); None when off."""
        return await dcut_api.aread_stats(self.engine)

    async def specexit_stats(self) -> SpecExitStats | None:
        """SpecExit's counters in the engine; None when this deployment does not run it."""
        if self.settings.specexit is None:
            return None
        raw = await dcut_api.aread_specexit(self.engine)
        return None if raw is None else SpecExitStats.model_validate(raw)

    def _specexit_args(self, body: dict) -> dict:
        """A request's ``"specexit"`` field (true, false, or settings overriding the deployment's), validated and
        handed to the engine as ``vllm_xargs`` (vLLM's route for a request's extra arguments)."""
        if not isinstance(body, dict) or "specexit" not in body:
            return body
        body = dict(body)
        value = body.pop("specexit")
        if self.settings.specexit is None:
            if value in (False, None):
                return body
            raise ValueError("specexit: not enabled for this model (a deployment with engine.specexit set)")
        if isinstance(value, dict):
            with_overrides(self.settings.specexit, value)  # refused here, with the setting's name
            arg = json.dumps(value)
        elif isinstance(value, bool):
            arg = "true" if value else "false"
        else:
            raise ValueError("specexit: expected true, false or an object of SpecExit settings")
        body["vllm_xargs"] = {**(body.get("vllm_xargs") or {}), "specexit": arg}
        return body

    async def _with_specexit_usage(self, item: Any) -> Any:
        """A response, or a stream's usage chunk, with what SpecExit did: ``completion_tokens_details.
        reasoning_tokens`` (OpenAI's field) and ``specexit`` (exits, thinking tokens the head estimated they
        saved). Other items pass as they are."""
        if self.settings.specexit is None:
            return item
        chunk = isinstance(item, str)
        if chunk:
            if not item.startswith("data: ") or not _USAGE.search(item):
                return item
            data = json.loads(item[len("data: "):])
        else:
            data = item
        if not isinstance(data.get("usage"), dict) or "id" not in data:
            return item
        found = await dcut_api.aread_specexit_usage(self.engine, data["id"])
        if found:
            usage = data["usage"]
            usage["completion_tokens_details"] = {**(usage.get("completion_tokens_details") or {}),
                                                  "reasoning_tokens": sum(u["reasoning_tokens"]
                                                                          for u in found.values())}
            usage["specexit"] = {"exits": sum(u["exited"] for u in found.values()),
                                 "predicted_tokens_saved": round(sum(u["predicted_saved"] or 0.0
                                                                     for u in found.values()), 1)}
        return f"data: {json.dumps(data)}\n\n" if chunk else data

    def tokens_per_s(self) -> float:
        return self._throughput.rate()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def client_error(e: Exception) -> dict | None:
    """The OpenAI-style 4xx body for an exception that vLLM's serving layer counts as the client's (its
    ``VLLMClientError`` family with their own status, ``ValueError``, ``TypeError``, ``OverflowError``, template
    errors: vLLM's own ``create_error_response`` decides), or a feature this model does not implement (400, where
    vLLM says 501); None for an engine fault."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    if isinstance(e, NotImplementedError):
        return error_body(f"Not supported by this server: {str(e) or type(e).__name__}", 400, "BadRequestError")
    response = create_error_response(e)
    return response.model_dump() if response.error.code < 500 else None


def validation_message(e) -> str:
    """One line per pydantic error, vLLM style ('field: message')."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or str(e)

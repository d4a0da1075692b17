"""The vLLM engine behind the `deployments.engine.Engine` door, and the only module of the deployments that
knows vLLM: an ``AsyncLLM`` built by the D-Cut plugin's ``dcut.vllm.engine.engine_kwargs`` plus vLLM's own
OpenAI serving objects (prompt rendering, chat templates, streaming chunks and error bodies are vLLM's), and
D-Cut's view of the engine (``dcut.vllm.api``). vLLM itself is imported only when an engine starts.
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import importlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from http import HTTPStatus
from typing import Any

from dcut.settings import EngineSettings
from dcut.snapshot import DCutSnapshot
from dcut.specexit import with_overrides
from dcut.speculation import EXTRA_ARG, FIELD, merged, parse_cap
from dcut.vllm import api as dcut_api
from dcut.vllm.engine import engine_kwargs
from dcut.vllm.fingerprint import fingerprint
from deployments.engine import Engine, EngineDead, carried_tokens
from deployments.records import SpecExitStats

logger = logging.getLogger(__name__)
_USAGE = re.compile(r'"usage":\s*\{')  # a stream chunk that carries the usage (vLLM's last, when asked for)
# What ``fingerprint`` and ``start`` import of vLLM (``import_library``: timed by the replica, ~20 s on a loaded CPU).
VLLM_MODULES = ("vllm", "vllm.engine.arg_utils", "vllm.v1.engine.async_llm", "vllm.v1.metrics.ray_wrappers",
                "vllm.entrypoints.launchers.api_server.app_state", "vllm.entrypoints.launchers.cli_args")
# OpenAI's chat roles. vLLM hands any other string to the chat template (a 200 for "role": "hacker"); OpenAI refuses it.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# The token budget the request in ``_serve`` named, ``(parameter, value)``: vLLM lowers ``max_tokens`` to what the
# context leaves before ``generate`` sees it, so the prompt length and the client's figure meet only there.
_REQUESTED_TOKENS: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("requested_tokens",
                                                                                          default=None)


def error_body(message: str, status: int, err_type: str | None = None, param: str | None = None) -> dict:
    """An OpenAI-style error body, in vLLM's ErrorResponse schema."""
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

    err_type = err_type or HTTPStatus(status).phrase.replace(" ", "")
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param,
                                         code=status)).model_dump()


class VLLMEngine(Engine):
    def __init__(self, settings: EngineSettings, max_prompt_tokens: int | None = None,
                 stat_loggers: list | None = None):
        super().__init__(settings, max_prompt_tokens)
        self._stat_loggers = stat_loggers
        self.engine = None
        self._vllm_generate = None
        self._chat = self._completion = self._models = None

    @classmethod
    def fingerprint(cls, settings: EngineSettings) -> str:
        """From the ``VllmConfig`` vLLM builds of ``settings`` (``dcut.vllm.fingerprint``), without an engine."""
        return fingerprint(settings).key()

    # ---- start -----------------------------------------------------------------------------

    @classmethod
    def import_library(cls) -> None:
        for name in VLLM_MODULES:
            importlib.import_module(name)

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
        self._route_generate_through_adapter()

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

    def _check_prompt(self, prompt: Any) -> None:
        """Refuse a prompt over ``max_prompt_tokens``, or one whose tokens and the budget the client named pass the
        context (a 400 from vLLM's serving layer, not an engine fault; vLLM would lower the budget and answer 200)."""
        from vllm.exceptions import VLLMValidationError
        from vllm.renderers.inputs.preprocess import extract_prompt_len

        requested = _REQUESTED_TOKENS.get()
        if self.max_prompt_tokens is None and requested is None:
            return
        n = extract_prompt_len(self.engine.model_config, prompt)
        if self.max_prompt_tokens is not None and n - carried_tokens.get() > self.max_prompt_tokens:
            raise VLLMValidationError(f"The prompt has {n} tokens; this server accepts at most "
                                      f"{self.max_prompt_tokens}.", parameter="prompt")
        context = self.engine.model_config.max_model_len
        if requested is not None and (message := context_overflow(n, requested[1], context)) is not None:
            raise VLLMValidationError(message, parameter=requested[0])

    def _route_generate_through_adapter(self) -> None:
        """Make this adapter's ``generate`` the ``generate`` of this one ``AsyncLLM`` instance.

        Why here, on the instance, and not among the plugin's patches of vLLM (``dcut.vllm.patches``): vLLM's
        OpenAI serving objects, built from this engine by ``init_app_state``, call ``engine_client.generate``
        for every request; it is the one place where each request's prompt and outputs pass and where a
        client's abort shows (the generator is cancelled or closed). The replica counts and admits requests
        there and changes nothing vLLM does: the outputs pass unchanged. The patches change vLLM's behaviour
        for every engine of a process, on its classes; this attribute belongs to one engine of one replica,
        leaves the ``AsyncLLM`` class and any other engine alone, and goes with the instance, so there is
        nothing to undo."""
        self._vllm_generate = self.engine.generate
        self.engine.generate = self.generate

    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs) -> AsyncIterator[Any]:
        """``AsyncLLM.generate`` as vLLM's serving objects see it: the prompt limit and ``admit`` first, then
        vLLM's outputs, counted (``Engine.generating``: tokens, running, aborted)."""
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        self._check_prompt(prompt)
        self.admitted(prompt, request_id)
        delta = sampling_params.output_kind == RequestOutputKind.DELTA
        produced = 0

        def new_tokens(out) -> int:  # a DELTA output carries its new tokens, a CUMULATIVE one all so far
            nonlocal produced
            n = sum(len(o.token_ids) for o in out.outputs)
            new = n if delta else max(0, n - produced)
            produced = produced + n if delta else max(produced, n)
            return new

        outputs = self._vllm_generate(prompt, sampling_params, request_id, *args, **kwargs)
        try:
            async with aclosing(self.generating(outputs, new_tokens)) as counted:
                async for out in counted:
                    yield out
        except EngineDeadError as e:  # vLLM's serving layer turns it into a 500; ``_serve`` raises ``EngineDead``
            self.died(str(e))
            raise

    # ---- requests --------------------------------------------------------------------------

    async def completions(self, body: dict) -> AsyncIterator[Any]:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        async for item in self._serve(CompletionRequest, body, self._completion.create_completion, "completions"):
            yield item

    async def chat(self, body: dict) -> AsyncIterator[Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        async for item in self._serve(ChatCompletionRequest, body, self._chat.create_chat_completion, "chat"):
            yield item

    async def _serve(self, request_cls, body: dict, create, route: str) -> AsyncIterator[Any]:
        from pydantic import ValidationError
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.exceptions import VLLMClientError

        try:
            if route == "chat" and (refused := unknown_role(body)) is not None:
                yield refused
                return
            body = self._speculation_args(self._specexit_args(body))
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
        # Read by ``generate`` (``_check_prompt``); set by every request before its engine call, in its own task's
        # context (Serve runs each request in a task of its own), so no value outlives its request's use of it.
        _REQUESTED_TOKENS.set(requested_tokens(body, route))
        with self.serving():
            try:
                result = await create(request, None)
            except Exception as e:  # noqa: BLE001 - a client error (4xx) or an engine fault (500)
                if (refused := client_error(e)) is not None:
                    yield refused
                    return
                self._raise_if_dead()
                logger.exception("engine fault")  # answer 500, keep the replica serving
                yield error_body(f"engine error: {e}", 500, "InternalServerError")
                return
            if isinstance(result, ErrorResponse):
                if result.error.code >= 500:
                    self._raise_if_dead()
                yield result.model_dump()
            elif hasattr(result, "model_dump"):
                yield await self._with_usage(result.model_dump(exclude_none=True), route)
            else:
                async for chunk in result:
                    if chunk.startswith('data: {"error"'):
                        self._raise_if_dead()
                    yield await self._with_usage(chunk, route)

    def _raise_if_dead(self) -> None:
        """Raise ``EngineDead`` where the engine core died (a 500 of vLLM's then is the replica's death, not the
        request's fault): seen by ``generate``, or by vLLM (``AsyncLLM.errored``) before this request reached it."""
        if self.dead is None and self.engine is not None and self.engine.errored:
            self.died("vLLM reports its engine core dead (AsyncLLM.errored)")
        if self.dead is not None:
            raise EngineDead(f"the engine of this replica died: {self.dead}")

    async def models(self) -> dict:
        """vLLM's model list, with the served name as each base model's ``root`` where vLLM puts the path it loaded
        (this server's file system is not the client's business)."""
        models = (await self._models.show_available_models()).model_dump()
        for card in models.get("data", []):
            if card.get("parent") is None:
                card["root"] = card["id"]
        return models

    async def check_health(self) -> None:
        self._raise_if_dead()
        await self.engine.check_health()

    async def dcut_snapshot(self) -> DCutSnapshot | None:
        """The plugin's D-Cut snapshot (stats window, cost source and table, estimates); None when off."""
        return await dcut_api.aread_snapshot(self.engine)

    async def specexit_stats(self) -> SpecExitStats | None:
        """SpecExit's counters in the engine; None when this deployment does not run it."""
        if self.settings.specexit is None:
            return None
        raw = await dcut_api.aread_specexit(self.engine)
        return None if raw is None else SpecExitStats.model_validate(raw)

    def _specexit_args(self, body: dict) -> dict:
        """A request's ``"specexit"`` field (true, false, or settings overriding the deployment's), validated and
        handed to the engine as ``vllm_xargs`` (vLLM's route for a request's extra arguments)."""
        def arg(value: Any) -> str | None:
            if self.settings.specexit is None:
                if value in (False, None):
                    return None
                raise ValueError("specexit: not enabled for this model (a deployment with engine.specexit set)")
            if isinstance(value, dict):
                with_overrides(self.settings.specexit, value)  # refused here, with the setting's name
                return json.dumps(value)
            if isinstance(value, bool):
                return "true" if value else "false"
            raise ValueError("specexit: expected true, false or an object of SpecExit settings")
        return _to_xargs(body, "specexit", "specexit", arg)

    def _speculation_args(self, body: dict) -> dict:
        """A request's ``"speculation"`` field (``dcut.speculation``: true, false or ``{"max_width": N}``),
        validated (a 400 naming it) and handed to the engine as ``vllm_xargs``."""
        def arg(value: Any) -> int | None:
            cap = parse_cap(value, self.settings.num_speculative_tokens)
            if cap is None or self.settings.method == "none":  # the deployment's default; or nothing to cap
                return None
            if self.settings.dcut is None:
                raise ValueError(f"{FIELD}: a cap needs D-Cut on this model (engine.dcut); its drafter verifies "
                                 f"{self.settings.num_speculative_tokens} drafts per step")
            return cap
        return _to_xargs(body, FIELD, EXTRA_ARG, arg)

    async def _with_usage(self, item: Any, route: str) -> Any:
        """A response, or a stream's usage chunk, with what speculation did for it (``usage.speculation``: steps,
        drafted, verified and accepted drafts, acceptance rate; recorded in the replica's acceptance histogram)
        and what SpecExit did (``completion_tokens_details.reasoning_tokens``, OpenAI's field, and
        ``specexit``: exits, thinking tokens the head estimated they saved). Other items pass as they are."""
        speculating = self.settings.dcut is not None and self.settings.method != "none"
        if self.settings.specexit is None and not speculating:
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
        if speculating:
            spec = merged(await dcut_api.aread_request_usage(self.engine, data["id"]))
            data["usage"]["speculation"] = spec
            self.record_speculation(route, spec)
        found = await dcut_api.aread_specexit_usage(self.engine, data["id"]) if self.settings.specexit else None
        if found:
            usage = data["usage"]
            usage["completion_tokens_details"] = {**(usage.get("completion_tokens_details") or {}),
                                                  "reasoning_tokens": sum(u["reasoning_tokens"]
                                                                          for u in found.values())}
            usage["specexit"] = {"exits": sum(u["exited"] for u in found.values()),
                                 "predicted_tokens_saved": round(sum(u["predicted_saved"] or 0.0
                                                                     for u in found.values()), 1)}
        return f"data: {json.dumps(data)}\n\n" if chunk else data

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


def unknown_role(body: Any) -> dict | None:
    """The 400 for a chat message whose role is not one of OpenAI's (``CHAT_ROLES``), naming it as OpenAI does
    (``messages[i].role``); None when every role is known. Other shapes are left to vLLM's validation."""
    messages = body.get("messages") if isinstance(body, dict) else None
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        role = message.get("role") if isinstance(message, dict) else None
        if isinstance(role, str) and role not in CHAT_ROLES:
            return error_body(f"Invalid value: {role[:40]!r}. Supported values are: {', '.join(CHAT_ROLES)}.", 400,
                              "BadRequestError", param=f"messages[{i}].role")
    return None


def requested_tokens(body: Any, route: str) -> tuple[str, int] | None:
    """``(parameter, value)`` of the completion budget a request names (chat: ``max_completion_tokens`` before the
    older ``max_tokens``, as vLLM reads them), or None."""
    names = ("max_completion_tokens", "max_tokens") if route == "chat" else ("max_tokens",)
    for name in names:
        value = body.get(name) if isinstance(body, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    return None


def context_overflow(prompt_tokens: int, requested: int, max_model_len: int) -> str | None:
    """OpenAI's message for a prompt whose tokens plus the requested completion pass the context, else None."""
    if prompt_tokens + requested <= max_model_len:
        return None
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} in the completion). "
            f"Please reduce the length of the prompt or completion.")


def validation_message(e) -> str:
    """One line per pydantic error, vLLM style ('field: message')."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or str(e)


def _to_xargs(body: Any, field: str, key: str, arg: Callable[[Any], Any]) -> Any:
    """``body`` without its ``field``, and with ``arg`` of that field's value (None: nothing to hand on) in
    ``vllm_xargs[key]``; ``arg`` raises ValueError on a bad value (a 400). Bodies without the field pass as they are."""
    if not isinstance(body, dict) or field not in body:
        return body
    body = dict(body)
    value = arg(body.pop(field))
    if value is not None:
        body["vllm_xargs"] = {**(body.get("vllm_xargs") or {}), key: value}
    return body

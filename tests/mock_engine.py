"""A vLLM-free engine behind the `deployments.engine.Engine` door, for the unit tests of the replica, ingress and
controller (STYLE §11: tests knock on a painted door). It imports neither vLLM nor torch.

Generation is deterministic: the completion of a request is ``max_tokens`` (default 16) tokens ``" w0"``,
``" w1"``, ..., one every ``token_delay_s``, counted by the same `Engine` accounting as the vLLM engine's. A prompt
is a string (one token a word) or a list of token ids; a chat's prompt is its messages' contents. Token ids: ``w<i>``
is 1000 + i, any other word one below 1000; a prompt that ends with the mock's own tokens 1000, 1001, ... (a
continuation's) goes on from there, so a continued request writes what the uninterrupted one would.
``return_token_ids`` and ``stream_options.include_usage`` answer as vLLM's do.

Failures on demand: per request, ``FAULT`` in the prompt is an engine fault (a 500 body, in a stream an SSE error
event as vLLM sends it; counted failed, the replica keeps serving), as ``tests.fault_engine`` does to the real
engine. Per instance (a test reaches the engine through its replica, ``replica.engine``):
``die_before_first`` and ``die_after_chunks`` (once) raise `ActorDiedError` as a dead replica does for the ingress,
``back_pressure`` raises `BackPressureError` as a full deployment does, ``engine_dies_after_tokens`` makes the engine
die inside the live replica after that many tokens of the next request (`EngineDead`, as ``VLLMEngine`` raises for
vLLM's ``EngineDeadError``: the health check fails from then on; the painted replica still serves the ingress's next
try, which on a real deployment goes to another replica), ``healthy = False`` fails the health check,
``token_delay_s`` slows generation, ``snapshot_delay_s`` makes D-Cut's state slow to read; a subclass's
``start_delay_s`` makes a slow start, half of it reported as compiling (its snapshot's ``compile_s``).

D-Cut's state is synthetic: the given cost table (``settings.dcut.cost_table``, source "given") or a made-up
profile ("profiled"); throughput estimates from it once a request ran; a learned state given at start
(``settings.dcut.learned``) is reported as this engine's, else a made-up one once it generated.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import zlib
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any, ClassVar

from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

from dcut.cost_table import CostTable, Fingerprint
from dcut.learned import LearnedState
from dcut.settings import EngineSettings
from dcut.snapshot import DCutSnapshot, Overhead, ThroughputEstimate, WindowSummary
from deployments.engine import Engine, carried_tokens
from deployments.records import SpecExitStats

FAULT = "__mock_engine_fault__"
DONE = "data: [DONE]\n\n"


def error_body(message: str, status: int, err_type: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def token_id(word: str) -> int:
    """A word's token id: ``w<i>``, the mock's i-th generated token, is 1000 + i; any other word one below 1000."""
    if word.startswith("w") and word[1:].isdigit():
        return 1000 + int(word[1:])
    return 1 + zlib.crc32(word.encode()) % 999


def generated_so_far(prompt_ids: list[int]) -> int:
    """How many of the mock's tokens end the prompt (a continuation's prompt ends with those already sent: ids 1000,
    1001, ...): where its generation goes on, so a continued request writes what the uninterrupted one would."""
    for k in range(len(prompt_ids), 0, -1):
        if prompt_ids[-k] == 1000 and prompt_ids[-k:] == list(range(1000, 1000 + k)):
            return k
    return 0


def _choice(text: str, chat: bool, stream: bool, first: bool = False, finish_reason: str | None = None) -> dict:
    """One choice of a response (``stream=False``) or of a stream's chunk, in OpenAI's shape."""
    if not chat:
        return {"index": 0, "text": text, "finish_reason": finish_reason}
    if not stream:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
    delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
    return {"index": 0, "delta": delta, "finish_reason": finish_reason}


class MockEngine(Engine):
    start_delay_s: ClassVar[float] = 0.0  # a subclass sets it: a replica that takes long to start

    def __init__(self, settings: EngineSettings, max_prompt_tokens: int | None = None):
        super().__init__(settings, max_prompt_tokens)
        self.name = settings.served_model_name or Path(settings.model).name
        self.die_before_first = 0  # the next this many requests find the replica dead
        self.die_after_chunks: int | None = None  # streams: the replica dies after this many chunks
        self.engine_dies_after_tokens: int | None = None  # the engine dies inside the replica (once)
        self.back_pressure = 0  # the next this many requests find every replica full
        self.healthy = True
        self.token_delay_s = 0.0
        self.snapshot_delay_s = 0.0
        self.started = self.shut_down = False
        self.table: CostTable | None = None
        self.cost_source = "fallback"
        self.learned: LearnedState | None = None
        self._ids = itertools.count()

    @classmethod
    def fingerprint(cls, settings: EngineSettings) -> str:
        return cls._fingerprint(settings).key()

    @staticmethod
    def _fingerprint(settings: EngineSettings) -> Fingerprint:
        return Fingerprint(hardware="mock", model=settings.model, drafter=settings.draft,
                           k=settings.num_speculative_tokens, tensor_parallel_size=settings.tensor_parallel_size,
                           dtype=settings.dtype, vllm_version="mock")

    async def start(self) -> None:
        await asyncio.sleep(self.start_delay_s)
        self._compile_s = self.start_delay_s / 2 if self.start_delay_s else None  # half a slow start "compiles"
        dcut = self.settings.dcut
        if dcut is not None:
            fp = self._fingerprint(self.settings)
            if dcut.cost_table:
                self.table, self.cost_source = CostTable.load_for(dcut.cost_table, fp), "given"
            else:  # a "profile": verifying costs 10 ms a step plus 0.5 ms a token
                self.table = CostTable(fp, {b: [(b, 10 + 0.5 * b, 1), (8 * b, 10 + 4 * b, 1)] for b in (1, 4, 8)})
                self.cost_source = "profiled"
            if dcut.learned:
                self.learned = LearnedState.model_validate_json(Path(dcut.learned).read_text())
        self.started = True

    # ---- requests --------------------------------------------------------------------------

    def completions(self, body: dict) -> AsyncIterator[Any]:
        return self._serve(body, chat=False)

    def chat(self, body: dict) -> AsyncIterator[Any]:
        return self._serve(body, chat=True)

    def _prompt(self, body: dict, chat: bool) -> tuple[list[str] | None, dict | None]:
        """The prompt's tokens, or the client's error body."""
        if body.get("model") not in (None, self.name):
            return None, error_body(f"The model `{body['model']}` does not exist.", 404, "NotFoundError", "model")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                return None, error_body("messages: Input should be a valid list", 400, "BadRequestError")
            prompt = " ".join(str(m.get("content", "")) for m in messages).split()
        else:
            raw = body.get("prompt")
            if not isinstance(raw, (str, list)):
                return None, error_body("prompt: Field required", 400, "BadRequestError")
            prompt = raw.split() if isinstance(raw, str) else [str(t) for t in raw]
        budget = body.get("max_tokens")
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            return None, error_body("max_tokens: must be at least 1", 400, "BadRequestError")
        if self.max_prompt_tokens is not None and len(prompt) - carried_tokens.get() > self.max_prompt_tokens:
            return None, error_body(f"The prompt has {len(prompt)} tokens; this server accepts at most "
                                    f"{self.max_prompt_tokens}.", 400, "BadRequestError", "prompt")
        return prompt, None

    async def _serve(self, body: dict, chat: bool) -> AsyncIterator[Any]:
        if self.back_pressure > 0:
            self.back_pressure -= 1
            raise BackPressureError(num_queued_requests=1, max_queued_requests=1)
        if self.die_before_first > 0:
            self.die_before_first -= 1
            raise ActorDiedError()
        prompt, refused = self._prompt(body, chat)
        if refused is not None:
            yield refused
            return
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-mock-{next(self._ids)}"
        kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chat and body.get("stream") else "")
        prompt_ids = [int(w) if w.isdigit() else token_id(w) for w in prompt]
        ids = bool(body.get("return_token_ids"))
        start, n = generated_so_far(prompt_ids), body.get("max_tokens") or 16  # null: "what the context leaves"
        with self.serving():
            try:
                self.admitted(prompt, request_id)
            except Exception as e:  # noqa: BLE001 - an engine fault: 500, the replica keeps serving
                fault = error_body(f"engine error: {e}", 500, "InternalServerError")
                yield sse(fault) if body.get("stream") else fault  # in a stream, vLLM sends an error event
                return
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
            async with aclosing(self.generating(self._generate(start, n), lambda _: 1)) as tokens:
                if not body.get("stream"):
                    text = "".join([t async for t in tokens])
                    choice = _choice(text, chat, stream=False, finish_reason="length")
                    out = {"id": request_id, "object": kind, "created": int(time.time()), "model": self.name,
                           "choices": [choice], "usage": usage}
                    if ids:
                        choice["token_ids"] = list(range(1000 + start, 1000 + start + n))
                        (out if chat else choice)["prompt_token_ids"] = prompt_ids
                    yield out
                    return
                sent = 0
                async for token in tokens:
                    if self.die_after_chunks is not None and sent >= self.die_after_chunks:
                        self.die_after_chunks = None  # once: the ingress's next try finds a live "replica"
                        raise ActorDiedError()
                    chunk = {"id": request_id, "object": kind, "model": self.name,
                             "choices": [_choice(token, chat, stream=True, first=sent == 0)]}
                    if ids:
                        chunk["choices"][0]["token_ids"] = [token_id(token.strip())]
                        if sent == 0:
                            (chunk if chat else chunk["choices"][0])["prompt_token_ids"] = prompt_ids
                    yield sse(chunk)
                    sent += 1
                last = {"id": request_id, "object": kind, "model": self.name,
                        "choices": [_choice("", chat, stream=True, finish_reason="length")]}
                if ids:
                    last["choices"][0]["token_ids"] = []
                yield sse(last)
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield sse({"id": request_id, "object": kind, "model": self.name, "choices": [], "usage": usage})
                yield DONE

    def admit(self, prompt: Any, request_id: str) -> None:
        if FAULT in prompt:
            raise RuntimeError(f"injected engine fault (request {request_id})")

    async def _generate(self, start: int, n: int) -> AsyncGenerator[str, None]:
        for i in range(start, start + n):
            await asyncio.sleep(self.token_delay_s)  # 0 still yields: a cancellation reaches the request here
            if self.engine_dies_after_tokens is not None and i - start >= self.engine_dies_after_tokens:
                self.engine_dies_after_tokens = None
                raise self.died("mock engine core died")
            yield f" w{i}"

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "dcut-serve"}]}

    async def check_health(self) -> None:
        if self.dead is not None:
            raise self.died(self.dead)
        if not self.healthy:
            raise RuntimeError("mock engine unhealthy")

    # ---- D-Cut's state ---------------------------------------------------------------------

    async def dcut_snapshot(self) -> DCutSnapshot | None:
        await asyncio.sleep(self.snapshot_delay_s)
        dcut = self.settings.dcut
        if dcut is None or not self.started:
            return None
        steps = self.load.generated_tokens_total  # one token a step
        return DCutSnapshot(
            settings=dcut, fingerprint=self.table.fingerprint, cost_source=self.cost_source,
            cost_path=dcut.cost_table, steps=steps, window=WindowSummary(steps=min(steps, 100)),
            overhead=Overhead(per_step_ms=1.0, per_token_ms=0.01), cost_table=self.table.to_json(),
            estimates=self._estimates() if steps else [], learned=self.learned_state(), compile_s=self._compile_s)

    def learned_state(self) -> LearnedState | None:
        """What this engine reports as learned: the state it started from, else a made-up one once it generated."""
        steps, k = self.load.generated_tokens_total, self.settings.num_speculative_tokens
        if self.learned is not None or not steps:
            return self.learned
        return LearnedState(fingerprint=self.fingerprint(self.settings), k=k, widths=[k],
                            reached=[[float(steps)] * k], accepted=[[steps / 2] * k], expected=[[0.5] * k],
                            expected_requests=[float(steps)])

    def _estimates(self) -> list[ThroughputEstimate]:
        """Two tokens a request a step (one accepted draft and the bonus token), at the table's costs."""
        estimates = []
        for b in sorted(self.table.points):
            ms = self.table.lookup(b, 2 * b)
            estimates.append(ThroughputEstimate(b, 2.0 * b, ms, 2000.0 * b / ms, 2000.0 / ms))
        return estimates

    async def specexit_stats(self) -> SpecExitStats | None:
        return None if self.settings.specexit is None else SpecExitStats(settings=self.settings.specexit.model_dump())

    def shutdown(self) -> None:
        self.shut_down = True

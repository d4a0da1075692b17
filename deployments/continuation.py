"""Continuation of a request whose engine replica died after it generated tokens (issue 64).

The ingress asks the engine for token ids (vLLM's ``return_token_ids``) and keeps, per request, the prompt's ids and
the ids of every token it passed to the client. When the replica dies, it sends another replica a continuation: the
same sampling settings, stop conditions and per-request fields (``speculation``, ``specexit``) on ``/v1/completions``
with the prompt's ids followed by the emitted ids as its prompt and the token budget reduced by what was emitted. The
continuation's chunks are written into the original stream: the same id, object, created and model, chat chunks for a
chat request, one ``finish_reason``, and a usage whose prompt and completion counts are the original request's.

What cannot be continued faithfully is refused up front (``refusal``) and keeps today's behaviour: several choices,
logprobs (earlier positions cannot be re-reported), guided decoding (its state would restart), ``echo``, stop strings
(vLLM holds back text that could start one, so the emitted text lags the emitted tokens), tools, a suffix, several
prompts, prompt truncation, continuous usage. A chat stream that has sent reasoning or tool calls is refused when it
dies (its parser's state would restart).

Tokens whose text is not out yet (a chunk with token ids and no text: an incomplete UTF-8 character) are held here
and sent with the next chunk that has text; a death drops them, and the continuation generates them again, so the
continuation's detokenizer starts at a character boundary of what the client has.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

DONE = "[DONE]"
# A continuation body names the request it continues, for the replica it lands on (its log line and its count);
# ``EngineReplica`` takes the field off before the engine sees the body.
CONTINUES = "dcut_continues"
# Fields of a chat request that mean the same on /v1/completions: what a chat continuation carries over.
SHARED_FIELDS = ("model", "frequency_penalty", "logit_bias", "presence_penalty", "seed", "temperature", "top_p",
                 "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids", "ignore_eos",
                 "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids", "bad_words", "priority",
                 "cache_salt", "vllm_xargs", "repetition_detection", "thinking_token_budget", "user", "speculation",
                 "specexit")
CHAT_STRUCTURED = ("reasoning", "reasoning_content", "tool_calls")  # delta fields a parser fills


def _given(body: dict, name: str) -> Any:
    value = body.get(name)
    return None if value in (None, False, [], {}, "") else value


def refusal(route: str, body: dict) -> str | None:
    """Why a request could not be continued faithfully (it keeps today's behaviour), else None."""
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1 or _given(body, "use_beam_search"):
        return "several choices"
    if (body.get("logprobs") is not None and body["logprobs"] is not False) or _given(body, "top_logprobs") or \
            body.get("prompt_logprobs") is not None:
        return "logprobs"
    response_format = body.get("response_format")
    if _given(body, "structured_outputs") or any(_given(body, k) for k in body if k.startswith("guided_")) or \
            (isinstance(response_format, dict) and response_format.get("type", "text") != "text"):
        return "guided decoding"
    if _given(body, "echo"):
        return "echo"
    if _given(body, "stop"):
        return "stop strings"
    if _given(body, "truncate_prompt_tokens") is not None:
        return "prompt truncation"
    options = body.get("stream_options")
    if isinstance(options, dict) and _given(options, "continuous_usage_stats"):
        return "continuous usage"
    if route == "chat":
        if _given(body, "tools") and body.get("tool_choice") != "none":
            return "tools"
        return None
    if _given(body, "suffix") or _given(body, "prompt_embeds"):
        return "suffix or prompt embeddings"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return "several prompts"
    return None


@dataclass
class Progress:
    """One request's progress, as the client has seen it; turns the engine's chunks into the client's events (dicts,
    or ``DONE``) and builds the continuation when its replica dies."""

    route: str  # "chat" or "completions"
    body: dict  # the client's
    prompt_ids: list[int] | None = None
    emitted: list[int] = field(default_factory=list)  # token ids the client has been sent (their text included)
    held: list[int] = field(default_factory=list)  # token ids whose text is not out yet
    identity: dict[str, Any] = field(default_factory=dict)  # id, object, created, model of the original response
    carried: int = 0  # tokens the current continuation was given as its prompt's tail (0: the original request)
    continuations: int = 0
    tries: int = 1  # replicas tried so far (the ingress's ``max_attempts`` bounds them)
    finished: bool = False  # a finish_reason was sent
    usage_sent: bool = False
    structured: bool = False  # a chat parser's output (reasoning, tool calls) was sent

    @classmethod
    def plan(cls, route: str, body: dict) -> Progress | None:
        """A progress for ``body`` when it could be continued, else None."""
        return None if refusal(route, body) is not None else cls(route, body)

    @property
    def client_stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def wants_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))

    @property
    def wants_usage(self) -> bool:
        options = self.body.get("stream_options")
        return not self.client_stream or (isinstance(options, dict) and bool(options.get("include_usage")))

    def engine_body(self) -> dict:
        """The original request as sent to an engine: with token ids; a non-streaming one streamed (the ingress
        collects it), with its usage."""
        body = {**self.body, "return_token_ids": True}
        if not self.client_stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body

    # ---- the engine's chunks into the client's events --------------------------------------------

    def take(self, chunk: str) -> list[dict | str]:
        """The client's events for one SSE chunk of the engine (none while its tokens' text is held)."""
        payload = chunk.strip()[len("data: "):] if chunk.startswith("data: ") else chunk.strip()
        if payload == DONE:
            return [DONE]
        data = json.loads(payload)
        if "error" in data:
            return [data]
        if self.carried and self.route == "chat":
            data = self._as_chat(data)
        if not self.identity:
            self.identity = {k: data[k] for k in ("id", "object", "created", "model") if k in data}
        elif self.carried:
            data |= self.identity
        prompt_ids = data.get("prompt_token_ids")  # chat: on the first chunk
        choices = data.get("choices") or []
        if not choices:
            if "usage" in data:
                return self._usage(data)
            return [data]
        choice = choices[0]
        prompt_ids = choice.get("prompt_token_ids", prompt_ids)  # completions: on the first choice
        if self.prompt_ids is None and isinstance(prompt_ids, list) and not self.carried:
            self.prompt_ids = list(prompt_ids)
        ids = choice.get("token_ids") or []
        if not self._visible(choice):
            self.held += ids
            return []
        ids, self.held = self.held + ids, []
        self.emitted += ids
        self.finished = self.finished or choice.get("finish_reason") is not None
        delta = choice.get("delta") or {}
        self.structured = self.structured or any(delta.get(k) for k in CHAT_STRUCTURED)
        choice["token_ids"] = ids if self.wants_ids else None
        for part in (choice, data):  # the prompt's ids: the original's, and only for a client that asked
            if "prompt_token_ids" in part and (self.carried or not self.wants_ids):
                part["prompt_token_ids"] = None
        return [data]

    def _visible(self, choice: dict) -> bool:
        """Whether a chunk's choice has something for the client besides token ids."""
        if choice.get("finish_reason") is not None:
            return True
        if self.route == "completions":
            return bool(choice.get("text"))
        delta = choice.get("delta") or {}
        return any(delta.get(k) for k in ("role", "content", *CHAT_STRUCTURED))

    def _usage(self, data: dict) -> list[dict]:
        """The usage chunk, with the original request's counts (a continuation's prompt re-reads emitted tokens)."""
        if self.usage_sent:
            return []
        self.usage_sent = True
        usage = data["usage"]
        if self.carried:
            prompt = len(self.prompt_ids or [])
            completion = self.carried + int(usage.get("completion_tokens") or 0)
            usage |= {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
            usage.pop("prompt_tokens_details", None)  # the continuation's cache hits, not the client's prompt's
        return [data] if self.wants_usage else []

    def _as_chat(self, data: dict) -> dict:
        """A /v1/completions chunk of a chat's continuation as a chat chunk."""
        out = {k: data[k] for k in ("id", "object", "created", "model") if k in data}
        out["object"] = "chat.completion.chunk"
        choices = []
        for c in data.get("choices") or []:
            choice = {"index": c.get("index", 0), "delta": {"content": c["text"]} if c.get("text") else {},
                      "logprobs": None, "finish_reason": c.get("finish_reason")}
            if "stop_reason" in c:
                choice["stop_reason"] = c["stop_reason"]
            choice["token_ids"] = c.get("token_ids")
            choices.append(choice)
        out["choices"] = choices
        out |= {k: data[k] for k in ("usage", "system_fingerprint") if k in data}
        return out

    # ---- when the replica dies ---------------------------------------------------------------

    def cannot_continue(self) -> str | None:
        """Why this request cannot be continued now, else None."""
        if self.prompt_ids is None:
            return "no prompt token ids yet"
        if self.structured:
            return "a chat parser's output (reasoning or tool calls) was sent"
        return None

    def budget_name(self) -> str:
        if self.route == "chat" and self.body.get("max_completion_tokens") is not None:
            return "max_completion_tokens"
        return "max_tokens"

    def continuation(self) -> tuple[str, dict]:
        """``(engine method, body)`` of the continuation: /v1/completions on the prompt's ids and the emitted ones."""
        self.continuations += 1
        self.carried = len(self.emitted)
        self.held = []
        if self.route == "chat":
            body = {k: self.body[k] for k in SHARED_FIELDS if k in self.body}
        else:
            body = {k: v for k, v in self.body.items() if k not in ("prompt", "max_tokens", "stream_options")}
        budget = self.body.get(self.budget_name())
        if budget is None and self.route == "completions":
            budget = 16  # vLLM's default for completions
        # None: what the context leaves (chat's default; /v1/completions reads an explicit null so), the same bound
        body["max_tokens"] = None if budget is None else max(1, int(budget) - self.carried)
        if isinstance(self.body.get("min_tokens"), int):
            body["min_tokens"] = max(0, self.body["min_tokens"] - self.carried)
        body |= {"prompt": [*self.prompt_ids, *self.emitted], "return_token_ids": True, "stream": True,
                 "stream_options": {"include_usage": True},
                 CONTINUES: {"request_id": self.identity.get("id"), "carried": self.carried}}
        return "completions", body

    def close(self) -> list[dict | str]:
        """The events that end a stream whose last token and finish_reason were sent before its replica died: its usage
        (counted here) and ``DONE``."""
        events: list[dict | str] = []
        if not self.usage_sent and self.wants_usage:
            prompt, completion = len(self.prompt_ids or []), len(self.emitted)
            events.append({**self.identity, "choices": [], "usage": {
                "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}})
            self.usage_sent = True
        return [*events, DONE]


def collected(events: list[dict | str], progress: Progress) -> dict:
    """A non-streaming response from the events of its (internally streamed) request: text or message joined,
    the last finish_reason, the usage; token ids where the client asked for them."""
    text: dict[str, str] = {}
    role, finish, usage, fingerprint = "assistant", {}, None, None
    for event in events:
        if not isinstance(event, dict):
            continue
        fingerprint = event.get("system_fingerprint") or fingerprint  # vLLM's, on the last chunk
        if event.get("usage"):
            usage = event["usage"]
        for c in event.get("choices") or []:
            parts = {"text": c.get("text")} if progress.route == "completions" else (c.get("delta") or {})
            for key, value in parts.items():
                if key == "role":
                    role = value
                elif isinstance(value, str):
                    text[key] = text.get(key, "") + value
            if c.get("finish_reason") is not None:
                finish = {"finish_reason": c["finish_reason"], "stop_reason": c.get("stop_reason")}
    identity = progress.identity
    if progress.route == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": role, **text}, **finish}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text.get("text", ""), **finish}
        kind = "text_completion"
    if progress.wants_ids:
        choice["token_ids"] = list(progress.emitted)
        if progress.route == "completions":
            choice["prompt_token_ids"] = progress.prompt_ids
    out = {"id": identity.get("id"), "object": kind, "created": identity.get("created", int(time.time())),
           "model": identity.get("model"), "choices": [{k: v for k, v in choice.items() if v is not None}]}
    if progress.wants_ids and progress.route == "chat":
        out["prompt_token_ids"] = progress.prompt_ids
    if usage is not None:
        out["usage"] = usage
    if fingerprint is not None:
        out["system_fingerprint"] = fingerprint
    return out


def sse(event: dict | str) -> str:
    """An event as an SSE chunk (compact JSON, as vLLM writes its chunks)."""
    return f"data: {event if isinstance(event, str) else json.dumps(event, separators=(',', ':'))}\n\n"

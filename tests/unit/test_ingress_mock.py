"""The ingress over the whole application on the mock engine (``tests.mock_app``: Serve's local testing mode, HTTP
over ASGI): OpenAI bodies and streams, API key, request limits, engine faults, retries on a replica that dies before
answering, a stream cut mid-way, back-pressure, a client that goes away, the controller's view. Milliseconds each;
``tests/integration/test_serve_app.py`` shows the same on real engines, replicas and HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.mock_app import MODEL, app_args, local_app, stream_until_gone
from tests.mock_engine import FAULT

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def app():
    a = local_app()
    yield a
    a.shutdown()


def run(coro):
    return asyncio.run(coro)


def events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"]
    return err


async def post(app, path: str, body: dict | None = None, **kw):
    async with app.client() as c:
        return await c.post(path, json=body, **kw) if body is not None else await c.post(path, **kw)


# ---- happy paths -----------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_completions_and_chat(app, stream):
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 5, "stream": stream}
    r = run(post(app, "/v1/completions", body))
    assert r.status_code == 200, r.text
    if stream:
        assert r.headers["content-type"].startswith("text/event-stream")
        got = events(r.text)
        assert got[-1] == "[DONE]" and "".join(json.loads(e)["choices"][0]["text"] for e in got[:-1]) == \
            " w0 w1 w2 w3 w4"
    else:
        assert r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": stream}
    r = run(post(app, "/v1/chat/completions", chat))
    assert r.status_code == 200, r.text
    if stream:
        assert json.loads(events(r.text)[0])["object"] == "chat.completion.chunk"
    else:
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": " w0 w1 w2"}
    load = app.engine.load
    assert (load.generated_tokens_total, load.ongoing_requests, load.engine_requests) == (8, 0, 0)


def test_models_health_and_api_key(app):
    async def scenario():
        async with app.client(key=None) as anonymous, app.client("wrong") as wrong, app.client() as c:
            assert (await anonymous.get("/health")).status_code == 200
            for client in (anonymous, wrong):
                for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/dcut/status")):
                    r = await client.request(method, path, json={"model": MODEL, "prompt": "x"})
                    assert error(r, 401)["type"] == "AuthenticationError"
            page = await anonymous.get("/dcut/")
            assert page.status_code == 401 and page.headers["www-authenticate"].startswith("Basic")
            return (await c.get("/v1/models")).json()

    assert [m["id"] for m in run(scenario())["data"]] == [MODEL]
    assert app.engine.load.generated_tokens_total == 0, "refused requests never reach the engine"


# ---- client errors and limits ----------------------------------------------------------------

def test_bad_requests_are_openai_errors(app):
    bad = [("/v1/completions", {"content": b"{not json", "headers": {"content-type": "application/json"}}, 400),
           ("/v1/completions", {"json": [1, 2]}, 400),
           ("/v1/completions", {"json": {"model": MODEL, "prompt": "x", "max_tokens": -3}}, 400),
           ("/v1/chat/completions", {"json": {"model": MODEL, "messages": "not a list"}}, 400),
           ("/v1/completions", {"json": {"model": "no-such-model", "prompt": "x"}}, 404)]
    for path, kw, status in bad:
        error(run(post(app, path, **kw)), status)
    assert app.engine.load.ongoing_requests == 0


def test_request_limits(app):
    limits = app.ingress.settings.limits
    big = b'{"model": "mock", "prompt": "' + b"x" * limits.max_body_bytes + b'"}'
    error(run(post(app, "/v1/completions", content=big, headers={"content-type": "application/json"})), 413)
    base = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for extra in ({"n": limits.max_n + 1}, {"max_tokens": limits.max_tokens + 1}, {"stop": ["a"] * 17}):
        assert error(run(post(app, "/v1/completions", {**base, **extra})), 400)["param"] == next(iter(extra))
    deep: dict = {}
    for _ in range(limits.max_depth + 1):
        deep = {"x": deep}
    error(run(post(app, "/v1/completions", {**base, "extra": deep})), 400)
    assert app.engine.load.generated_tokens_total == 0


def test_prompt_token_limit_reaches_the_engine():
    """``engine_replica.max_prompt_tokens`` is the engine's to check (it has the tokenizer): 400, both ways."""
    app = local_app(app_args(engine_replica={"max_prompt_tokens": 3}))
    try:
        for stream in (False, True):
            body = {"model": MODEL, "prompt": "a b c d", "max_tokens": 2, "stream": stream}
            assert "at most 3" in error(run(post(app, "/v1/completions", body)), 400)["message"]
        assert run(post(app, "/v1/completions", {"model": MODEL, "prompt": "a b c"})).status_code == 200
    finally:
        app.shutdown()


# ---- engine faults, replica deaths, back-pressure --------------------------------------------

def test_engine_fault_is_500_and_the_replica_keeps_serving(app):
    for stream in (False, True):
        body = {"model": MODEL, "prompt": f"a {FAULT} b", "max_tokens": 4, "stream": stream}
        assert error(run(post(app, "/v1/completions", body)), 500)["type"] == "InternalServerError"
    assert run(post(app, "/v1/completions", {"model": MODEL, "prompt": "ok"})).status_code == 200
    assert app.engine.load.failed_total == 2 and app.engine.load.ongoing_requests == 0


@pytest.mark.parametrize("stream", [False, True])
def test_replica_that_dies_before_answering_is_retried(app, stream):
    app.engine.die_before_first = 1  # max_attempts is 2
    r = run(post(app, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": stream}))
    assert r.status_code == 200 and app.engine.die_before_first == 0, r.text
    app.engine.die_before_first = 2  # every try fails
    err = error(run(post(app, "/v1/completions", {"model": MODEL, "prompt": "x", "stream": stream})), 500)
    assert "ActorDiedError" in err["message"]


def test_no_retry_beyond_max_attempts():
    app = local_app(app_args(ingress={"max_attempts": 1}))
    try:
        app.engine.die_before_first = 1
        error(run(post(app, "/v1/completions", {"model": MODEL, "prompt": "x"})), 500)
        assert run(post(app, "/v1/completions", {"model": MODEL, "prompt": "x"})).status_code == 200
    finally:
        app.shutdown()


def _answer(r, stream: bool, chat: bool) -> tuple[str, list[int], list[str | None], dict | None, set[str]]:
    """A response's text, token ids, finish reasons, usage and response ids (one per chunk of a stream)."""
    assert r.status_code == 200, r.text
    if not stream:
        out = r.json()
        (choice,) = out["choices"]
        text = choice["message"]["content"] if chat else choice["text"]
        return text, choice.get("token_ids") or [], [choice["finish_reason"]], out.get("usage"), {out["id"]}
    got = events(r.text)
    assert got[-1] == "[DONE]" and not any("error" in json.loads(e) for e in got[:-1]), got
    chunks = [json.loads(e) for e in got[:-1]]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join((c["delta"].get("content") or "") if chat else c["text"] for c in choices)
    ids = [t for c in choices for t in (c.get("token_ids") or [])]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage) <= 1 and {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
    return text, ids, [c["finish_reason"] for c in choices if c["finish_reason"]], (usage or [None])[0], \
        {c["id"] for c in chunks}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_replica_dying_mid_generation_is_continued_on_another(app, chat, stream):
    """Issue 64: the replica dies after 3 tokens; the ingress continues the request from the prompt's ids and the 3
    sent: the client gets what the uninterrupted request gives (text, token ids, one finish_reason, one id, the
    original usage), streaming or not, chat or completions."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "max_tokens": 8, "stream": stream, "return_token_ids": True,
            **({"messages": [{"role": "user", "content": "Hello world"}]} if chat else {"prompt": "Hello world"}),
            **({"stream_options": {"include_usage": True}} if stream else {})}
    whole = _answer(run(post(app, path, body)), stream, chat)
    app.engine.die_after_chunks = 3
    continued = _answer(run(post(app, path, body)), stream, chat)
    assert app.engine.die_after_chunks is None and app.engine.load.continued_total == 1
    assert whole[0] == continued[0] == "".join(f" w{i}" for i in range(8))
    assert whole[1] == continued[1] == list(range(1000, 1008))
    assert whole[2] == continued[2] == ["length"]
    assert whole[3] == continued[3] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}
    assert len(continued[4]) == 1, continued[4]  # one response id


def test_the_prompt_limit_bounds_the_clients_prompt_not_what_a_continuation_carries():
    """A continuation's prompt is the client's and the tokens already sent: ``max_prompt_tokens`` (3 here) bounds the
    first part only (found on real engines: the test app's limit of 200 refused continuations of longer answers)."""
    app = local_app(app_args(engine_replica={"max_prompt_tokens": 3}))
    try:
        app.engine.die_after_chunks = 4
        body = {"model": MODEL, "prompt": "a b c", "max_tokens": 8, "stream": True}
        text = _answer(run(post(app, "/v1/completions", body)), stream=True, chat=False)[0]
        assert text == "".join(f" w{i}" for i in range(8)) and app.engine.load.continued_total == 1
        assert "at most 3" in error(run(post(app, "/v1/completions", {**body, "prompt": "a b c d"})), 400)["message"]
    finally:
        app.shutdown()


def test_token_ids_reach_only_a_client_that_asked(app):
    app.engine.die_after_chunks = 2
    r = run(post(app, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, "stream": True}))
    text, ids, finish, usage, _ = _answer(r, stream=True, chat=False)
    assert (text, ids, finish, usage) == (" w0 w1 w2 w3", [], ["length"], None)  # no usage asked: none sent
    assert '"prompt_token_ids":[' not in r.text and '"token_ids":[' not in r.text
    out = run(post(app, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4})).json()
    assert "token_ids" not in out["choices"][0] and "prompt_token_ids" not in out["choices"][0]


def test_engine_dead_mid_stream_is_continued(app):
    app.engine.engine_dies_after_tokens = 3
    body = {"model": MODEL, "prompt": "x", "max_tokens": 6, "stream": True}
    assert _answer(run(post(app, "/v1/completions", body)), stream=True, chat=False)[0] == \
        " w0 w1 w2 w3 w4 w5"
    assert app.engine.load.continued_total == 1


@pytest.mark.parametrize("extra", [{"logprobs": 1}, {"n": 2}, {"stop": ["w5"]}, {"echo": True}])
def test_what_cannot_be_continued_faithfully_ends_with_an_error_event(app, extra):
    """Logprobs (earlier positions cannot be re-reported), several choices, stop strings, echo: today's behaviour."""
    app.engine.die_after_chunks = 2
    r = run(post(app, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8, "stream": True, **extra}))
    assert r.status_code == 200  # the client already had chunks: no retry, no silent cut
    got = events(r.text)
    assert len(got) == 4 and got[-1] == "[DONE]", got
    assert json.loads(got[-2])["error"]["code"] == 500 and "mid-stream" in json.loads(got[-2])["error"]["message"]
    assert app.engine.load.continued_total == 0


def test_no_continuation_beyond_max_attempts():
    app = local_app(app_args(ingress={"max_attempts": 1}))
    try:
        app.engine.die_after_chunks = 2
        r = run(post(app, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8, "stream": True}))
        got = events(r.text)
        assert json.loads(got[-2])["error"]["code"] == 500 and got[-1] == "[DONE]" and len(got) == 4, got
        app.engine.die_after_chunks = 2  # not streamed: a 500, nothing sent
        r = run(post(app, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8}))
        assert "ActorDiedError" in error(r, 500)["message"]
        assert app.engine.load.continued_total == 0
    finally:
        app.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_engine_dead_inside_a_live_replica_counts_as_its_death(app, stream):
    """vLLM's EngineDeadError inside a live replica (issue 64): not a 500 of the request but the replica's death, so
    the request is tried again before its first byte; the replica ends its process (here: records that it would)
    and fails its health check from then on."""
    from deployments.engine import EngineDead

    run(app.replica.check_health())
    app.engine.engine_dies_after_tokens = 0
    r = run(post(app, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": stream}))
    assert r.status_code == 200 and "error" not in r.text, r.text
    assert app.engine.engine_dies_after_tokens is None and app.engine.load.failed_total == 0
    with pytest.raises(EngineDead, match="mock engine core died"):
        run(app.replica.check_health())
    assert app.replica.exits == [1]  # once


def test_back_pressure_is_503_with_retry_after(app):
    """Serve's handle raises BackPressureError when every replica's queue is full (local testing mode has no
    queues: the mock raises it in their place); the ingress answers 503 with its Retry-After."""
    app.engine.back_pressure = 1
    r = run(post(app, "/v1/completions", {"model": MODEL, "prompt": "x"}))
    assert error(r, 503)["type"] == "ServiceUnavailableError"
    assert r.headers["Retry-After"] == str(app.ingress.settings.retry_after_s)


def test_client_that_goes_away_aborts_the_engine_request(app):
    app.engine.token_delay_s = 0.02  # 1000 tokens: 20 s, if nothing aborts them
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1000, "stream": True}
    got = run(stream_until_gone("/v1/completions", body, chunks=3))
    assert len(got) >= 3

    async def settled():
        deadline = time.monotonic() + 5
        while app.engine.load.engine_requests or not app.engine.load.aborted_total:
            assert time.monotonic() < deadline, app.engine.load
            await asyncio.sleep(0.01)

    run(settled())
    load = app.engine.load
    assert (load.aborted_total, load.engine_requests, load.ongoing_requests) == (1, 0, 0), load
    assert load.generated_tokens_total < 500, "the engine kept generating for a client that left"


# ---- the controller's view -------------------------------------------------------------------

def test_status_shows_the_replica_report(app):
    assert run(post(app, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 6})).status_code == 200

    async def status():
        async with app.client() as c:
            for _ in range(100):  # the replica reports every 50 ms
                s = (await c.get("/dcut/status")).json()
                if s["replicas"] and s["replicas"][0]["load"]["generated_tokens_total"] == 6:
                    return s, (await c.get("/dcut/history")).json()
                await asyncio.sleep(0.02)
            raise AssertionError(s)

    s, history = run(status())
    (replica,) = s["replicas"]
    assert replica["cost_source"] == "profiled" and replica["capacity_from"] == "estimates"
    assert list(s["cost_tables"]) == [replica["fingerprint"]] and replica["model"] == MODEL
    assert s["cluster"]["replicas"] == 1 and list(history["replicas"]) == [replica["replica_id"]]

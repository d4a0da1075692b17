"""The whole Serve application on a real local Ray instance with real vLLM engines and the D-Cut plugin
on (tiny Qwen3 target + DFlash head, K=7, mode joint — the app default —, a two-batch-size start-up profile).

Two applications share one Ray instance: ``dcut`` (2 engine replicas, API key, tiny queues for 503)
and ``scale`` (1..2 replicas, fast autoscaling) for the scale-up/scale-down test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path

import httpx
import pytest

from dcut.settings import engine_env
from tests.fault_engine import MARKER as FAULT
from tests.fault_engine import FaultyEngine
from tests.serve_apps import delete_apps, wait_until

pytestmark = pytest.mark.integration

PORT = int(os.environ.get("DCUT_TEST_HTTP_PORT", 8765))
BASE = f"http://127.0.0.1:{PORT}"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
# A request that must still be running when the test acts on it (a disconnect, a kill): the tiny pair decodes
# 240 tokens in under a second, and replicas report every second, so one that short could finish unseen.
LONG = 1000
REPO = Path(__file__).resolve().parents[2]


def _args(models: dict, cache_dir, **replica) -> dict:
    """D-Cut on (DFlash, K=7, auto) with a small start-up profile; ``cache_dir``: where the engine caches it."""
    dcut = {"mode": "joint", "profile_batch_sizes": [1, 4], "profile_warmups": 0, "profile_repeats": 1,
            "cache_dir": str(cache_dir)}
    return {
        "engine": {"model": str(models["target"]), "draft": str(models["dflash"]), "method": "dflash",
                   "num_speculative_tokens": 7, "max_num_seqs": 8, "max_model_len": 1024, "enforce_eager": True,
                   "served_model_name": MODEL, "dcut": dcut},
        "engine_replica": {"num_cpus": 0.3, "telemetry_interval_s": 1.0, "profile_wait_s": 300,
                           "env": {**engine_env(kv_cache_gib=1), "PYTHONPATH": str(REPO)}, **replica},
        "ingress": {"api_key": KEY, "retry_after_s": 2, "num_cpus": 0.05},
        "controller": {"num_cpus": 0.02},
    }


@pytest.fixture(scope="module")
def apps(ray_cluster, tiny_models, tmp_path_factory):
    from ray import serve

    from app.builder import compose_app

    main = _args(tiny_models, tmp_path_factory.mktemp("dcut-cache"), max_ongoing_requests=3,
                 max_queued_requests=2, max_prompt_tokens=200,
                 autoscaling={"min_replicas": 2, "max_replicas": 2, "initial_replicas": 2})
    scale = _args(tiny_models, tmp_path_factory.mktemp("scale-cache"), max_ongoing_requests=8,
                  max_queued_requests=16,
                  autoscaling={"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
                               "request_tokens_per_s": 1e5, "upscale_delay_s": 0, "downscale_delay_s": 3,
                               "look_back_period_s": 2})
    # batch 8 profiled too: the drain test's app starts from this table, and one of its replicas must be able to
    # run its 5 clients at once (capacity: requests run at the objective, dcut.telemetry.capacity)
    scale["engine"]["dcut"]["profile_batch_sizes"] = [1, 8]
    t0 = time.monotonic()
    serve.run_many([serve.RunTarget(compose_app(main, engine_cls=FaultyEngine), name="dcut", route_prefix="/"),
                    serve.RunTarget(compose_app(scale, engine_cls=FaultyEngine), name="scale", route_prefix="/scale")])
    wait_until(lambda: len(httpx.get(f"{BASE}/dcut/status", headers=AUTH, timeout=10).json()["replicas"]) == 2,
               120, "both engine replicas reporting to the controller")
    print(f"apps ready in {time.monotonic() - t0:.1f} s")
    yield
    delete_apps("scale", "dcut")


@pytest.fixture
def client(apps):
    with httpx.Client(base_url=BASE, headers=AUTH, timeout=60) as c:
        yield c


def _status(client) -> dict:
    return client.get("/dcut/status").json()


# ---- happy paths -----------------------------------------------------------------------------

def test_health_and_models(client):
    assert httpx.get(f"{BASE}/health").status_code == 200  # no key needed
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["root"] == MODEL  # the served name, not the server's path of the model (issue 64)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_httpx(client, stream):
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 8, "temperature": 0, "stream": stream}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        out = r.json()
        assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] == 8
        return
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_httpx(client, stream):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": stream}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
    else:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[0])["object"] == "chat.completion.chunk"


def test_openai_client(apps):
    import openai

    c = openai.OpenAI(base_url=f"{BASE}/v1", api_key=KEY, max_retries=0)
    out = c.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    assert out.usage.completion_tokens == 5
    # ignore_eos: the random tiny model's near-tied logits may pick EOS under another batch's numerics
    chunks = list(c.completions.create(model=MODEL, prompt="Hello", max_tokens=5, stream=True,
                                       extra_body={"ignore_eos": True}))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert chat.choices[0].message.role == "assistant"
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, stream=True)
    assert [ch.object for ch in stream][0] == "chat.completion.chunk"
    assert [m.id for m in c.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{BASE}/v1", api_key="wrong", max_retries=0).models.list()


# ---- errors ----------------------------------------------------------------------------------

def _error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"]
    return err


def test_auth_required(apps):
    """Every route of the ingress but /health answers 401 without the key; FastAPI's docs routes do not exist."""
    from deployments.ingress import api

    routes = [(method, route.path) for route in api.routes for method in route.methods if route.path != "/health"]
    assert {("GET", "/v1/models"), ("GET", "/dcut/status"), ("POST", "/v1/completions")} <= set(routes)
    for method, path in routes:
        _error(httpx.request(method, BASE + path), 401)
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(BASE + path).status_code == 404
    _error(httpx.post(f"{BASE}/v1/completions", json={"model": MODEL, "prompt": "x"},
                      headers={"Authorization": "Bearer nope"}), 401)


def test_bad_requests(client):
    _error(client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
           400)
    _error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -3}), 400)
    _error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": "hot"}), 400)
    _error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": "not a list"}), 400)
    err = _error(client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello " * 1200,
                                                      "max_tokens": 4}), 400)
    assert "context length" in err["message"]
    _error(client.post("/v1/completions", json={"model": "no-such-model", "prompt": "x"}), 404)
    # issue 64: both were a 200 (vLLM passes any role to the template, and lowers max_tokens to what the context
    # leaves); OpenAI answers both with a 400 naming the parameter
    hacker = {"model": MODEL, "messages": [{"role": "hacker", "content": "hi"}], "max_tokens": 2}
    assert _error(client.post("/v1/chat/completions", json=hacker), 400)["param"] == "messages[0].role"
    for stream in (False, True):  # 150 prompt tokens + 900 > max_model_len 1024
        over = {"model": MODEL, "prompt": [5] * 150, "max_tokens": 900, "stream": stream}
        err = _error(client.post("/v1/completions", json=over), 400)
        assert err["param"] == "max_tokens" and "maximum context length is 1024" in err["message"], err
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1020}
    assert _error(client.post("/v1/chat/completions", json=chat), 400)["param"] == "max_completion_tokens"
    assert client.post("/v1/completions", json={**over, "max_tokens": 8, "stream": False}).status_code == 200


def test_engine_fault_is_500_and_replica_survives(client):
    before = {r["replica_id"] for r in _status(client)["replicas"]}
    for stream in (False, True):
        _error(client.post("/v1/completions", json={"model": MODEL, "prompt": f"a {FAULT} b", "max_tokens": 4,
                                                    "stream": stream}), 500)
    for _ in range(4):  # both replicas still answer
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2}
                           ).status_code == 200
    after = time.monotonic()  # the replicas report again after the faults: neither was replaced
    wait_until(lambda: all(r["age_s"] < time.monotonic() - after for r in _status(client)["replicas"]), 10,
               "fresh report from every replica")
    assert {r["replica_id"] for r in _status(client)["replicas"]} == before


def test_503_with_retry_after_when_full(apps):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 120, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(base_url=BASE, headers=AUTH, timeout=120) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(14)])

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 503 in codes, codes
    full = next(r for r in responses if r.status_code == 503)
    assert full.headers["Retry-After"] == "2"
    assert full.json()["error"]["code"] == 503


def _aborted(client) -> int:
    return sum(r["load"]["aborted_total"] for r in _status(client)["replicas"])


def _wait_aborted(client, before: int) -> None:
    """Until a replica counts one more aborted engine request and none runs any (its KV cache is free)."""
    replicas: list[dict] = []

    def aborted() -> bool:
        replicas[:] = _status(client)["replicas"]
        return sum(x["load"]["aborted_total"] for x in replicas) > before and \
            all(x["load"]["engine_requests"] == 0 for x in replicas)

    wait_until(aborted, 20, lambda: f"aborted engine request: {replicas}")


def test_client_disconnect_aborts_engine_request(client):
    aborted = _aborted(client)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    _wait_aborted(client, aborted)


def test_client_disconnect_aborts_non_streaming_request(client):
    """The client gives up on a non-streaming request while the engine generates it: the engine aborts it."""
    aborted = _aborted(client)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": LONG, "ignore_eos": True}

    async def give_up():
        async with httpx.AsyncClient(base_url=BASE, headers=AUTH, timeout=120) as c:
            request = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.to_thread(wait_until, lambda: request.done() or any(
                r["load"]["engine_requests"] for r in _status(client)["replicas"]), 20, "request inside an engine", 0.2)
            assert not request.done(), "the request ended before the client gave up"
            request.cancel()  # closes the connection
            with contextlib.suppress(asyncio.CancelledError):
                await request

    asyncio.run(give_up())
    _wait_aborted(client, aborted)


# ---- D-Cut controller ------------------------------------------------------------------------

def test_second_replica_uses_controller_table(client):
    """One replica profiles; the other waits for its table and starts from it without profiling."""
    status = _status(client)
    sources = sorted((r["cost_source"], r["cost_path"] or "") for r in status["replicas"])
    (fingerprint,) = {r["fingerprint"] for r in status["replicas"]}
    assert [s for s, _ in sources] == ["given", "profiled"], sources
    assert fingerprint in sources[0][1], "the given table is the controller's, saved under its fingerprint"
    assert list(status["cost_tables"]) == [fingerprint]
    assert len(status["cost_tables"][fingerprint]["from_replicas"]) == 2
    table = status["cost_tables"][fingerprint]["table"]
    assert table["points"] and set(table["draft"]["1"]) >= {"0", "7"}, "both parts: verify rows and drafter widths"
    assert status["profiling"] == {}


def test_capacity_and_demand_from_dcut_estimates(client):
    from dcut import telemetry

    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 24, "ignore_eos": True}
    for _ in range(4):  # both replicas step with D-Cut on
        assert client.post("/v1/completions", json=body).status_code == 200
    wait_until(lambda: all(r["steps"] and r["capacity_from"] == "estimates" and r["demand_tokens_per_s"] == 0.0
                           for r in _status(client)["replicas"]), 15, "telemetry of the steps from every replica")
    status = _status(client)
    rate = status["cluster"]["request_tokens_per_s"]
    for r in status["replicas"]:
        assert {"batch_size", "keep_ratio", "acceptance", "estimates", "capacity_tokens_per_s",
                "demand_tokens_per_s", "cost_source"} <= set(r)
        # No keep ratio where the window drafted nothing: joint at width 0, right for a pair whose drafts are never
        # accepted (this tiny one's, once a fresh engine has verified its first 64 requests' blocks in full).
        assert r["steps"] > 0 and (r["keep_ratio"] is None or 0.0 <= r["keep_ratio"] <= 1.0)
        assert r["capacity_from"] == "estimates"
        assert sorted(e["batch_size"] for e in r["estimates"]) == [1, 4]
        estimates = [telemetry.ThroughputEstimate(**e) for e in r["estimates"]]
        expected = telemetry.capacity(estimates, rate, max_batch_size=8)  # the app's max_num_seqs
        assert expected > 0
        assert r["capacity_tokens_per_s"] == pytest.approx(expected)
        assert r["demand_tokens_per_s"] == 0.0  # idle now
    assert {"capacity_tokens_per_s", "demand_tokens_per_s", "suggested_replicas"} <= set(status["cluster"])


def test_metrics_carry_replica_label(client):
    """vLLM's and D-Cut's metrics reach Ray's metrics port, one series per replica."""
    import ray

    port = ray.nodes()[0]["MetricsExportPort"]
    replicas = {r["replica_id"] for r in _status(client)["replicas"]}
    seen: dict = {}

    def exported() -> bool:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        seen["dcut"] = {line for line in text.splitlines() if line.startswith("ray_dcut_capacity_tokens_per_s{")}
        seen["vllm"] = [line for line in text.splitlines() if line.startswith("ray_vllm_num_requests_running{")]
        seen["steps"] = "ray_dcut_estimated_tokens_per_s{" in text and "ray_dcut_keep_ratio{" in text  # after a step
        return all(any(f'replica="{r}"' in line for line in seen["dcut"]) for r in replicas) and seen["vllm"] \
            and seen["steps"]

    wait_until(exported, 40, lambda: f"metrics: {sorted(seen['dcut'])} {seen['vllm']} estimates+keep {seen['steps']}",
               every_s=2)
    assert any('ReplicaId="' in line for line in seen["vllm"])


# ---- autoscaling -----------------------------------------------------------------------------

def _scale_replicas() -> int:
    from ray import serve

    return serve.status().applications["scale"].deployments["EngineReplica"].replica_states.get("RUNNING", 0)


def _scale_decision() -> dict | None:
    """The scale app's autoscaling policy's latest evaluation, as its controller publishes it."""
    return httpx.get(f"{BASE}/scale/dcut/status", headers=AUTH, timeout=10).json()["autoscaling"]["latest"]


def test_scales_up_under_load_and_back_down(apps):
    """An objective of 1e5 tokens/s per request no batch size meets: one request in flight makes the policy ask
    for a second replica at once; Serve starts it; none lets it go again. The decision and the start are waited
    for apart: the decision takes a second, but a vLLM engine starting on a 2-core box that is serving meanwhile
    took 53 s alone and over 120 s in one CI run."""
    assert _scale_replicas() == 1
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 64, "ignore_eos": True}
    seen: dict = {}

    async def load(stop: asyncio.Event):
        async with httpx.AsyncClient(base_url=f"{BASE}/scale", headers=AUTH, timeout=120) as c:
            async def worker():
                while not stop.is_set():
                    await c.post("/v1/completions", json=body)
            await asyncio.gather(*[worker() for _ in range(2)])

    def decided() -> bool:
        seen["latest"] = _scale_decision()
        return bool(seen["latest"]) and seen["latest"]["bounded"] >= 2 and seen["latest"]["rule"] == "up"

    async def scenario() -> tuple[float, float]:
        stop = asyncio.Event()
        task = asyncio.create_task(load(stop))
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(wait_until, decided, 60, lambda: f"decision to scale up: {seen}", 0.5)
            asked = time.monotonic() - t0
            await asyncio.to_thread(wait_until, lambda: _scale_replicas() >= 2, 300, "second replica running", 1)
        finally:
            stop.set()
            await task
        return asked, time.monotonic() - t0

    asked_s, up_s = asyncio.run(scenario())
    t0 = time.monotonic()
    wait_until(lambda: _scale_replicas() <= 1, 90, "scale-down", every_s=1)
    print(f"asked for a second replica in {asked_s:.1f} s, running in {up_s:.1f} s, down in "
          f"{time.monotonic() - t0:.1f} s")


# ---- status page -----------------------------------------------------------------------------

def test_status_page_in_chromium(client):
    """GET /dcut/ in headless Chromium, logged in with the key as a browser user is: no console error, every
    chart drawn from the running app's data, both replicas named, the autoscaler's latest decision shown."""
    from tests.browser import CHARTS, chromium, open_page, wait_for_charts

    challenge = httpx.get(f"{BASE}/dcut/").headers["www-authenticate"]
    assert challenge.startswith("Basic"), "a browser must be asked for the key"
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 24, "ignore_eos": True}

    def verified() -> bool:  # until a replica has verified drafts (joint may start at width 0)
        if any(a is not None for r in _status(client)["replicas"] for a in r["acceptance"]["per_position"] or []):
            return True
        assert client.post("/v1/completions", json=body).status_code == 200
        return False

    wait_until(verified, 60, "drafts verified", every_s=0)
    h: dict = {}

    def two_points() -> bool:
        h.update(client.get("/dcut/history").json())
        return min(map(len, h["replicas"].values()), default=0) >= 2

    wait_until(two_points, 20, lambda: f"two history points per replica: {h}")
    status = _status(client)
    replicas = {r["replica_id"] for r in status["replicas"]}
    assert set(h["replicas"]) == replicas and h["cluster"][-1]["replicas"] == 2
    errors: list[str] = []
    with chromium() as browser:
        page = open_page(browser, f"{BASE}/dcut/", KEY, errors)
        wait_for_charts(page, timeout_s=30)
        drawn = dict(page.eval_on_selector_all(CHARTS, "fs => fs.map(f => [f.id || f.dataset.title, "
                                                        "f.querySelectorAll('path.series').length])"))
        tables = page.eval_on_selector_all("figure.cost-table", "fs => fs.map(f => f.dataset.fingerprint)")
        shown = set(page.eval_on_selector_all("#replicas .replica-id", "cells => cells.map(c => c.title)"))
        started = dict(page.eval_on_selector_all("#startup tr[data-replica]", "rows => rows.map(r => "
                                                 "[r.dataset.replica, r.querySelectorAll('rect[data-phase]').length])"))
        latest = page.inner_text("#scaling-latest")
        header = page.inner_text("#replicas tr")
    assert not errors, errors
    assert "continued" in header, header  # requests each replica took over from one that died (issue 64)
    charts = ["batch_size", "queued", "keep_ratio", "drafted_width", "tokens_per_s", "acceptance", "capacity",
              "replicas", "request-acceptance"]  # drafts were verified above: some response has an acceptance rate
    assert all(drawn.pop(f"chart-{name}") >= 1 for name in charts), drawn
    assert tables == 2 * list(status["cost_tables"]) and all(n >= 2 for n in drawn.values()), drawn  # bs 1, 4
    assert shown == replicas
    assert set(started) == replicas and all(n >= 5 for n in started.values()), started  # a bar per start-up phase
    assert status["autoscaling"]["latest"] and latest.startswith("autoscaler now: utilisation"), latest


# ---- limits, replica and controller faults, drain (issue 12); these kill processes: keep them last --------

def test_request_limits_are_openai_errors(client):
    """Every limit answers with its OpenAI-style 4xx naming the parameter; a request within them is served."""
    big = b'{"model": "tiny", "prompt": "' + b"x" * (1 << 20) + b'"}'
    _error(client.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)

    def chunked():  # no Content-Length: refused while the body is read
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    _error(client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"}), 413)
    base = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for extra in ({"n": 17}, {"best_of": 1000}, {"max_tokens": 10**8}, {"stop": ["a"] * 17},
                  {"stop_token_ids": list(range(17))}):
        assert _error(client.post("/v1/completions", json={**base, **extra}), 400)["param"] == next(iter(extra))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}
    assert _error(client.post("/v1/chat/completions", json=chat), 400)["param"] == "max_completion_tokens"
    for stream in (False, True):  # prompt tokens: counted by the replica (max_prompt_tokens=200 < max_model_len)
        err = _error(client.post("/v1/completions", json={**base, "prompt": [5] * 201, "stream": stream}), 400)
        assert "at most 200" in err["message"]
    assert client.post("/v1/completions", json={**base, "prompt": [5] * 200, "n": 2}).status_code == 200


def test_fuzzed_bodies_never_5xx(client):
    """``loadtest.fuzz``'s hand-written hostile bodies on both routes and a sample of 40 hypothesis-drawn ones
    (valid-ish and hostile, both routes, raw bytes): no 5xx, every error an OpenAI-style body, every 200 a
    completion or a stream ending in [DONE]; then a plain request is still answered. At most 4 tokens per choice,
    so the sample stays short."""
    from loadtest.fuzz import RAW_FIXED, fuzz

    t0 = time.monotonic()
    report = fuzz(client, MODEL, n_cases=40, seed=12, cap=4)
    print(f"fuzz sample: {report.cases} cases in {time.monotonic() - t0:.1f} s, statuses {report.statuses}, "
          f"outcomes {report.outcomes}")
    assert report.server_errors == 0 and not report.problems, json.dumps(report.problems, indent=1)
    assert report.cases >= 2 * len(RAW_FIXED) + 30 and report.after == 200 and not report.client_errors


def test_api_key_never_logged(client):
    """The key travels in every request here; no log of the Ray session (Serve, replicas, proxy) holds it."""
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "logs"
    assert client.get("/v1/models").status_code == 200
    leaked = [f.name for f in logs.rglob("*") if f.is_file() and KEY.encode() in f.read_bytes()]
    assert not leaked, leaked


def _metric(name: str) -> float:
    """Sum of a ``ray_dcut_*`` series over its labels on Ray's metrics port."""
    import ray

    port = ray.nodes()[0]["MetricsExportPort"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_controller_killed_serving_continues_and_restarted_controller_relearns(client):
    from loadtest.faults import replica_pid

    before = _status(client)
    ids, tables = {r["replica_id"] for r in before["replicas"]}, set(before["cost_tables"])
    os.kill(replica_pid("::dcut#DCutController#"), 9)  # this app's: the "scale" app has a controller too
    t0 = time.monotonic()
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    for _ in range(4):  # while Serve notices and restarts it
        assert client.post("/v1/completions", json=body).status_code == 200
    last: list[str] = []

    def relearned() -> bool:
        r = client.get("/dcut/status", timeout=30)
        last[:] = [r.text[:300]]
        return r.status_code == 200 and {x["replica_id"] for x in r.json()["replicas"]} == ids \
            and set(r.json()["cost_tables"]) == tables

    wait_until(relearned, 90, lambda: f"relearning by the restarted controller: {last}")
    print(f"controller back with both replicas and their tables {time.monotonic() - t0:.1f} s after SIGKILL")


def test_scale_down_under_load_drains(apps, tiny_models, tmp_path):
    """A third app starts at 2 replicas with an objective so low that the policy wants 1 (one replica runs the 5
    clients at once at batch 8, the largest in its table): the downscale comes
    while clients keep sending (streams and plain), the stopped replica finishes what it runs: 0 failures.
    Then `serve.delete` (what `serve shutdown` does) while 3 requests of LONG tokens run in the engine (none has
    finished when the delete is issued): they finish after it, each 200 with all its tokens."""
    from ray import serve

    from app.builder import compose_app
    from loadtest.faults import Load

    def scale_tables() -> list[dict]:
        return [t["table"] for t in httpx.get(f"{BASE}/scale/dcut/status", headers=AUTH,
                                              timeout=60).json()["cost_tables"].values()]

    wait_until(scale_tables, 30, "cost table in the scale app's controller")
    (table,) = scale_tables()
    (tmp_path / "table.json").write_text(json.dumps(table))  # both replicas start at once, nobody profiles
    args = _args(tiny_models, tmp_path, max_ongoing_requests=8, max_queued_requests=16,
                 autoscaling={"min_replicas": 1, "max_replicas": 2, "initial_replicas": 2,
                              "request_tokens_per_s": 1e-3, "downscale_delay_s": 5, "look_back_period_s": 2})
    args["engine"]["dcut"]["cost_table"] = str(tmp_path / "table.json")
    serve.run(compose_app(args, engine_cls=FaultyEngine), name="drain", route_prefix="/drain")

    def states() -> dict:
        return serve.status().applications["drain"].deployments["EngineReplica"].replica_states

    assert states().get("RUNNING") == 2, states()
    plain = {"model": MODEL, "prompt": "Hello", "max_tokens": 32, "ignore_eos": True}

    def drain_status() -> dict:
        return httpx.get(f"{BASE}/drain/dcut/status", headers=AUTH, timeout=60).json()

    async def scenario():
        busy: list[int] | None = None
        recent: list[tuple[float, dict]] = []
        now: dict = {}

        def scaled_down() -> bool:
            nonlocal busy, recent, now
            now = states()
            if now.get("RUNNING") == 1 and not now.get("STOPPING"):
                return True
            if busy is None and now.get("STOPPING") and recent:
                # what each replica ran over the last 3 s before the drain was seen (reports lag by up
                # to a second; Serve's routers may learn of the stop before serve.status shows it)
                most: dict[str, int] = {}
                for _, status in recent:
                    for r in status["replicas"]:
                        rid = r["replica_id"]
                        most[rid] = max(most.get(rid, 0), r["load"]["ongoing_requests"])
                busy = list(most.values())
            recent = [(t, st) for t, st in recent if time.monotonic() - t < 3.0]
            recent.append((time.monotonic(), drain_status()))
            return False

        async with httpx.AsyncClient(base_url=f"{BASE}/drain", headers=AUTH, timeout=120) as c:
            async with Load(c, plain, 3) as load, Load(c, {**plain, "stream": True}, 2) as streams:
                t0 = time.monotonic()
                await asyncio.to_thread(wait_until, scaled_down, 60, lambda: f"scale-down to one replica: {now}", 0.1)
                await asyncio.sleep(1)  # the load goes on against the one replica left
            return load, streams, busy, time.monotonic() - t0

    load, streams, busy, took = asyncio.run(scenario())
    print(f"scale-down under load in {took:.1f} s: plain {dict(load.outcomes)}, streams {dict(streams.outcomes)}, "
          f"in flight per replica as the drain began {busy}")
    assert not load.failed and not streams.failed, (load.outcomes, streams.outcomes)
    assert busy and len(busy) == 2 and all(n > 0 for n in busy), busy

    def in_engine() -> int:
        return sum(r["load"]["engine_requests"] for r in drain_status()["replicas"])

    async def shutdown():
        async with httpx.AsyncClient(base_url=f"{BASE}/drain", headers=AUTH, timeout=120) as c:
            async def timed() -> tuple[httpx.Response, float]:
                r = await c.post("/v1/completions", json={**plain, "max_tokens": LONG})
                return r, time.monotonic()

            requests = [asyncio.create_task(timed()) for _ in range(3)]
            running = 0

            def three_in_engine() -> bool:  # the replica's report (LONG tokens each: seconds of decoding left)
                nonlocal running
                running = in_engine()
                return running == 3 or any(r.done() for r in requests)

            await asyncio.to_thread(wait_until, three_in_engine, 30, "three requests inside the engine", 0.2)
            unfinished = sum(not r.done() for r in requests)
            serve.delete("drain", _blocking=False)
            deleted = time.monotonic()
            return unfinished, running, deleted, await asyncio.gather(*requests)

    unfinished, running, deleted, done = asyncio.run(shutdown())
    assert unfinished == 3, f"only {unfinished} of 3 requests still running when the app was deleted"
    assert running == 3, f"the replica reported {running} of them inside its engine before the delete"
    for r, finished in done:
        assert r.status_code == 200, r.text
        assert finished > deleted
        out = r.json()
        assert out["usage"]["completion_tokens"] == LONG and out["choices"][0]["finish_reason"] == "length", out
    print(f"serve.delete with 3 requests of {LONG} tokens in flight: all 200 and complete, finished "
          f"{min(t for _, t in done) - deleted:.1f}-{max(t for _, t in done) - deleted:.1f} s after the delete")
    wait_until(lambda: "drain" not in serve.status().applications, 90, "deletion of the drain app")


def _outcome(r: httpx.Response | str, chat: bool) -> dict:
    """Text, token ids, finish reasons, usage and response ids of a response (a stream's SSE text, or a response)."""
    if isinstance(r, httpx.Response):
        assert r.status_code == 200, r.text
        out = r.json()
        (choice,) = out["choices"]
        usage = {k: v for k, v in out["usage"].items() if k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return {"text": choice["message"]["content"] if chat else choice["text"], "ids": choice["token_ids"],
                "finish": [choice["finish_reason"]], "usage": [usage], "response_ids": [out["id"]]}
    events = [line[len("data: "):] for line in r.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], [c for c in chunks if "error" in c]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    usage = [{k: v for k, v in c["usage"].items() if k in ("prompt_tokens", "completion_tokens", "total_tokens")}
             for c in chunks if c.get("usage")]
    return {"text": "".join((c["delta"].get("content") or "") if chat else c["text"] for c in choices),
            "ids": [t for c in choices for t in c.get("token_ids") or []],
            "finish": [c["finish_reason"] for c in choices if c["finish_reason"]], "usage": usage,
            "response_ids": sorted({c["id"] for c in chunks})}


def _continued(client) -> dict[str, int]:
    """Each live replica's count of requests it took over from one that died."""
    return {r["replica_id"]: r["load"]["continued_total"] for r in _status(client)["replicas"]}


def _two_replicas(client, without: str | None = None) -> None:
    def ready() -> bool:
        ids = {r["replica_id"] for r in _status(client)["replicas"]}
        return len(ids) == 2 and without not in ids

    wait_until(ready, 240, "two engine replicas reporting (the killed one replaced)", every_s=1)


def _kill_serving_replica(client) -> str:
    """SIGKILL the one replica that reports a request inside its engine (only the test's is in flight)."""
    from loadtest.faults import replica_pid

    busy: list[dict] = []

    def one_busy() -> bool:
        busy[:] = [r for r in _status(client)["replicas"] if r["load"]["engine_requests"] > 0]
        return len(busy) == 1

    wait_until(one_busy, 10, lambda: f"one replica serving the request: {busy}", every_s=0.1)
    os.kill(replica_pid(f"#{busy[0]['replica_id']}"), 9)
    return busy[0]["replica_id"]


@pytest.mark.parametrize("case", ["chat-stream", "completion-stream", "chat-not-streamed"])
def test_request_continued_after_its_replica_is_killed_equals_the_unkilled_run(client, case):
    """Issue 64: a greedy request of ~1,000 tokens whose replica is SIGKILLed mid-generation is continued on the
    other replica from the tokens already sent: its text and token ids equal those of the same request run without a
    kill, with one finish_reason, one response id and the original request's usage; the survivor counts the
    continuation. Each case waits for the killed replica's replacement, so every kill leaves a replica to go on."""
    chat, stream = case.startswith("chat"), case.endswith("-stream")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "max_tokens": 960, "temperature": 0, "ignore_eos": True, "stream": stream,
            "return_token_ids": True,
            **({"messages": [{"role": "user", "content": "def add(a, b):"}]} if chat else {"prompt": "def add(a, b):"}),
            **({"stream_options": {"include_usage": True}} if stream else {})}
    _two_replicas(client)
    whole = _outcome(client.post(path, json=body) if not stream else client.post(path, json=body).text, chat)
    # a report still showing the run above would name the wrong replica to kill
    wait_until(lambda: not any(r["load"]["engine_requests"] for r in _status(client)["replicas"]), 20,
               "every replica reporting itself idle")
    continued = _continued(client)

    async def killed() -> tuple[httpx.Response | str, str]:
        async with httpx.AsyncClient(base_url=BASE, headers=AUTH, timeout=240) as c:
            if not stream:
                request = asyncio.create_task(c.post(path, json=body))
                victim = await asyncio.to_thread(_kill_serving_replica, client)
                return await request, victim
            victim, lines = None, []
            async with c.stream("POST", path, json=body) as r:
                async for line in r.aiter_lines():
                    lines.append(line)
                    if victim is None and len(lines) >= 40:  # ~20 chunks out: mid-stream
                        victim = await asyncio.to_thread(_kill_serving_replica, client)
            return "\n".join(lines), victim

    t0 = time.monotonic()
    answer, victim = asyncio.run(killed())
    took = time.monotonic() - t0
    got = _outcome(answer, chat)
    print(f"{case}: replica {victim[:8]} killed mid-generation; {len(got['ids'])} tokens in {took:.1f} s")
    assert got["text"] == whole["text"] and got["ids"] == whole["ids"], (got["text"][:200], whole["text"][:200])
    assert len(got["ids"]) == 960 and got["finish"] == whole["finish"] == ["length"]
    assert got["usage"] == whole["usage"] and len(got["response_ids"]) == 1

    def counted() -> bool:  # by the replica it moved to (the victim's own count left with it)
        return sum(n - continued.get(rid, 0) for rid, n in _continued(client).items() if rid != victim) >= 1

    wait_until(counted, 20, "the continuation counted by the replica it moved to")
    _two_replicas(client, without=victim)


def test_replica_sigkill_under_load(client):
    """SIGKILL of the replica serving a stream, under concurrent non-streaming load: no request fails (those
    that had no byte yet are retried on the other replica, those with tokens out continued there), the stream is
    continued on the other replica to its [DONE] (issue 64; it ended with an error event before),
    the dead replica leaves /dcut/status within 3 report intervals, its vLLM engine core process dies with it.
    Two clients: what the surviving replica holds
    (max_ongoing_requests=3), and what the ingress may queue (max_queued_requests=2: both clients can wait for a
    replica at once while the router learns of the death), so none is refused by back-pressure."""
    from loadtest.faults import kill_drill

    continuations = _metric("ray_dcut_continuations_total")

    async def drill():
        async with httpx.AsyncClient(base_url=BASE, headers=AUTH, timeout=120) as c:
            # warmup 0.2 s: the probe (LONG tokens) must still be streaming when the kill comes
            return await kill_drill(c, MODEL, users=2, max_tokens=16, probe_tokens=LONG, warmup_s=0.2, load_s=8,
                                    timeout_s=60, until_replaced=False)

    report = asyncio.run(drill())
    print(f"replica SIGKILL: {report}, retries {_metric('ray_dcut_ingress_retries_total')}")
    assert report.failed == 0, report.outcomes
    assert report.probe_stream == "done"
    assert report.children >= 1 and report.orphans == 0, "the engine core outlived its replica (dcut.vllm.lifeline)"
    assert report.dropped_from_status_s is not None and report.dropped_from_status_s <= 3 * 1.0 + 1.5
    # Ray exports metrics every few seconds
    wait_until(lambda: _metric("ray_dcut_continuations_total") > continuations, 40, "continuation counted",
               every_s=1)


def test_speculation_per_request_field_usage_and_metrics(client):
    """The ``speculation`` field (``dcut.speculation``): off for one request among speculating ones sharing steps,
    capped at 1 for another, all three write the same greedy text; the one off reports zero drafts in its
    ``usage.speculation``, the capped one at most one per step; a stream's usage chunk carries it too; a bad value
    is a 400 naming the field and the replica keeps serving; per-request acceptance reaches Prometheus by route."""
    from concurrent.futures import ThreadPoolExecutor

    def complete(spec: object, **extra: object) -> httpx.Response:
        body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 48, "temperature": 0, **extra}
        if spec is not None:
            body["speculation"] = spec
        for _ in range(5):  # this app's queues are tiny (for the 503 test): a 503 says retry, as a client would
            response = client.post("/v1/completions", json=body)
            if response.status_code != 503:
                break
            time.sleep(float(response.headers["Retry-After"]))
        return response

    with ThreadPoolExecutor(3) as pool:
        on, off, capped = [r.json() for r in pool.map(complete, [True, False, {"max_width": 1}])]
    texts = {out["choices"][0]["text"] for out in (on, off, capped)}
    assert len(texts) == 1, texts
    spec = {name: out["usage"]["speculation"] for name, out in (("on", on), ("off", off), ("capped", capped))}
    assert all(s["steps"] > 0 for s in spec.values()), spec
    assert spec["off"]["drafted_tokens"] == spec["off"]["verified_tokens"] == spec["off"]["accepted_tokens"] == 0
    assert spec["capped"]["verified_tokens"] <= spec["capped"]["steps"], spec
    assert spec["capped"]["drafted_tokens"] <= spec["capped"]["steps"], spec

    bad = complete({"max_width": 99})
    assert bad.status_code == 400 and "speculation" in bad.json()["error"]["message"], bad.text
    assert complete("sometimes").status_code == 400
    stream = complete(None, stream=True, stream_options={"include_usage": True})
    assert stream.status_code == 200
    usage = [json.loads(line[6:])["usage"] for line in stream.text.splitlines()
             if line.startswith("data: {") and json.loads(line[6:]).get("usage")]
    assert usage and usage[-1]["speculation"]["steps"] > 0, usage

    verified = sum(1 for s in (*spec.values(), usage[-1]["speculation"]) if s["verified_tokens"])
    wait_until(lambda: _metric("ray_dcut_speculation_requests_total") >= 4
               and _metric("ray_dcut_request_acceptance_rate_count") >= verified, 40,
               "per-request speculation figures on Ray's metrics port", every_s=2)

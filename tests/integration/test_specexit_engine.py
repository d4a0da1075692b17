"""SpecExit on the embedded reasoning pair, in a real vLLM engine and served through the app (issue 13).

Greedy, on held-out problems: with SpecExit off a request's output is the target's own, token for token; with it
on, every output is the target's own up to the exit, the exit comes at a paragraph end inside the thinking,
``</think>`` follows, and an answer is produced. Served: the usage reports the thinking tokens and the exit, bad
settings are a 400 naming the setting, the replica's counters reach ``/dcut/status`` and Prometheus.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import httpx
import pytest

from dcut.settings import EMBEDDED_MODELS, DCutSettings, EngineSettings
from dcut.specexit import SpecExitSettings
from tests.serve_apps import wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TARGET, DRAFT = (str(REPO / p) for p in EMBEDDED_MODELS["reasoning"])
PROBLEMS = REPO / "models" / "reasoning_heldout.jsonl"
MAX_TOKENS = 460  # the target thinks ~330 tokens
PORT = int(os.environ.get("DCUT_TEST_HTTP_PORT", 8765))
BASE = f"http://127.0.0.1:{PORT}"


def _problems(n: int) -> list[dict]:
    from dcut.bench.specexit import load_problems

    return load_problems(PROBLEMS)[:n]


def _engine(method: str, cache_dir: Path) -> EngineSettings:
    dcut = DCutSettings(mode="joint", cache_dir=str(cache_dir), profile_batch_sizes=[1, 8], profile_warmups=0,
                        profile_repeats=1)
    return EngineSettings(model=TARGET, draft=None if method == "none" else DRAFT, method=method,
                          max_num_seqs=8, max_model_len=512, enforce_eager=True,
                          dcut=None if method == "none" else dcut,
                          specexit=None if method == "none" else SpecExitSettings())


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict:
    """Token ids of 8 held-out problems: the target alone; SpecExit off and on (one engine); the usage."""
    from vllm import LLM, SamplingParams

    from dcut.vllm.api import read_specexit_usage
    from dcut.vllm.engine import engine_kwargs

    cache = tmp_path_factory.mktemp("specexit-cache")
    prompts = [p["prompt"] for p in _problems(8)]
    out: dict = {}
    for method in ("none", "dflash"):
        llm = LLM(**engine_kwargs(_engine(method, cache)))
        if method == "none":
            res = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
            out["target"] = [list(r.outputs[0].token_ids) for r in res]
        else:
            for arm, flag in (("off", "false"), ("on", "true")):
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, extra_args={"specexit": flag})
                res = llm.generate(prompts, params, use_tqdm=False)
                out[arm] = [list(r.outputs[0].token_ids) for r in res]
                out[f"{arm}_ids"] = [r.request_id for r in res]
            out["usage"] = read_specexit_usage(llm)
            tok = llm.get_tokenizer()
            out["decode"], out["think_end"] = tok.decode, tok.convert_tokens_to_ids("</think>")
        del llm
        gc.collect()
    return out


def test_off_is_the_target_token_for_token(outputs):
    assert outputs["off"] == outputs["target"]


def test_on_exits_at_a_paragraph_end_then_answers_and_is_the_target_before_the_exit(outputs):
    from dcut.bench.specexit import answer_of

    end, decode = outputs["think_end"], outputs["decode"]
    exits = 0
    for target, ids, rid in zip(outputs["target"], outputs["on"], outputs["on_ids"], strict=True):
        usage = next(u for r, u in outputs["usage"].items() if r.startswith(f"{rid}-"))
        if not usage["exited"]:
            assert ids == target
            continue
        exits += 1
        cut = ids.index(end)  # the forced </think>
        assert ids[:cut] == target[:cut], "before the exit, the target's own tokens"
        assert end in target[cut:] and target[cut] != end, "the target was still thinking there"
        assert decode(ids[:cut]).endswith("\n\n"), "the exit comes at a paragraph end"
        assert usage["exit_at"] == usage["reasoning_tokens"] - 1 and usage["predicted_saved"] >= 0
        assert answer_of(decode(ids)) is not None, decode(ids)
    assert exits >= 4, f"SpecExit ended only {exits} of 8 thinking sections"
    assert sum(map(len, outputs["on"])) < sum(map(len, outputs["target"]))


@pytest.fixture(scope="module")
def reasoning_app(ray_cluster, tmp_path_factory):
    from ray import serve

    from app.builder import build_app
    from dcut.settings import engine_env

    engine = _engine("dflash", tmp_path_factory.mktemp("served-cache")).model_dump(mode="json")
    args = {"engine": {**engine, "served_model_name": "reasoning"},
            "engine_replica": {"num_cpus": 0.2, "telemetry_interval_s": 1.0, "env": engine_env(kv_cache_gib=1),
                               "autoscaling": {"min_replicas": 1, "max_replicas": 1}},
            "ingress": {"num_cpus": 0.02}, "controller": {"num_cpus": 0.02}}
    serve.run(build_app(args), name="reasoning", route_prefix="/reasoning")
    yield f"{BASE}/reasoning"
    serve.delete("reasoning")


def test_served_usage_reports_thinking_and_the_exit(reasoning_app):
    problem = _problems(1)[0]
    body = {"model": "reasoning", "prompt": problem["prompt"], "max_tokens": MAX_TOKENS, "temperature": 0}
    on = httpx.post(f"{reasoning_app}/v1/completions", json=body, timeout=120)
    assert on.status_code == 200, on.text
    usage = on.json()["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] > 0 and usage["specexit"]["exits"] == 1
    off = httpx.post(f"{reasoning_app}/v1/completions", json={**body, "specexit": False}, timeout=120).json()
    assert "specexit" not in off["usage"]  # this request did not use it
    assert off["usage"]["completion_tokens"] > usage["completion_tokens"]
    assert "</think>" in on.json()["choices"][0]["text"]
    stream = httpx.post(f"{reasoning_app}/v1/completions", timeout=120, json={
        **body, "stream": True, "stream_options": {"include_usage": True}}).text
    # parsed, not matched as text: the ingress writes the chunks it relays compactly (deployments.continuation)
    streamed = [json.loads(line[len("data: "):]) for line in stream.splitlines() if line.startswith("data: {")]
    assert [c["usage"]["specexit"]["exits"] for c in streamed if c.get("usage")] == [1]
    assert stream.rstrip().endswith("data: [DONE]")
    bad = httpx.post(f"{reasoning_app}/v1/completions", json={**body, "specexit": {"alpha": 5}}, timeout=30)
    assert bad.status_code == 400 and "alpha" in bad.json()["error"]["message"]


def test_served_counters_reach_the_status_and_prometheus(reasoning_app):
    import ray

    httpx.post(f"{reasoning_app}/v1/completions", timeout=120, json={
        "model": "reasoning", "prompt": _problems(2)[1]["prompt"], "max_tokens": MAX_TOKENS, "temperature": 0})
    port = ray.nodes()[0]["MetricsExportPort"]
    specexit: list[dict] = []

    def counted() -> bool:
        status = httpx.get(f"{reasoning_app}/dcut/status", timeout=10).json()
        specexit[:] = [r["specexit"] for r in status["replicas"] if r.get("specexit")]
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        return bool(specexit) and specexit[0]["exits"] >= 1 and "ray_dcut_specexit_exits_total{" in text

    wait_until(counted, 40, lambda: f"SpecExit counters in the status and on Prometheus: {specexit}", every_s=2)
    assert specexit[0]["reasoning_tokens"] > 0 and specexit[0]["settings"]["confidence_min"] == 0.8

"""The fuzzer's own pieces (``loadtest.fuzz``): every drawn body is bounded in engine work, valid bodies carry the
model and the required field, and answers are judged as the property says."""

from __future__ import annotations

import json

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.fuzz import (
    RAW_FIXED,
    REFUSED_MAX_TOKENS,
    bound_work,
    cases,
    chat_bodies,
    classify,
    completion_bodies,
    fuzz,
    openai_error,
    token_work,
)

CAP = 8
PLAIN = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}  # what fuzz() sends last


@settings(max_examples=300, deadline=None)
@given(cases("tiny", CAP))
def test_every_case_is_bounded_json_or_raw(case):
    assert case.path in ("/v1/completions", "/v1/chat/completions")
    assert len(case.content) < 1 << 20  # under the body limit: the parser, not the 413, meets the deep nesting
    if case.label in ("completion", "chat"):
        body = json.loads(case.content)
        assert isinstance(body, dict) and token_work(body, CAP, chat=case.label == "chat"), body


def test_fixed_cases_are_bodies_the_limits_let_through_to_the_parser():
    assert len(set(RAW_FIXED)) == len(RAW_FIXED)
    assert all(len(raw) < 1 << 20 for raw in RAW_FIXED)  # under the body limit: the 413 would hide the rest


@settings(max_examples=200, deadline=None)
@given(completion_bodies("tiny", CAP, valid=True), chat_bodies("tiny", CAP, valid=True))
def test_valid_bodies_name_the_model_and_a_small_count(completion, chat):
    assert completion["model"] == chat["model"] == "tiny"
    assert completion["prompt"] and chat["messages"]
    assert all(m["role"] in ("user", "system", "assistant") for m in chat["messages"])
    assert completion.get("max_tokens", 16) <= 16 and 1 <= completion.get("max_tokens", 1)
    tokens = [chat[k] for k in ("max_tokens", "max_completion_tokens") if k in chat]
    assert tokens and all(1 <= t <= CAP for t in tokens)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["messages", "max_tokens", "max_completion_tokens", "n"]),
                       st.one_of(st.none(), st.integers(-10, 10**6), st.text(max_size=3))))
def test_bound_work_leaves_no_chat_body_unbounded(body):
    bounded = bound_work(body, CAP, chat=True)
    assert any(bounded.get(k) is not None for k in ("max_tokens", "max_completion_tokens"))
    assert bounded in (body, {**body, "max_completion_tokens": CAP})  # only added, never changed


def test_token_work():
    assert token_work({"max_tokens": CAP}, CAP, chat=False)
    assert token_work({}, CAP, chat=False)  # vLLM's completion default: 16
    assert not token_work({}, CAP, chat=True)  # chat default: up to the context length
    assert not token_work({"max_tokens": 100}, CAP, chat=False)  # served, too long for a fuzz case
    for refused in (0, -1, REFUSED_MAX_TOKENS + 1, 1.5, "8", True, []):
        assert token_work({"max_tokens": refused}, CAP, chat=True)
    assert not token_work({"max_tokens": None, "max_completion_tokens": None}, CAP, chat=True)


def test_openai_error_bodies():
    good = json.dumps({"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}})
    assert openai_error(400, good.encode()) is None
    assert openai_error(404, good.encode()) == "code 400 != status 404"
    assert openai_error(400, b"Internal Server Error") == "not JSON"
    assert openai_error(400, b'{"detail": "x"}') == "no 'error' object"
    assert openai_error(400, b'{"error": {"message": "", "type": "x", "code": 400}}') == "no message"


def test_classify():
    assert classify(500, "text/plain", b"Internal Server Error")[0] == "5xx"
    assert classify(503, "application/json", b"{}")[1] is not None
    assert classify(200, "application/json", b'{"choices": []}') == ("completion", None)
    assert classify(200, "application/json", b'{"id": 1}')[1] is not None
    sse = 'data: {"choices": []}\n\ndata: [DONE]\n\n'
    assert classify(200, "text/event-stream; charset=utf-8", sse.encode()) == ("stream", None)
    assert classify(200, "text/event-stream", b'data: {"choices": []}\n\n')[1] == "stream without [DONE]"
    bad = 'data: {"error": {"code": 400, "message": "x"}}\n\ndata: [DONE]\n\n'
    assert classify(200, "text/event-stream", bad.encode()) == ("stream-error", None)
    fault = 'data: {"error": {"code": 500, "message": "x"}}\n\ndata: [DONE]\n\n'
    assert classify(200, "text/event-stream", fault.encode())[1] is not None


@settings(max_examples=300, deadline=None)
@given(completion_bodies("tiny", CAP, valid=True), chat_bodies("tiny", CAP, valid=True))
def test_valid_bodies_pass_vllms_own_request_validation(completion, chat):
    """The valid tier is valid to vLLM: its request classes accept it and build sampling parameters, so those cases
    reach the engine (what they may still be refused for needs the model: token ids out of its vocabulary)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    CompletionRequest.model_validate(completion).to_sampling_params(CAP, {})
    ChatCompletionRequest.model_validate(chat).to_sampling_params(CAP, {})


def _stub_client(answer) -> httpx.Client:
    return httpx.Client(base_url="http://127.0.0.1:1", transport=httpx.MockTransport(answer))


def test_fuzz_loop_counts_every_answer_against_a_stub():
    """The loop itself, against an in-process stub: a 400 for everything but the plain request afterwards."""
    def answer(request: httpx.Request) -> httpx.Response:
        if request.content.startswith(b'{"model":"tiny","prompt":"def add') and json.loads(request.content) == PLAIN:
            return httpx.Response(200, json={"choices": []})
        return httpx.Response(400, json={"error": {"message": "no", "type": "BadRequestError", "code": 400}})

    with _stub_client(answer) as client:
        report = fuzz(client, "tiny", n_cases=20, seed=1)
    assert report.cases == 2 * len(RAW_FIXED) + 20 and report.statuses == {"400": report.cases}
    assert report.ok and report.after == 200 and not report.out_of_time
    assert report.top_errors == {"400 no": report.cases}


def test_fuzz_loop_flags_5xx_and_bad_error_bodies_and_stops_at_its_deadline():
    calls = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(500, text="Internal Server Error") if len(calls) % 2 else httpx.Response(404, json={})

    with _stub_client(answer) as client:
        report = fuzz(client, "tiny", n_cases=10, seed=1)
    assert report.server_errors == report.statuses["500"] > 0 and len(report.problems) == report.cases
    assert not report.ok
    with _stub_client(answer) as client:
        stopped = fuzz(client, "tiny", n_cases=10, seed=1, max_s=0.0)
    assert stopped.out_of_time and stopped.cases == 0 and not stopped.ok


def test_fuzz_requires_a_400_naming_the_parameter_for_the_refused_cases():
    """Issue 64: an unknown chat role and a prompt plus ``max_tokens`` over the context (read off /v1/models) must be
    400s naming the parameter; a 200 for them, or a 400 naming another, is a problem."""
    def serve(names_param: bool):
        def answer(request: httpx.Request) -> httpx.Response:
            if request.method == "GET":
                return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 64}]})
            try:
                body = json.loads(request.content)
            except (ValueError, RecursionError):  # the raw hostile bodies
                body = None
            if body == PLAIN:
                return httpx.Response(200, json={"choices": []})
            param = None
            if isinstance(body, dict) and body.get("max_tokens") == 60:
                param = "max_tokens"
            elif isinstance(body, dict) and body.get("max_completion_tokens") == 64:
                param = "max_completion_tokens"
            elif isinstance(body, dict) and "hacker" in request.content.decode():
                param = "messages[1].role"
            if param is None or not names_param:
                return httpx.Response(200, json={"choices": []}) if param else httpx.Response(
                    400, json={"error": {"message": "no", "type": "BadRequestError", "code": 400}})
            return httpx.Response(400, json={"error": {"message": "no", "type": "BadRequestError", "code": 400,
                                                       "param": param}})
        return answer

    with _stub_client(serve(names_param=True)) as client:
        good = fuzz(client, "tiny", n_cases=1, seed=1)
    assert good.ok and good.labels["refused"] == 4, good.problems
    with _stub_client(serve(names_param=False)) as client:
        bad = fuzz(client, "tiny", n_cases=1, seed=1)
    assert not bad.ok and len([p for p in bad.problems if "expected a 400 naming" in p["problem"]]) == 4


"""The ingress's continuation of a request whose replica died (``deployments.continuation``) on chunks shaped as vLLM
0.32 writes them with ``return_token_ids``: what is refused up front, tokens held until their text is out, the
continuation's body, its chunks rewritten into the original stream, the usage of the original request."""

from __future__ import annotations

import json

import pytest

from deployments.continuation import CONTINUES, DONE, Progress, collected, refusal


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def completion_chunk(text: str, ids: list[int], finish: str | None = None, prompt_ids: list[int] | None = None,
                     rid: str = "cmpl-a", created: int = 1) -> str:
    return sse({"id": rid, "object": "text_completion", "created": created, "model": "tiny", "choices": [
        {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
         "prompt_token_ids": prompt_ids, "token_ids": ids}]})


def usage_chunk(prompt: int, completion: int, rid: str = "cmpl-a", fingerprint: str | None = None) -> str:
    return sse({"id": rid, "object": "text_completion", "created": 1, "model": "tiny", "choices": [],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": 3}},
                **({"system_fingerprint": fingerprint} if fingerprint else {})})


@pytest.mark.parametrize(("route", "extra", "why"), [
    ("completions", {"n": 2}, "several choices"), ("completions", {"logprobs": 0}, "logprobs"),
    ("chat", {"logprobs": True}, "logprobs"), ("chat", {"top_logprobs": 2}, "logprobs"),
    ("chat", {"response_format": {"type": "json_object"}}, "guided decoding"),
    ("completions", {"structured_outputs": {"regex": "a+"}}, "guided decoding"),
    ("completions", {"echo": True}, "echo"), ("chat", {"stop": ["\n"]}, "stop strings"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("completions", {"prompt": ["a", "b"]}, "several prompts"),
    ("completions", {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "continuous usage"),
])
def test_what_is_refused_up_front(route, extra, why):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4, **extra}
    assert refusal(route, body) == why and Progress.plan(route, body) is None
    plain = {"model": "tiny", "prompt": [1, 2], "max_tokens": 4, "stop": [], "n": 1, "logprobs": None, "seed": 3,
             "temperature": 0.7, "stop_token_ids": [5], "speculation": {"max_width": 2}}
    assert refusal(route, plain) is None


def test_a_completion_stream_continued_reads_as_one_stream():
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 6, "min_tokens": 4, "stream": True, "seed": 7,
            "stream_options": {"include_usage": True}, "speculation": False, "stop_token_ids": [9]}
    p = Progress.plan("completions", body)
    assert p.engine_body() == {**body, "return_token_ids": True}
    client = p.take(completion_chunk("a", [11], prompt_ids=[1, 2]))
    client += p.take(completion_chunk("", [12]))  # an incomplete character: held, nothing sent
    assert len(client) == 1 and p.emitted == [11] and p.held == [12]
    client += p.take(completion_chunk("bé", [13]))  # its text is out: sent with the held token's id
    assert p.emitted == [11, 12, 13] and client[-1]["choices"][0]["token_ids"] is None  # not asked for
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in client)
    client += p.take(completion_chunk("", [14]))  # held when the replica dies: generated again
    assert p.cannot_continue() is None
    method, cont = p.continuation()
    assert method == "completions" and cont["prompt"] == [1, 2, 11, 12, 13] and cont["max_tokens"] == 3
    assert cont["min_tokens"] == 1 and cont["seed"] == 7 and cont["speculation"] is False
    assert cont["stop_token_ids"] == [9] and cont["return_token_ids"] and cont["stream"]
    assert cont[CONTINUES] == {"request_id": "cmpl-a", "carried": 3}
    client += p.take(completion_chunk("c", [14], prompt_ids=[1, 2, 11, 12, 13], rid="cmpl-b", created=9))
    client += p.take(completion_chunk("d", [15], finish="length", rid="cmpl-b", created=9))
    client += p.take(usage_chunk(5, 2, rid="cmpl-b"))
    client += p.take("data: [DONE]\n\n")
    assert client[-1] == DONE
    chunks = client[:-1]
    assert {(c["id"], c["created"], c["object"], c["model"]) for c in chunks} == {("cmpl-a", 1, "text_completion",
                                                                                   "tiny")}
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "abécd"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [None, None, None, "length"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    assert p.emitted == [11, 12, 13, 14, 15]


def test_a_chat_continued_on_completions_is_written_as_chat_chunks():
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
            "temperature": 0, "stream": False, "return_token_ids": True, "chat_template_kwargs": {"x": 1},
            "specexit": True}
    p = Progress.plan("chat", body)
    engine = p.engine_body()
    assert engine["stream"] and engine["stream_options"] == {"include_usage": True} and engine["return_token_ids"]
    head = {"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}
    got = p.take(sse({**head, "prompt_token_ids": [1, 2, 3], "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}))
    got += p.take(sse({**head, "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None,
                                            "token_ids": [21]}]}))
    method, cont = p.continuation()
    assert method == "completions" and cont["prompt"] == [1, 2, 3, 21] and cont["max_tokens"] == 4
    assert cont["temperature"] == 0 and cont["specexit"] is True
    assert "messages" not in cont and "chat_template_kwargs" not in cont and "max_completion_tokens" not in cont
    got += p.take(completion_chunk("y", [22], prompt_ids=[1, 2, 3, 21], rid="cmpl-z"))
    got += p.take(completion_chunk("", [], finish="stop", rid="cmpl-z"))
    got += p.take(usage_chunk(4, 1, rid="cmpl-z", fingerprint="vllm-x"))
    assert {c["object"] for c in got} == {"chat.completion.chunk"} and {c["id"] for c in got} == {"chatcmpl-a"}
    out = collected(got + [DONE], p)
    assert out["object"] == "chat.completion" and out["id"] == "chatcmpl-a"
    assert out["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "xy"}, "finish_reason": "stop",
                               "token_ids": [21, 22]}]
    assert out["prompt_token_ids"] == [1, 2, 3]
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert out["system_fingerprint"] == "vllm-x"


def test_a_chat_without_a_budget_continues_to_what_the_context_leaves():
    p = Progress.plan("chat", {"messages": [{"role": "user", "content": "hi"}], "stream": True})
    p.take(sse({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": [1],
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}, "token_ids": [2]}]}))
    assert p.continuation()[1]["max_tokens"] is None  # /v1/completions reads an explicit null as that


def test_a_chat_that_sent_reasoning_is_not_continued_and_one_that_finished_is_closed():
    p = Progress.plan("chat", {"messages": [{"role": "user", "content": "hi"}], "stream": True})
    p.take(sse({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": [1],
                "choices": [{"index": 0, "delta": {"reasoning": "hmm"}, "token_ids": [2]}]}))
    assert "reasoning" in p.cannot_continue()
    q = Progress.plan("completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    q.take(completion_chunk("a", [5], finish="length", prompt_ids=[1, 2]))
    assert q.finished and q.close() == [{"id": "cmpl-a", "object": "text_completion", "created": 1, "model": "tiny",
                                         "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1,
                                                                  "total_tokens": 3}}, DONE]

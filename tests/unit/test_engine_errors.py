"""Which exceptions of vLLM's serving layer the engine replica answers as the client's (4xx) and which as an engine
fault (500): ``deployments.vllm_engine.client_error``."""

from __future__ import annotations

import jinja2
import pytest
from vllm.exceptions import VLLMNotFoundError, VLLMValidationError

from deployments.vllm_engine import client_error, context_overflow, requested_tokens, unknown_role
from tests.fault_engine import InjectedEngineFault


@pytest.mark.parametrize(("exc", "code", "param"), [
    (ValueError("token id out of vocabulary"), 400, None), (TypeError("unhashable"), 400, None),
    (OverflowError("int too large"), 400, None), (VLLMValidationError("bad seed", parameter="seed"), 400, "seed"),
    (VLLMNotFoundError("no such model"), 404, None), (jinja2.TemplateError("bad template"), 400, None),
    (NotImplementedError(), 400, None),  # vLLM says 501; an unsupported request feature is the client's
])
def test_client_errors_are_openai_4xx(exc, code, param):
    body = client_error(exc)
    assert body["error"]["code"] == code and body["error"]["param"] == param and body["error"]["message"]


@pytest.mark.parametrize("exc", [InjectedEngineFault("boom"), RuntimeError("engine dead"), KeyError("k")])
def test_engine_faults_stay_500(exc):
    assert client_error(exc) is None


def test_unknown_chat_role_is_a_400_naming_the_message():
    """Issue 64: vLLM hands any role to the chat template (a 200 for "hacker"); OpenAI's roles only, as OpenAI."""
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "hacker", "content": "x"}]}
    err = unknown_role(body)["error"]
    assert err["code"] == 400 and err["param"] == "messages[1].role" and "'hacker'" in err["message"]
    for role in ("system", "developer", "user", "assistant", "tool", "function"):
        assert unknown_role({"messages": [{"role": role, "content": "x"}]}) is None
    for odd in ({"messages": "hi"}, {"messages": [None, {"content": "x"}, {"role": 5}]}, [], None):
        assert unknown_role(odd) is None  # shapes vLLM's own validation answers


def test_prompt_and_budget_over_the_context_name_the_budget():
    assert requested_tokens({"max_tokens": 5, "max_completion_tokens": 7}, "chat") == ("max_completion_tokens", 7)
    assert requested_tokens({"max_tokens": 5, "max_completion_tokens": 7}, "completions") == ("max_tokens", 5)
    assert requested_tokens({"max_tokens": True}, "completions") is None
    assert requested_tokens({}, "chat") is None
    assert context_overflow(24, 1000, 1024) is None
    message = context_overflow(25, 1000, 1024)
    assert "maximum context length is 1024" in message and "1025 tokens (25 in the prompt, 1000" in message


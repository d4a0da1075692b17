"""Which exceptions of vLLM's serving layer the engine replica answers as the client's (4xx) and which as an engine
fault (500): ``deployments.vllm_engine.client_error``."""

from __future__ import annotations

import jinja2
import pytest
from vllm.exceptions import VLLMNotFoundError, VLLMValidationError

from deployments.vllm_engine import client_error
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

"""How the ingress reads a request body (``Ingress._body``), without Serve: hostile bodies the fuzzer sends
(``loadtest.fuzz.RAW_FIXED``) become OpenAI-style 4xx responses, never an exception (Serve's 500)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from fastapi.responses import JSONResponse

from deployments.ingress import Ingress
from deployments.settings import IngressSettings
from loadtest.fuzz import RAW_FIXED, openai_error


class _Request:
    def __init__(self, raw: bytes):
        self.raw, self.headers = raw, {"content-length": str(len(raw))}

    async def stream(self):
        for i in range(0, len(self.raw), 65536):
            yield self.raw[i:i + 65536]


def _body(raw: bytes):
    return asyncio.run(Ingress._body(SimpleNamespace(settings=IngressSettings()), _Request(raw)))


@pytest.mark.parametrize("raw", RAW_FIXED)
def test_fixed_hostile_bodies_are_refused_or_passed_on(raw):
    out = _body(raw)
    if isinstance(out, JSONResponse):
        assert 400 <= out.status_code < 500 and openai_error(out.status_code, out.body) is None
    else:  # a JSON object the limits let through: the engine's validation answers it
        assert isinstance(out, dict)
        json.dumps(out, allow_nan=False).encode()  # finite, valid Unicode: any answer echoing it can be written


@pytest.mark.parametrize(("raw", "words"), [
    (b'{"temperature": NaN, "prompt": "x"}', "NaN is not JSON"),
    (b'{"top_p": 1e999}', "out of range"),
    (b"[" * 100_000, "nested too deeply"),
    (b'{"a": ' + b"[" * 900 + b"]" * 900 + b"}", "more than 64 levels"),
    (b'{"model": "\\ud800"}', "not valid Unicode"),
])
def test_each_kind_of_hostile_body_says_why(raw, words):
    out = _body(raw)
    assert isinstance(out, JSONResponse) and out.status_code == 400
    assert words in json.loads(out.body)["error"]["message"]


def test_a_plain_body_comes_through():
    assert _body(b'{"model": "m", "prompt": "caf\\u00e9 \\ud83d\\ude00", "max_tokens": 2}') == {
        "model": "m", "prompt": "café 😀", "max_tokens": 2}

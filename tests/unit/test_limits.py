"""The ingress's request limits (``deployments.limits``): body size while reading, parameter ceilings."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deployments.limits import BodyTooLarge, json_problem, parse_json, read_body, violation
from deployments.settings import RequestLimits

LIMITS = RequestLimits(max_body_bytes=100, max_n=4, max_stop=2, max_tokens=64)


async def _chunks(sizes: list[int], read: list[int]):
    for size in sizes:
        read.append(size)
        yield b"x" * size


def _read(sizes: list[int], content_length: str | None, limit: int = 100) -> tuple[bytes | None, list[int]]:
    read: list[int] = []
    try:
        return asyncio.run(read_body(_chunks(sizes, read), content_length, limit)), read
    except BodyTooLarge:
        return None, read


def test_declared_length_over_the_limit_is_refused_before_reading():
    body, read = _read([10], "101")
    assert body is None and read == []


def test_undeclared_body_is_refused_at_the_chunk_that_passes_the_limit():
    body, read = _read([60, 60, 60, 60], None)
    assert body is None and read == [60, 60]  # the rest is never pulled


def test_a_lying_content_length_does_not_help():
    assert _read([60, 60], "10")[0] is None
    assert _read([60, 40], "garbage")[0] == b"x" * 100  # exactly the limit is fine


@given(st.lists(st.integers(0, 50), max_size=8))
def test_bodies_within_the_limit_come_back_whole(sizes):
    body, _ = _read(sizes, None)
    assert (body is None) == (sum(sizes) > 100)
    if body is not None:
        assert len(body) == sum(sizes)


@pytest.mark.parametrize(("body", "param"), [
    ({"n": 5}, "n"), ({"best_of": 1000}, "best_of"), ({"max_tokens": 65}, "max_tokens"),
    ({"max_completion_tokens": 10**8}, "max_completion_tokens"), ({"stop": ["a", "b", "c"]}, "stop"),
    ({"stop_token_ids": [1, 2, 3]}, "stop_token_ids"),
])
def test_each_ceiling_names_its_parameter(body, param):
    found = violation({"model": "m", "prompt": "x", **body}, LIMITS)
    assert found is not None and found[0] == param and "at most" in found[1]


@pytest.mark.parametrize("body", [
    {"n": 4, "best_of": 4, "max_tokens": 64, "stop": ["a", "b"]},
    {"stop": "a single string"}, {"max_tokens": None}, {"n": True},
    {"n": "five", "max_tokens": "lots"},  # wrong types: the engine's validation answers those
])
def test_within_limits_or_not_a_count_passes(body):
    assert violation(body, LIMITS) is None


def _nested(depth: int):
    value: object = 0
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@given(st.integers(0, 3000), st.integers(2, 100))
def test_nesting_deeper_than_the_limit_is_named(depth, limit):
    problem = json_problem(_nested(depth), limit)
    assert (problem is not None) == (depth > limit)
    assert problem is None or f"more than {limit} levels" in problem


def test_a_body_nested_too_deeply_is_refused():
    limits = RequestLimits(max_depth=8)
    assert violation({"prompt": "x", "user": _nested(7)}, limits) is None  # the body object is level 1
    assert violation({"prompt": "x", "user": _nested(8)}, limits)[0] == "body"
    assert violation({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, limits) is None


@pytest.mark.parametrize("raw", [b'{"temperature": NaN}', b'{"top_p": Infinity}', b'{"t": -Infinity}',
                                 b'{"temperature": 1e400}', b'{"a": [1, 2e999]}'])
def test_non_finite_numbers_are_not_json(raw):
    with pytest.raises(ValueError):
        parse_json(raw)


def test_strings_must_be_unicode():
    assert parse_json(b'{"t": 1e308, "n": 10000000000000000000000}') == {"t": 1e308, "n": 10**22}
    for raw in (b'{"model": "\\ud800"}', b'{"\\udc00": 1}', b'{"messages": [{"content": ["x\\udfff"]}]}'):
        assert "not valid Unicode" in violation(parse_json(raw), LIMITS)[1]
    assert violation(parse_json(b'{"prompt": "\\ud83d\\ude00"}'), LIMITS) is None  # a paired escape: one emoji

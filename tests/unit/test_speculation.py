"""Speculation per request: the field's validation, the caps the engine reads, the usage it reports."""

from __future__ import annotations

import pytest

from dcut.speculation import EXTRA_ARG, KEPT_RECORDS, RequestSpeculation, cap_of, merged, parse_cap


@pytest.mark.parametrize(("value", "cap"), [(None, None), (True, None), (False, 0), ({"max_width": 0}, 0),
                                            ({"max_width": 3}, 3), ({"max_width": 15}, 15)])
def test_the_field_gives_a_cap(value, cap) -> None:
    assert parse_cap(value, 15) == cap


def test_the_deployments_default_cap_is_what_a_request_gets_without_asking() -> None:
    assert parse_cap(True, 15, default=7) == 7
    assert parse_cap(None, 15, default=7) == 7
    assert parse_cap({"max_width": 11}, 15, default=7) == 11  # a request may ask for more than the default
    assert parse_cap({"max_width": 3}, 15, default=7) == 3
    assert parse_cap(False, 15, default=7) == 0


@pytest.mark.parametrize("value", [{"max_width": 16}, {"max_width": -1}, {"max_width": 2.5}, {"max_width": True},
                                   {"max_width": "3"}, {}, {"max_width": 3, "min_width": 1}, "off", 0, 3, [1]])
def test_bad_values_are_refused_with_the_fields_name(value) -> None:
    with pytest.raises(ValueError, match=r"^speculation"):
        parse_cap(value, 15)


def test_the_engine_reads_the_cap_from_extra_args() -> None:
    assert cap_of(None, 15) == 15
    assert cap_of({}, 15) == 15
    assert cap_of({EXTRA_ARG: 0}, 15) == 0
    assert cap_of({EXTRA_ARG: "7"}, 15) == 7  # extra_args travel as JSON: a string is read as a number
    assert cap_of({EXTRA_ARG: 99}, 15) == 15
    assert cap_of(None, 15, default=3) == 3 and cap_of({EXTRA_ARG: 7}, 15, default=3) == 7
    # a seeded sampled request is decoded plainly unless it gives a cap of its own
    assert cap_of(None, 15, default=3, seeded=True) == 0 and cap_of({EXTRA_ARG: 7}, 15, seeded=True) == 7


def test_usage_counts_drafted_within_the_cap_verified_and_accepted() -> None:
    spec = RequestSpeculation(k=15)
    args = {"a": (None, False), "b": ({EXTRA_ARG: 0}, False), "c": ({EXTRA_ARG: 3}, True), "d": (None, True)}
    assert spec.caps_for(["d"], args.get) == [0]
    caps = spec.caps_for(["a", "b", "c"], args.get)
    assert caps == [15, 0, 3]
    spec.step(["a", "b", "c"], caps, width=7)
    spec.step(["c", "a", "b"], [caps[2], caps[0], caps[1]], 0, verified=[3, 5, 0], accepted=[1, 4, 0])
    usage = spec.usage("")
    assert usage["a"] == {"steps": 2, "drafted_tokens": 7, "verified_tokens": 5, "accepted_tokens": 4,
                          "acceptance_rate": 0.8}
    assert usage["b"]["drafted_tokens"] == usage["b"]["verified_tokens"] == 0 and usage["b"]["acceptance_rate"] is None
    assert usage["c"]["drafted_tokens"] == 3 and usage["c"]["verified_tokens"] == 3
    assert merged({k: usage[k] for k in ("a", "c")})["acceptance_rate"] == round(5 / 8, 4)


def test_finished_requests_stay_readable_and_bounded() -> None:
    spec = RequestSpeculation(k=3)
    spec.step(["cmpl-1-0", "cmpl-1-1", "cmpl-2-0"], [3, 3, 3], width=3)
    spec.drop({"cmpl-1-0", "cmpl-1-1"})
    assert set(spec.usage("cmpl-1")) == {"cmpl-1-0", "cmpl-1-1"}  # one response, n=2
    assert set(spec.usage("cmpl-2")) == {"cmpl-2-0"}  # still running
    assert not spec.caps
    for i in range(KEPT_RECORDS + 5):
        spec.step([f"r{i}"], None, width=1)
        spec.drop({f"r{i}"})
    assert len(spec.finished) == KEPT_RECORDS
    assert "cmpl-1-0" not in spec.finished


def test_the_acceptance_histogram_buckets_rates_by_route() -> None:
    from dcut.speculation import AcceptanceHistogram

    h = AcceptanceHistogram()
    for rate in (0.0, 0.05, 0.5, 0.99, 1.0):
        h.add("chat", rate)
    h.add("completions", 0.31)
    h.add("chat", None)
    assert h.counts["chat"] == [2, 0, 0, 0, 0, 1, 0, 0, 0, 2]
    assert h.counts["completions"][3] == 1 and sum(h.counts["completions"]) == 1
    assert h.unverified == {"chat": 1}
    assert AcceptanceHistogram.model_validate_json(h.model_dump_json()) == h

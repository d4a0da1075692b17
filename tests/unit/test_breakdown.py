"""The step breakdown of ``dcut compare --breakdown``: timers booked per label, removed after, loud on a vLLM
without the parts it names, and the report's tables."""

from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import pytest

from dcut.bench.breakdown import PARTS, StepBreakdown
from dcut.bench.interleaved import _summaries, arms_for, markdown
from dcut.settings import EngineSettings


def _fake_engine(monkeypatch: pytest.MonkeyPatch, clock: list[float]) -> type:
    """A module ``fake_engine`` whose ``Core.step`` takes 3 ticks, 2 of them in ``Core.forward``."""
    module = types.ModuleType("fake_engine")

    class Core:
        def forward(self) -> str:
            clock[0] += 2.0
            return "out"

        def step(self) -> str:
            clock[0] += 1.0
            return self.forward()

    module.Core = Core
    monkeypatch.setitem(sys.modules, "fake_engine", module)
    return Core


def test_time_is_booked_per_step_to_the_label_and_the_timers_come_off(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    core = _fake_engine(monkeypatch, clock)
    original = core.__dict__["step"]
    parts = (("fake_engine", "Core", "step", "engine step"), ("fake_engine", "Core", "forward", "forward"))
    with StepBreakdown(parts, clock=lambda: clock[0] / 1000.0) as timers:
        engine = core()
        engine.step()  # no label: warm-up, booked to nothing
        timers.measuring("a/8")
        assert engine.step() == "out" and engine.step() == "out"
        timers.measuring("b/8")
        engine.step()
        timers.measuring(None)
        assert timers.per_step("a/8") == pytest.approx({"engine step": 3.0, "forward": 2.0})
        assert timers.per_step("b/8") == pytest.approx({"engine step": 3.0, "forward": 2.0})
        assert timers.per_step("c/8") == {}
    assert core.__dict__["step"] is original


def test_a_part_this_vllm_does_not_have_stops_the_breakdown(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_engine(monkeypatch, [0.0])
    with pytest.raises(KeyError), StepBreakdown((("fake_engine", "Core", "no_such_method", "x"),)):
        pass


def test_every_part_exists_in_the_installed_vllm_and_dcut() -> None:
    for module, cls, method, _ in PARTS:
        assert method in vars(getattr(importlib.import_module(module), cls)), (module, cls, method)


def test_the_report_shows_each_modes_parts_per_batch_size() -> None:
    runs = [{"mode": m, "bs": 8, "repeat": r, "tokens_per_s": v, "token_ids_sha256": "x"}
            for m, v in (("none", 100.0), ("joint-w0", 95.0)) for r in range(2)]
    arms = arms_for(EngineSettings(), ["none", "joint-w0"], None)
    cells, comparisons, _ = _summaries(runs, arms, [8], np.random.default_rng(0))
    cells[0]["step_ms"] = {"engine step": 17.083, "target forward": 14.257}
    cells[1]["step_ms"] = {"engine step": 18.298, "target forward": 14.762, "D-Cut cut": 0.084}
    record = {"batch_sizes": [8], "modes": ["none", "joint-w0"], "cells": cells, "comparisons": comparisons,
              "repeats": 2, "max_tokens": 128, "seed": 0, "schedule": None, "startup_s": {},
              "machine": {"cpu": "test", "cores": 2, "torch": "x"}}
    text = markdown(record)
    assert "| engine step | 17.083 | 18.298 |" in text and "| D-Cut cut | – | 0.084 |" in text
    assert text.index("| engine step |") < text.index("| target forward |") < text.index("| D-Cut cut |")
    del cells[0]["step_ms"], cells[1]["step_ms"]
    assert "Where a step's time goes" not in markdown(record)

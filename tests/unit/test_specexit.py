"""SpecExit's exit rule on synthetic signals, its settings, and the synthetic reasoning traces (issue 13)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from pydantic import ValidationError

from dcut.specexit import Signals, Smoother, SpecExitSettings, exit_index, passes, step_signals
from dcut.train.reasoning import THINK_END, THINK_START, answer_of, make_trace, problems

DEFAULT = SpecExitSettings()
SURE = Signals(confidence=0.95, progress=0.6, remaining=50.0)


def test_step_signals_activate_then_average_over_positions() -> None:
    raw = torch.tensor([[0.0, 0.0, math.log(100.0)], [math.log(3.0), 0.0, math.log(300.0)]])
    s = step_signals(raw)
    assert s.confidence == pytest.approx((0.5 + 0.75) / 2) and s.progress == pytest.approx(0.5)
    assert s.remaining == pytest.approx(200.0)
    with pytest.raises(ValueError, match="positions"):
        step_signals(torch.zeros(0, 3))


def test_exit_only_while_thinking_at_a_paragraph_end_when_every_signal_passes() -> None:
    step = ["The", " sum", " is", " 5198.\n\n", "Let"]
    assert exit_index(step, thinking=True, signals=SURE, settings=DEFAULT) == 3  # keep up to the split
    assert exit_index(step, thinking=False, signals=SURE, settings=DEFAULT) is None  # the answer: never
    assert exit_index(["no", " split"], thinking=True, signals=SURE, settings=DEFAULT) is None
    for weak in (Signals(0.7, 0.6, 50.0), Signals(0.95, 0.2, 50.0), Signals(0.95, 0.6, 250.0)):
        assert not passes(weak, DEFAULT)
        assert exit_index(step, thinking=True, signals=weak, settings=DEFAULT) is None
    assert exit_index([" done.\n", THINK_END, "\n\n"], thinking=True, signals=SURE, settings=DEFAULT) is None
    only_conf = SpecExitSettings(progress_min=None, remaining_max=None)
    assert passes(Signals(0.9, 0.0, 1e6), only_conf)


def test_bad_settings_are_refused_with_their_name() -> None:
    with pytest.raises(ValidationError, match="at least one"):
        SpecExitSettings(confidence_min=None, progress_min=None, remaining_max=None)
    with pytest.raises(ValidationError, match="alpha"):
        SpecExitSettings(alpha=0.0)
    with pytest.raises(ValidationError, match="split_strings"):
        SpecExitSettings(split_strings=("",))
    with pytest.raises(ValidationError, match="confidence_min"):
        SpecExitSettings(confidence_min=1.5)


def test_smoothing_lags_a_jump_and_momentum_leads_a_trend() -> None:
    ewma = Smoother(SpecExitSettings(alpha=0.5))
    assert ewma.update(Signals(0.0, 0.0, 100.0)) == Signals(0.0, 0.0, 100.0)  # first step as it is
    assert ewma.update(Signals(1.0, 1.0, 0.0)) == Signals(0.5, 0.5, 50.0)
    window = Smoother(SpecExitSettings(smoothing="window", window=2))
    for c in (0.0, 0.4, 0.8):
        last = window.update(Signals(c, c, c))
    assert last.confidence == pytest.approx(0.6)  # the last two only
    plain, momentum = Smoother(SpecExitSettings(alpha=0.3)), Smoother(SpecExitSettings(smoothing="momentum", alpha=0.3))
    for i in range(10):  # a steady rise: momentum tracks it more closely
        x = Signals(0.1 * i, 0.1 * i, 0.0)
        p, m = plain.update(x), momentum.update(x)
    assert abs(m.confidence - 0.9) < abs(p.confidence - 0.9)


def test_traces_over_think_after_the_answer_is_settled() -> None:
    rng = random.Random(0)
    lengths = []
    for p in problems(50, seed=1, heldout=False):
        t = make_trace(p, rng)
        assert t.text.startswith(THINK_START) and t.text[t.think_end_at:].startswith(THINK_END)
        assert answer_of(t.text) == p.answer == str(p.a + p.b)
        assert f"So the sum is {p.answer}." in t.text[:t.settled_at]
        assert t.text[t.settled_at - 2:t.settled_at] == "\n\n"  # settled at a paragraph boundary
        labels = t.labels()
        assert len(labels) == t.think_end_at and labels[0][1] == 0.0 and labels[-1][2] == 1.0
        assert {c for c, _, _ in labels[:t.settled_at]} == {0.0} and {c for c, _, _ in labels[t.settled_at:]} == {1.0}
        lengths.append(t.think_end_at - t.settled_at)
    assert max(lengths) > 3 * min(lengths)  # how much is redundant varies: something for the signals to learn


def test_heldout_problems_never_appear_in_training() -> None:
    train = {(p.a, p.b) for p in problems(2000, seed=2, heldout=False)}
    held = {(p.a, p.b) for p in problems(200, seed=3, heldout=True)}
    assert len(held) == 200 and not train & held
    assert answer_of("<think>x</think>\n123") == "123" and answer_of("no think 123") is None

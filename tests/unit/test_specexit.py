"""SpecExit's exit rule on synthetic signals, its settings, and the synthetic reasoning traces (issue 13)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from pydantic import ValidationError

from dcut.bench.specexit import answer_of
from dcut.specexit import Signals, Smoother, SpecExitSettings, exit_index, passes, step_signals
from train.reasoning import THINK_END, THINK_START, make_trace, problems

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


# ---- inside the model runner (dcut.vllm.specexit), on synthetic rows ----------------------------------------

TEXTS = ["<eos>", "<think>", "</think>", "A", ".\n\n", "\n", "B"]  # a toy vocabulary
EOS, START, END, A, PARA, NL, B = range(7)


def _runner(conf_logit: float = 5.0, settings: SpecExitSettings = DEFAULT):
    from dcut.vllm.specexit import RunnerSpecExit

    bias = torch.tensor([conf_logit, 2.0, math.log(10.0)])  # sure, 88% through, 10 tokens left
    return RunnerSpecExit(settings, torch.zeros(3, 4), bias, TEXTS, START, END)


def _cached(prompt: list[int], extra_args: dict | None = None):
    from types import SimpleNamespace

    return SimpleNamespace(prompt_token_ids=prompt, output_token_ids=[],
                           sampling_params=SimpleNamespace(extra_args=extra_args))


def _draft(runner, req_ids: list[str], cached: dict, width: int = 2) -> None:
    runner.raw = runner.head(torch.randn(len(req_ids) * width, 4))
    runner.on_drafted(req_ids, cached, width)


def test_the_cut_puts_think_end_after_the_first_paragraph_end_and_only_while_thinking() -> None:
    runner = _runner()
    cached = {"t": _cached([A, START]), "answer": _cached([A])}  # "answer" never thinks
    _draft(runner, ["t", "answer"], cached)
    rows = torch.tensor([[A, PARA, B, A, -1], [A, PARA, B, -1, -1]])
    runner.apply(["t", "answer"], cached, rows)
    assert rows.tolist() == [[A, PARA, END, -1, -1], [A, PARA, B, -1, -1]]
    usage = runner.usage("t")["t"]
    assert usage["exited"] and usage["reasoning_tokens"] == 3 and usage["exit_at"] == 2
    assert usage["predicted_saved"] == pytest.approx(10.0)
    _draft(runner, ["t"], cached)
    after = torch.tensor([[A, PARA, B]])
    runner.apply(["t"], cached, after)  # the answer now: never cut again
    assert after.tolist() == [[A, PARA, B]] and runner.totals.exits == 1


def test_no_signals_weak_signals_or_no_paragraph_end_leave_the_row_alone() -> None:
    cached = {"t": _cached([START])}
    for runner, drafted, row in ((_runner(), False, [A, PARA, B]),  # no drafter pass yet: no signals
                                 (_runner(conf_logit=-5.0), True, [A, PARA, B]),  # not confident
                                 (_runner(), True, [A, B, A])):  # no paragraph ends
        if drafted:
            _draft(runner, ["t"], cached)
        rows = torch.tensor([row])
        runner.apply(["t"], cached, rows)
        assert rows.tolist() == [row] and runner.totals.exits == 0


def test_a_split_across_tokens_and_a_split_on_the_last_slot() -> None:
    split = SpecExitSettings(split_strings=("\n\n",))
    runner, cached = _runner(settings=split), {"t": _cached([START])}
    _draft(runner, ["t"], cached)
    first = torch.tensor([[A, NL]])  # the paragraph ends with the next step's first token
    runner.apply(["t"], cached, first)
    assert first.tolist() == [[A, NL]]
    second = torch.tensor([[NL, B, A]])
    runner.apply(["t"], cached, second)
    assert second.tolist() == [[NL, END, -1]]
    runner2 = _runner()
    _draft(runner2, ["t"], cached)
    full = torch.tensor([[A, PARA]])  # no slot left for </think>: it comes first in the next step
    runner2.apply(["t"], cached, full)
    nxt = torch.tensor([[B, A, -1]])
    runner2.apply(["t"], cached, nxt)
    assert full.tolist() == [[A, PARA]] and nxt.tolist() == [[END, -1, -1]]


def test_a_request_may_turn_it_off_or_tighten_it() -> None:
    from dcut.vllm.specexit import request_settings

    runner = _runner()
    cached = {"off": _cached([START], {"specexit": "false"}),
              "strict": _cached([START], {"specexit": '{"confidence_min": 0.999}'}),
              "on": _cached([START], {"specexit": True})}
    ids = list(cached)
    _draft(runner, ids, cached)
    rows = torch.tensor([[A, PARA, B]] * 3)
    runner.apply(ids, cached, rows)
    assert rows.tolist() == [[A, PARA, B], [A, PARA, B], [A, PARA, END]]
    assert set(runner.usage("")) == {"strict", "on"}  # off: not a SpecExit request at all
    with pytest.raises(ValidationError, match="alpha"):
        request_settings(DEFAULT, {"specexit": {"alpha": 2}})


def test_finished_requests_keep_their_usage_by_engine_id_prefix() -> None:
    runner, cached = _runner(), {"cmpl-1-0-ab12": _cached([START]), "cmpl-2-0-cd34": _cached([START])}
    _draft(runner, list(cached), cached)
    runner.apply(list(cached), cached, torch.tensor([[A, PARA, B], [A, B, A]]))
    runner.drop({"cmpl-1-0-ab12"})
    assert "cmpl-1-0-ab12" not in runner.requests
    assert runner.usage("cmpl-1")["cmpl-1-0-ab12"]["exited"]
    assert not runner.usage("cmpl-2")["cmpl-2-0-cd34"]["exited"]
    assert runner.stats()["exits"] == 1 and runner.stats()["thinking_now"] == 1


def test_a_head_of_the_wrong_shape_is_refused() -> None:
    from dcut.vllm.specexit import RunnerSpecExit

    with pytest.raises(ValueError, match="head"):
        RunnerSpecExit(DEFAULT, torch.zeros(2, 4), torch.zeros(2), TEXTS, START, END)


# ---- the serving layer's request field (deployments.vllm_engine), no engine started --------------------------

def test_the_request_field_is_validated_and_handed_to_the_engine_as_extra_args() -> None:
    from dcut.settings import EngineSettings
    from deployments.vllm_engine import VLLMEngine

    on = VLLMEngine(EngineSettings(specexit=SpecExitSettings()))
    body = on._specexit_args({"prompt": "x", "specexit": {"confidence_min": 0.9}, "vllm_xargs": {"a": 1}})
    assert "specexit" not in body and body["vllm_xargs"] == {"a": 1, "specexit": '{"confidence_min": 0.9}'}
    assert on._specexit_args({"specexit": False})["vllm_xargs"] == {"specexit": "false"}
    with pytest.raises(ValidationError, match="alpha"):
        on._specexit_args({"specexit": {"alpha": 5}})
    with pytest.raises(ValueError, match="expected true, false or an object"):
        on._specexit_args({"specexit": "soon"})
    off = VLLMEngine(EngineSettings())  # a model without SpecExit: asking for it is the client's error
    with pytest.raises(ValueError, match="not enabled for this model"):
        off._specexit_args({"specexit": True})
    assert off._specexit_args({"specexit": False}) == {}


def test_the_speculation_field_is_validated_and_handed_to_the_engine_as_its_cap() -> None:
    from dcut.settings import EngineSettings
    from dcut.speculation import EXTRA_ARG
    from deployments.vllm_engine import VLLMEngine

    dcut = VLLMEngine(EngineSettings())  # D-Cut on: a request may cap its drafts
    body = dcut._speculation_args({"prompt": "x", "speculation": {"max_width": 3}, "vllm_xargs": {"a": 1}})
    assert "speculation" not in body and body["vllm_xargs"] == {"a": 1, EXTRA_ARG: 3}
    assert dcut._speculation_args({"speculation": False})["vllm_xargs"] == {EXTRA_ARG: 0}
    assert dcut._speculation_args({"speculation": True}) == {}  # the deployment's default: nothing to hand on
    assert dcut._speculation_args({"prompt": "x"}) == {"prompt": "x"}
    with pytest.raises(ValueError, match="max_width"):
        dcut._speculation_args({"speculation": {"max_width": 99}})
    plain = VLLMEngine(EngineSettings(dcut=None))  # a drafter without D-Cut verifies every draft: no cap to apply
    with pytest.raises(ValueError, match="a cap needs D-Cut"):
        plain._speculation_args({"speculation": {"max_width": 2}})
    assert VLLMEngine(EngineSettings(method="none", draft=None, dcut=None))._speculation_args(
        {"speculation": False}) == {}  # nothing speculates: nothing to cap

"""The interleaved comparison's statistics and report (`dcut.bench.interleaved`), on synthetic runs."""

from __future__ import annotations

import numpy as np
import pytest

from dcut.bench.generate import run_mode, settings_for_mode
from dcut.bench.interleaved import (
    Sampling,
    _steady,
    _summaries,
    arms_for,
    bootstrap_median,
    markdown,
    steady_requests,
    verdict,
)
from dcut.settings import EngineSettings


def test_bootstrap_interval_contains_the_median_and_narrows_with_agreement():
    rng = np.random.default_rng(0)
    median, low, high = bootstrap_median([10.0, 11.0, 9.0, 10.5, 9.5], rng)
    assert median == 10.0 and low <= median <= high
    _, tight_low, tight_high = bootstrap_median([10.0, 10.01, 9.99, 10.0, 10.0], rng)
    assert tight_high - tight_low < high - low


def test_verdicts_only_where_the_interval_excludes_one():
    assert verdict(0.80, 0.95) == "joint faster"
    assert verdict(1.02, 1.10) == "joint slower"
    assert verdict(0.97, 1.03) == "within noise"


def test_arms_build_what_each_mode_means():
    base = EngineSettings()
    modes = ["none", "full", "dynamic", "joint", "joint-w0"]
    arms = {a.name: a.settings for a in arms_for(base, modes, [(1, 4, 7), (5, 64, 3)])}
    assert arms["none"].method == "none" and arms["none"].dcut is None
    assert arms["full"] == settings_for_mode("full", base) and arms["full"].dcut.mode == "full"  # as dcut sweep
    assert arms["dynamic"].spec_schedule == [(1, 4, 7), (5, 64, 3)] and arms["dynamic"].num_speculative_tokens == 7
    assert arms["dynamic"].dcut.mode == "full"  # vLLM's dynamic K, every draft verified as in full
    assert arms["joint"].dcut.mode == "joint" and arms["joint-w0"].dcut.widths == [0]
    assert {a.name: a.settings for a in arms_for(base, ["joint-w3"], None)}["joint-w3"].dcut.widths == [3]
    off = {a.name: a.settings.dcut for a in arms_for(base, ["joint", "joint-noshift"], None)}
    assert off["joint"].speed_shift == 0.3 and off["joint-noshift"] == off["joint"].model_copy(
        update={"speed_shift": None})  # joint in all but noticing the machine change speed
    mixed = {a.name: a.settings.dcut for a in arms_for(base, ["joint", "joint-mixed"], None)}
    assert not mixed["joint"].count_mixed_steps and mixed["joint-mixed"] == mixed["joint"].model_copy(
        update={"count_mixed_steps": True})  # joint in all but counting the steps that held prefills
    copies = {a.name: a.settings for a in arms_for(base, ["none", "none#2", "joint-w0#2"], None)}
    assert copies["none#2"] == copies["none"] and copies["joint-w0#2"].dcut.widths == [0]  # one more engine of each
    with pytest.raises(ValueError, match="schedule"):
        arms_for(base, ["dynamic"], None)
    stock = {a.name: a.settings for a in arms_for(base, ["vllm", "vllm-dynamic"], [(1, 4, 7), (5, 64, 3)])}
    assert stock["vllm"] == base.model_copy(update={"dcut": None})  # vLLM's own speculation: no D-Cut hooks at all
    assert stock["vllm-dynamic"] == arms["dynamic"].model_copy(update={"dcut": None})
    assert {run_mode(s) for s in stock.values()} == {"vllm"}
    with pytest.raises(ValueError, match="unknown mode"):
        arms_for(base, ["fastest"], None)
    with pytest.raises(ValueError, match="renamed to 'reference'"):
        settings_for_mode("auto", base)


def test_result_rows_name_what_ran():
    """``none`` without speculation, D-Cut's mode with D-Cut, ``vllm`` for vLLM's own speculation without D-Cut."""
    base = EngineSettings()
    assert run_mode(settings_for_mode("none", base)) == "none" and run_mode(settings_for_mode("full", base)) == "full"
    assert run_mode(base) == "joint" and run_mode(base.model_copy(update={"dcut": None})) == "vllm"


def _runs(rates: dict[str, list[float]], bs: int = 8, sha: str = "a") -> list[dict]:
    return [{"mode": m, "bs": bs, "repeat": r, "tokens_per_s": v, "token_ids_sha256": sha}
            for m, values in rates.items() for r, v in enumerate(values)]


def test_paired_ratios_rank_modes_that_drift_together():
    # The machine slows down over the rounds, for every mode alike: unpaired medians overlap, paired ratios do not.
    drift = [1.0, 0.8, 0.6, 0.9, 0.7]
    runs = _runs({"none": [100 * d for d in drift], "joint": [110 * d for d in drift]})
    arms = arms_for(EngineSettings(), ["none", "joint"], None)
    cells, comparisons, _ = _summaries(runs, arms, [8], np.random.default_rng(0))
    assert [c["identical_to_none"] for c in cells] == [True, True]
    (none_vs_joint,) = comparisons
    assert none_vs_joint["ratio_to_joint"] == pytest.approx(100 / 110) and none_vs_joint["verdict"] == "joint faster"
    record = {"batch_sizes": [8], "modes": ["none", "joint"], "cells": cells, "comparisons": comparisons,
              "repeats": 5, "max_tokens": 128, "seed": 0, "schedule": None, "startup_s": {},
              "machine": {"cpu": "test", "cores": 2, "torch": "x"}}
    text = markdown(record)
    assert "joint faster" in text and "bs 8: 1.100" in text and "identical to `none` in every run: **yes**" in text


def test_a_differing_output_is_reported():
    runs = _runs({"none": [1.0, 1.0]}) + [{**r, "mode": "joint", "token_ids_sha256": "b"}
                                           for r in _runs({"none": [1.0, 1.0]})]
    cells, _, _ = _summaries(runs, arms_for(EngineSettings(), ["none", "joint"], None), [8], np.random.default_rng(0))
    assert [c["identical_to_none"] for c in cells] == [True, False]


def test_a_comparison_without_joint_still_reports_its_cells_and_floor():
    runs = _runs({"none": [100.0, 101.0], "joint-w0": [90.0, 91.0]})
    arms = arms_for(EngineSettings(), ["none", "joint-w0"], None)
    cells, comparisons, _ = _summaries(runs, arms, [8], np.random.default_rng(0))
    record = {"batch_sizes": [8], "modes": ["none", "joint-w0"], "cells": cells, "comparisons": comparisons,
              "repeats": 2, "max_tokens": 128, "seed": 0, "schedule": None, "startup_s": {},
              "machine": {"cpu": "test", "cores": 2, "torch": "x"}}
    assert comparisons == [] and "no speculation (`none`), medians: bs 8: 0.900" in markdown(record)
    assert "Traffic: batch (closed batches" in markdown(record)  # a record from before steady traffic


def test_floors_and_copies_are_paired_with_what_they_measure_and_kept_out_of_the_rivals():
    # The machine drifts over the rounds; the copy of none is 3 % slower in every round, width 0 1 % slower.
    drift = [1.0, 0.8, 0.6, 0.9, 0.7]
    runs = _runs({"none": [100 * d for d in drift], "none#2": [97 * d for d in drift],
                  "joint-w0": [99 * d for d in drift], "joint": [90 * d for d in drift]})
    arms = arms_for(EngineSettings(), ["none", "none#2", "joint-w0", "joint"], None)
    cells, comparisons, controls = _summaries(runs, arms, [8], np.random.default_rng(0))
    assert {(c["mode"], c["against"]): round(c["ratio"], 3) for c in controls} == {
        ("none#2", "none"): 0.97, ("joint-w0", "none"): 0.99}
    assert {c["mode"]: c["verdict"] for c in controls} == {"none#2": "none faster", "joint-w0": "none faster"}
    record = {"batch_sizes": [8], "modes": ["none", "none#2", "joint-w0", "joint"], "cells": cells,
              "comparisons": comparisons, "controls": controls, "repeats": 5, "max_tokens": 128, "seed": 0,
              "schedule": None, "startup_s": {}, "build_order": ["joint", "none#2", "none", "joint-w0"],
              "machine": {"cpu": "test", "cores": 2, "torch": "x"}}
    text = markdown(record)
    assert "| none#2 ÷ none | 0.970 [0.97–0.97] none faster |" in text
    assert "bs 8: 0.900" in text  # joint ÷ none: the copy (97) and width 0 (99) are not rivals
    assert "engines built in the order joint, none#2, none, joint-w0" in text


def test_a_floor_built_a_b_b_a_is_also_measured_on_all_its_engines_together():
    # Each engine built later runs 2 % slower: none 100, joint-w0 98, joint-w0#2 96, none#2 94. Width 0 costs
    # nothing, and only the pooled ratio, (98 + 96) / (100 + 94), says so.
    runs = _runs({"none": [100.0] * 5, "joint-w0": [98.0] * 5, "joint-w0#2": [96.0] * 5, "none#2": [94.0] * 5})
    arms = arms_for(EngineSettings(), ["none", "joint-w0", "joint-w0#2", "none#2"], None)
    _, _, controls = _summaries(runs, arms, [8], np.random.default_rng(0))
    ratios = {(c["mode"], c["against"]): round(c["ratio"], 3) for c in controls}
    assert ratios == {("joint-w0", "none"): 0.98, ("joint-w0#2", "joint-w0"): 0.98, ("none#2", "none"): 0.94,
                      ("joint-w0 (2 engines)", "none (2 engines)"): 1.0}


def test_the_report_shows_predicted_beside_realized_at_each_cells_own_bucket_and_the_traffic():
    runs = _runs({"none": [100.0, 101.0], "joint": [110.0, 111.0]})
    arms = arms_for(EngineSettings(), ["none", "joint"], None)
    cells, comparisons, _ = _summaries(runs, arms, [8], np.random.default_rng(0))
    cells[1]["width_realized"] = {"8/3": {"tokens_per_s": 1790.4, "predicted_tokens_per_s": 1829.0, "samples": 222},
                                  "8/15": {"tokens_per_s": 2185.0, "predicted_tokens_per_s": 2156.0, "samples": 99,
                                           "tokens": 20.54, "ms": 9.4, "predicted_tokens": 20.27, "predicted_ms": 9.4},
                                  "4/15": {"tokens_per_s": 1.0, "predicted_tokens_per_s": 2.0, "samples": 5}}
    cells[1]["width_histogram"], cells[1]["speed_shifts"] = {3: 400, 15: 112}, {"4": 1, "8": 2}  # (keys: JSON's)
    record = {"batch_sizes": [8], "modes": ["none", "joint"], "cells": cells, "comparisons": comparisons,
              "repeats": 2, "max_tokens": 128, "seed": 0, "schedule": None, "startup_s": {}, "traffic": "steady",
              "waves": 3, "min_window": 32, "machine": {"cpu": "test", "cores": 2, "torch": "x"}}
    text = markdown(record)
    # bucket 4 is another cell's; a cycle's tokens and ms where the snapshot has them
    assert "- bs 8: width 3: 1790 / 1829 (222), width 15: 2185 / 2156 (99; 20.5 / 20.3 tokens in 9.4 / 9.4 ms)" \
        in text
    assert "- bs 8: {3: 400, 15: 112}, speed shifts noticed 2" in text
    assert "Traffic: steady (concurrency held at the batch size, 3 waves of requests per cell and at least 32 " \
           "admitted in the window" in text


class _FakeEngine:
    """An engine whose request (of prompt ``p``) emits ``speed[p]`` tokens a step until it has its ``max_tokens``;
    every step takes one tick of a fake clock, and ``prefill`` ticks more for each request admitted since the last.
    What ``_steady`` reads of vLLM's ``LLMEngine``, and nothing more."""

    def __init__(self, speed: dict[str, int], clock: list[float], prefill: float = 0.0) -> None:
        self.speed, self.clock, self.prefill = speed, clock, prefill
        self.running: dict[str, list] = {}
        self.in_flight: list[int] = []
        self.admitted = 0
        self.prefilled: list[int] = []  # requests admitted before each step

    def add_request(self, request_id, prompt, params):
        assert params.output_kind.name == "DELTA"
        self.running[request_id] = [prompt, 0, params.max_tokens]
        self.admitted += 1

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        from types import SimpleNamespace

        self.clock[0] += 1.0 + self.prefill * self.admitted
        self.prefilled.append(self.admitted)
        self.admitted = 0
        self.in_flight.append(len(self.running))
        outs = []
        for rid, state in list(self.running.items()):
            n = min(self.speed[state[0]], state[2] - state[1])
            state[1] += n
            done = state[1] >= state[2]
            outs.append(SimpleNamespace(request_id=rid, finished=done,
                                        outputs=[SimpleNamespace(token_ids=[len(rid)] * n)]))
            if done:
                del self.running[rid]
        return outs


def test_steady_traffic_holds_the_batch_full_and_times_only_that_window(monkeypatch):
    from types import SimpleNamespace

    from vllm import SamplingParams

    import dcut.bench.interleaved as interleaved

    clock = [0.0]
    monkeypatch.setattr(interleaved.time, "perf_counter", lambda: clock[0])
    engine = _FakeEngine({"fast": 4, "slow": 1}, clock=clock)
    prompts = ["fast", "slow"]
    out, tokens, wall = _steady(SimpleNamespace(llm_engine=engine), prompts, 2, 6,
                                Sampling.only(SamplingParams(max_tokens=8)))
    # Every request, in admission order, to its last token; the first wave's staggered (1/2 and 2/2 of the tokens).
    assert [len(o) for o in out] == [4, 8, 8, 8, 8, 8]
    # The short first request ends at tick 1, one more is admitted at once: two in flight until the last admission.
    first_drain = engine.in_flight.index(1)
    assert set(engine.in_flight[:first_drain]) == {2}
    # After a burn-in of two waves (requests 0-3), the window runs from request 4's first token (tick 9) to the last
    # request's (tick 11); the tokens are those emitted in ticks 10 and 11 (5 and 2).
    assert (tokens, wall) == (7, 2.0)
    with pytest.raises(RuntimeError, match="no window"):
        _steady(SimpleNamespace(llm_engine=_FakeEngine({"fast": 4}, clock)), ["fast"], 2, 2,
                Sampling.only(SamplingParams(max_tokens=8)))


class _ChunkedEngine:
    """Requests prefill ``work`` units each, first come first served, ``budget`` units a step less ``reserve`` for
    each request decoding (a speculative engine keeps room for every running request's drafts), then emit a token
    a step (the first as their prefill ends) to their ``max_tokens``. A step costs 1 tick plus ``cost`` per prefill
    unit."""

    def __init__(self, budget: int, reserve: int, clock: list[float], work: int = 6,
                 cost: float = 0.25) -> None:
        self.budget, self.reserve, self.clock, self.work, self.cost = budget, reserve, clock, work, cost
        self.requests: dict[str, list[int]] = {}  # prefilled units, tokens emitted

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = [0, 0, params.max_tokens]

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        from types import SimpleNamespace

        left = self.budget - self.reserve * sum(p >= self.work for p, _, _ in self.requests.values())
        ran, outs = 0, []
        for rid, state in list(self.requests.items()):
            if state[0] < self.work:
                n = min(max(left, 0), self.work - state[0])
                state[0], left, ran = state[0] + n, left - n, ran + n
                if state[0] < self.work:
                    continue
            state[1] += 1
            done = state[1] >= state[2]
            outs.append(SimpleNamespace(request_id=rid, finished=done, outputs=[SimpleNamespace(token_ids=[1])]))
            if done:
                del self.requests[rid]
        self.clock[0] += 1.0 + self.cost * ran
        return outs


@pytest.mark.parametrize(("budget", "reserve", "length"), [(24, 2, 8), (20, 1, 8), (16, 1, 16)])
def test_steady_window_holds_the_same_prefills_however_the_scheduler_chunks_them(monkeypatch, budget, reserve,
                                                                                length):
    """A cell's window measures what forty waves do, within 2.5 %, where the engine chunks prefills finer while
    requests decode. Bounded by finishes, it measured 5-8 % low here: the next wave's first prefills fell inside."""
    def rate(requests: int) -> float:
        return _steady_rate(monkeypatch, lambda clock: _ChunkedEngine(budget, reserve, clock), ["p"], 8, requests,
                            length)

    assert rate(steady_requests(8)) == pytest.approx(rate(40 * 8), rel=0.025)


@pytest.mark.parametrize("bs", [1, 2, 4, 8, 16])
def test_steady_window_measures_the_prompts_not_the_few_that_fill_it(monkeypatch, bs):
    """A cell's window holds enough admissions that its rate is the prompt set's, within 6 % of a window of
    hundreds, where prompts' speeds differ 16-fold (greedy: every repeat meets the same prompts, so only the window's
    size averages them). Three waves alone measured up to 35 % high here at bs 8 and 16 (live, MoE pair at bs 4:
    speculation measured 0.8x plain decoding where a long window put it at 1.05x)."""
    import dcut.bench.interleaved as interleaved

    speeds = [1, 4, 8, 2, 16, 1, 3, 12, 6, 1, 8, 16, 2, 5, 10, 1]
    prompts = [f"p{i}" for i in range(len(speeds))]

    def rate(requests: int) -> float:
        return _steady_rate(monkeypatch, lambda clock: _FakeEngine(dict(zip(prompts, speeds, strict=True)), clock),
                            prompts, bs, requests, 128)

    assert rate(interleaved.steady_requests(bs)) == pytest.approx(rate(400 * bs), rel=0.06)


@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("prefill", [0.0, 2.0])
def test_steady_window_measures_a_server_long_under_load(monkeypatch, bs, prefill):
    """Where prompts run at 1-16 tokens a step and a prefill costs time, a cell's window measures what a hundred
    waves do, within 2.5 %. A window opened on the second wave of a first wave of one length measured 4-56 % high
    here: in flight were one of each prompt, where under load slow prompts hold more of the slots; and plain
    decoding's lockstep waves prefilled together."""
    speeds = [1, 4, 8, 2, 16, 1, 3, 12, 6, 1, 8, 16, 2, 5, 10, 1]
    prompts = [f"p{i}" for i in range(len(speeds))]

    def rate(requests: int) -> float:
        return _steady_rate(monkeypatch,
                            lambda clock: _FakeEngine(dict(zip(prompts, speeds, strict=True)), clock, prefill),
                            prompts, bs, requests, 128)

    assert rate(steady_requests(bs)) == pytest.approx(rate(100 * bs), rel=0.025)


def test_steady_traffic_admits_plain_decoding_one_by_one_not_in_waves(monkeypatch):
    """Requests of one length at one token a step (plain decoding) finish together if they start together, and
    every wave after is prefilled at once: no server under load does that."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    import dcut.bench.interleaved as interleaved

    clock = [0.0]
    monkeypatch.setattr(interleaved.time, "perf_counter", lambda: clock[0])
    engine = _FakeEngine({"p": 1}, clock)
    _steady(SimpleNamespace(llm_engine=engine), ["p"], 8, steady_requests(8),
            Sampling.only(SamplingParams(max_tokens=16)))
    assert engine.prefilled[0] == 8 and max(engine.prefilled[1:]) == 1  # after the first wave, one at a time


def _steady_rate(monkeypatch, make_engine, prompts: list[str], bs: int, requests: int, max_tokens: int) -> float:
    """``_steady``'s tokens per tick on a fake engine built by ``make_engine(clock)``, timed by that fake clock."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    import dcut.bench.interleaved as interleaved

    clock = [0.0]
    monkeypatch.setattr(interleaved.time, "perf_counter", lambda: clock[0])
    _, tokens, wall = _steady(SimpleNamespace(llm_engine=make_engine(clock)), prompts, bs, requests,
                              Sampling.only(SamplingParams(max_tokens=max_tokens)))
    return tokens / wall


def test_mixed_sampling_alternates_greedy_and_sampled_requests_and_checks_only_the_greedy():
    """``mixed`` traffic: every other request at temperature 1 from the first wave on (both kinds in every batch);
    only the greedy requests' outputs are hashed against ``none``'s, and sampled traffic has nothing to compare."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    engine = _FakeEngine({"p": 2}, [0.0])
    temperatures: list[float] = []
    add = engine.add_request
    engine.add_request = lambda rid, prompt, params: (temperatures.append(params.temperature), add(rid, prompt, params))
    mixed = Sampling("mixed", SamplingParams(max_tokens=8, temperature=0.0), SamplingParams(max_tokens=8))
    out, _, _ = _steady(SimpleNamespace(llm_engine=engine), ["p"], 4, steady_requests(4), mixed)
    assert temperatures == [0.0, 1.0] * (len(out) // 2) + [0.0] * (len(out) % 2)
    assert temperatures[:4] == [0.0, 1.0, 0.0, 1.0]  # the first wave holds both kinds too
    ids = [[i, i] for i in range(4)]
    assert mixed.greedy_sha256(ids) == Sampling.only(mixed.greedy).greedy_sha256([ids[0], ids[2]])
    assert Sampling("sampled", mixed.greedy, mixed.sampled).greedy_sha256(ids) is None


def test_sampled_runs_claim_no_greedy_identity():
    runs = _runs({"none": [100.0] * 5, "joint": [101.0] * 5}, sha=None)
    cells, _, _ = _summaries(runs, arms_for(EngineSettings(), ["none", "joint"], None), [8], np.random.default_rng(0))
    assert {c["identical_to_none"] for c in cells} == {None}

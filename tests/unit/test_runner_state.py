"""`RunnerDCut`, the per-runner state machine, on synthetic tensors (no engine): what the vLLM hooks call
each step (begin_step -> choose_width -> on_drafted -> cut) and what it records."""

from __future__ import annotations

import math

import pytest
import torch

from dcut.cost_table import CostTable, Fingerprint
from dcut.settings import DCutSettings
from dcut.vllm.state import ACCOUNT_STEPS, CALIBRATION_STEPS, MAX_HOLD_STEPS, REDECIDE_STEPS, RunnerDCut, _held_for
from dcut.vllm.step_records import Decided
from dcut.width import WidthChoice

FP = Fingerprint(hardware="cpu", model="m", drafter="d", k=4)
REQS = ["a", "b"]


def _runner(**settings) -> RunnerDCut:
    return RunnerDCut(DCutSettings(**{"calibrate": False, **settings}), FP, k=4)


def _step(r: RunnerDCut, spec: dict[str, list[int]], log_conf: torch.Tensor | None,
          sampled: torch.Tensor | None = None) -> list[list[int]]:
    """One engine step: verify ``spec`` (``sampled``: vLLM's [bs, drafts + 1] with -1 for rejected), draft 4."""
    r.begin_step({q: 1 + len(spec.get(q, ())) for q in REQS}, spec)
    width = r.choose_width(len(REQS), 4)
    num_draft = [len(spec.get(q, ())) for q in REQS] if sampled is not None else None
    r.on_drafted(REQS, log_conf, sampled, num_draft)
    return r.cut(REQS, [[1, 2, 3, 4][:width], [5, 6, 7, 8][:width]])


def test_fixed_mode_cuts_the_least_confident_drafts_to_prefixes():
    r = _runner(mode="fixed", fixed_ratio=0.5)
    sure, unsure = math.log(0.95), math.log(0.2)
    log_conf = torch.tensor([[sure, sure, sure, unsure], [unsure, sure, sure, sure]])
    drafts = _step(r, {}, log_conf)
    # ratio 0.5 of the 2 x 5 verify slots, minus the 2 anchors: 3 drafts, all from request a.
    assert drafts == [[1, 2, 3], []]
    (record,) = r.window.records
    assert (record.proposed, record.kept, record.batch_size) == (8, 3, 2)


def test_acceptance_is_counted_from_the_sampled_tokens_next_step():
    r = _runner(mode="full")
    lc = torch.full((2, 4), math.log(0.9))
    drafts = _step(r, {}, lc)
    assert drafts == [[1, 2, 3, 4], [5, 6, 7, 8]]  # full: nothing cut
    # Next step verifies them: a accepts 2 of 4 (+ bonus), b none (only the target's own token).
    sampled = torch.tensor([[11, 12, 13, -1, -1], [21, -1, -1, -1, -1]])
    _step(r, {"a": drafts[0], "b": drafts[1]}, lc, sampled)
    last = r.window.records[-1]
    assert last.accepted == 2
    assert last.kept_per_position == [2, 2, 2, 2] and last.accepted_per_position == [1, 1, 0, 0]
    assert r.window.position_acceptance()[:3] == [0.5, 0.5, 0.0]


def test_calibration_learns_from_the_drafts_it_scored():
    r = RunnerDCut(DCutSettings(mode="reference", calibrate=True), FP, k=4)
    lc = torch.full((2, 4), math.log(0.9))
    for _ in range(3):
        drafts = _step(r, {}, lc)
        _step(r, {"a": drafts[0], "b": drafts[1]}, None, torch.tensor([[1, -1, -1, -1, -1]] * 2)[:, : 1 + 4])
    assert r.calibrators[4].reliability()["observations"][0] == 0  # 6 steps: held, not counted yet
    r.settle()
    rel = r.calibrators[4].reliability()
    assert rel["observations"][0] > 0 and rel["acceptance_rate"][0] == 0.0  # confident, never accepted


def test_outcomes_are_counted_every_account_steps_and_when_read():
    r = _runner(mode="full")
    lc = torch.full((2, 4), math.log(0.9))
    sampled = torch.tensor([[11, 12, -1, -1, -1], [21, -1, -1, -1, -1]])  # a accepts 1 draft, b none
    drafts = _step(r, {}, lc)
    for _ in range(ACCOUNT_STEPS - 2):
        drafts = _step(r, {"a": drafts[0], "b": drafts[1]}, lc, sampled)
    assert len(r._window) == 0 and r.steps == ACCOUNT_STEPS - 1  # held
    drafts = _step(r, {"a": drafts[0], "b": drafts[1]}, lc, sampled)
    assert len(r._window) == ACCOUNT_STEPS  # the eighth step counts all eight, in order
    assert [rec.accepted for rec in r._window.records] == [0] + [1] * (ACCOUNT_STEPS - 1)
    _step(r, {"a": drafts[0], "b": drafts[1]}, lc, sampled)
    assert len(r._window) == ACCOUNT_STEPS and len(r.window) == ACCOUNT_STEPS + 1  # reading settles


def test_calibrators_count_every_calibration_steps_and_first_when_decisions_begin():
    """Calibration updates are the dearest part of a step's accounting: they wait for ``CALIBRATION_STEPS`` steps
    of outcomes, except the first, which the first decisions after the calibration phase must see."""
    r = _runner(mode="full", calibrate=True)
    lc = torch.full((2, 4), math.log(0.9))
    sampled = torch.tensor([[11, 12, -1, -1, -1], [21, -1, -1, -1, -1]])
    drafts = _step(r, {}, lc)
    counted = []
    for _ in range(CALIBRATION_STEPS + ACCOUNT_STEPS):
        drafts = _step(r, {"a": drafts[0], "b": drafts[1]}, lc, sampled)
        counted.append(float(r.calibrators[4].count.sum()))  # the counts, without flushing what is held
    at = ACCOUNT_STEPS - 2  # the loop's step that is the engine's ACCOUNT_STEPS-th: the first settle
    first = counted[at]
    assert first > 0 and counted[:at] == [0.0] * at  # the first settle counts
    assert set(counted[at:at + CALIBRATION_STEPS]) == {first}  # then the outcomes wait
    assert counted[at + CALIBRATION_STEPS] > first

    joint = _runner(mode="joint", calibrate=True)
    joint.cost_table, joint.cost_source = CostTable(FP, {2: [(2, 10.0, 3), (10, 11.0, 3)]}, draft={
        2: {w: (1.0, 3) for w in (0, 1, 2, 3, 4)}}), "given"
    joint.calibrating = 6  # three probe steps at bs 2
    drafts = _step(joint, {}, lc)
    for _ in range(3):
        drafts = _step(joint, {"a": drafts[0], "b": drafts[1]}, lc, sampled)
    assert joint.calibrating <= 0 and joint.steps < ACCOUNT_STEPS
    assert float(joint.calibrators[4].count.sum()) > 0  # the first decision settled and counted the probes


def test_joint_chooses_a_listed_width_from_the_cost_table():
    table = CostTable(FP, {2: [(2, 10.0, 3), (10, 11.0, 3)]},
                      draft={2: {w: (0.1 if w == 0 else 30.0, 3) for w in (0, 1, 2, 3, 4)}})
    r = _runner(mode="joint")
    r.cost_table, r.cost_source = table, "given"
    r.begin_step({q: 1 for q in REQS}, {})
    width = r.choose_width(2, 4)
    assert width in r.widths
    # Drafting costs 3 plain steps: even the prior's acceptance cannot pay for it; width 0 wins unless probing.
    assert width == 0 or r.probe
    snap = r.snapshot()
    assert snap.cost_source == "given" and snap.settings.mode == "joint"


def test_hysteresis_holds_a_width_per_batch_size_bucket():
    """Drafting is nearly free at bs 2 and dearer than it can pay at bs 8: each bucket holds its own choice, and a
    decision at one leaves the other's alone (held engine-wide, the width of one batch size was kept at another)."""
    r = RunnerDCut(DCutSettings(mode="joint", calibrate=False, widths=[0, 4], probe_share=0.0), FP, k=4)
    r.cost_table = CostTable(FP, {2: [(2, 10.0, 3), (10, 10.1, 3)], 8: [(8, 10.0, 3), (40, 80.0, 3)]},
                             draft={2: {0: (0.1, 1), 4: (0.2, 1)}, 8: {0: (0.1, 1), 4: (30.0, 1)}})
    for bs in (2, 8, 2):
        r.begin_step({f"r{i}": 1 for i in range(bs)}, {})
        r.choose_width(bs, 4)
    assert (r.held_width(1), r.held_width(2), r.held_width(5), r.held_width(8)) == (4, 4, 0, 0)
    assert r.held_width(9) is None  # beyond the table


def test_no_probe_where_width_zero_is_chosen_and_no_width_could_beat_it():
    """Probes verify a whole block wherever one is due, but at a batch size where width 0 is chosen and no width's
    optimistic estimate beats it (drafting 30 ms against a 10 ms step), a probe could change nothing: none is taken,
    however large the share. Where a width is chosen (bs 2, drafting nearly free), the share is still spent."""
    r = RunnerDCut(DCutSettings(mode="joint", calibrate=False, widths=[0, 2, 4], probe_share=0.5), FP, k=4)
    r.cost_table = CostTable(FP, {2: [(2, 10.0, 3), (10, 10.1, 3)], 8: [(8, 10.0, 3), (40, 80.0, 3)]},
                             draft={2: {0: (0.1, 1), 4: (0.2, 1)}, 8: {0: (0.1, 1), 4: (30.0, 1)}})

    def widths(bs: int) -> list[tuple[int, bool]]:
        taken = []
        for _ in range(40):
            r.begin_step({f"r{i}": 1 for i in range(bs)}, {})
            taken.append((r.choose_width(bs, 4), r.probe))
        return taken

    assert widths(8) == [(0, False)] * 40
    assert r.held_width(8) == 0
    assert any(probe for _, probe in widths(2))


def test_a_catch_up_flush_is_charged_to_width_zero_not_to_the_drafting_width():
    clock = [0.0]
    r = RunnerDCut(DCutSettings(mode="joint", calibrate=False, widths=[0, 4]), FP, k=4, clock=lambda: clock[0])
    r.cost_table = CostTable(FP, {2: [(2, 10.0, 3), (10, 11.0, 3)]}, draft={2: {0: (0.1, 1), 4: (1.0, 1)}})
    r.begin_step({q: 1 for q in REQS}, {})
    r.choose_width(2, 4)
    r.width = 4
    start = r.mark()
    clock[0] += 0.005  # 5 ms of deferred drafter writes, then 1 ms drafting
    r.on_flush(start, rows=10)
    clock[0] += 0.001
    r.on_drafted(REQS, torch.zeros(2, 4), None, None)
    r.cut(REQS, [[1, 2, 3, 4], [5, 6, 7, 8]])  # (the step's times are read here, where an engine has waited)
    assert r.window.records[-1].draft_ms == pytest.approx(1.0)


def test_a_flush_charges_width_zeros_cycles_only_their_rows_share():
    """Four width-0 cycles of 10 ms at bs 2 stashed 8 rows of the 80 flushed (the rest: prompts of requests admitted
    at width 0, a pass every drafting width pays too, whatever its width): their 8 ms flush adds 0.8 ms, 0.2 a
    cycle."""
    clock = [0.0]
    r = RunnerDCut(DCutSettings(mode="joint", calibrate=False, widths=[0], probe_share=0.0), FP, k=4,
                   clock=lambda: clock[0])
    r.cost_table = CostTable(FP, {2: [(2, 10.0, 3), (10, 11.0, 3)]}, draft={2: {0: (0.1, 1), 4: (1.0, 1)}})
    for _ in range(5):  # each step opens a cycle, the last is not finished yet: four counted
        r.begin_step({q: 1 for q in REQS}, {})
        r.width = r.choose_width(2, 4)
        r.on_drafted(REQS, None, None, None)
        r.cut(REQS, [[], []])
        clock[0] += 0.010
    r.settle()  # the steps still held
    assert r.realized.summary()["2/0"]["samples"] == 4
    assert r.realized.summary()["2/0"]["tokens_per_s"] == pytest.approx(200.0)
    r.begin_step({q: 1 for q in REQS}, {})
    r.width = r.choose_width(2, 4)
    start = r.mark()
    clock[0] += 0.008
    r.on_flush(start, rows=80)
    r.on_drafted(REQS, None, None, None)
    r.cut(REQS, [[], []])  # (the flush's time is read, and charged, here)
    assert r.realized.summary()["2/0"]["tokens_per_s"] == pytest.approx(1000.0 * 2 / 10.2)


@pytest.mark.parametrize("mixed", [True, False])
def test_a_cycle_verified_beside_a_prefill_counts_with_its_time_unless_asked_not_to(mixed: bool):
    """Width 0 at bs 2, 10 ms a cycle; two of the verification steps also prefill a new request in a finished one's
    place (20 ms more). Counted (``count_mixed_steps=True``), the width pays for them; pure steps only (the default),
    it looks as fast as its pure steps."""
    clock = [0.0]
    r = RunnerDCut(DCutSettings(mode="joint", calibrate=False, widths=[0], probe_share=0.0, count_mixed_steps=mixed),
                   FP, k=4, clock=lambda: clock[0])
    r.cost_table = CostTable(FP, {2: [(2, 10.0, 3), (10, 11.0, 3)]}, draft={2: {0: (0.1, 1), 4: (1.0, 1)}})
    for step in range(7):
        clock[0] += 0.010
        prefill = step in (3, 5)
        r.begin_step({"a": 6 if prefill else 1, "b": 1}, {})
        clock[0] += 0.020 if prefill else 0.0  # the prompt, in the step's target forward
        r.width = r.choose_width(2, 4)
        r.on_drafted(REQS, None, None, None)
        r.cut(REQS, [[], []])
    r.settle()
    found = r.realized.summary()["2/0"]  # six cycles finish (steps 1-6): 12 tokens in 100 ms, or the pure 4 alone
    assert (found["samples"], found["tokens_per_s"]) == ((6, pytest.approx(120.0)) if mixed else
                                                         (4, pytest.approx(200.0)))


def test_joint_drafts_nothing_for_a_batch_whose_requests_lately_accepted_nothing():
    """Once a request's recent blocks predict its next one better than calibration does (acceptance in phases per
    request), a batch whose requests have lately accepted nothing is not drafted for; new requests are."""
    r = RunnerDCut(DCutSettings(mode="joint", calibrate=False, widths=[0, 4], probe_share=0.0), FP, k=4)
    r.cost_table = CostTable(FP, {2: [(2, 10.0, 3), (10, 10.1, 3)]}, draft={2: {0: (0.1, 1), 4: (6.0, 1)}})
    r.begin_step({q: 1 for q in REQS}, {})
    assert r.choose_width(2, 4, REQS) == 4  # drafting pays on calibration alone, by a fifth

    others = [f"p{i}" for i in range(4)]
    for t in range(200):  # other requests, accepting whole blocks or nothing in phases of 10 steps
        r.history.observe(others, [2.0] * 4, [4] * 4, [4 if ((t + 3 * i) // 10) % 2 == 0 else 0 for i in range(4)])
    r.history.observe(REQS, [2.0, 2.0], [4, 4], [0, 0])
    r.history.observe(REQS, [2.0, 2.0], [4, 4], [0, 0])
    assert r.history.useful
    assert r.choose_width(2, 4, REQS) == 0
    assert r.choose_width(2, 4, ["new1", "new2"]) == 4
    assert r.held_width(2) == 4  # the held decision is the calibrated one; the history only skips its drafts


def test_the_estimate_where_the_held_width_is_measured_is_what_it_delivered():
    """Autoscaling reads ``estimates``. Where the held width has been measured, the figure is what its cycles
    delivered, not the model's best width corrected (replayed, deep pair at bs 16: the model said width 15 at
    2,517 tokens/s, the policy held width 3, which delivered 2,285); a batch size not yet met keeps the model's."""
    r = RunnerDCut(DCutSettings(mode="joint", calibrate=False, widths=[0, 4], probe_share=0.0), FP, k=4)
    r.cost_table = CostTable(FP, {2: [(2, 10.0, 3), (10, 10.1, 3)], 8: [(8, 10.0, 3), (40, 10.4, 3)]},
                             draft={2: {0: (0.1, 1), 4: (0.2, 1)}, 8: {0: (0.1, 1), 4: (0.2, 1)}})
    _step(r, {}, torch.zeros(2, 4))
    model = {e.batch_size: e.tokens_per_s for e in r.estimates()}
    held = r.held_width(2)
    assert held == 4 and r.realized.delivered(2, held) is None  # nothing measured yet: the model's figure
    # The held width's cycles: 3 tokens in 25 ms, where the kept drafts' confidences promised 4 in 10.2 (the model's
    # survival curve promises more: it is not what the cycles' predictions rest on)
    for _ in range(40):
        r.realized.add(2, held, 3.0, 25.0, 4.0, 10.2)
    estimates = {e.batch_size: e for e in r.estimates()}
    assert estimates[2].tokens_per_s == pytest.approx(120.0)
    assert (estimates[2].tokens_per_step, estimates[2].step_ms) == pytest.approx((3.0, 25.0))
    assert estimates[8].tokens_per_s == pytest.approx(model[8])


def test_a_cached_table_lacking_batch_sizes_gets_them_profiled_and_cached(tmp_path) -> None:
    """The fingerprint leaves out max_num_seqs: an engine of more sequences than the one that cached the table
    profiles the batch sizes it lacks (only those), and caches the union; one of fewer sequences profiles nothing."""
    shapes: list[tuple[int, int]] = []

    def run_step(bs: int, tokens: int, context: int | None = None) -> None:
        shapes.append((bs, tokens))

    def run_draft(bs: int, width: int) -> None:
        pass

    settings = {"mode": "joint", "cache_dir": str(tmp_path), "profile_warmups": 0, "profile_repeats": 1}
    first = _runner(**settings)
    first.load_or_profile(run_step, run_draft, [1, 2])
    assert first.cost_source == "profiled" and sorted(first.cost_table.points) == [1, 2]
    shapes.clear()
    wider = _runner(**settings)
    wider.load_or_profile(run_step, run_draft, [1, 2, 4, 8])
    assert wider.cost_source == "cache" and sorted(wider.cost_table.points) == [1, 2, 4, 8]
    assert {bs for bs, _ in shapes} == {4, 8}  # only what the cache lacked
    assert wider.cost_table.points[1] == first.cost_table.points[1]
    assert sorted(CostTable.load(wider.cache_path()).points) == [1, 2, 4, 8]
    shapes.clear()
    narrower = _runner(**settings)
    narrower.load_or_profile(run_step, run_draft, [1, 2])
    assert narrower.cost_source == "cache" and not shapes and sorted(narrower.cost_table.points) == [1, 2, 4, 8]


def test_a_decision_found_unchanged_is_held_twice_as_long_and_a_change_takes_it_back_to_the_start():
    def decided(width: int | None) -> Decided:
        return Decided(0, 16, None if width is None else WidthChoice(width, width, 20.0, 10.0))

    first = _held_for(decided(3), None)
    assert first.hold == REDECIDE_STEPS
    holds, last = [], first
    for _ in range(5):
        last = _held_for(decided(3), last)
        holds.append(last.hold)
    assert holds == [min(REDECIDE_STEPS * 2 ** i, MAX_HOLD_STEPS) for i in range(1, 6)]
    assert holds[-1] == MAX_HOLD_STEPS > REDECIDE_STEPS
    assert _held_for(decided(5), last).hold == REDECIDE_STEPS  # another width: watched closely again
    assert _held_for(decided(None), last).hold == REDECIDE_STEPS  # no cost known: nothing to hold on to


@pytest.mark.parametrize("order", [["a", "b"], ["b", "a"], ["b"]])
def test_calibration_pairs_each_verified_block_with_its_own_drafts_whatever_the_batch_order(order: list[str]):
    """Drafted as [a, b], verified in ``order`` (vLLM may reorder or drop requests between the two steps): a's
    confident block was accepted whole and b's unsure one rejected, and the calibrator counts them at their own
    confidences."""
    r = RunnerDCut(DCutSettings(mode="full", calibrate=True), FP, k=4)
    sure, unsure = 0.95, 0.35
    r.begin_step({q: 1 for q in REQS}, {})
    r.choose_width(2, 4)
    r.on_drafted(REQS, torch.log(torch.tensor([[sure] * 4, [unsure] * 4])), None, None)
    drafts = dict(zip(REQS, r.cut(REQS, [[1, 2, 3, 4], [5, 6, 7, 8]]), strict=True))
    sampled = {"a": [11, 12, 13, 14, 15], "b": [21, -1, -1, -1, -1]}
    r.begin_step({q: 5 for q in order}, {q: drafts[q] for q in order})
    r.choose_width(len(order), 4)
    r.on_drafted(order, None, torch.tensor([sampled[q] for q in order]), [4] * len(order))
    r.cut(order, [[] for _ in order])
    r.settle()
    calibrator = r.calibrators[4]
    at = {q: calibrator._bin(torch.tensor(p).numpy()) for q, p in (("a", sure), ("b", unsure))}
    assert calibrator.count[0, at["b"]] == (1 if "b" in order else 0)
    assert calibrator.accepted[0, at["b"]] == 0
    assert calibrator.count[:, at["a"]].tolist() == ([1, 1, 1, 1] if "a" in order else [0, 0, 0, 0])
    assert calibrator.accepted[:, at["a"]].tolist() == calibrator.count[:, at["a"]].tolist()

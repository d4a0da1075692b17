"""Step records, window summaries and throughput estimates on hand-checkable numbers."""

from __future__ import annotations

import json

import pytest

from dcut.cost_table import CostTable, Fingerprint
from dcut.settings import DCutSettings
from dcut.telemetry import (
    StepRecord,
    StepWindow,
    ThroughputEstimate,
    capacity,
    demand,
    expected_tokens_per_step,
    step_time,
    throughput_by_batch_size,
)


def record(bs: int, proposed: int, kept: int, accepted: list[int], kept_pos: list[int],
           step_ms: float | None = None) -> StepRecord:
    return StepRecord(batch_size=bs, proposed=proposed, kept=kept, accepted=sum(accepted),
                      accepted_per_position=accepted, kept_per_position=kept_pos, step_ms=step_ms,
                      timestamp=0.0)


def test_window_summaries() -> None:
    w = StepWindow(maxlen=2)
    w.add(record(9, 9, 9, [9], [9]))  # pushed out by maxlen
    w.add(record(2, 6, 3, [2, 1, 0], [2, 1, 0], 10.0))
    w.add(record(4, 12, 12, [4, 2, 1], [4, 4, 4], 20.0))
    assert len(w) == 2
    assert w.mean_keep_ratio() == pytest.approx(0.75)  # (0.5 + 1.0) / 2
    assert w.mean_accepted_length() == pytest.approx(10 / 6)
    assert w.keep_ratio_histogram() == [0, 0, 0, 0, 0, 1, 0, 0, 0, 1]
    assert w.position_acceptance() == [1.0, 0.6, 0.25]
    assert w.acceptance_curve() == [1.0, 0.6, 0.25]
    assert w.batch_size_histogram() == {2: 1, 4: 1}
    assert w.mean_step_ms() == {2: 10.0, 4: 20.0}
    summary = json.loads(json.dumps(w.summary()))
    assert summary["steps"] == 2 and summary["batch_size_histogram"] == {"2": 1, "4": 1}


def test_totals_outlive_the_window() -> None:
    """The window keeps the last steps; the totals count every step, so two readings give what ran between."""
    w = StepWindow(maxlen=2)
    w.add(record(4, 40, 20, [4, 2], [4, 4]))
    first = (w.totals.steps, w.totals.accepted, w.totals.request_steps)
    w.add(record(2, 20, 20, [1, 0], [2, 2]))
    w.add(record(2, 0, 0, [], []))  # proposed nothing: no keep ratio
    assert len(w) == 2 and first == (1, 6, 4)
    t = w.totals
    assert (t.steps, t.request_steps, t.proposed, t.kept, t.accepted) == (3, 8, 60, 40, 7)
    assert t.keep_ratio_steps == 2 and t.keep_ratio_sum == pytest.approx(0.5 + 1.0)
    # between the first reading and now: 1 accepted draft over 4 request-steps
    assert (t.accepted - first[1]) / (t.request_steps - first[2]) == pytest.approx(0.25)


def test_acceptance_curve_is_non_increasing_and_zero_where_unseen() -> None:
    w = StepWindow()
    w.add(record(4, 12, 8, [2, 2, 0], [4, 2, 0]))
    assert w.position_acceptance() == [0.5, 1.0, None]
    assert w.acceptance_curve() == [0.5, 0.5, 0.0]
    assert StepWindow().summary()["mean_keep_ratio"] is None


def flat_table() -> CostTable:
    fp = Fingerprint(hardware="t", model="m", k=2)
    return CostTable(fp, {1: [(1, 10.0, 1), (3, 10.0, 1)], 4: [(4, 20.0, 1), (12, 40.0, 1)]})


def test_expected_tokens_and_step_time() -> None:
    off = DCutSettings(mode="full")
    tokens, kept = expected_tokens_per_step(4, [0.5, 0.25], off, flat_table())
    assert (tokens, kept) == (pytest.approx(4 + 4 * 0.75), 8)
    assert step_time(4, kept, flat_table(), draft_ms=2.0) == pytest.approx(40.0 + 2.0)
    assert step_time(8, 0, flat_table()) is None
    # the bonus flag changes the decision's numerator, never E(b)'s count of bonus tokens
    bonus = DCutSettings(mode="full", count_bonus=True)
    assert expected_tokens_per_step(4, [0.5, 0.25], bonus, flat_table())[0] == pytest.approx(7.0)
    fixed = DCutSettings(mode="fixed", fixed_ratio=0.5)  # ceil(0.5 * 4 * 3) - 4 = 2 drafts, both 0.5
    assert expected_tokens_per_step(4, [0.5, 0.25], fixed, None) == (pytest.approx(5.0), 2)


def test_throughput_capacity_demand() -> None:
    off = DCutSettings(mode="full")
    est = throughput_by_batch_size([1, 4, 8], [0.5, 0.25], off, flat_table())
    assert [e.batch_size for e in est] == [1, 4]  # 8 is beyond the table
    one, four = est
    assert one.tokens_per_s == pytest.approx(1.75 / 10.0 * 1000)  # 175
    assert four.tokens_per_s == pytest.approx(7.0 / 40.0 * 1000)  # 175
    assert four.request_tokens_per_s == pytest.approx(43.75)
    # capacity: the objective rate x the most requests run at once that each still get it
    assert capacity(est, min_request_rate=40.0) == pytest.approx(40.0 * 4)  # batch 4: 43.75 each
    assert capacity(est, min_request_rate=50.0) == pytest.approx(50.0 * 1)  # only batch 1 meets it
    assert capacity(est, min_request_rate=500.0) == 500.0  # none does: one request at a time
    assert capacity(est, min_request_rate=40.0, max_batch_size=2) == pytest.approx(40.0)  # max_num_seqs bounds it
    assert capacity([], 40.0) == 0.0
    with_two = [ThroughputEstimate(2, 3.0, 10.0, 300.0, 150.0), *est]
    assert capacity(with_two, 100.0) == 200.0
    # in demand's units: a replica holding as many requests as it can run at the objective is fully used
    assert demand(running=4, waiting=0, per_request_rate=40.0) == capacity(est, 40.0)
    assert demand(running=3, waiting=2, per_request_rate=20.0) == 100.0


def test_prometheus_counts_a_few_steps_at_once_as_each_step_alone() -> None:
    from dcut.vllm import prometheus

    def sample(name: str, **labels: str) -> float:
        """Read from the metrics themselves: an engine started in the same process unregisters every ``vllm:``
        collector from the default registry (vLLM's ``unregister_vllm_metrics``)."""
        want = {"model_name": "batched", **labels}
        return sum(s.value for metric in prometheus._metrics().values() for family in metric.collect()
                   for s in family.samples if s.name == name and s.labels == want)

    steps = [record(2, 8, 4, [2, 1, 0, 0], [2, 2, 0, 0]), record(2, 0, 0, [0] * 4, [0] * 4),
             record(1, 4, 3, [1, 1, 1, 0], [1, 1, 1, 0])]
    for r in steps:
        r.ratio, r.budget = (r.kept / r.proposed if r.proposed else 1.0), r.kept
    prometheus.observe(steps, "batched", shifts=2)
    assert sample("vllm:dcut_steps_total") == 3 and sample("vllm:dcut_speed_shifts_total") == 2
    assert sample("vllm:dcut_drafts_kept_total") == 7 and sample("vllm:dcut_drafts_accepted_total") == 6
    assert sample("vllm:dcut_verify_tokens_total") == 5 + 7  # bs + kept drafts, summed over the steps
    assert [sample("vllm:dcut_drafts_accepted_per_pos_total", position=str(p)) for p in (1, 2, 3, 4)] == [3, 2, 1, 0]
    assert sample("vllm:dcut_keep_ratio_count") == 2  # steps that proposed drafts, each observed

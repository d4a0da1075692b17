"""Learned state shared across a fleet (`dcut.learned`): a second replica starts where the first converged."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from dcut.cost_table import CostTable, Fingerprint
from dcut.learned import LearnedState, RealizedCell, merge
from dcut.replay.cases import custom_case
from dcut.replay.simulate import Pools, RunnerPolicy, SimClock, run_cell
from dcut.settings import DCutSettings
from dcut.snapshot import DCutSnapshot, Overhead, WindowSummary
from dcut.vllm.state import CALIBRATE_REQUESTS
from dcut.width import RealizedRates
from deployments.controller import DCutController
from deployments.records import EngineLoad, ReplicaReport
from deployments.settings import AutoscalingSettings, ControllerSettings

DATA = Path(__file__).resolve().parents[1] / "data" / "replay"
JOINT = DCutSettings(mode="joint", widths=[0, 1, 3, 7, 15])


class Recording(RunnerPolicy):
    """The runner, noting the width it chose (not an exploring or probe step) at every step."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.held: list[int | None] = []

    def width(self, bs: int, last: object) -> int:
        width = super().width(bs, last)
        self.held.append(self.runner.held_width(bs))
        return width


@pytest.fixture(scope="module")
def case():
    torch.set_num_threads(1)
    return custom_case(DATA / "deep-small.npz", DATA / "deep-small-costs.json", "4")


def test_a_second_replica_starts_with_the_first_ones_choice(case):
    pools, bs = Pools(case.trace), 4
    clock = SimClock()
    first = Recording("joint", JOINT, case.cost.for_policies(), case.trace.k, clock)
    run_cell(first, bs, pools, case.cost, steps=300, warmup=0, clock=clock)
    converged = first.held[-1]
    assert first.held.count(converged) < len(first.held)  # the first replica had to find it

    # What the controller hands a starting replica: the fleet's refined cost table and learned state, as JSON.
    state = LearnedState.model_validate_json(first.runner.learned().model_dump_json())
    table = CostTable.from_json(first.runner.cost_table.to_json())
    clock = SimClock()
    second = Recording("joint", JOINT, case.cost.for_policies(), case.trace.k, clock)
    second.runner.cost_table = table
    second.runner.adopt(state)
    run_cell(second, bs, pools, case.cost, steps=50, warmup=0, clock=clock)
    # The first replica's choice, or the width its measurements rank first where hysteresis kept it from switching.
    measured = {int(k.split("/")[1]): v["tokens_per_s"] for k, v in first.runner.realized.summary().items()
                if k.startswith(f"{bs}/") and v["samples"] >= 3}
    assert len(set(second.held)) == 1 and second.held[0] in {converged, max(measured, key=measured.get)}

    clock = SimClock()
    cold = Recording("joint", JOINT, case.cost.for_policies(), case.trace.k, clock)
    cold.runner.cost_table = CostTable.from_json(table.to_json())
    run_cell(cold, bs, pools, case.cost, steps=50, warmup=0, clock=clock)
    assert cold.held != second.held  # without it, the same start calibrates and explores first


def test_a_fresh_runner_verifies_full_blocks_before_it_decides(case):
    """Calibration from nothing: the first CALIBRATE_REQUESTS requests draft the full width and verify all of it
    (probes, which the realized rates do not count); only then is a width chosen."""
    pools, bs, clock = Pools(case.trace), 4, SimClock()
    fresh = Recording("joint", JOINT, case.cost.for_policies(), case.trace.k, clock)
    cell = run_cell(fresh, bs, pools, case.cost, steps=40, warmup=0, clock=clock)
    probes = CALIBRATE_REQUESTS // bs
    assert fresh.held[:probes] == [None] * probes and fresh.held[probes] is not None
    assert cell.widths.get(case.trace.k, 0) >= probes
    assert sum(fresh.runner.pooled_calibrator.count[0].tolist()) >= CALIBRATE_REQUESTS - bs  # outcomes lag a step


def test_a_runner_pinned_at_a_width_calibrates_at_that_width(case):
    """Pinned at width 3 (``widths: [3]``), the calibrating start drafts width 3, whose calibrator it then reads:
    blocks of K would teach no calibrator it uses, at the cost of K's steps."""
    pools, bs, clock = Pools(case.trace), 4, SimClock()
    pinned = Recording("joint-w3", JOINT.model_copy(update={"widths": [3]}), case.cost.for_policies(), case.trace.k,
                       clock)
    cell = run_cell(pinned, bs, pools, case.cost, steps=40, warmup=0, clock=clock)
    assert set(cell.widths) == {3}
    assert sum(pinned.runner.calibrators[3].count[0].tolist()) >= CALIBRATE_REQUESTS - bs


def _state(reached: float, expected: float, requests: float, n: int, rate: float) -> LearnedState:
    return LearnedState(fingerprint="f", k=2, widths=[0, 2], reached=[[0, 0], [reached, reached]],
                        accepted=[[0, 0], [reached / 2, 0]], expected=[[0, 0], [expected, expected / 2]],
                        expected_requests=[0, requests],
                        realized=[RealizedCell(bucket=4, width=2, tokens=8, ms=4, predicted_tokens=8, predicted_ms=4,
                                               rate=rate, rate_var=0.0, n=n)])


def test_merge_adds_counts_and_weighs_means_by_them():
    merged = merge([_state(10, 0.9, 30, 3, 2.0), _state(30, 0.5, 10, 1, 4.0)])
    assert merged.reached[1] == [40, 40] and merged.accepted[1] == [20, 0]
    assert merged.expected[1][0] == pytest.approx((0.9 * 30 + 0.5 * 10) / 40)
    (cell,) = merged.realized
    assert cell.n == 4 and cell.rate == pytest.approx(2.5) and cell.rate_var == pytest.approx(0.75)
    with pytest.raises(ValueError, match="different"):
        merge([_state(1, 0.5, 1, 1, 1.0), _state(1, 0.5, 1, 1, 1.0).model_copy(update={"widths": [0, 3]})])


def test_merge_pools_the_spreads_of_what_cycles_delivered_and_took():
    """Two replicas whose width delivered 0.5 and 1.5 times its predicted tokens on steady cycles, and took 1.0 and
    1.2 times its predicted time: merged, the spreads are the replicas' differences (the bound a new replica puts on
    the width is as wide as the fleet's)."""
    a, b = _state(10, 0.9, 30, 2, 2.0), _state(10, 0.9, 30, 2, 2.0)
    a.realized[0] = a.realized[0].model_copy(update={"tokens": 4.0, "ratio_var": 0.01})
    b.realized[0] = b.realized[0].model_copy(update={"tokens": 12.0, "ms": 4.8, "time_var": 0.02})
    (cell,) = merge([a, b]).realized
    assert cell.ratio_var == pytest.approx(0.005 + 0.25) and cell.time_var == pytest.approx(0.01 + 0.01)
    rates = RealizedRates()
    rates.load([cell])
    assert rates.cells()[0].ratio_var == pytest.approx(cell.ratio_var)  # kept as loaded, handed on as kept


def test_merge_weighs_what_a_widths_positions_were_worth_by_cycles():
    """What each position of a width's blocks was worth (``RealizedRates``' yardstick for the requests of now):
    weighted by cycles, over the replicas that kept it, and handed on as merged."""
    a, b, old = _state(10, 0.9, 30, 3, 2.0), _state(10, 0.9, 30, 1, 2.0), _state(10, 0.9, 30, 5, 2.0)
    a.realized[0] = a.realized[0].model_copy(update={"gains": [0.8, 0.4], "requests": 4.0})
    b.realized[0] = b.realized[0].model_copy(update={"gains": [0.4, 0.0], "requests": 4.0})
    (cell,) = merge([a, b, old]).realized  # (``old``: saved before gains were kept)
    assert cell.gains == pytest.approx([0.7, 0.3]) and cell.requests == pytest.approx(4.0)
    rates = RealizedRates()
    rates.load([cell])
    assert rates.cells()[0].gains == pytest.approx(cell.gains)


def test_the_controller_hands_a_starting_replica_what_the_fleet_learned():
    fp = Fingerprint(hardware="cpu", model="m", drafter="d", k=2)
    table = CostTable(fp, {4: [(4, 1.0, 1), (12, 2.0, 1)]}).to_json()

    def report(replica: str, state: LearnedState) -> dict:
        snap = DCutSnapshot(settings=DCutSettings(mode="joint"), fingerprint=fp, cost_source="profiled", steps=1,
                            window=WindowSummary(steps=1), overhead=Overhead(per_step_ms=0.0, per_token_ms=0.0),
                            cost_table=table, learned=state.model_copy(update={"fingerprint": fp.key()}))
        return ReplicaReport(replica_id=replica, served_model_name="m", fingerprint=fp.key(), start_seconds=1.0,
                             sent_at=time.time(), interval_s=2.0, load=EngineLoad(), capacity_tokens_per_s=1.0,
                             capacity_from="estimates", demand_tokens_per_s=0.0, dcut=snap).model_dump(mode="json")

    c = DCutController(ControllerSettings(), AutoscalingSettings())
    c.report(report("a", _state(10, 0.9, 30, 3, 2.0)))
    c.report(report("b", _state(30, 0.5, 10, 1, 4.0)))
    offer = c.offer_cost_table(fp.key(), "c")
    assert offer["action"] == "use"
    learned = LearnedState.model_validate(offer["learned"])
    assert learned.reached[1] == [40, 40] and learned.realized[0].n == 4

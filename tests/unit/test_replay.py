"""The replay loop (`dcut.replay.simulate`) on hand-made traces and a linear cost model: accounting,
common draws, request slots walking by the tokens they emit, the oracle as an upper bound, and the runner replayed
deterministically."""

from __future__ import annotations

import numpy as np
import pytest

from dcut.cost_table import CostTable, Fingerprint
from dcut.replay.costs import CostModel
from dcut.replay.policy import FixedWidth
from dcut.replay.simulate import Drift, Pools, RunnerPolicy, SimClock, confidence_oracle, oracle, pooled, run_cell
from dcut.settings import DCutSettings
from dcut.trace import from_rows

K = 4
SIZES = (1, 2, 4, 8)


def linear_cost(base: float = 10.0, per_token: float = 1.0, draft_per_width: float = 0.5,
                overhead: tuple[float, float] = (1.0, 0.1)) -> CostModel:
    """verify = base + per_token * tokens; draft = draft_per_width * bs * width."""
    fp = Fingerprint(hardware="test", model="m", drafter="d", k=K)
    points = {b: [(t, base + per_token * t, 1) for t in range(b, b * (K + 1) + 1)] for b in SIZES}
    draft = {b: {w: (draft_per_width * b * w + 0.01, 1) for w in range(K + 1)} for b in SIZES}
    return CostModel("linear", CostTable(fp, points, draft=draft), *overhead)


def trace(rng_seed: int = 0, rows: int = 64):
    """Widths 1, 2, 4; confidences that rank acceptance well (a request accepts while its confidence > 0.5)."""
    rng = np.random.default_rng(rng_seed)
    steps = []
    for w in (1, 2, 4):
        p = rng.uniform(0.2, 1.0, size=(rows, w))
        conf = np.sort(p, axis=1)[:, ::-1]
        accepted = (conf > 0.5).cumprod(axis=1).sum(axis=1)
        steps.append({"bs": rows, "width": w, "log_conf": np.log(conf), "accepted": accepted})
    return from_rows(K, steps)


def test_none_and_fixed_width_accounting():
    cost, pools = linear_cost(), Pools(trace())
    none = run_cell(FixedWidth(0), 4, pools, cost, steps=10, warmup=0, none=True)
    assert none.tokens == 40 and none.ms == pytest.approx(10 * (10 + 4 + 1 + 0.4))
    fixed = run_cell(FixedWidth(2), 4, pools, cost, steps=20, warmup=5)
    _, acc = pools.walk(4).rows(2)
    assert fixed.widths == {2: 20} and fixed.verified_drafts == 20 * 8 == fixed.drafted
    assert fixed.tokens >= 20 * 4 and fixed.tokens_per_s > 0
    assert acc.shape == (4,)


def test_a_drifting_machine_slows_every_cost_of_alternate_stretches():
    """Steps 0-4 at speed, 5-9 at 2x, 10-14 at speed: every part of a step (verify, drafter, overhead) pays it (all
    steps of ``none`` cost the same: 20 steps' worth), the same tokens come out, and the runner's clock reads the
    slowed times."""
    cost, pools = linear_cost(), Pools(trace())
    drift = Drift(2.0, 5)
    assert [drift(n) for n in (0, 4, 5, 9, 10)] == [1.0, 1.0, 2.0, 2.0, 1.0]
    steady = run_cell(FixedWidth(0), 4, pools, cost, steps=15, warmup=0, none=True)
    slowed = run_cell(FixedWidth(0), 4, pools, cost, steps=15, warmup=0, none=True, drift=drift)
    assert slowed.tokens == steady.tokens and slowed.ms == pytest.approx(steady.ms * 20 / 15)
    fixed = [run_cell(FixedWidth(2), 4, pools, cost, 15, 0, drift=d) for d in (None, drift)]
    assert fixed[1].tokens == fixed[0].tokens and fixed[0].ms < fixed[1].ms < 2 * fixed[0].ms  # (steps differ)
    clock = SimClock()
    run_cell(RunnerPolicy("full", DCutSettings(mode="full"), cost, K, clock), 4, pools, cost, 15, 0, clock,
             drift=drift)
    assert clock.t * 1000.0 == pytest.approx(run_cell(FixedWidth(K), 4, pools, cost, 15, 0, drift=drift).ms)
    with pytest.raises(ValueError, match="factor > 0"):
        Drift(0.0, 5)


def test_a_jittery_machine_scatters_each_step_alike_for_every_policy():
    """Jitter multiplies each step's costs by its own draw: mean one over many steps, the same draw at the same step
    (whichever policy, however often asked), another seed other draws; it changes times, not tokens."""
    jitter = Drift(jitter=0.2, seed=3)
    draws = np.array([jitter(n) for n in range(4000)])
    assert draws.min() > 0 and draws.std() > 0.1 and draws.mean() == pytest.approx(1.0, abs=0.02)
    assert jitter(17) == Drift(jitter=0.2, seed=3)(17) != Drift(jitter=0.2, seed=4)(17)
    assert Drift(2.0, 5, jitter=0.2, seed=3)(7) == pytest.approx(2.0 * jitter(7))  # the stretch, then the draw
    cost, pools = linear_cost(), Pools(trace())
    steady, jittery = (run_cell(FixedWidth(2), 4, pools, cost, 15, 0, drift=d) for d in (None, jitter))
    assert jittery.tokens == steady.tokens and jittery.ms != pytest.approx(steady.ms)
    with pytest.raises(ValueError, match="spread"):
        Drift(jitter=-0.1)


@pytest.mark.parametrize("bs", (1, 4))
def test_the_oracle_bounds_every_policy_on_a_drifting_machine(bs):
    cost, pools, drift = linear_cost(), Pools(trace()), Drift(3.0, 7)
    best = oracle(bs, pools, cost, steps=40, warmup=2, drift=drift)
    assert best.ms > oracle(bs, pools, cost, steps=40, warmup=2).ms
    for w in (0, 1, 2, 4):
        cell = run_cell(FixedWidth(w), bs, pools, cost, 40, 2, none=w == 0, drift=drift)
        assert cell.tokens_per_s <= best.tokens_per_s * (1 + 1e-9)
    clock = SimClock()
    joint = run_cell(RunnerPolicy("joint", DCutSettings(mode="joint", widths=[0, 1, 2, 4]), cost, K, clock),
                     bs, pools, cost, 40, 2, clock, drift=drift)
    assert joint.tokens_per_s <= best.tokens_per_s * (1 + 1e-9)
    assert confidence_oracle(bs, pools, cost, 40, 2, drift).tokens_per_s <= best.tokens_per_s * 1.02


def test_policies_drafting_the_same_width_see_the_same_draws():
    cost, pools = linear_cost(), Pools(trace())
    a = run_cell(FixedWidth(4), 2, pools, cost, steps=30, warmup=3)
    clock = SimClock()
    b = run_cell(RunnerPolicy("full", DCutSettings(mode="full"), cost, K, clock), 2, pools, cost, 30, 3, clock)
    assert (a.tokens, a.ms) == (b.tokens, pytest.approx(b.ms))


@pytest.mark.parametrize("bs", SIZES)
def test_the_oracle_bounds_every_policy(bs):
    cost, pools = linear_cost(), Pools(trace())
    best = oracle(bs, pools, cost, steps=40, warmup=2)
    for w in (0, 1, 2, 4):
        cell = run_cell(FixedWidth(w), bs, pools, cost, 40, 2, none=w == 0)
        assert cell.tokens_per_s <= best.tokens_per_s * (1 + 1e-9)
    clock = SimClock()
    joint = run_cell(RunnerPolicy("joint", DCutSettings(mode="joint", widths=[0, 1, 2, 4]), cost, K, clock),
                     bs, pools, cost, 40, 2, clock)
    assert joint.tokens_per_s <= best.tokens_per_s * (1 + 1e-9)


@pytest.mark.parametrize("bs", SIZES)
def test_the_confidence_oracle_lies_between_what_confidences_rank_and_the_oracle(bs):
    """It knows every width's confidences (which here rank acceptance perfectly) but not the outcomes: about the
    oracle at most, and at least the best fixed width, which verifies every draft whatever it is worth. (About:
    each picks step by step, and a pick moves its slots on by what it emits, so a different pick now meets other
    rows later; neither is the best path over the whole walk.)"""
    cost, pools = linear_cost(), Pools(trace())
    signals = confidence_oracle(bs, pools, cost, steps=40, warmup=2)
    assert signals.policy == "oracle-conf" and sum(signals.widths.values()) == 40
    assert signals.tokens_per_s <= oracle(bs, pools, cost, steps=40, warmup=2).tokens_per_s * 1.02
    fixed = max(run_cell(FixedWidth(w), bs, pools, cost, 40, 2, none=w == 0).tokens_per_s for w in (0, 1, 2, 4))
    assert signals.tokens_per_s >= fixed * (1 - 1e-9)


def test_the_oracle_stops_drafting_when_drafting_is_dear():
    dear = linear_cost(draft_per_width=100.0)
    best = oracle(8, Pools(trace()), dear, steps=20, warmup=0)
    assert best.widths == {0: 20}


def test_the_runner_replays_bit_identically():
    cost, pools = linear_cost(), Pools(trace())

    def once() -> tuple[float, float, dict[int, int]]:
        clock = SimClock()
        policy = RunnerPolicy("joint", DCutSettings(mode="joint", widths=[0, 1, 2, 4]), cost, K, clock)
        cell = run_cell(policy, 4, pools, cost, 60, 10, clock)
        return cell.tokens, cell.ms, cell.widths

    assert once() == once()


def test_a_trace_without_verified_rows_is_refused():
    t = from_rows(K, [{"bs": 1, "width": 2, "log_conf": [[-0.1, -0.1]], "accepted": [-1]}])
    with pytest.raises(ValueError, match="no fully verified"):
        Pools(t)


def _phased_request(hard: int = 6, easy: int = 8, width: int = 4) -> list[dict]:
    """One recorded request at bs 1, drafting ``width`` every step: ``hard`` steps rejecting everything (one token
    each), then ``easy`` steps accepting every draft (width + 1 tokens each); contexts as an engine records them."""
    steps, ctx = [], 100
    for i in range(hard + easy):
        accepted = 0 if i < hard else width
        steps.append({"bs": 1, "width": width, "log_conf": np.full((1, width), np.log(0.5)),
                      "accepted": [accepted], "ctx_len": [ctx]})
        ctx += 1 + accepted
    return steps


def test_a_slot_walks_through_its_request_by_the_tokens_it_emits():
    """A request that rejects its first 6 blocks and then accepts whole ones: a slot emitting one token a step (no
    drafts kept) stays in the hard part 6 steps, one verifying every draft leaves it at the same tokens, and
    reaches the easy part's rows at the context they were recorded at."""
    pools = Pools(from_rows(K, _phased_request() * 1))
    walk = pools.walk(1)
    seen = []
    for _ in range(6):
        seen.append(int(walk.rows(4)[1][0]))
        walk.advance(np.array([1]))
    assert seen == [0] * 6 and int(walk.rows(4)[1][0]) == 4  # six tokens in: the first easy row
    assert walk.context() == pytest.approx(106.0)
    walk.advance(np.array([5]))
    assert walk.context() == pytest.approx(111.0) and int(walk.rows(4)[1][0]) == 4


def test_requests_are_told_apart_by_their_contexts_and_slots_move_on_to_the_next():
    two = from_rows(K, _phased_request(hard=2, easy=2) + [dict(s, ctx_len=[c + 1000 for c in s["ctx_len"]])
                                                          for s in _phased_request(hard=2, easy=2)])
    assert two.request_ids().tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    walk = Pools(two).walk(1)
    walk.advance(np.array([2 + 5 + 5 + 1]))  # past the first request's last row
    assert walk.context() == pytest.approx(1100.0)  # the second request, from its start


def test_another_start_walks_other_requests_at_other_stages():
    """Start 0 is the walk as it always was (slot i of 4 on request 0 of the one-request trace, i/4 of the way in);
    another start moves every slot to another stage, and with several requests to the next request."""
    pools = Pools(trace())  # no context recorded: one request of every row
    first, other = pools.walk(4), pools.walk(4, start=1)
    begin, end = pools.span(0)
    span = end - begin + 1
    assert first._position.tolist() == [i * span // 4 for i in range(4)]
    assert other._position.tolist() != first._position.tolist()
    two = from_rows(K, _phased_request(hard=2, easy=2) + [dict(s, ctx_len=[c + 1000 for c in s["ctx_len"]])
                                                          for s in _phased_request(hard=2, easy=2)])
    assert Pools(two).walk(1).context() == pytest.approx(100.0)
    assert Pools(two).walk(1, start=1).context() >= 1000.0  # the second request


def test_cells_from_several_starts_pool_their_sums_and_keep_each_rate():
    cost, pools = linear_cost(), Pools(trace())
    cells = [run_cell(FixedWidth(2), 4, pools, cost, steps=20, warmup=5, start=s) for s in range(3)]
    assert len({c.tokens for c in cells}) > 1  # the starts met other drafts
    one = pooled(cells)
    assert one.steps == 60 and one.tokens == sum(c.tokens for c in cells) and one.ms == sum(c.ms for c in cells)
    assert one.widths == {2: 60} and one.drafted == sum(c.drafted for c in cells)
    assert one.extra["by_start"] == [round(c.tokens_per_s, 3) for c in cells]
    assert min(one.extra["by_start"]) <= one.tokens_per_s <= max(one.extra["by_start"])

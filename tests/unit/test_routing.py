"""D-Cut-aware routing (``dcut.routing``, ``deployments.routing``) on synthetic figures, no Ray instance."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dcut.cost_table import Fingerprint
from dcut.routing import (
    RoutingStats,
    batch_tokens_per_s,
    marginal_tokens_per_s,
    measured_speed,
    rank_replicas,
    routing_stats,
)
from dcut.settings import DCutSettings
from dcut.snapshot import DCutSnapshot, Overhead, ThroughputEstimate, WindowSummary
from deployments.routing import DCutRequestRouter
from deployments.settings import RoutingSettings

NOW = 1000.0
# Concave, like a real engine: 100 tok/s alone, 600 at 8, 800 at 16 (max_num_seqs).
CURVE = ((1, 4, 8, 16), (100.0, 350.0, 600.0, 800.0))


def stats(speed: float = 1.0, running: int = 0, sent_at: float = NOW, max_running: int = 16) -> RoutingStats:
    return RoutingStats(CURVE[0], CURVE[1], max_running, speed, running, sent_at)


def snapshot(window: WindowSummary) -> DCutSnapshot:
    est = [ThroughputEstimate(b, float(b), 10.0 * b ** 0.5, t, t / b) for b, t in zip(*CURVE, strict=True)]
    return DCutSnapshot(settings=DCutSettings(), fingerprint=Fingerprint(hardware="cpu", model="m", drafter="d", k=15),
                        cost_source="profiled", steps=window.steps, window=window,
                        overhead=Overhead(per_step_ms=1.0, per_token_ms=0.0), estimates=est)


def test_the_curve_is_interpolated_through_zero_and_flat_past_the_engine() -> None:
    s = stats()
    assert batch_tokens_per_s(s, 0) == 0.0 and batch_tokens_per_s(s, 1) == 100.0
    assert batch_tokens_per_s(s, 6) == pytest.approx(475.0)  # between 4 and 8
    assert batch_tokens_per_s(s, 16) == batch_tokens_per_s(s, 40) == 800.0  # max_num_seqs: the rest waits
    assert marginal_tokens_per_s(s, 0) == 100.0 > marginal_tokens_per_s(s, 8) > 0.0
    assert marginal_tokens_per_s(s, 16) == 0.0
    assert batch_tokens_per_s(stats(speed=0.5), 8) == 300.0


def test_measured_speed_compares_real_steps_with_the_estimate() -> None:
    est_ms_at_4 = 10.0 * 4 ** 0.5
    slow = snapshot(WindowSummary(steps=10, batch_size_histogram={4: 10}, mean_step_ms={4: 2 * est_ms_at_4}))
    assert measured_speed(slow) == pytest.approx(0.5)
    assert measured_speed(snapshot(WindowSummary())) is None  # nothing ran: no evidence either way
    wild = snapshot(WindowSummary(steps=1, batch_size_histogram={1: 1}, mean_step_ms={1: 1e6}))
    assert measured_speed(wild) == 0.1  # bounded
    s = routing_stats(slow, max_running=16, running=3, now=NOW)
    assert s is not None and s.batch_sizes == CURVE[0] and s.speed == pytest.approx(0.5) and s.running == 3
    assert RoutingStats.from_dict(s.to_dict()) == s
    assert routing_stats(None, 16, 0, NOW) is None


def test_malformed_or_empty_stats_are_none() -> None:
    assert RoutingStats.from_dict({}) is None
    assert RoutingStats.from_dict({**stats().to_dict(), "tokens_per_s": [1.0]}) is None  # lengths differ
    assert RoutingStats.from_dict({**stats().to_dict(), "speed": "fast"}) is None


def test_ranks_by_what_one_more_request_adds() -> None:
    # a: idle and full speed; b: idle but half as fast; c: 8 running at full speed; d: full
    order = rank_replicas([("d", stats(), 16), ("c", stats(), 8), ("b", stats(speed=0.5), 0), ("a", stats(), 0)],
                          NOW, stale_after_s=6.0)
    assert order == ["a", "b", "c", "d"]
    # the router's queue count is fresher than the replica's own: it is the one priced
    assert rank_replicas([("x", stats(running=0), 12), ("y", stats(running=12), 0)], NOW, 6.0) == ["y", "x"]
    assert rank_replicas([("x", stats(running=5), None), ("y", stats(running=1), None)], NOW, 6.0) == ["y", "x"]


def test_a_replica_that_has_not_run_is_priced_at_the_others_speed() -> None:
    """The starvation an earlier version had: replicas that ran measured themselves faster than a conservative
    table and outbid the idle one (speed 1.0) for ever, so it never ran and never measured itself."""
    assert RoutingStats.from_dict(stats(speed=None).to_dict()) == stats(speed=None)
    fast, idle = ("fast", stats(speed=1.8), 3), ("idle", stats(speed=None), 0)
    assert rank_replicas([fast, idle], NOW, 6.0) == ["idle", "fast"]
    assert batch_tokens_per_s(stats(speed=None), 8) == 600.0  # alone, unknown speed is the table's


def test_near_equal_marginal_rates_go_to_the_shorter_queue() -> None:
    """A straight curve (step time flat in the batch): every replica adds the same; the queue decides, and a
    few percent of estimate noise (speed 1.05 against 1.0) does not pull every request to one replica."""
    line = ((1, 8, 16), (100.0, 800.0, 1600.0))
    straight = [("a", RoutingStats(*line, 16, 1.05, 0, NOW), 6), ("b", RoutingStats(*line, 16, 1.0, 0, NOW), 2)]
    assert rank_replicas(straight, NOW, 6.0) == ["b", "a"]
    # a clear gap is not a tie: the twice-as-fast replica wins despite its queue
    assert rank_replicas([("a", RoutingStats(*line, 16, 2.0, 0, NOW), 6), straight[1]], NOW, 6.0) == ["a", "b"]
    # every engine full: shortest queue first
    assert rank_replicas([("a", stats(), 20), ("b", stats(), 17)], NOW, 6.0) == ["b", "a"]


def test_missing_or_stale_figures_fall_back() -> None:
    assert rank_replicas([("a", stats(), 0), ("b", None, 0)], NOW, 6.0) is None
    assert rank_replicas([("a", stats(), 0), ("b", stats(sent_at=NOW - 7), 0)], NOW, 6.0) is None


def _replica(rid: str, figures: dict) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats=figures)


def test_router_puts_each_replica_in_its_own_rank_best_first(monkeypatch) -> None:
    monkeypatch.setattr("deployments.routing.time.time", lambda: NOW)
    router = SimpleNamespace(replica_queue_len_cache=SimpleNamespace(get=lambda replica_id: None),
                             stale_after_s=6.0, fallbacks=0, _parsed={})
    router._stats = lambda replica: DCutRequestRouter._stats(router, replica)
    busy, idle = _replica("busy", stats(running=10).to_dict()), _replica("idle", stats(running=1).to_dict())
    ranks = asyncio.run(DCutRequestRouter.choose_replicas(router, [busy, idle]))
    assert ranks == [[idle], [busy]] and router.fallbacks == 0
    new = _replica("new", {})  # no estimates yet: Serve's default (one rank of two random replicas)
    ranks = asyncio.run(DCutRequestRouter.choose_replicas(router, [busy, idle, new]))
    assert len(ranks) == 1 and len(ranks[0]) == 2 and router.fallbacks == 1
    assert asyncio.run(DCutRequestRouter.choose_replicas(router, [])) == []
    parsed = router._parsed["busy"][1]
    assert router._stats(busy) is parsed  # the same figures: parsed once
    busy.routing_stats = stats(running=3).to_dict()  # Serve's next update: parsed again
    assert router._stats(busy).running == 3


def test_routing_settings_give_serve_a_router_config_only_when_asked() -> None:
    assert RoutingSettings().serve_config() is None
    cfg = RoutingSettings(policy="dcut", stats_period_s=1.0, stale_after_s=3.0).serve_config()
    assert cfg["request_router_class"] == "deployments.routing:DCutRequestRouter"
    assert cfg["request_router_kwargs"] == {"stale_after_s": 3.0} and cfg["request_routing_stats_period_s"] == 1.0
    with pytest.raises(ValueError):
        RoutingSettings(policy="round_robin")

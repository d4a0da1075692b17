"""The load test's pure computations: percentiles, a point's figures and goodput, the replicas' acceptance
between two readings, repeats, and where an arm stops paying; the arms' configs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from app.config import AppConfig
from loadtest.arms import ARMS, app_entry, arm_args, arm_config, committed_sweep, load_schedule, schedule_from_sweep
from loadtest.figures import (
    Objectives,
    PointFigures,
    RequestRecord,
    acceptance_between,
    measured_window,
    percentile,
    point_figures,
    read_requests_log,
    spread,
    stops_paying,
    stops_paying_line,
    summarize_repeats,
)

REPO = Path(__file__).resolve().parents[2]
DENSE_SWEEP = REPO / "docs" / "experiments" / "2026-11-29-sweep-dense" / "sweep.json"
DEEP_SWEEP = REPO / "docs" / "experiments" / "2026-12-01-sweep-deep" / "sweep.json"


# ---- percentiles -------------------------------------------------------------------------------------

def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=200))
def test_percentiles_are_ordered_and_bounded(values):
    p50, p90, p99 = (percentile(values, q) for q in (50, 90, 99))
    assert min(values) <= p50 <= p90 <= p99 <= max(values)


# ---- one point -----------------------------------------------------------------------------------------

def _request(start, ttft, gap, tokens, status="ok", per_chunk=1):
    chunks, t, left = [], ttft, tokens
    while left > 0:
        n = min(per_chunk, left)
        chunks.append((t, n))
        left -= n
        t += gap
    end = chunks[-1][0] + 0.001 if chunks else ttft
    return RequestRecord(start=start, status=status, end=end, chunks=tuple(chunks))


def test_request_record_latencies():
    r = _request(100.0, ttft=0.5, gap=0.1, tokens=6, per_chunk=2)  # chunks at 0.5, 0.6, 0.7 of 2 tokens
    assert r.output_tokens == 6
    assert r.ttft_ms() == 500.0
    assert r.tpot_ms() == pytest.approx(200.0 / 5)  # (0.7 - 0.5) s over 5 tokens after the first
    assert r.itl_ms() == pytest.approx([100.0, 100.0])
    assert _request(0, 0.5, 0.1, tokens=1).tpot_ms() is None


def test_point_figures_window_goodput_and_unfinished():
    objectives = Objectives(ttft_ms=1000, tpot_ms=100)
    records = [
        _request(10.0, ttft=0.2, gap=0.05, tokens=10),   # good, finished at ~10.65
        _request(11.0, ttft=1.5, gap=0.05, tokens=10),   # TTFT misses
        _request(12.0, ttft=0.2, gap=0.20, tokens=10),   # TPOT misses
        _request(1.0, ttft=0.1, gap=0.01, tokens=5),     # finished before the window: not counted
        _request(13.0, ttft=0.1, gap=0.01, tokens=0, status="failed"),
        _request(18.0, ttft=0.1, gap=0.5, tokens=10, status="cut"),  # still streaming at the end
    ]
    f = point_figures(records, (10.0, 20.0), objectives)
    assert f.window_s == 10.0
    assert f.offered == 5 and f.requests == 4 and f.failures == 1 and f.unfinished == 1
    assert f.requests_per_s == pytest.approx(0.3)
    assert f.goodput_requests_per_s == pytest.approx(0.1) and f.goodput_tokens_per_s == pytest.approx(1.0)
    # tokens: 3 x 10 finished + the cut request's chunks at 18.1 .. 19.6 (4 of them) inside the window
    assert f.output_tokens_per_s == pytest.approx((30 + 4) / 10)
    assert f.ttft_p50_ms == pytest.approx(200.0) and f.ttft_p99_ms == pytest.approx(1500 - 0.02 * 1300)
    assert f.tpot_p50_ms == pytest.approx(50.0)
    assert f.goodput_tokens_per_s <= f.output_tokens_per_s


@given(st.lists(st.tuples(st.floats(0, 30), st.floats(0.001, 3), st.floats(0.001, 0.3), st.integers(1, 40),
                          st.sampled_from(["ok", "ok", "ok", "failed", "cut"])), min_size=1, max_size=60),
       st.floats(1, 5000), st.floats(1, 500))
def test_goodput_never_exceeds_throughput(rows, ttft_ms, tpot_ms):
    records = [_request(s, ttft, gap, n, status) for s, ttft, gap, n, status in rows]
    f = point_figures(records, (5.0, 25.0), Objectives(ttft_ms, tpot_ms))
    assert f.goodput_requests_per_s <= f.requests_per_s
    assert f.goodput_tokens_per_s <= f.output_tokens_per_s + 1e-9
    assert f.requests <= f.offered + sum(1 for r in records if r.start < 5.0)
    for name in ("ttft", "tpot", "itl", "e2e"):
        values = [getattr(f, f"{name}_p{q}_ms") for q in (50, 90, 99)]
        assert values == [None] * 3 or values[0] <= values[1] <= values[2]


def test_requests_log_and_window(tmp_path):
    path = tmp_path / "log.jsonl"
    lines = [{"event": "test_start", "t": 100.0}, {"event": "spawning_complete", "t": 103.0},
             {"start": 104.0, "path": "/v1/completions", "max_tokens": 3, "status": "ok", "error": None,
              "prompt_tokens": 5, "end": 0.5, "chunks": [[0.2, 1], [0.3, 2]]},
             {"event": "test_stop", "t": 110.0}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    events, records = read_requests_log(path)
    assert measured_window(events, warmup_s=1) == (103.0, 110.0)  # after every user started
    assert measured_window(events, warmup_s=5) == (105.0, 110.0)  # open loop: after the warm-up
    assert records == [RequestRecord(start=104.0, status="ok", end=0.5, chunks=((0.2, 1), (0.3, 2)))]
    with pytest.raises(ValueError):
        measured_window({"test_start": 100.0}, 1)


# ---- the replicas' acceptance between two readings -----------------------------------------------------

def _status(**replicas):
    return {"replicas": [{"replica_id": rid, "totals": totals} for rid, totals in replicas.items()]}


def _totals(steps, request_steps, accepted, keep_sum, keep_steps):
    return {"steps": steps, "request_steps": request_steps, "proposed": 0, "kept": 0, "accepted": accepted,
            "keep_ratio_sum": keep_sum, "keep_ratio_steps": keep_steps}


def test_acceptance_between_two_readings():
    before = _status(a=_totals(10, 40, 20, 5.0, 10), b=_totals(5, 5, 1, 5.0, 5))
    after = _status(a=_totals(30, 120, 100, 15.0, 30),   # +20 steps, +80 request-steps, +80 accepted, keep 0.5
                    b=_totals(2, 10, 10, 2.0, 2),          # restarted (went down): counts from zero
                    c=_totals(8, 10, 10, 8.0, 8))          # new since the first reading: counts from its start
    got = acceptance_between(before, after)
    assert got["replicas"] == 3 and got["steps"] == 20 + 2 + 8
    assert got["mean_accepted_length"] == pytest.approx((80 + 10 + 10) / (80 + 10 + 10))
    assert got["keep_ratio"] == pytest.approx((10.0 + 2.0 + 8.0) / (20 + 2 + 8))


def test_keep_ratio_of_steps_that_kept_everything_is_one():
    """Two steps that kept every draft after a running sum of 31.507: in floats the sum grows by more than 2,
    and the ratio between two readings must still not exceed 1."""
    before_sum = 31.507
    after_sum = before_sum + 1.0 + 1.0
    before, after = _status(a=_totals(40, 40, 0, before_sum, 40)), _status(a=_totals(42, 42, 0, after_sum, 42))
    assert (after_sum - before_sum) / 2 > 1 and acceptance_between(before, after)["keep_ratio"] == 1.0


def test_acceptance_without_dcut_telemetry():
    none = {"replicas": [{"replica_id": "a", "totals": None}]}
    assert acceptance_between(none, none) == {"replicas": 0, "steps": 0, "mean_accepted_length": None,
                                                "keep_ratio": None}
    assert acceptance_between(None, None)["mean_accepted_length"] is None


# ---- repeats and where an arm stops paying ------------------------------------------------------------

def test_spread_and_summary():
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert spread([None, 4.0]) == {"median": 4.0, "min": 4.0, "max": 4.0}
    assert spread([None]) == {"median": None, "min": None, "max": None}
    figs = [PointFigures(window_s=10, offered=n, requests=n, failures=0, unfinished=0, requests_per_s=n / 10,
                         output_tokens_per_s=10.0 * n, goodput_requests_per_s=0.0, goodput_tokens_per_s=0.0)
            for n in (5, 9, 7)]
    s = summarize_repeats(figs)
    assert s["output_tokens_per_s"] == {"median": 70.0, "min": 50.0, "max": 90.0}
    assert s["ttft_p50_ms"]["median"] is None


def _curve(values):
    return {load: {"median": m, "min": m - 1, "max": m + 1} for load, m in values.items()}


def test_stops_paying_verdicts():
    none = _curve({1: 100, 8: 400, 32: 800, 64: 900})
    stops = stops_paying("joint", "output_tokens_per_s", none, _curve({1: 150, 8: 420, 32: 700, 64: 600}))
    assert (stops.verdict, stops.load, stops.clear) == ("stops", 32, True)
    assert stops.ratio == pytest.approx(700 / 800)
    never = stops_paying("full", "output_tokens_per_s", none, _curve({1: 99.5, 8: 300, 32: 500, 64: 500}))
    assert (never.verdict, never.load, never.clear) == ("never_pays", 1, False)  # 99.5 vs 100: within spread
    always = stops_paying("x", "output_tokens_per_s", none, _curve({1: 200, 64: 901}))
    assert (always.verdict, always.load) == ("always_pays", 64)
    assert stops_paying("y", "m", none, {}).verdict == "no_data"


def test_stops_paying_for_a_latency():
    none = _curve({1: 100.0, 4: 120.0, 8: 1000.0})
    got = stops_paying("joint", "e2e_p50_ms", none, _curve({1: 80.0, 4: 130.0, 8: 5000.0}), higher_is_better=False)
    assert (got.verdict, got.load, got.clear) == ("stops", 4, True)


def test_stops_paying_line_is_one_line():
    none = _curve({1: 100, 8: 400})
    results = [stops_paying("full", "output_tokens_per_s", none, _curve({1: 50, 8: 100})),
               stops_paying("dynamic", "output_tokens_per_s", none, _curve({1: 120, 8: 300})),
               stops_paying("joint", "output_tokens_per_s", none, _curve({1: 120, 8: 500}))]
    line = stops_paying_line("Fixed concurrency", "users", results, repeats=3)
    assert "\n" not in line
    assert "`full` never pays (already 0.50x at 1 users, beyond the repeats' spread)" in line
    assert "`dynamic` stops paying at 8 users (0.75x" in line
    assert "`joint` pays at every load measured (1.25x at 8 users)" in line
    assert "one repeat" in stops_paying_line("x", "users", results, repeats=1)


# ---- arms --------------------------------------------------------------------------------------------

def _base_config():
    import yaml

    return yaml.safe_load((REPO / "app.config.yaml").read_text())


def test_arms_configure_one_app_four_ways():
    base = _base_config()
    schedule = [(1, 1, 15), (2, 4096, 3)]
    configs = {arm: arm_config(base, arm, ["engine.seed=7"], 8794, schedule) for arm in ARMS}
    cfg = {arm: AppConfig.model_validate(c["applications"][0]["args"]) for arm, c in configs.items()}
    assert cfg["none"].engine.method == "none" and cfg["none"].engine.dcut is None and cfg["none"].engine.draft is None
    assert cfg["full"].engine.dcut.mode == "full" and cfg["full"].engine.spec_schedule is None
    assert cfg["dynamic"].engine.dcut.mode == "full"
    assert cfg["dynamic"].engine.spec_schedule == schedule and cfg["dynamic"].engine.num_speculative_tokens == 15
    assert cfg["joint"].engine == AppConfig.model_validate(
        {**base["applications"][0]["args"], "engine": {**base["applications"][0]["args"]["engine"], "seed": 7}}).engine
    assert cfg["joint"].engine.dcut.mode == "joint"  # the app config as it is: it ships joint
    for arm in ARMS:  # the same app otherwise: seed, port, deployments
        assert cfg[arm].engine.seed == 7 and configs[arm]["http_options"]["port"] == 8794
        assert cfg[arm].engine_replica == cfg["joint"].engine_replica and cfg[arm].ingress == cfg["joint"].ingress
    assert base["applications"][0]["args"]["engine"].get("seed") is None, "the base config is not changed"
    with pytest.raises(ValueError, match="schedule"):
        arm_args({}, "dynamic", None)
    with pytest.raises(ValueError, match="unknown arm"):
        arm_args({}, "auto")
    with pytest.raises(ValueError, match="arm 'dcut' was renamed to 'joint'"):  # no alias
        arm_args({}, "dcut")
    other = {"engine": {"dcut": {"mode": "continuous", "calibrate": False}}}
    assert arm_args(other, "joint")["engine"]["dcut"] == {"mode": "joint", "calibrate": False}  # the name holds


def test_dynamic_schedule_from_the_committed_sweep():
    record = json.loads((DENSE_SWEEP).read_text())
    schedule = schedule_from_sweep(record)
    # The sweep's own dynamic mode was run with the same schedule (it writes it into its notes).
    assert str(schedule) in " ".join(record["notes"])
    assert schedule[0][0] == 1 and schedule[-1][1] >= 4096
    for (_, hi, _), (lo, _, _) in zip(schedule, schedule[1:], strict=False):
        assert lo == hi + 1
    by_bs = {}
    for row in record["dynamic_fixed_k"]:
        by_bs.setdefault(row["bs"], {})[row["k"]] = row["tokens_per_s"]
    for _, hi, k in schedule:  # the fastest fixed K at the batch size that closes each range
        bs = hi if hi in by_bs else max(by_bs)
        assert by_bs[bs][k] == max(by_bs[bs].values())
    assert load_schedule("1-4:7,5-64:3", Path("missing.json"))[0] == [(1, 4, 7), (5, 64, 3)]
    assert "dynamic_fixed_k" in load_schedule(None, DENSE_SWEEP)[1]


def test_dynamic_arm_sized_on_the_served_pair():
    """The default config serves the deep pair: its dynamic arm takes the deep sweep's schedule, not another pair's."""
    config = yaml.safe_load((REPO / "app.config.yaml").read_text())
    sweep = committed_sweep(config, REPO / "docs")
    assert sweep == DEEP_SWEEP and sweep.exists()
    assert "models/deep" in load_schedule(None, sweep)[1]
    app_entry(config)["args"]["engine"]["model"] = "/elsewhere/qwen3-8b"
    with pytest.raises(ValueError, match="not an embedded pair"):
        committed_sweep(config, REPO / "docs")


def test_poisson_gaps_are_reproducible():
    """The open loop's arrival times come from their own seeded generator: every arm sees the same."""
    def arrivals(seed):
        rng = random.Random(f"{seed}-arrivals")
        return [rng.expovariate(4.0) for _ in range(5)]

    assert arrivals(0) == arrivals(0) != arrivals(1)


# ---- the runner's plan (no server, no Locust) ------------------------------------------------------------

def test_quick_flag_and_plan():
    from loadtest.run import QUICK, Point, Target, auto_rates, locust_command, parse_args, plan

    quick = parse_args(["--quick"])
    assert (quick.users, quick.repeats, quick.duration) == (QUICK["users"], 1, 20.0)
    assert parse_args(["--quick", "--repeats", "2"]).repeats == 2  # a flag given wins over --quick
    full = parse_args([])
    assert (full.users, full.rates, full.repeats) == ("1,8,32,64,128,256", "auto", 3)
    assert full.objectives == Objectives(2000.0, 100.0)
    arms, users, rates = plan(parse_args(["--arms", "none,joint", "--users", "1,8", "--rates", "0.5,2"]))
    assert arms == ["none", "joint"] and [p.label for p in users] == ["u1", "u8"] and rates == [0.5, 2.0]
    with pytest.raises(SystemExit):
        plan(parse_args(["--arms", "auto"]))
    with pytest.raises(SystemExit, match="arm 'dcut' was renamed to 'joint'"):
        plan(parse_args(["--arms", "none,dcut"]))

    runs = [{"kind": "users", "figures": {"requests_per_s": r}} for r in (1.0, 4.1, 3.0)]
    assert auto_rates(runs, [0.5, 1.25]) == [2.0, 5.1]

    target = Target("http://127.0.0.1:8000", None, "dense")
    closed = locust_command(Point("users", 8), target, full, Path("/tmp/x"))
    assert closed[closed.index("-u") + 1] == "8" and "--request-rate" not in closed
    assert closed[closed.index("--run-time") + 1] == "70s" and "--requests-log" in closed
    opened = locust_command(Point("rate", 2.5), target, full, Path("/tmp/x"))
    assert opened[opened.index("-u") + 1] == "1" and opened[opened.index("--request-rate") + 1] == "2.5"
    assert opened[opened.index("--host") + 1] == "http://127.0.0.1:8000"


def test_fresh_status_waits_for_a_report_sent_after_the_point():
    import time

    from loadtest.run import fresh_status

    since = time.time()
    readings = iter([{"replicas": [{"replica_id": "a", "age_s": 5.0}]},   # sent before `since`
                     None,                                                # a failed read keeps the last one
                     {"replicas": [{"replica_id": "a", "age_s": 0.0}]}])
    status, fresh = fresh_status(lambda path: next(readings), since, timeout_s=5)
    assert fresh and status["replicas"][0]["age_s"] == 0.0
    stale = {"replicas": [{"replica_id": "a", "age_s": 100.0}]}
    status, fresh = fresh_status(lambda path: stale, time.time(), timeout_s=0.3)
    assert not fresh and status == stale


def test_main_plans_arms_points_and_repeats(tmp_path, monkeypatch):
    """``loadtest.run.main`` without a server: each arm 'served', each point 'measured' by stand-ins; the rates
    are sized once from the first arm's users points and used for every arm; the report is written."""
    from loadtest import run

    served, measured = [], []

    def fake_serve_arm(arm, config, opts, work, measure):
        served.append((arm, AppConfig.model_validate(config["applications"][0]["args"]).engine.method))

        class Serve:
            def get_json(self, path):
                return {"replicas": []}

            def remember_tree(self):
                pass

        measure(run.Target("http://127.0.0.1:1", None, "dense"), Serve())
        return {"engine": {}, "ready_s": 1.0, "replicas_at_end": 2}

    def fake_measure_point(arm, point, repeat, target, opts, work, get_json, on_tick=None):
        measured.append((arm, point.kind, point.load, repeat))
        name = f"{arm}-{point.label}-r{repeat}.requests.jsonl"
        (work / name).write_text('{"event": "test_start", "t": 0}\n')
        per_user = {"none": 4.0, "full": 1.0, "dynamic": 2.0, "joint": 3.0}[arm]
        rps = per_user * (point.load if point.kind == "users" else 1)
        figures = PointFigures(window_s=20, offered=10, requests=10, failures=0, unfinished=0, requests_per_s=rps,
                               output_tokens_per_s=rps * 64, goodput_requests_per_s=rps, goodput_tokens_per_s=rps * 60,
                               e2e_p50_ms=1000 / rps)
        return {"arm": arm, "kind": point.kind, "load": point.load, "repeat": repeat, "locust_exit": 0,
                "figures": figures.to_json(), "telemetry": {}, "errors": {}, "requests_log": name}

    monkeypatch.setattr(run, "serve_arm", fake_serve_arm)
    monkeypatch.setattr(run, "measure_point", fake_measure_point)
    out = tmp_path / "out"
    rc = run.main(["--out", str(out), "--users", "1,2", "--rate-fractions", "0.5,1", "--repeats", "2",
                   "--duration", "1", "--ramp", "0"])
    assert rc == 0
    assert served == [("none", "none"), ("full", "dflash"), ("dynamic", "dflash"), ("joint", "dflash")]
    # none's best users point completed 8 req/s: rates 4 and 8 for every arm, after the users points, per repeat
    assert [m for m in measured if m[0] == "joint"] == [
        ("joint", "users", 1.0, 1), ("joint", "users", 2.0, 1), ("joint", "rate", 4.0, 1), ("joint", "rate", 8.0, 1),
        ("joint", "users", 1.0, 2), ("joint", "users", 2.0, 2), ("joint", "rate", 4.0, 2), ("joint", "rate", 8.0, 2)]
    assert len(measured) == 4 * 2 * 4
    record = json.loads((out / "results.json").read_text())
    deep_schedule = load_schedule(None, DEEP_SWEEP)[0]  # the served pair's sweep
    assert record["setup"]["rates"] == [4.0, 8.0]
    assert record["setup"]["spec_schedule"] == [list(r) for r in deep_schedule]
    assert len(record["points"]) == 4 * 4 and all(p["repeats"] == 2 for p in record["points"])
    users = {s["arm"]: s["verdict"] for s in record["stops_paying"]["users"]}
    assert users == {"full": "never_pays", "dynamic": "never_pays", "joint": "never_pays"}
    assert all((out / r["requests_log"]).exists() for r in record["runs"])
    md = (out / "results.md").read_text()
    assert "Where speculation stops paying" in md and "Incomplete" not in md
    text = (out / "results.json").read_text()
    assert str(REPO) not in text and record["setup"]["config"] == "app.config.yaml", "no machine paths"

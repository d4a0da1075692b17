"""The soak's pure pieces (``loadtest.soak``): percentiles per minute, RSS growth after the warm-up, and the
started / finished accounting of its log."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
from hypothesis import given
from hypothesis import strategies as st

from loadtest.soak import LogCounts, LogReader, per_minute, percentile, rss_growth
from tests.serve_apps import wait_until


def test_percentile_nearest_rank():
    assert percentile([], 99) is None
    assert percentile([5.0], 99) == 5.0
    values = list(range(1, 101))
    assert percentile(values, 99) == 99 and percentile(values, 50) == 50 and percentile(values, 100) == 100
    assert percentile([3, 1, 2], 50) == 2


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=200), st.floats(0, 100))
def test_percentile_is_a_sample_bounded_by_the_extremes(values, q):
    p = percentile(values, q)
    assert p in values and min(values) <= p <= max(values)
    assert sum(v <= p for v in values) >= q / 100 * len(values)


def test_per_minute_groups_by_minute_since_start():
    t0 = 1000.0
    samples = [(t0 - 5, 1e9)]  # before the start: dropped
    samples += [(t0 + i, float(i)) for i in range(60)]        # minute 1: 0..59
    samples += [(t0 + 180 + i, 1000.0) for i in range(10)]   # minute 4; minutes 2 and 3 empty
    rows = per_minute(samples, t0)
    assert [r["minute"] for r in rows] == [1, 2, 3, 4]
    assert rows[0] == {"minute": 1, "n": 60, "p50": 29.0, "p99": 59.0}
    assert rows[1] == {"minute": 2, "n": 0, "p50": None, "p99": None}
    assert rows[3]["n"] == 10 and rows[3]["p99"] == 1000.0
    assert per_minute([], t0) == []


def test_rss_growth_from_the_first_sample_after_warmup():
    mib = 2**20
    samples = {
        11: [(0.0, 100 * mib), (50.0, 180 * mib), (60.0, 200 * mib), (120.0, 205 * mib), (600.0, 210 * mib)],
        # started during the soak: its own warm-up (60 s from first seen) passes its start-up
        12: [(300.0, 10 * mib), (330.0, 100 * mib), (360.0, 100 * mib), (600.0, 103 * mib)],
        13: [(0.0, 100 * mib), (30.0, 100 * mib)],      # gone before the warm-up ended
        14: [(580.0, 10 * mib), (600.0, 50 * mib)],     # started too late to be warm
    }
    rows = {g.pid: g for g in rss_growth(samples, {11: "a"}, warmup_end=60.0, warmup_s=60.0)}
    assert rows[11].baseline == 200 * mib and rows[11].end == 210 * mib and rows[11].growth_pct == 5.0
    assert rows[11].peak == 210 * mib and rows[11].to_dict()["baseline_mib"] == 200.0
    assert rows[12].baseline == 100 * mib and rows[12].growth_pct == 3.0
    assert rows[13].baseline is None and rows[13].growth_pct is None and rows[13].to_dict()["end_mib"] is None
    assert rows[14].growth_pct is None and rows[14].peak == 50 * mib


def test_log_counts_started_finished_cut(tmp_path):
    log = tmp_path / "soak.jsonl"
    records = [["start", 1.0], ["start", 1.5], ["TTFT", 2.0, 120.0], ["ITL", 2.1, 30.0], ["end", 3.0, "ok"],
               ["start", 4.0], ["fail", 4.5, "POST /v1/completions: 500"], ["end", 4.6, "failed"], ["cut", 9.0]]
    text = "".join(json.dumps(r) + "\n" for r in records)
    log.write_text(text[:-10])  # a line still being written is not read yet
    reader = LogReader(log)
    partial = reader.poll()
    assert partial.started == 3 and partial.cut == 0
    log.write_text(text)
    c = reader.poll()
    assert (c.started, c.ok, c.failed, c.cut, c.finished, c.in_flight) == (3, 1, 1, 1, 2, 0)
    assert c.failures == {"POST /v1/completions: 500": 1} and c.ttft == [(2.0, 120.0)] and c.first_start == 1.0
    assert LogReader(tmp_path / "missing.jsonl").poll() == LogCounts()


def test_replica_processes_found_by_title_under_a_root(tmp_path):
    """A child retitled as Ray titles a Serve replica is found under this process, by application; others are not."""
    import subprocess
    import sys

    from loadtest.soak import RssSampler, replica_processes

    script = "import setproctitle, sys, time; setproctitle.setproctitle(sys.argv[1]); time.sleep(60)"
    titles = ["ray::ServeReplica:dcut:EngineReplica.completions", "ray::ServeReplica:dcut:Ingress",
              "ray::ServeReplica:other:EngineReplica",
              "ray::SERVE_REPLICA::dcut#EngineReplica#jesa8z0p:ServeReplica:dcut:EngineReplica.__init__",
              "ray::ServeReplica:dcut:EngineReplicaX"]
    children = [subprocess.Popen([sys.executable, "-c", script, title]) for title in titles]
    try:
        ours = {child.pid for child in children}  # in the full suite, this process is also the root of Ray's workers

        def found(app: str | None = None) -> dict[int, str]:
            return {pid: title for pid, title in replica_processes(os.getpid(), app).items() if pid in ours}

        wait_until(lambda: len(found()) >= 3, 20, lambda: f"three retitled children found: {found()}", every_s=0.1)
        assert set(found()) == {children[0].pid, children[2].pid, children[3].pid}
        assert found("dcut") == {children[0].pid: titles[0], children[3].pid: titles[3]}
        sampler = RssSampler(os.getpid(), "dcut")
        sampler.sample()
        assert set(sampler.samples) & ours == {children[0].pid, children[3].pid}
        assert sampler.latest_mib()[children[0].pid] > 0
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_pin_tree_confines_every_thread_of_a_process_and_its_children():
    from loadtest.soak import pin_tree

    code = ("import subprocess, sys, threading, time; threading.Thread(target=time.sleep, args=(30,), daemon=True)"
            ".start(); subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        proc = psutil.Process(parent.pid)
        wait_until(lambda: proc.children() and proc.num_threads() >= 2, 20, "thread and child of the test process",
                   every_s=0.1)
        assert pin_tree(parent.pid, {0}) >= 3  # two threads of the parent, at least one of the child
        for p in [proc, *proc.children()]:
            assert all(os.sched_getaffinity(t.id) == {0} for t in p.threads())
    finally:
        for p in psutil.Process(parent.pid).children():
            p.kill()
        parent.kill()


def test_rss_growth_of_a_late_replica_counts_from_when_it_served():
    """A replica started during the soak whose engine start (compiling, profiling) outlasts ``warmup_s`` from its
    process's first sample: its baseline is ``warmup_s`` after the application first listed it."""
    mib = 2**20
    series = [(36.0, 400 * mib), (96.0, 1500 * mib), (230.0, 1600 * mib), (240.0, 2700 * mib),
              (300.0, 3000 * mib), (600.0, 3050 * mib)]
    by_process = rss_growth({7: series}, {}, warmup_end=60.0, warmup_s=60.0)[0]
    by_ready = rss_growth({7: series}, {}, warmup_end=60.0, warmup_s=60.0, ready={7: 235.0})[0]
    assert by_process.baseline == 1500 * mib and by_process.growth_pct > 100  # its start-up, read as growth
    assert by_ready.baseline == 3000 * mib and by_ready.growth_pct == round(100 * 50 / 3000, 2)

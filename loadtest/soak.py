"""Soak (issue 12, item 7): ``users`` Locust users streaming for ``minutes`` against one application, while the
engine replicas' resident memory is sampled. Bounded (Locust's run time, a hard deadline on top), 127.0.0.1 only,
progress every ``--progress-s`` seconds.

    python -m loadtest.soak                                  # serves app.config.yaml here, 256 users x 10 min
    python -m loadtest.soak --users 256 --minutes 3 --out /tmp/soak
    python -m loadtest.soak --url http://127.0.0.1:8000 [--api-key KEY]   # an app already served here

It reports: requests started and finished (``--stop-timeout`` lets the requests in flight at the end finish, so
the two should match; ``cut``: stopped mid-way), failures and their messages, p50/p99 TTFT and ITL per minute, and
each engine replica process's RSS after the warm-up (``--warmup-s``) and at the end, with its growth. It passes
(exit 0) with no failure, every started request finished, and every replica's growth <= ``--max-rss-growth``.

Replica processes: those of this run's ``serve run`` process tree whose title is ``ray::ServeReplica:<app>:
EngineReplica`` (with ``--url``: under ``--serve-pid``, else every such process of this user on the machine).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from loadtest.serve_process import served

LOCAL = ("127.0.0.1", "localhost")
# Ray titles a Serve replica's process "ray::ServeReplica:<app>:<deployment>[.<method>]", or, while a method runs
# with the actor's name, "ray::SERVE_REPLICA::<app>#<deployment>#<id>:ServeReplica:<app>:<deployment>.<method>".
REPLICA_TITLE = re.compile(r"^ray::(?:\S*:)?ServeReplica:(?P<app>[^:\s]+):EngineReplica(?:[.\s]|$)")


# ---- pure pieces ----------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def per_minute(samples: Iterable[tuple[float, float]], t0: float, qs: tuple[float, ...] = (50, 99)) -> list[dict]:
    """``samples`` (wall time, value) grouped by whole minutes since ``t0``: ``{"minute", "n", "p50", "p99"}`` per
    minute from the first to the last with samples (a minute without any is listed with n = 0); samples before
    ``t0`` are dropped."""
    minutes: dict[int, list[float]] = {}
    for t, value in samples:
        if t >= t0:
            minutes.setdefault(int((t - t0) // 60), []).append(value)
    if not minutes:
        return []
    rows = []
    for m in range(min(minutes), max(minutes) + 1):
        values = minutes.get(m, [])
        row = {"minute": m + 1, "n": len(values)}
        for q in qs:
            p = percentile(values, q)
            row[f"p{q:g}"] = None if p is None else round(p, 1)
        rows.append(row)
    return rows


@dataclass
class RssGrowth:
    """One replica process: RSS (bytes) at the baseline (first sample at or after the warm-up) and at the end."""

    pid: int
    name: str
    baseline: int | None
    end: int | None
    peak: int
    samples: int

    @property
    def growth_pct(self) -> float | None:
        if not self.baseline or self.end is None:
            return None
        return round(100.0 * (self.end - self.baseline) / self.baseline, 2)

    def to_dict(self) -> dict:
        mib = lambda b: None if b is None else round(b / 2**20, 1)
        return {"pid": self.pid, "name": self.name, "baseline_mib": mib(self.baseline), "end_mib": mib(self.end),
                "peak_mib": mib(self.peak), "growth_pct": self.growth_pct, "samples": self.samples}


def rss_growth(samples: dict[int, list[tuple[float, int]]], names: dict[int, str], warmup_end: float,
               warmup_s: float = 0.0, ready: dict[int, float] | None = None) -> list[RssGrowth]:
    """Per process: baseline = its first sample at or after its own warm-up, end = its last sample. The warm-up
    ends at ``warmup_end`` for a process serving from the start, and ``warmup_s`` after it started serving for one
    that came later (a replica the autoscaler started during the soak: its engine start — loading, profiling,
    compiling — is not steady state): ``ready[pid]`` is when the application first listed it, else (no status
    read) when its process was first seen. A process gone (or ready too late) to have a sample after its warm-up
    has none."""
    out = []
    ready = ready or {}
    for pid, series in sorted(samples.items()):
        series = sorted(series)
        start = max(warmup_end, ready.get(pid, series[0][0]) + warmup_s)
        after = [rss for t, rss in series if t >= start]
        out.append(RssGrowth(pid=pid, name=names.get(pid, ""), baseline=after[0] if after else None,
                             end=after[-1] if after else None, peak=max(rss for _, rss in series),
                             samples=len(series)))
    return out


@dataclass
class LogCounts:
    """What the soak log says so far."""

    started: int = 0
    ok: int = 0
    failed: int = 0
    cut: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # message -> count (the first 50 distinct)
    ttft: list[tuple[float, float]] = field(default_factory=list)
    itl: list[tuple[float, float]] = field(default_factory=list)
    first_start: float | None = None

    @property
    def finished(self) -> int:
        return self.ok + self.failed

    @property
    def in_flight(self) -> int:
        return self.started - self.finished - self.cut

    def add(self, record: list) -> None:
        kind, t = record[0], record[1]
        if kind == "start":
            self.started += 1
            self.first_start = t if self.first_start is None else min(self.first_start, t)
        elif kind == "end":
            if record[2] == "ok":
                self.ok += 1
            else:
                self.failed += 1
        elif kind == "cut":
            self.cut += 1
        elif kind == "fail":
            if record[2] in self.failures or len(self.failures) < 50:
                self.failures[record[2]] = self.failures.get(record[2], 0) + 1
        elif kind == "TTFT":
            self.ttft.append((t, record[2]))
        elif kind == "ITL":
            self.itl.append((t, record[2]))


class LogReader:
    """Reads the soak log incrementally (complete lines only)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.counts = path, 0, LogCounts()

    def poll(self) -> LogCounts:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.counts
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            if line.strip():
                self.counts.add(json.loads(line))
        self.offset += end
        return self.counts


# ---- replica processes ----------------------------------------------------------------------------

def replica_processes(root_pid: int | None, app: str | None = None) -> dict[int, str]:
    """pid -> title of the engine replica processes under ``root_pid`` (every one of this user when None)."""
    if root_pid is not None:
        try:
            candidates = psutil.Process(root_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return {}
    else:
        me = os.getuid()
        candidates = [p for p in psutil.process_iter() if _uid(p) == me]
    found = {}
    for p in candidates:
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        match = REPLICA_TITLE.match(title)
        if match and (app is None or match["app"] == app):
            found[p.pid] = title.split()[0]
    return found


def _uid(p: psutil.Process) -> int | None:
    try:
        return p.uids().real
    except psutil.Error:
        return None


def tree_rss(process: psutil.Process) -> int:
    """RSS of a replica process and of its descendants (vLLM may run its engine core in a child process, which
    holds the weights and the KV cache), in bytes."""
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total


def pin_tree(pid: int, cpus: set[int]) -> int:
    """Confine a process, its descendants and every thread of them to ``cpus`` (``sched_setaffinity`` is per
    thread; threads started later inherit it); returns how many threads were pinned."""
    pinned = 0
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            threads = p.threads()
        except psutil.Error:
            continue
        for t in threads:
            try:
                os.sched_setaffinity(t.id, cpus)
                pinned += 1
            except OSError:  # the thread ended meanwhile
                pass
    return pinned


class RssSampler(threading.Thread):
    """Samples the replica processes' RSS every ``interval_s`` seconds until stopped."""

    def __init__(self, root_pid: int | None, app: str | None, interval_s: float = 5.0, status_url: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(daemon=True)
        self.root_pid, self.app, self.interval_s = root_pid, app, interval_s
        self.status_url, self.headers = status_url, headers or {}
        self.samples: dict[int, list[tuple[float, int]]] = {}
        self.names: dict[int, str] = {}
        self.ready: dict[int, float] = {}  # pid -> when /dcut/status first listed its replica (serving)
        self._stop_event = threading.Event()

    def sample(self) -> None:
        for pid, name in replica_processes(self.root_pid, self.app).items():
            try:
                rss = tree_rss(psutil.Process(pid))
            except psutil.Error:
                continue
            self.names[pid] = name
            self.samples.setdefault(pid, []).append((time.time(), rss))
        if self.status_url:
            try:
                replicas = httpx.get(self.status_url, headers=self.headers, timeout=5).json()["replicas"]
            except (httpx.HTTPError, ValueError, KeyError):
                return  # a busy ingress: the next sample asks again
            for r in replicas:
                if r.get("pid"):
                    self.ready.setdefault(r["pid"], time.time())

    def latest_mib(self) -> dict[int, float]:
        return {pid: round(s[-1][1] / 2**20) for pid, s in list(self.samples.items()) if s}  # the thread adds

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval_s)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)
        self.sample()  # the end sample


# ---- the run --------------------------------------------------------------------------------------

def locust_command(opts, log: Path, out_dir: Path) -> list[str]:
    users_file = Path(__file__).resolve().with_name("soak_users.py")
    cmd = [str(Path(sys.executable).with_name("locust")), "-f", str(users_file), "--headless",
           "-u", str(opts.users), "-r", f"{opts.spawn_rate:g}", "--run-time", f"{round(opts.minutes * 60)}s",
           "--stop-timeout", f"{opts.stop_timeout:g}", "--host", opts.url, "--soak-log", str(log),
           "--max-tokens", opts.max_tokens, "--prompt-chars", opts.prompt_chars,
           "--csv", str(out_dir / "locust"), "--only-summary", "--loglevel", "WARNING"]
    if opts.model:
        cmd += ["--model", opts.model]
    return cmd


def run_soak(opts, root_pid: int | None, out_dir: Path) -> dict:
    log = out_dir / "soak.jsonl"
    log.unlink(missing_ok=True)
    env = {**os.environ}
    if opts.api_key:
        env["LOADTEST_API_KEY"] = opts.api_key
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    sampler = RssSampler(root_pid, opts.app, opts.rss_interval_s, f"{opts.url.rstrip('/')}/dcut/status", headers)
    sampler.sample()
    sampler.start()
    reader = LogReader(log)
    t_start = time.time()
    warmup_end = t_start + opts.warmup_s
    deadline = time.monotonic() + opts.minutes * 60 + opts.stop_timeout + 120
    with open(out_dir / "locust.log", "wb") as locust_log:
        proc = subprocess.Popen(locust_command(opts, log, out_dir), stdout=locust_log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, cwd=Path(__file__).resolve().parents[1])
    print(f"locust started (pid {proc.pid}): {opts.users} users for {opts.minutes:g} min; log {log}", flush=True)
    last = 0.0
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                print("deadline passed: stopping Locust", flush=True)
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(1)
            if time.monotonic() - last >= opts.progress_s:
                last = time.monotonic()
                c = reader.poll()
                recent = [ms for t, ms in c.ttft if t >= time.time() - 60]
                recent_itl = [ms for t, ms in c.itl if t >= time.time() - 60]
                p99 = lambda v: "-" if not v else f"{percentile(v, 99):.0f}"
                print(f"  {time.time() - t_start:5.0f} s  started {c.started}  finished {c.finished} "
                      f"(failed {c.failed})  in flight {c.in_flight}  last-minute p99 TTFT {p99(recent)} ms "
                      f"ITL {p99(recent_itl)} ms  replica RSS MiB {sampler.latest_mib()}", flush=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        sampler.stop()
    c = reader.poll()
    t0 = c.first_start or t_start
    growth = rss_growth(sampler.samples, sampler.names, warmup_end, opts.warmup_s, sampler.ready)
    growths = [g.growth_pct for g in growth if g.growth_pct is not None]
    report = {
        "users": opts.users, "minutes": opts.minutes, "max_tokens": opts.max_tokens,
        "prompt_chars": opts.prompt_chars, "warmup_s": opts.warmup_s, "locust_exit": proc.returncode,
        "duration_s": round(time.time() - t_start, 1),
        "started": c.started, "finished": c.finished, "ok": c.ok, "failed": c.failed, "cut": c.cut,
        "in_flight_at_end": c.in_flight, "failures": c.failures,
        "ttft_ms_per_minute": per_minute(c.ttft, t0), "itl_ms_per_minute": per_minute(c.itl, t0),
        "ttft_ms_all": {"n": len(c.ttft), "p50": percentile([v for _, v in c.ttft], 50),
                        "p99": percentile([v for _, v in c.ttft], 99)},
        "itl_ms_all": {"n": len(c.itl), "p50": percentile([v for _, v in c.itl], 50),
                       "p99": percentile([v for _, v in c.itl], 99)},
        "replica_rss": [g.to_dict() for g in growth],
        "max_rss_growth_pct": max(growths) if growths else None,
        # per replica pid: [seconds since the soak started, MiB] every --rss-interval-s (a leak is a slope that
        # does not flatten; pools and caches filling up flatten)
        "replica_ready_s": {str(pid): round(t - t_start, 1) for pid, t in sampler.ready.items()},
        "replica_rss_series": {str(pid): [[round(t - t_start, 1), round(rss / 2**20)] for t, rss in series]
                               for pid, series in sampler.samples.items()},
    }
    report["passed"] = (c.failed == 0 and not c.failures and c.cut == 0 and c.started == c.finished
                        and c.started > 0 and bool(growths) and max(growths) <= opts.max_rss_growth)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("app.config.yaml"),
                   help="Serve this config (`serve run`, its own local Ray) for the soak, then stop it.")
    p.add_argument("--url", help="Soak an app already served here instead (e.g. http://127.0.0.1:8000).")
    p.add_argument("--api-key")
    p.add_argument("--model", default="", help="Model name (default: the --config's served model name, else the "
                   "first one the app lists).")
    p.add_argument("--app", default=None, help="Serve application name of the engine replicas (default: any).")
    p.add_argument("--serve-pid", type=int, help="With --url: only replicas under this process (its `serve run`).")
    p.add_argument("--users", type=int, default=256)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--spawn-rate", type=float, default=16.0, help="Users started per second.")
    p.add_argument("--max-tokens", default="16:64", help="MIN:MAX output tokens per request.")
    p.add_argument("--prompt-chars", default="64:512", help="MIN:MAX prompt characters.")
    p.add_argument("--warmup-s", type=float, default=60.0, help="RSS baseline: the first sample after this.")
    p.add_argument("--stop-timeout", type=float, default=300.0,
                   help="At the end, seconds the requests in flight may take to finish.")
    p.add_argument("--rss-interval-s", type=float, default=5.0)
    p.add_argument("--progress-s", type=float, default=30.0)
    p.add_argument("--max-rss-growth", type=float, default=5.0, help="Pass threshold, percent after the warm-up.")
    p.add_argument("--out", type=Path, help="Folder for soak.json, the soak log and Locust's CSV files.")
    opts = p.parse_args()
    out_dir = opts.out or Path(tempfile.mkdtemp(prefix="soak-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    config = None
    if opts.url is None:  # serve --config here
        import yaml

        config = opts.config
        loaded = yaml.safe_load(config.read_text())
        http = loaded.get("http_options", {})
        opts.url = f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}"
        opts.app = opts.app or loaded["applications"][0].get("name")
    assert httpx.URL(opts.url).host in LOCAL, "the soak runs against this machine only"
    with served(config, opts.url, opts.api_key, model=opts.model, log=out_dir / "serve.log") as app:
        opts.model = app.model
        report = run_soak(opts, app.process.proc.pid if app.process else opts.serve_pid, out_dir)
    text = json.dumps(report, indent=1)
    (out_dir / "soak.json").write_text(text + "\n")
    print(text)
    print(f"report: {out_dir / 'soak.json'}")
    raise SystemExit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()

"""The load-test report: four arms, fixed concurrency and open-loop request rates, repeats with spread.

    python -m loadtest.run --out docs/experiments/2026-12-01-loadtest           # the full report (~3 h, 2 CPU cores)
    python -m loadtest.run --out docs/experiments/2026-12-01-loadtest --quick   # a look (~15 min)

For each arm (``loadtest/arms.py``: ``none``, ``full``, ``dynamic``, ``joint``) it writes the arm's config, starts
``serve run`` on it (its own local Ray, HTTP on 127.0.0.1 only), waits until every initial replica reports, then
for each repeat runs Locust once per load point:

- ``--users``: closed loop, that many users (ramp ``--ramp`` s, not measured, then ``--duration`` s);
- ``--rates``: open loop, Poisson arrivals at that many requests/s (``--ramp`` s of warm-up, then ``--duration``
  s); ``auto`` = ``--rate-fractions`` of the first arm's best completed requests/s at the users points, the same
  rates for every arm, up to past saturation.

Before and after each point it reads ``/dcut/status`` (a report sent after the point ended) for the replicas'
step totals: mean accepted length and keep ratio of that point. Same prompts, request lengths and arrival
times in every arm (``--seed``). Every Locust run is bounded (``--run-time``, then killed); the whole run stops
by itself. Output under ``--out``: ``results.md``, ``results.json``, plots, and the requests logs (``raw/``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from loadtest.arms import ARMS, app_entry, arm_config, committed_sweep, load_schedule, unknown_arm
from loadtest.figures import (
    Objectives,
    acceptance_between,
    measured_window,
    point_figures,
    read_requests_log,
)
from loadtest.results import run_result
from loadtest.serve_process import ServeProcess, port_in_use

REPO = Path(__file__).resolve().parent.parent
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"
QUICK = {"users": "8,32", "rates": "auto", "rate_fractions": "0.5,1.25", "repeats": 1, "duration": 20.0,
         "ramp": 5.0}


def log(message: str) -> None:
    print(f"[{dt.datetime.now():%H:%M:%S}] {message}", flush=True)


def validated_args(config: dict):
    """AppConfig of the config (same validation as the app); fails early on a bad override."""
    from app.config import AppConfig

    return AppConfig.model_validate(app_entry(config).get("args") or {})


@dataclass(frozen=True)
class Point:
    """One load point: ``users`` concurrent closed-loop users, or ``rate`` requests/s arriving open-loop."""

    kind: str  # "users" | "rate"
    load: float

    @property
    def label(self) -> str:
        return f"u{self.load:g}" if self.kind == "users" else f"r{self.load:g}"


@dataclass(frozen=True)
class Target:
    """Where an arm is served: base URL (127.0.0.1), API key, model name."""

    base_url: str
    api_key: str | None
    model: str


# ---- one Locust run ------------------------------------------------------------------------------

def locust_command(point: Point, target: Target, opts, prefix: Path) -> list[str]:
    ramp = max(opts.ramp, 1.0)
    users = int(point.load) if point.kind == "users" else 1
    cmd = [str(Path(sys.executable).with_name("locust")), "-f", str(LOCUSTFILE), "--headless",
           "-u", str(users), "-r", f"{users / ramp:g}" if point.kind == "users" else "1",
           "--run-time", f"{round(ramp + opts.duration)}s", "--stop-timeout", "0", "--host", target.base_url,
           "--csv", str(prefix), "--only-summary", "--loglevel", "WARNING",
           "--model", target.model, "--max-tokens", opts.max_tokens, "--prompt-chars", opts.prompt_chars,
           "--chat-fraction", str(opts.chat_fraction), "--prompt-file", str(opts.prompt_file),
           "--seed", str(opts.seed), "--requests-log", f"{prefix}.requests.jsonl"]
    if point.kind == "rate":
        cmd += ["--request-rate", f"{point.load:g}", "--max-in-flight", str(opts.max_in_flight)]
    return cmd


def run_locust(point: Point, target: Target, opts, prefix: Path, on_tick: Callable[[], None] = lambda: None) -> int:
    """One bounded Locust run; returns its exit code (1 when any request failed)."""
    cmd = locust_command(point, target, opts, prefix)
    env = {**os.environ, "LOADTEST_API_KEY": target.api_key} if target.api_key else None
    planned = max(opts.ramp, 1.0) + opts.duration
    limit = planned + 90
    t0 = time.monotonic()
    with open(f"{prefix}.log", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        next_note = t0 + opts.progress_every
        while proc.poll() is None:
            time.sleep(0.5)
            now = time.monotonic()
            if now > t0 + limit:
                proc.kill()
                proc.wait(timeout=30)
                log(f"    locust killed after {limit:.0f} s")
                break
            if now >= next_note:
                on_tick()
                log(f"    {now - t0:.0f}/{planned:.0f} s: {_progress(prefix)}")
                next_note = now + opts.progress_every
    return proc.returncode


def _progress(prefix: Path) -> str:
    try:
        r = run_result(prefix, "", 0)
    except (OSError, KeyError, ValueError):
        return "no stats yet"
    return (f"{r.requests} requests, {r.failures} failed, {r.output_tokens_per_s:.1f} output tok/s, "
            f"TTFT p50 {r.ttft_p50_ms or 0:.0f} ms")


# ---- the replicas' telemetry around a point --------------------------------------------------------

def fresh_status(get_json: Callable[[str], dict | None], since: float, timeout_s: float) -> tuple[dict | None, bool]:
    """``/dcut/status`` once every replica in it has reported after ``since`` (wall time), and True; or the
    last reading at ``timeout_s``, and False."""
    deadline = time.monotonic() + timeout_s
    status = None
    while True:
        status = get_json("/dcut/status") or status
        replicas = (status or {}).get("replicas", [])
        if replicas and all(time.time() - r.get("age_s", 1e9) >= since for r in replicas):
            return status, True
        if time.monotonic() > deadline:
            return status, False
        time.sleep(0.25)


def measure_point(arm: str, point: Point, repeat: int, target: Target, opts, work: Path,
                  get_json: Callable[[str], dict | None], on_tick: Callable[[], None] = lambda: None) -> dict:
    """One Locust run at one point, its figures, and the replicas' acceptance over it."""
    prefix = work / f"{arm}-{point.label}-r{repeat}"
    before, fresh_before = fresh_status(get_json, time.time(), opts.status_timeout)
    rc = run_locust(point, target, opts, prefix, on_tick)
    after, fresh_after = fresh_status(get_json, time.time(), opts.status_timeout)
    log_path = Path(f"{prefix}.requests.jsonl")
    if not log_path.exists():
        tail = Path(f"{prefix}.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"locust wrote no requests log (exit {rc}):\n{tail}")
    events, records = read_requests_log(log_path)
    events.setdefault("test_stop", log_path.stat().st_mtime)  # Locust killed at its deadline: the log's last write
    figures = point_figures(records, measured_window(events, opts.ramp), opts.objectives)
    telemetry = {**acceptance_between(before, after), "fresh": fresh_before and fresh_after}
    figures.mean_accepted_length, figures.keep_ratio = telemetry["mean_accepted_length"], telemetry["keep_ratio"]
    errors: dict[str, int] = {}
    for r in records:
        if r.status in ("failed", "dropped"):
            errors[r.error or r.status] = errors.get(r.error or r.status, 0) + 1
    return {"arm": arm, "kind": point.kind, "load": point.load, "repeat": repeat, "locust_exit": rc,
            "figures": figures.to_json(), "telemetry": telemetry, "errors": errors,
            "requests_log": log_path.name}


def measure_points(arm: str, points: list[Point], repeat: int, target: Target, opts, work: Path,
                   get_json: Callable[[str], dict | None], runs: list[dict], bar=None,
                   on_tick: Callable[[], None] = lambda: None) -> None:
    """``points`` of one arm, one repeat; each run is appended to ``runs`` as soon as it is measured."""
    for point in points:
        log(f"{arm} {point.kind} {point.load:g} (repeat {repeat}/{opts.repeats}): "
            f"{opts.ramp:g} s ramp + {opts.duration:g} s")
        run = measure_point(arm, point, repeat, target, opts, work, get_json, on_tick)
        f = run["figures"]
        log(f"  {f['requests']} requests ({f['failures']} failed, {f['unfinished']} unfinished), "
            f"{f['output_tokens_per_s']:.1f} tok/s, goodput {f['goodput_requests_per_s']:.2f} req/s, "
            f"TTFT p50/p99 {_ms(f['ttft_p50_ms'])}/{_ms(f['ttft_p99_ms'])} ms, "
            f"TPOT p50 {_ms(f['tpot_p50_ms'])} ms, accepted length {_num(f['mean_accepted_length'])}, "
            f"keep ratio {_num(f['keep_ratio'])}")
        for error, n in run["errors"].items():
            log(f"  failure x{n}: {error[:200]}")
        runs.append(run)
        if bar is not None:
            bar.set_postfix_str(f"{arm} {point.label} {f['output_tokens_per_s']:.0f} tok/s")
            bar.update()


def measure_arm(arm: str, users: list[Point], rates: Callable[[], list[float]], target: Target, opts, work: Path,
                get_json: Callable[[str], dict | None], runs: list[dict], bar=None,
                on_tick: Callable[[], None] = lambda: None) -> None:
    """Every point of one arm, ``opts.repeats`` times (repeat outermost, so slow drift spreads over points):
    the users points, then the rates (``rates()`` is asked after them: it may be sized from them)."""
    for repeat in range(1, opts.repeats + 1):
        measure_points(arm, users, repeat, target, opts, work, get_json, runs, bar, on_tick)
        points = [Point("rate", r) for r in rates()]
        measure_points(arm, points, repeat, target, opts, work, get_json, runs, bar, on_tick)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


# ---- rates -----------------------------------------------------------------------------------------

def auto_rates(runs: list[dict], fractions: list[float]) -> list[float]:
    """Request rates at ``fractions`` of the best completed requests/s among ``runs`` (2 significant digits)."""
    best = max((r["figures"]["requests_per_s"] for r in runs if r["kind"] == "users"), default=0.0)
    if best <= 0:
        raise RuntimeError("no users point completed a request: cannot size the request-rate sweep (--rates)")
    return [float(f"{best * f:.2g}") for f in fractions]


# ---- one arm, served ---------------------------------------------------------------------------------

def serve_arm(arm: str, config: dict, opts, work: Path, measure: Callable[[Target, ServeProcess], None]) -> dict:
    """``serve run`` the arm's config, measure it, stop it (nothing left running)."""
    cfg = validated_args(config)
    http = config.get("http_options", {})
    host, port = http.get("host", "127.0.0.1"), int(http.get("port", 8000))
    if host not in ("127.0.0.1", "localhost"):
        raise ValueError(f"http_options.host is {host}: this load test only talks to 127.0.0.1")
    if port_in_use("127.0.0.1", port):
        raise RuntimeError(f"127.0.0.1:{port} is already in use (another serve?): choose --port")
    if not Path(cfg.engine.model).exists():
        raise FileNotFoundError(f"engine.model {cfg.engine.model} does not exist: build it or "
                                "--set engine.model=... (and engine.draft=...)")
    path = work / f"app.{arm}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    serve = ServeProcess(path, work / f"serve-{arm}.log", f"http://127.0.0.1:{port}", cfg.ingress.api_key, cwd=REPO)
    info = {"config": app_entry(config)["args"],
            "engine": {"method": cfg.engine.method, "k": cfg.engine.num_speculative_tokens,
                       "spec_schedule": cfg.engine.spec_schedule,
                       "dcut_mode": cfg.engine.dcut.mode if cfg.engine.dcut else None}}
    log(f"arm {arm}: serve run {path} (log {serve.log})")
    serve.start()
    try:
        auto = cfg.engine_replica.autoscaling
        replicas = auto.initial_replicas or auto.min_replicas
        info["ready_s"] = round(serve.wait_ready(cfg.engine.served_model_name, opts.start_timeout,
                                                 replicas=replicas, progress=log), 1)
        log(f"  ready after {info['ready_s']} s")
        if opts.pin_replica:
            info["pinned"] = pin_one_replica(serve, opts.pin_replica)
        measure(Target(serve.base_url, cfg.ingress.api_key, cfg.engine.served_model_name), serve)
        status = serve.get_json("/dcut/status") or {}
        info["replicas_at_end"] = len(status.get("replicas", []))
    finally:
        log(f"stopping serve ({arm})")
        info["killed_leftover_pids"] = serve.stop(progress=log)
    return info


def pin_one_replica(serve: ServeProcess, cpus: str) -> dict:
    """Confine the first engine replica (lowest pid, its engine core and their threads) to ``cpus`` ("0" or
    "0,1"): replicas of unequal speed, as on a shared or mixed machine (how the app copes with a slow one)."""
    from loadtest.soak import pin_tree, replica_processes

    wanted = {int(c) for c in cpus.split(",") if c.strip()}
    replicas = replica_processes(serve.proc.pid)
    if not replicas:
        raise RuntimeError("--pin-replica: no engine replica process found under serve run")
    pid = min(replicas)
    threads = pin_tree(pid, wanted)
    log(f"  pinned engine replica pid {pid} ({threads} threads) to CPUs {sorted(wanted)}")
    return {"pid": pid, "cpus": sorted(wanted), "threads": threads}


# ---- main ----------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "docs" / "experiments" / "2026-12-01-loadtest")
    p.add_argument("--config", type=Path, default=REPO / "app.config.yaml")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    p.add_argument("--users", default="1,8,32,64,128,256", help="closed-loop points (users); '' for none")
    p.add_argument("--rates", default="auto", help="open-loop points (requests/s), or auto; '' for none")
    p.add_argument("--rate-fractions", default="0.25,0.5,0.75,1,1.25,1.5",
                   help="--rates auto: fractions of the first arm's best completed requests/s")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--duration", type=float, default=60, help="measured seconds per run (after the ramp)")
    p.add_argument("--ramp", type=float, default=10,
                   help="seconds before measuring (closed loop: users start; open loop: warm-up)")
    p.add_argument("--quick", action="store_true",
                   help="a short look: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    p.add_argument("--ttft-ms", type=float, default=Objectives.ttft_ms, help="goodput objective: TTFT <= this")
    p.add_argument("--tpot-ms", type=float, default=Objectives.tpot_ms, help="goodput objective: TPOT <= this")
    p.add_argument("--spec-schedule", default=None,
                   help="arm dynamic: K per batch size, 'FROM-TO:K,...' (default: from --sweep)")
    p.add_argument("--sweep", type=Path, default=None,
                   help="arm dynamic: the sweep whose dynamic_fixed_k gives the best K per batch size (default: the "
                   "committed sweep of the config's embedded pair, e.g. "
                   "docs/experiments/2026-12-01-sweep-deep/sweep.json)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override the app's args for every arm (repeatable)")
    p.add_argument("--max-tokens", default="16:128", help="MIN:MAX output tokens per request")
    p.add_argument("--prompt-chars", default="64:512", help="MIN:MAX prompt characters")
    p.add_argument("--chat-fraction", type=float, default=0.5)
    p.add_argument("--prompt-file", type=Path, default=REPO / "models" / "heldout_prompts.jsonl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-in-flight", type=int, default=1024, help="open loop: drop arrivals beyond this")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds to wait for the app to serve")
    p.add_argument("--status-timeout", type=float, default=10, help="seconds to wait for fresh replica reports")
    p.add_argument("--progress-every", type=float, default=15)
    p.add_argument("--note", action="append", default=[], help="a line for results.md (repeatable)")
    p.add_argument("--pin-replica", default=None, metavar="CPUS",
                   help="confine one engine replica to these CPUs (e.g. 0): one replica slower than the others")
    opts = p.parse_args(argv)
    if opts.quick:  # the quick look's values become the defaults; flags given still win
        p.set_defaults(**QUICK)
        opts = p.parse_args(argv)
    opts.objectives = Objectives(opts.ttft_ms, opts.tpot_ms)
    return opts


def plan(opts) -> tuple[list[str], list[Point], list[float] | None]:
    arms = [a.strip() for a in opts.arms.split(",") if a.strip()]
    if not arms or not set(arms) <= set(ARMS):
        why = [unknown_arm(a) for a in arms if a not in ARMS]
        raise SystemExit("; ".join([f"--arms takes {', '.join(ARMS)}", *why]))
    users = [Point("users", float(u)) for u in opts.users.split(",") if u.strip()]
    rates = None if opts.rates.strip() == "auto" else [float(r) for r in opts.rates.split(",") if r.strip()]
    if rates is None and not users:
        raise SystemExit("--rates auto needs --users points to size it")
    return arms, users, rates


def copy_raw(runs: list[dict], work: Path, out: Path) -> None:
    raw = out / "raw"
    if raw.exists():
        shutil.rmtree(raw)
    raw.mkdir(parents=True)
    for run in runs:
        src = work / run["requests_log"]
        (raw / f"{src.name}.gz").write_bytes(gzip.compress(src.read_bytes(), mtime=0))  # reproducible bytes
        run["requests_log"] = f"raw/{src.name}.gz"


def main(argv=None) -> int:
    opts = parse_args(argv)
    arms, users, rates = plan(opts)
    base = yaml.safe_load(opts.config.read_text())
    schedule, schedule_source = None, None
    if "dynamic" in arms:
        sweep = opts.sweep or (None if opts.spec_schedule else committed_sweep(base, REPO / "docs"))
        schedule, schedule_source = load_schedule(opts.spec_schedule, sweep)
    configs = {arm: arm_config(base, arm, opts.overrides, opts.port, schedule) for arm in arms}
    for config in configs.values():
        validated_args(config)
    n_rates = len(rates) if rates is not None else len(opts.rate_fractions.split(","))
    runs_total = len(arms) * opts.repeats * (len(users) + n_rates)
    work = Path(tempfile.mkdtemp(prefix="dcut-loadtest-"))
    log(f"work folder {work}; arms {arms}; users {[int(p.load) for p in users]}; rates {rates or 'auto'}; "
        f"{opts.repeats} repeats: {runs_total} runs, ~{runs_total * (opts.ramp + opts.duration + 8) / 60:.0f} min "
        f"of load plus {len(arms)} app start-ups")

    from tqdm import tqdm

    from dcut.machine import machine_info, provenance
    from loadtest.report import write_report

    started = dt.datetime.now().isoformat(timespec="seconds")
    runs: list[dict] = []
    arms_info: dict[str, dict] = {}
    bar = tqdm(total=runs_total, desc="load test", unit="run", file=sys.stderr)

    def rate_points() -> list[float]:
        nonlocal rates
        if rates is None:  # --rates auto: sized once, from the first arm's users points, for every arm
            rates = auto_rates(runs, [float(f) for f in opts.rate_fractions.split(",")])
            log(f"request rates (every arm): {rates} req/s")
        return rates

    try:
        for arm in arms:
            def measure(target: Target, serve: ServeProcess, arm=arm) -> None:
                measure_arm(arm, users, rate_points, target, opts, work, serve.get_json, runs, bar,
                            serve.remember_tree)

            arms_info[arm] = serve_arm(arm, configs[arm], opts, work, measure)
    finally:
        bar.close()
        if runs:
            copy_raw(runs, work, opts.out)
            setup = {"config": str(opts.config), "overrides": opts.overrides, "arms": arms,
                     "users": [int(p.load) for p in users], "rates": rates, "rate_fractions": opts.rate_fractions,
                     "repeats": opts.repeats, "ramp_s": opts.ramp, "duration_s": opts.duration,
                     "objectives": {"ttft_ms": opts.ttft_ms, "tpot_ms": opts.tpot_ms},
                     "max_tokens": opts.max_tokens, "prompt_chars": opts.prompt_chars,
                     "chat_fraction": opts.chat_fraction, "prompt_file": str(opts.prompt_file), "seed": opts.seed,
                     "ignore_eos": True, "temperature": 0.0, "quick": opts.quick,
                     "runs_planned": runs_total, "runs_done": len(runs),
                     "spec_schedule": schedule, "spec_schedule_source": schedule_source,
                     "command": "python -m loadtest.run " + " ".join(sys.argv[1:] if argv is None else argv)}
            meta = {"started": started, "finished": dt.datetime.now().isoformat(timespec="seconds"),
                    "machine": machine_info(), **provenance(), "setup": setup, "arms": arms_info, "notes": opts.note}
            write_report(opts.out, runs, meta)
            log(f"wrote {opts.out / 'results.md'}")
    failed = sum(r["figures"]["failures"] for r in runs)
    return 0 if runs and len(runs) == runs_total and failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""D-Cut ON vs OFF under load: serve the app, run Locust at several user counts, compare.

    python -m loadtest.run --out docs/loadtest [--users 64,128,256] [--duration 60] [--config app.config.yaml]

For each mode (``dcut``: the config as is; ``full``: the same config with ``engine.dcut.mode: full``,
every draft verified) it writes a temporary config, starts ``serve run`` on it, waits for /health
and a first completion, runs ``locust --headless`` once per user count (ramp, then ``--duration``
seconds measured, then in-flight requests finish), and stops everything. Then it writes
``results.md``, ``results.json``, plots and the raw Locust CSVs under ``--out``.

``--set key.path=value`` changes the application's ``args`` (``app/config.py``: AppConfig) for both
modes, e.g. ``--set engine.model=/tmp/m/target``; every override is recorded in the results.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from loadtest.results import RunResult, run_result, write_report
from loadtest.serve_process import ServeProcess, port_in_use

REPO = Path(__file__).resolve().parent.parent
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"
APP_IMPORT_PATH = "app.builder:build_app"


def log(message: str) -> None:
    print(f"[{dt.datetime.now():%H:%M:%S}] {message}", flush=True)


# ---- configuration -------------------------------------------------------------------------------

def _parse_value(text: str):
    """``--set`` values are YAML scalars: 16 -> int, true -> bool, null -> None, text -> str."""
    return yaml.safe_load(text)


def apply_override(args: dict, assignment: str) -> None:
    key, sep, value = assignment.partition("=")
    if not sep:
        raise ValueError(f"--set {assignment!r}: expected key.path=value")
    *parents, leaf = key.strip().split(".")
    node = args
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = _parse_value(value)


def app_entry(config: dict) -> dict:
    for app in config.get("applications", []):
        if app.get("import_path") == APP_IMPORT_PATH:
            return app
    raise ValueError(f"no application with import_path {APP_IMPORT_PATH} in the config")


def mode_config(base: dict, mode: str, overrides: list[str], port: int | None) -> dict:
    """The config to serve for one mode: overrides, then every draft verified for ``full``, then the port."""
    config = copy.deepcopy(base)
    args = app_entry(config).setdefault("args", {})
    for assignment in overrides:
        apply_override(args, assignment)
    if mode == "full":
        args.setdefault("engine", {}).setdefault("dcut", {})["mode"] = "full"
    if port is not None:
        config.setdefault("http_options", {})["port"] = port
    return config


def validated_args(config: dict):
    """AppConfig of the config (same validation as the app); fails early on a bad override."""
    from app.config import AppConfig

    return AppConfig.model_validate(app_entry(config).get("args") or {})


# ---- one Locust run --------------------------------------------------------------------------------

def run_locust(prefix: Path, users: int, base_url: str, opts, api_key: str | None, model: str,
               serve: ServeProcess) -> int:
    """``locust --headless`` for ramp + duration seconds; returns its exit code. Bounded in time."""
    ramp = max(opts.ramp, 1)
    cmd = [str(Path(sys.executable).with_name("locust")), "-f", str(LOCUSTFILE), "--headless",
           "-u", str(users), "-r", f"{users / ramp:g}", "--run-time", f"{round(ramp + opts.duration)}s",
           "--reset-stats", "--stop-timeout", str(opts.stop_timeout), "--host", base_url,
           "--csv", str(prefix), "--only-summary", "--loglevel", "WARNING",
           "--model", model, "--max-tokens", opts.max_tokens, "--prompt-chars", opts.prompt_chars,
           "--chat-fraction", str(opts.chat_fraction), "--prompt-file", str(opts.prompt_file),
           "--seed", str(opts.seed)]
    env = None
    if api_key:
        env = {**os.environ, "LOADTEST_API_KEY": api_key}
    limit = ramp + opts.duration + opts.stop_timeout + 60
    t0 = time.monotonic()
    with open(f"{prefix}.log", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        next_note = t0 + opts.progress_every
        while proc.poll() is None:
            time.sleep(1)
            now = time.monotonic()
            if now > t0 + limit:
                proc.kill()
                proc.wait(timeout=30)
                log(f"  locust killed after {limit:.0f} s")
                break
            if now >= next_note:
                serve.remember_tree()
                log(f"  {now - t0:.0f}/{ramp + opts.duration:.0f} s: {_progress(prefix)}")
                next_note = now + opts.progress_every
    return proc.returncode


def _progress(prefix: Path) -> str:
    try:
        r = run_result(prefix, "", 0)
    except (OSError, KeyError, ValueError):
        return "no stats yet"
    return (f"{r.requests} requests, {r.failures} failed, {r.output_tokens_per_s:.1f} output tok/s, "
            f"TTFT p50 {r.ttft_p50_ms or 0:.0f} ms")


# ---- one mode ------------------------------------------------------------------------------------

def run_mode(mode: str, config: dict, users_list: list[int], opts, work: Path) -> tuple[list[RunResult], dict]:
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
    path = work / f"app.{mode}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    base_url = f"http://127.0.0.1:{port}"
    serve = ServeProcess(path, work / f"serve-{mode}.log", base_url, cfg.ingress.api_key, cwd=REPO)
    results, info = [], {"config": app_entry(config)["args"], "dcut_mode": cfg.engine.dcut.mode}
    log(f"D-Cut {mode} (engine.dcut.mode={cfg.engine.dcut.mode}): serve run {path} (log {serve.log})")
    serve.start()
    try:
        auto = cfg.engine_replica.autoscaling
        replicas = auto.initial_replicas or auto.min_replicas
        info["ready_s"] = round(serve.wait_ready(cfg.engine.served_model_name, opts.start_timeout, replicas=replicas,
                                                 progress=log), 1)
        log(f"  ready after {info['ready_s']} s")
        for users in users_list:
            prefix = work / f"{mode}-u{users}"
            log(f"D-Cut {mode}, {users} users: ramp {opts.ramp} s + {opts.duration} s")
            rc = run_locust(prefix, users, base_url, opts, cfg.ingress.api_key, cfg.engine.served_model_name, serve)
            if not Path(f"{prefix}_stats.csv").exists():
                tail = Path(f"{prefix}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"locust wrote no stats (exit {rc}):\n{tail}")
            result = run_result(prefix, mode, users)
            results.append(result)
            log(f"  done (locust exit {rc}): {result.requests} requests, {result.failures} failed, "
                f"{result.requests_per_s:.2f} req/s, {result.output_tokens_per_s:.1f} output tok/s, "
                f"TTFT p50/p99 {result.ttft_p50_ms}/{result.ttft_p99_ms} ms, "
                f"ITL p50/p99 {result.itl_p50_ms}/{result.itl_p99_ms} ms")
            for e in result.errors:
                log(f"  failure x{e['occurrences']}: {e['name']}: {e['error'][:200]}")
        info["dcut_status"] = serve.get_json("/dcut/status")
        status_replicas = (info["dcut_status"] or {}).get("replicas", [])
        info["replicas_at_end"] = len(status_replicas)
        log(f"  engine replicas at the end: {len(status_replicas)}")
    finally:
        log(f"stopping serve ({mode})")
        killed = serve.stop(progress=log)
        info["killed_leftover_pids"] = killed
        log(f"  stopped{'' if not killed else f'; had to kill leftover pids {killed}'}")
    return results, info


# ---- main ----------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "docs" / "loadtest")
    p.add_argument("--config", type=Path, default=REPO / "app.config.yaml")
    p.add_argument("--users", default="64,128,256", help="comma-separated user counts")
    p.add_argument("--duration", type=float, default=60, help="measured seconds per run (after the ramp)")
    p.add_argument("--ramp", type=float, default=10, help="seconds to start all users (not measured)")
    p.add_argument("--stop-timeout", type=int, default=0,
                   help="seconds in-flight requests get to finish when a run ends (Locust's CSV does not "
                   "see them: tokens they streamed before the end are counted either way)")
    p.add_argument("--modes", default="dcut,full", help="dcut: the config as is; full: engine.dcut.mode=full")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override the app's args for every mode (repeatable)")
    p.add_argument("--max-tokens", default="16:128", help="MIN:MAX output tokens per request")
    p.add_argument("--prompt-chars", default="64:512", help="MIN:MAX prompt characters")
    p.add_argument("--chat-fraction", type=float, default=0.5)
    p.add_argument("--prompt-file", type=Path, default=REPO / "models" / "heldout_prompts.jsonl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=900, help="seconds to wait for the app to serve")
    p.add_argument("--progress-every", type=float, default=15)
    p.add_argument("--note", action="append", default=[], help="a line for results.md (repeatable)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    users_list = [int(u) for u in opts.users.split(",") if u.strip()]
    modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    if not set(modes) <= {"dcut", "full"}:
        raise SystemExit("--modes takes dcut and/or full")
    base = yaml.safe_load(opts.config.read_text())
    configs = {mode: mode_config(base, mode, opts.overrides, opts.port) for mode in modes}
    for config in configs.values():
        validated_args(config)
    work = Path(tempfile.mkdtemp(prefix="dcut-loadtest-"))
    log(f"work folder {work}; modes {modes}; users {users_list}; "
        f"~{len(modes) * len(users_list) * (opts.ramp + opts.duration) / 60:.0f} min of load plus start-ups")

    from dcut.machine import machine_info

    started = dt.datetime.now().isoformat(timespec="seconds")
    results: list[RunResult] = []
    modes_info = {}
    try:
        for mode in modes:
            mode_results, modes_info[mode] = run_mode(mode, configs[mode], users_list, opts, work)
            results += mode_results
    finally:
        if results:
            opts.out.mkdir(parents=True, exist_ok=True)
            csv_dir = opts.out / "csv"
            csv_dir.mkdir(exist_ok=True)
            for r in results:
                for suffix in ("_stats.csv", "_failures.csv"):
                    src = work / f"{r.mode}-u{r.users}{suffix}"
                    if src.exists():
                        shutil.copy(src, csv_dir / src.name)
            cfg0 = validated_args(next(iter(configs.values())))
            model_note = _model_note(cfg0, validated_args(mode_config(base, "dcut", [], None)))
            meta = {
                "started": started,
                "finished": dt.datetime.now().isoformat(timespec="seconds"),
                "machine": machine_info(),
                "setup": {"config": str(opts.config), "overrides": opts.overrides, "users": users_list,
                          "ramp_s": opts.ramp, "duration_s": opts.duration, "max_tokens": opts.max_tokens,
                          "prompt_chars": opts.prompt_chars, "chat_fraction": opts.chat_fraction,
                          "prompt_file": str(opts.prompt_file), "ignore_eos": True, "temperature": 0.0},
                "modes": modes_info,
                "notes_md": [*opts.note, model_note, "",
                             f"Started {started}; {opts.ramp:g} s ramp (not measured), then {opts.duration:g} s "
                             "measured per run (requests still streaming at the end: their tokens count, they do not); "
                             "closed loop (no think time). "
                             "Machine: " + json.dumps(machine_info())],
            }
            write_report(opts.out, results, meta)
            log(f"wrote {opts.out / 'results.md'}")
            print((opts.out / "results.md").read_text())
    return 0 if results and all(r.failures == 0 and r.user_errors == 0 for r in results) else 1


def _model_note(cfg, base_cfg) -> str:
    served = f"Served: target `{cfg.engine.model}`, drafter `{cfg.engine.draft}` ({cfg.engine.method}, " \
             f"k={cfg.engine.num_speculative_tokens})."
    if (cfg.engine.model, cfg.engine.draft) != (base_cfg.engine.model, base_cfg.engine.draft):
        missing = [p for p in (base_cfg.engine.model, base_cfg.engine.draft) if p and not Path(p).exists()]
        state = f"missing when this ran: {', '.join(missing)}" if missing else "present when this ended"
        served += (f" **Not the config's models** (`{base_cfg.engine.model}`, `{base_cfg.engine.draft}`; "
                   f"{state}).")
    return served


if __name__ == "__main__":
    sys.exit(main())

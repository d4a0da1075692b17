"""``serve run <config>`` as a child process: start it, wait until it answers, stop it with nothing left.

``served(config, ...)`` does all three around a block (the fault drill, the fuzzer and the soak serve an app
this way); ``model_name`` is the one rule for the model name they ask for.

The process runs in its own session (process group) with ``RAY_AUTH_MODE=disabled`` and
``--address local`` (a fresh local Ray instance, never another engineer's). Stopping:
``serve shutdown -y`` against this instance's dashboard, then SIGTERM to the process group, then
SIGTERM / SIGKILL to any process of this tree still alive (Ray raylet, workers, engine cores).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

DASHBOARD_RE = re.compile(r"dashboard at (?:http://)?([0-9.]+:\d+)")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


class ServeProcess:
    def __init__(self, config: Path, log: Path, base_url: str, api_key: str | None = None,
                 cwd: Path | None = None):
        self.config, self.log, self.base_url, self.cwd = config, log, base_url, cwd
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.proc: subprocess.Popen | None = None
        self._tree: dict[int, float] = {}  # pid -> create_time, every process of ours seen

    # ---- start ------------------------------------------------------------------------------

    def start(self) -> None:
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
               "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        env.pop("RAY_ADDRESS", None)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([_bin("serve"), "run", "--address", "local", str(self.config.resolve())],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=self.cwd, start_new_session=True)

    def remember_tree(self) -> None:
        if self.proc is None:
            return
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                self._tree.setdefault(p.pid, p.create_time())
        except psutil.NoSuchProcess:
            pass

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, model: str, timeout_s: float, replicas: int = 1, progress=print) -> float:
        """Wait (bounded) for /health, a first successful completion and ``replicas`` engine replicas
        reporting to the D-Cut controller; returns seconds waited."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        stage, last_note = "health", 0.0
        body = {"model": model, "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}
        with httpx.Client(base_url=self.base_url, headers=self.headers, timeout=60) as client:
            while time.monotonic() < deadline:
                self.remember_tree()
                if self.proc.poll() is not None:
                    raise RuntimeError(f"serve run exited ({self.proc.returncode}) before it was ready:\n"
                                       f"{self.log_tail()}")
                try:
                    if stage == "health" and client.get("/health").status_code == 200:
                        stage = "completion"
                    if stage == "completion":
                        r = client.post("/v1/completions", json=body)
                        if r.status_code == 200:
                            stage = "replicas"
                        else:
                            note = f"first completion: HTTP {r.status_code} {r.text[:200]}"
                    if stage == "replicas":  # every initial engine replica has reported (no start-up left)
                        status = client.get("/dcut/status")
                        up = len(status.json().get("replicas", [])) if status.status_code == 200 else 0
                        if up >= replicas:
                            self.remember_tree()
                            return time.monotonic() - t0
                        note = f"{up}/{replicas} engine replicas reported"
                    elif stage == "health":
                        note = "waiting for /health"
                except httpx.HTTPError as e:
                    note = f"{stage}: {type(e).__name__}"
                if time.monotonic() - last_note > 30:
                    progress(f"  ... {time.monotonic() - t0:.0f} s, {note}")
                    last_note = time.monotonic()
                time.sleep(2)
        raise TimeoutError(f"serve app not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def get_json(self, path: str) -> dict | None:
        try:
            r = httpx.get(self.base_url + path, headers=self.headers, timeout=30)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    # ---- stop -------------------------------------------------------------------------------

    def dashboard_address(self) -> str | None:
        text = ANSI_RE.sub("", self.log.read_text(errors="replace")) if self.log.exists() else ""
        match = DASHBOARD_RE.search(text)
        if not match:
            return None
        port = int(match.group(1).rsplit(":", 1)[1])
        ours = set(self._tree)
        try:  # only ever shut down Serve on our own Ray instance
            listeners = {c.pid for c in psutil.net_connections("tcp")
                         if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}
        except psutil.Error:
            return None
        return f"http://{match.group(1)}" if listeners and listeners <= ours else None

    def stop(self, progress=print) -> list[str]:
        """Shut everything down; returns "pid command" of what had to be killed by hand (empty when clean)."""
        if self.proc is None:
            return []
        self.remember_tree()
        if self.proc.poll() is None and (address := self.dashboard_address()):
            try:
                subprocess.run([_bin("serve"), "shutdown", "-y", "--address", address], timeout=60,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "RAY_AUTH_MODE": "disabled"})
            except subprocess.TimeoutExpired:
                progress("  serve shutdown timed out")
            time.sleep(3)
            self.remember_tree()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        return self._reap_leftovers()

    def _alive(self) -> list[psutil.Process]:
        alive = []
        for pid, created in self._tree.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive

    def _reap_leftovers(self) -> list[str]:
        deadline = time.monotonic() + 30
        while self._alive() and time.monotonic() < deadline:
            time.sleep(1)
        left = self._alive()
        names = {}
        for p in left:
            try:
                names[p] = " ".join(p.cmdline())[:80]
            except psutil.Error:
                names[p] = "?"
        for p in left:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, still = psutil.wait_procs(left, timeout=10)
        for p in still:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        return [f"{p.pid} {name}" for p, name in names.items()]


# ---- a served app around a block ----------------------------------------------------------------

def _say(line: str) -> None:
    print(line, flush=True)


def app_settings(config: Path):
    """The ``AppConfig`` of the config's D-Cut application: the app's own validation and defaults."""
    import yaml

    from app.config import AppConfig
    from loadtest.arms import app_entry

    return AppConfig.model_validate(app_entry(yaml.safe_load(config.read_text())).get("args") or {})


def model_name(model: str | None, config: Path | None, base_url: str, api_key: str | None = None) -> str:
    """The model to ask for: ``model`` if given, else the name the config's app serves (its
    ``served_model_name``, else the target folder's name, as the app decides), else the first model the app
    at ``base_url`` lists (``/v1/models``, as the locustfile does)."""
    if model:
        return model
    if config is not None:
        return app_settings(config).engine.served_model_name
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


@dataclass(frozen=True)
class Served:
    """The app a block runs against: the process ``served`` started (None: an app already served), and the
    model name to ask for."""

    process: ServeProcess | None
    model: str


@contextmanager
def served(config: Path | None, base_url: str, api_key: str | None = None, *, model: str | None = None,
           log: Path | None = None, timeout_s: float = 900, progress: Callable[[str], None] = _say) -> Iterator[Served]:
    """``serve run config`` on its own local Ray, waited on until ``/health`` answers, a completion of the
    model (`model_name`) succeeds and the initial engine replicas report; stopped, nothing left running, when
    the block ends, also when starting it failed. Without a config: the app already served at ``base_url``,
    neither started nor stopped."""
    if config is None:
        yield Served(None, model_name(model, None, base_url, api_key))
        return
    app = app_settings(config)
    auto = app.engine_replica.autoscaling
    process = ServeProcess(config, log or Path(tempfile.mkdtemp()) / "serve.log", base_url, api_key,
                           cwd=config.resolve().parent)
    result = Served(process, model_name(model, config, base_url))
    process.start()
    try:
        waited = process.wait_ready(result.model, timeout_s, auto.initial_replicas or auto.min_replicas, progress)
        progress(f"served {config} in {waited:.0f} s (log {process.log})")
        yield result
    finally:
        if left := process.stop(progress):
            progress(f"killed by hand: {left}")

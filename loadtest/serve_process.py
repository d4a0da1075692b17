"""``serve run <config>`` as a child process: start it, wait until it answers, stop it with nothing left.

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
import time
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

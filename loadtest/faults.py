"""Fault drills against a dcut-serve application on this machine: SIGKILL one engine replica while clients send
requests, and measure what the clients saw. HTTP to 127.0.0.1 only; bounded in users and seconds.

    python -m loadtest.faults --config app.config.yaml --users 16 --max-tokens 32   # serves it, drills, stops it
    python -m loadtest.faults --users 16 [--api-key KEY]      # against an app already served here (make serve)

The drill opens one long stream (the probe), finds the replica serving it from ``/dcut/status``, starts ``users``
clients posting non-streaming completions in a loop (and ``streaming_users`` posting streams), SIGKILLs the probe's
replica (its process, found in the local Ray cluster's actor table; ``--kill engine-core``: only its vLLM engine core
process, so the replica lives on with a dead engine), keeps the clients going for ``load_s`` seconds (then counts the
replica's child processes, its vLLM engine core, still alive: they must die with it), then waits until
``/dcut/status`` lists as many replicas as before again (or ``timeout``). It reports every request's outcome,
how the probe stream ended, the continuations the replicas took over (issue 64), how long the dead replica stayed
in the status, and how long until a replacement reported.

    python -m loadtest.faults --users 16 --streaming-users 16 --kill engine-core --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from loadtest.serve_process import served

LOCAL = ("127.0.0.1", "localhost")
RETRY_BACKOFF_S = 0.5  # the OpenAI SDK's first retry delay (INITIAL_RETRY_DELAY)


def stream_ending(text: str) -> str:
    """How an SSE body ended: ``done`` ([DONE] after data), ``error`` (an error event, then [DONE]) or ``cut``."""
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "cut"
    return "error" if any(e.startswith('{"error"') for e in events[:-1]) else "done"


class Load:
    """``users`` clients posting ``body`` in a loop until stopped; ``outcomes`` counts what came back (the status
    code, ``cut``/``error`` for a stream that did not end cleanly, or the client-side exception's name).

    ``client_retries``: how often a client sends a request again when its connection broke before any response
    (a proxy that died with its node), after a backoff of 0.5 s doubling per try, as the OpenAI SDK does
    (``max_retries=2``, backoff from 0.5 s): a dying node's proxy may still take connections for a moment, and an
    immediate retry can land on it again. ``reconnects`` counts them."""

    def __init__(self, client: httpx.AsyncClient, body: dict, users: int, path: str = "/v1/completions",
                 client_retries: int = 0):
        self.client, self.body, self.users, self.path = client, body, users, path
        self.client_retries = client_retries
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.reconnects: collections.Counter[str] = collections.Counter()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _user(self) -> None:
        while not self._stop.is_set():
            for attempt in range(self.client_retries + 1):
                try:
                    r = await self.client.post(self.path, json=self.body)
                except httpx.TransportError as e:  # no response: the connection broke or never opened
                    if attempt < self.client_retries:
                        self.reconnects[type(e).__name__] += 1
                        await asyncio.sleep(RETRY_BACKOFF_S * 2**attempt)
                        continue
                    self.outcomes[type(e).__name__] += 1
                except httpx.HTTPError as e:
                    self.outcomes[type(e).__name__] += 1
                else:
                    ending = stream_ending(r.text) if self.body.get("stream") and r.status_code == 200 else "done"
                    self.outcomes[str(r.status_code) if ending == "done" else ending] += 1
                break

    @property
    def failed(self) -> dict[str, int]:
        return {k: n for k, n in self.outcomes.items() if k != "200"}

    async def __aenter__(self) -> Load:
        self._tasks = [asyncio.create_task(self._user()) for _ in range(self.users)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()  # every request already sent finishes: none is abandoned by the drill
        await asyncio.gather(*self._tasks)


def replica_pid(name_part: str) -> int:
    """PID of the live Ray actor whose name contains ``name_part`` (a Serve replica is named
    ``SERVE_REPLICA::<app>#<deployment>#<replica id>``). Needs ``ray.init`` on this machine's cluster."""
    from ray._private import state

    for info in state.actors(actor_state_name="ALIVE").values():
        if name_part in info["Name"] and info["Pid"]:
            return int(info["Pid"])
    raise LookupError(f"no live actor named *{name_part}*")


@dataclass
class KillReport:
    users: int
    max_tokens: int
    streaming_users: int = 0
    kill: str = "replica"  # or "engine-core": the replica's vLLM engine core process only
    killed_replica: str = ""
    outcomes: dict[str, int] = field(default_factory=dict)  # the non-streaming clients'
    stream_outcomes: dict[str, int] = field(default_factory=dict)  # the streaming clients' ("cut", "error": failed)
    continuations: int = 0  # requests the live replicas took over from the killed one (their continued_total)
    probe_stream: str = ""
    dropped_from_status_s: float | None = None
    replaced_s: float | None = None
    children: int = 0  # the killed replica's child processes (its vLLM engine core)
    orphans: int | None = None  # of those, alive after the load
    duration_s: float = 0.0

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values()) + sum(self.stream_outcomes.values())

    @property
    def failed(self) -> int:
        return sum(n for outcomes in (self.outcomes, self.stream_outcomes) for k, n in outcomes.items() if k != "200")


async def _replicas(client: httpx.AsyncClient) -> list[dict]:
    return (await client.get("/dcut/status", timeout=30)).json()["replicas"]


def _continued(replicas: list[dict]) -> int:
    return sum(r["load"].get("continued_total", 0) for r in replicas)


def engine_cores(pid: int) -> list[psutil.Process]:
    """The vLLM engine core processes under the replica process ``pid`` (vLLM titles them ``VLLM::EngineCore``)."""
    def named(p: psutil.Process) -> bool:
        try:
            return "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())
        except psutil.Error:
            return False
    return [p for p in psutil.Process(pid).children(recursive=True) if named(p)]


async def kill_drill(client: httpx.AsyncClient, model: str, users: int = 16, max_tokens: int = 32,
                     probe_tokens: int = 240, warmup_s: float = 1.0, load_s: float = 20.0, timeout_s: float = 180.0,
                     until_replaced: bool = True, streaming_users: int = 0, kill: str = "replica") -> KillReport:
    """SIGKILL the replica serving a long stream (``kill="engine-core"``: its engine core only) while ``users``
    clients send completions and ``streaming_users`` clients streams (module docstring); ``until_replaced=False``
    stops once the load is over and the dead replica left the status."""
    assert client.base_url.host in LOCAL, "fault drills run against this machine only"
    assert kill in ("replica", "engine-core"), kill
    report = KillReport(users=users, max_tokens=max_tokens, streaming_users=streaming_users, kill=kill)
    before = await _replicas(client)
    probe_body = {"model": model, "prompt": "Hello", "max_tokens": probe_tokens, "ignore_eos": True, "stream": True}
    first_chunk = asyncio.Event()

    async def probe() -> str:
        async with client.stream("POST", "/v1/completions", json=probe_body) as r:
            text = ""
            async for line in r.aiter_lines():
                text += line + "\n"
                first_chunk.set()
        return stream_ending(text)

    probe_task = asyncio.create_task(probe())
    await asyncio.wait_for(first_chunk.wait(), 60)
    deadline = time.monotonic() + 30
    # only the probe is in flight now: exactly one replica runs it (another may still report a finished request)
    while len(busy := [r for r in await _replicas(client) if r["load"]["engine_requests"] > 0]) != 1:
        assert time.monotonic() < deadline, f"not one replica reports the probe stream: {busy}"
        await asyncio.sleep(0.25)
    victim = report.killed_replica = busy[0]["replica_id"]
    body = {"model": model, "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True}
    async with Load(client, body, users) as load, Load(client, {**body, "stream": True}, streaming_users) as streams:
        await asyncio.sleep(warmup_s)
        t0 = time.monotonic()
        if probe_task.done():  # nothing left to break: the drill would test nothing about streams
            raise RuntimeError("the probe stream ended before the kill: a longer probe or a shorter warm-up")
        pid = replica_pid(f"#{victim}")
        children = psutil.Process(pid).children(recursive=True)
        report.children = len(children)
        if kill == "replica":
            os.kill(pid, signal.SIGKILL)
        else:
            cores = engine_cores(pid)
            assert cores, f"no engine core process under replica {victim} (pid {pid})"
            for core in cores:
                core.send_signal(signal.SIGKILL)
        await _watch(client, victim, len(before), report, t0, t0 + load_s, done=lambda r: False)
    report.orphans = sum(alive(c) for c in children)
    report.probe_stream = await probe_task
    report.outcomes, report.stream_outcomes = dict(load.outcomes), dict(streams.outcomes)
    # what the other replicas took over, from their next reports (every 1-2 s; the victim's count dies with it)
    await asyncio.sleep(2.5)
    others = [r for r in await _replicas(client) if r["replica_id"] != victim]
    report.continuations = _continued(others) - _continued([r for r in before if r["replica_id"] != victim])
    seen = "replaced_s" if until_replaced else "dropped_from_status_s"
    await _watch(client, victim, len(before), report, t0, t0 + timeout_s,
                 done=lambda r: getattr(r, seen) is not None)
    report.duration_s = round(time.monotonic() - t0, 2)
    return report


def alive(process: psutil.Process) -> bool:
    """Running and not a zombie (an orphan nobody reaped yet is dead)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def _watch(client: httpx.AsyncClient, victim: str, replicas: int, report: KillReport, t0: float,
                 until: float, done: Callable[[KillReport], bool]) -> None:
    """Poll ``/dcut/status`` until ``until`` (monotonic) or ``done(report)``, noting when ``victim`` left it and
    when ``replicas`` replicas report again without it."""
    while time.monotonic() < until and not done(report):
        ids = {r["replica_id"] for r in await _replicas(client)}
        if report.dropped_from_status_s is None and victim not in ids:
            report.dropped_from_status_s = round(time.monotonic() - t0, 2)
        if report.replaced_s is None and victim not in ids and len(ids) >= replicas:
            report.replaced_s = round(time.monotonic() - t0, 2)
        await asyncio.sleep(0.25)


def drill(opts, model: str) -> None:
    """The kill drill against the app at ``opts.base_url``, its report printed."""
    import ray

    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}

    async def run() -> KillReport:
        async with httpx.AsyncClient(base_url=opts.base_url, headers=headers, timeout=300) as client:
            return await kill_drill(client, model, opts.users, opts.max_tokens, opts.probe_tokens, load_s=opts.load_s,
                                    timeout_s=opts.timeout, streaming_users=opts.streaming_users, kill=opts.kill)

    try:
        ray.init(address="auto", log_to_driver=False)
        report = asyncio.run(run())
        print(json.dumps({**asdict(report), "requests": report.requests, "failed": report.failed}, indent=1))
    finally:
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--model", help="Model name (default: the --config's served model name, else the first one "
                   "the app lists).")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--streaming-users", type=int, default=0, help="Clients posting streams beside --users.")
    p.add_argument("--kill", choices=("replica", "engine-core"), default="replica",
                   help="SIGKILL the probe's replica process, or only its vLLM engine core (the replica lives on).")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--probe-tokens", type=int, default=960,
                   help="The probe stream's tokens: long enough that a replica reports it before it ends (the deep "
                   "pair emits 240 in about a second), within the model's context.")
    p.add_argument("--load-s", type=float, default=20.0, help="Seconds of load after the kill.")
    p.add_argument("--timeout", type=float, default=180.0, help="Longest wait for a replacement replica (s).")
    p.add_argument("--config", type=Path, help="Serve this config (`serve run`, its own local Ray) for the drill; "
                   "its engine_replica.autoscaling.initial_replicas replicas must start.")
    opts = p.parse_args()
    with served(opts.config, opts.base_url, opts.api_key, model=opts.model) as app:
        drill(opts, app.model)


if __name__ == "__main__":
    main()

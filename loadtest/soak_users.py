"""Locust users for the soak (``loadtest.soak``): ``loadtest.locustfile``'s streaming users, plus a log that counts
every request started and how it finished, and records each TTFT / ITL as it arrives.

    locust -f loadtest/soak_users.py --headless -u 256 -r 16 --run-time 600s --stop-timeout 300 \\
        --host http://127.0.0.1:8000 --soak-log soak.jsonl

The log (``--soak-log``, one JSON array per line, wall-clock seconds): ``["start", t]`` when a request is sent,
``["end", t, "ok" | "failed"]`` when it ended, ``["cut", t]`` when Locust stopped the user mid-request (the run
ended before it: ``--stop-timeout`` lets requests finish), ``["fail", t, message]`` for each failure Locust
records, and ``["TTFT", t, ms]`` / ``["ITL", t, ms]`` for each token chunk.
"""

from __future__ import annotations

import json
import time

from gevent import GreenletExit
from locust import events, task

import loadtest.locustfile as streaming  # a module, not its classes: Locust would run every user class it sees


@events.init_command_line_parser.add_listener
def _arguments(parser):
    parser.add_argument("--soak-log", env_var="LOADTEST_SOAK_LOG", default="", help="JSON lines for the soak.")


class SoakLog:
    """The ``--soak-log`` file, appended line by line (greenlets of one process: lines never interleave)."""

    file = None

    @classmethod
    def write(cls, *record) -> None:
        if cls.file is not None:
            cls.file.write(json.dumps(record, separators=(",", ":")) + "\n")


@events.init.add_listener
def _open(environment, **_kwargs):
    opts = environment.parsed_options
    if opts is not None and opts.soak_log and SoakLog.file is None:
        SoakLog.file = open(opts.soak_log, "a", buffering=1)  # noqa: SIM115 - closed at quit


@events.quit.add_listener
def _close(**_kwargs):
    if SoakLog.file is not None:
        SoakLog.file.close()
        SoakLog.file = None


@events.request.add_listener
def _request(request_type, name, response_time, exception=None, context=None, **_kwargs):
    now = time.time()
    if exception is not None:
        SoakLog.write("fail", now, f"{name}: {exception}"[:300])
        if isinstance(context, dict) and isinstance(context.get("soak_user"), SoakUser):
            context["soak_user"].failed = True
    elif request_type == streaming.SSE_TYPE and name in ("TTFT", "ITL"):
        SoakLog.write(name, now, round(response_time, 3))


class SoakUser(streaming.OpenAIStreamUser):
    """One closed-loop client of ``loadtest.locustfile``; each request's start and end are logged."""

    failed = False

    def context(self) -> dict:
        """Carried by this user's request events, so a failure is pinned on the request that had it."""
        return {"soak_user": self}

    @task
    def stream_completion(self) -> None:
        SoakLog.write("start", time.time())
        self.failed = False
        try:
            streaming.OpenAIStreamUser.stream_completion(self)
        except GreenletExit:
            SoakLog.write("cut", time.time())
            raise
        SoakLog.write("end", time.time(), "failed" if self.failed else "ok")

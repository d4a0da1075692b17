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

import time

from gevent import GreenletExit

import loadtest.locustfile as streaming  # a module, not its classes: Locust would run every user class it sees
from loadtest.soak_log import SoakLog  # imported once (Locust may import this file twice): listeners once


class SoakUser(streaming.OpenAIStreamUser):
    """One closed-loop client of ``loadtest.locustfile``; each request's start and end are logged."""

    failed = False

    def context(self) -> dict:
        """Carried by this user's request events, so a failure is pinned on the request that had it
        (``loadtest.soak_log`` sets ``failed``)."""
        return {"soak_user": self}

    def stream_completion(self) -> None:
        SoakLog.write("start", time.time())
        self.failed = False
        try:
            streaming.OpenAIStreamUser.stream_completion(self)
        except GreenletExit:
            SoakLog.write("cut", time.time())
            raise
        SoakLog.write("end", time.time(), "failed" if self.failed else "ok")


# Locust adds a base class's tasks to a subclass's: this one task replaces the inherited one (else every other
# request would go unlogged).
SoakUser.tasks = [SoakUser.stream_completion]

"""The soak's log file and its Locust listeners (``loadtest.soak_users``). A module of its own, imported by name:
Locust may import a locustfile more than once, and listeners registered twice would log every event twice."""

from __future__ import annotations

import json
import time

from locust import events

SSE_TYPE = "SSE"  # loadtest.locustfile's request type for TTFT / ITL entries


class SoakLog:
    """The ``--soak-log`` file, appended line by line (greenlets of one process: lines never interleave)."""

    file = None

    @classmethod
    def write(cls, *record) -> None:
        if cls.file is not None:
            cls.file.write(json.dumps(record, separators=(",", ":")) + "\n")


@events.init_command_line_parser.add_listener
def _arguments(parser):
    parser.add_argument("--soak-log", env_var="LOADTEST_SOAK_LOG", default="", help="JSON lines for the soak.")


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
        user = context.get("soak_user") if isinstance(context, dict) else None
        if user is not None:
            user.failed = True  # pinned on the request that failed
    elif request_type == SSE_TYPE and name in ("TTFT", "ITL"):
        SoakLog.write(name, now, round(response_time, 3))

"""Helpers for the integration tests' Serve applications on the session's Ray instance."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def wait_until(condition: Callable[[], object], timeout_s: float, what: str | Callable[[], str],
               every_s: float = 0.5) -> None:
    """Poll ``condition`` until it holds; fail the test (or fixture) at the deadline, naming ``what`` (a callable:
    called then, to say what was seen last). From async code: ``await asyncio.to_thread(wait_until, ...)``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what() if callable(what) else what} within {timeout_s:.0f} s")
        time.sleep(every_s)


def delete_apps(*names: str, timeout_s: float = 90) -> None:
    """Delete applications at once and wait until all are gone: `serve.delete` blocks on one app at a time,
    and each waits out its replicas' graceful shutdown."""
    from ray import serve

    for name in names:
        serve.delete(name, _blocking=False)
    wait_until(lambda: not set(names) & set(serve.status().applications), timeout_s, f"deletion of {names}")

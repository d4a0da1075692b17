"""Die with the parent: an engine core (or TP worker) whose parent was SIGKILLed must not live on.

vLLM's ``AsyncLLM`` always runs its engine core in a child process, and that child outlives a parent killed
without a chance to clean up (a Ray replica SIGKILLed, OOM-killed, its node lost): measured here, the orphan kept
its ~1.7 GB (on a GPU it would keep the GPU memory the replacement replica needs) and its busy-polling loop, for
good. The plugin loads in every vLLM process, so each multiprocessing child watches its parent from a daemon
thread and kills itself once it has been re-parented. Polling ``getppid`` rather than ``PR_SET_PDEATHSIG``:
the signal fires when the *thread* that started the child exits, which in an asyncio server may be any time.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

POLL_S = 1.0


def watch_parent(poll_s: float = POLL_S) -> threading.Thread | None:
    """In a multiprocessing child, start the watcher (once per process); elsewhere do nothing."""
    if multiprocessing.parent_process() is None or getattr(watch_parent, "_thread", None) is not None:
        return None
    parent = os.getppid()
    if parent == 1:  # already orphaned before vLLM loaded its plugins
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup to run: the parent that wanted results is gone

    thread = threading.Thread(target=watch, name="dcut-parent-watch", daemon=True)
    thread.start()
    watch_parent._thread = thread  # type: ignore[attr-defined]
    return thread

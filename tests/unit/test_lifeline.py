"""A vLLM child process (engine core, TP worker) dies with its parent (``dcut.vllm.lifeline``): real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from dcut.vllm.lifeline import watch_parent
from loadtest.faults import alive
from tests.serve_apps import wait_until

POLL_S = 0.1

# The middle process starts a multiprocessing child that arms its watcher and says so through a pipe (the
# handshake); the middle process relays "<child pid> <armed>" on stdout, then waits to be SIGKILLed by the test.
MIDDLE = f"""
import multiprocessing, sys, time
from dcut.vllm.lifeline import watch_parent

def child(conn):
    thread = watch_parent(poll_s={POLL_S}) or getattr(watch_parent, "_thread", None)
    conn.send(thread is not None and thread.is_alive())
    conn.close()
    time.sleep(60)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=child, args=(send,), daemon=False)
    p.start()
    send.close()  # the child holds the only write end: a child that dies before the handshake ends the pipe
    try:
        armed = recv.recv() if recv.poll(60) else "timeout"
    except EOFError:
        armed = "died"
    print(p.pid, armed, flush=True)
    time.sleep(60)
"""


def test_child_dies_when_its_parent_is_killed(tmp_path):
    script = tmp_path / "middle.py"
    script.write_text(MIDDLE)
    middle = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=os.getcwd())
    child = None
    try:
        handshake = middle.stdout.readline().split()
        assert len(handshake) == 2, f"no handshake from the middle process: {middle.communicate(timeout=10)}"
        pid, armed = int(handshake[0]), handshake[1]
        assert armed == "True", f"the child's watcher was not armed (handshake: {armed})"
        child = psutil.Process(pid)  # the child sent the handshake: it was alive a moment ago
        assert alive(child) and child.ppid() == middle.pid
        # while its parent lives, the armed watcher leaves the child alone (10 polls of getppid)
        time.sleep(10 * POLL_S)
        assert alive(child), "the child died while its parent was alive"
        os.kill(middle.pid, signal.SIGKILL)
        assert middle.wait(timeout=10) == -signal.SIGKILL
        wait_until(lambda: not alive(child), 10, "death of the orphaned child", every_s=POLL_S)
    finally:
        if middle.poll() is None:
            middle.kill()
            middle.wait()
        if child is not None and alive(child):
            child.kill()


def test_not_a_child_process_starts_no_watcher():
    assert watch_parent() is None  # pytest's own process: nobody to outlive

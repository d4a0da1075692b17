"""A vLLM child process (engine core, TP worker) dies with its parent (``dcut.vllm.lifeline``): real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from dcut.vllm.lifeline import watch_parent
from loadtest.faults import alive

# The middle process starts a multiprocessing child that watches it, prints the child's pid, and is SIGKILLed.
MIDDLE = """
import multiprocessing, os, signal, sys, time
from dcut.vllm.lifeline import watch_parent
from loadtest.faults import alive

def child():
    watch_parent(poll_s=0.1)
    time.sleep(60)

if __name__ == "__main__":
    p = multiprocessing.get_context("spawn").Process(target=child, daemon=False)
    p.start()
    print(p.pid, flush=True)
    time.sleep(1.0)  # the child is up and watching
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_child_dies_when_its_parent_is_killed(tmp_path):
    script = tmp_path / "middle.py"
    script.write_text(MIDDLE)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         cwd=os.getcwd())
    assert out.returncode == -9, out.stderr
    try:
        child = psutil.Process(int(out.stdout.split()[0]))
    except psutil.NoSuchProcess:
        return  # already gone
    deadline = time.monotonic() + 5
    while alive(child):
        assert time.monotonic() < deadline, "the orphaned child is still alive"
        time.sleep(0.1)


def test_not_a_child_process_starts_no_watcher():
    assert watch_parent() is None  # pytest's own process: nobody to outlive

"""What counts as a replica death (retried by the ingress) and how the fault drill reads a stream's ending."""

from __future__ import annotations

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from deployments.engine import EngineDead
from deployments.ingress import replica_died
from loadtest.faults import KillReport, engine_cores, stream_ending


def test_replica_death_is_an_actor_error_however_wrapped():
    assert replica_died(ActorDiedError()) and replica_died(ActorUnavailableError("gone", None))
    wrapped = RayTaskError("completions", "traceback", ActorDiedError())
    assert replica_died(wrapped)
    assert not replica_died(RayTaskError("completions", "traceback", ValueError("bad request")))
    assert not replica_died(RuntimeError("engine fault"))
    # the engine dead inside a live replica (vLLM's EngineDeadError, issue 64) is the replica's death too
    assert replica_died(EngineDead("engine core died"))
    assert replica_died(RayTaskError("completions", "traceback", EngineDead("engine core died")))


def test_stream_endings():
    chunk = 'data: {"object": "text_completion"}\n\n'
    assert stream_ending(chunk * 3 + "data: [DONE]\n\n") == "done"
    assert stream_ending(chunk + 'data: {"error": {"code": 500}}\n\ndata: [DONE]\n\n') == "error"
    assert stream_ending(chunk * 2) == "cut"
    assert stream_ending("") == "cut"


def test_engine_cores_are_the_children_vllm_titles_so():
    """``--kill engine-core`` finds the replica's vLLM engine core among its children (vLLM titles it
    ``VLLM::EngineCore``; here a child whose command line names it) and leaves the others."""
    import os
    import subprocess
    import sys

    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    core, other = subprocess.Popen([*sleep, "EngineCore"]), subprocess.Popen([*sleep, "other"])
    try:
        assert [p.pid for p in engine_cores(os.getpid())] == [core.pid]
    finally:
        core.kill()
        other.kill()
        core.wait()
        other.wait()


def test_kill_report_counts_streams_as_requests():
    report = KillReport(users=2, max_tokens=8, outcomes={"200": 5}, stream_outcomes={"200": 3, "error": 1})
    assert report.requests == 9 and report.failed == 1


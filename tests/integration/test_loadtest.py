"""The load-test tooling against real Serve apps, real engines and real Locust.

The four arms of ``loadtest.arms`` run as four applications on the shared local Ray instance
(tests/conftest.py), ``/lt-<arm>`` (tests.tiny_models target + DFlash head, K=7, one engine replica each,
API key on); ``loadtest.run.measure_arm`` drives each with Locust for a few seconds at one concurrency
and one request rate, and ``loadtest.report.write_report`` writes the report. (``loadtest.run.main`` adds
only ``serve run`` of each arm's config, ``loadtest.serve_process``, around the same calls.)
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loadtest.arms import ARMS, arm_args
from loadtest.figures import LATENCIES, PERCENTILES
from loadtest.results import run_result
from tests.serve_apps import delete_apps, wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PORT = int(os.environ.get("DCUT_TEST_HTTP_PORT", 8765))
ROOT = f"http://127.0.0.1:{PORT}"
KEY = "loadtest-key"
MODEL = "tiny-lt"
HEADERS = {"Authorization": f"Bearer {KEY}"}
SCHEDULE = [(1, 1, 7), (2, 4096, 3)]  # the dynamic arm: K=7 alone, K=3 from 2 requests on


def _get_json(base: str):
    def get(path: str) -> dict | None:
        try:
            r = httpx.get(base + path, headers=HEADERS, timeout=30)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
    return get


@pytest.fixture(scope="module")
def arm_apps(ray_cluster, tiny_models, tmp_path_factory):
    """The four arms of one app config, served side by side (started together, waited for together)."""
    from ray import serve
    from ray.serve.api import RunTarget

    from app.builder import build_app

    dcut = {"mode": "joint", "profile_batch_sizes": [1, 4], "profile_warmups": 0, "profile_repeats": 1,
            "cache_dir": str(tmp_path_factory.mktemp("loadtest-cache"))}
    args = {
        "engine": {"model": str(tiny_models["target"]), "draft": str(tiny_models["dflash"]), "method": "dflash",
                   "num_speculative_tokens": 7, "max_num_seqs": 8, "max_model_len": 256, "enforce_eager": True,
                   "served_model_name": MODEL, "dcut": dcut},
        "engine_replica": {"num_cpus": 0.2, "telemetry_interval_s": 1.0, "max_ongoing_requests": 8,
                           "max_queued_requests": 64, "profile_wait_s": 60,
                           "autoscaling": {"min_replicas": 1, "max_replicas": 1, "initial_replicas": 1}},
        "ingress": {"api_key": KEY, "num_cpus": 0.05},
        "controller": {"num_cpus": 0.02},
    }
    serve.run_many([RunTarget(build_app(arm_args(args, arm, SCHEDULE)), name=f"lt-{arm}", route_prefix=f"/lt-{arm}")
                    for arm in ARMS], wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    waiting = set(ARMS)

    def all_serve() -> bool:
        for arm in sorted(waiting):
            app = serve.status().applications.get(f"lt-{arm}")
            if app is not None and app.status == "DEPLOY_FAILED":
                pytest.fail(f"arm {arm} failed to deploy: {app.message}")
            try:
                ok = httpx.post(f"{ROOT}/lt-{arm}/v1/completions", json=body, headers=HEADERS,
                                timeout=30).status_code == 200
                status = _get_json(f"{ROOT}/lt-{arm}")("/dcut/status") if ok else None
                if status and status.get("replicas"):
                    waiting.discard(arm)
            except httpx.HTTPError:
                pass
        return not waiting

    # four engines starting at once on 2 cores (each profiles its cost table)
    wait_until(all_serve, 360, lambda: f"service from arms {sorted(waiting)}", every_s=1)
    yield {arm: f"{ROOT}/lt-{arm}" for arm in ARMS}
    delete_apps(*(f"lt-{arm}" for arm in ARMS))


@pytest.fixture(scope="module")
def loadtest_app(arm_apps):
    return arm_apps["joint"]


def _locust(host: str, prefix: Path, users: int = 3, seconds: int = 6) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).with_name("locust")), "-f", str(REPO / "loadtest" / "locustfile.py"),
           "--headless", "-u", str(users), "-r", str(users), "--run-time", f"{seconds}s", "--host", host,
           "--csv", str(prefix), "--only-summary", "--max-tokens", "4:12", "--prompt-chars", "16:120",
           "--chat-fraction", "0.5", "--seed", "1"]
    env = {**os.environ, "LOADTEST_API_KEY": KEY}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, env=env, cwd=REPO)


def _rows(prefix: Path) -> dict[tuple[str, str], dict]:
    with open(f"{prefix}_stats.csv", newline="") as f:
        return {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}


def test_locust_streams_and_records_ttft_itl(loadtest_app, tmp_path):
    prefix = tmp_path / "lt"
    proc = _locust(loadtest_app, prefix)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(prefix)
    # Both routes streamed, nothing failed.
    for name in ("/v1/completions", "/v1/chat/completions"):
        assert int(rows[("POST", name)]["Request Count"]) > 0, name
    assert all(int(r["Failure Count"]) == 0 for r in rows.values())
    # Time to first token, inter-token latency and token counts were recorded.
    for name in ("TTFT", "ITL", "TPOT", "TOKENS_PER_S"):
        assert int(rows[("SSE", name)]["Request Count"]) > 0, name
    ttft, request = rows[("SSE", "TTFT")], rows[("POST", "/v1/completions")]
    assert 0 < float(ttft["Average Response Time"]) <= float(request["Max Response Time"])
    assert 4 <= float(request["Average Content Size"]) <= 12  # output tokens, ignore_eos -> max_tokens

    result = run_result(prefix, "joint", 3)
    assert result.failures == 0 and result.user_errors == 0 and not result.errors
    assert result.output_tokens > 0 and result.output_tokens_per_s > 0 and result.ttft_p50_ms > 0


def test_failures_carry_the_openai_error_message(loadtest_app, tmp_path):
    """A wrong API key: every request fails with the ingress's 401 message, and no TTFT is recorded."""
    prefix = tmp_path / "bad"
    env = {**os.environ, "LOADTEST_MODEL": MODEL}  # skip /v1/models (it would fail first)
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("locust")), "-f", str(REPO / "loadtest" / "locustfile.py"),
         "--headless", "-u", "1", "-r", "1", "--run-time", "2s", "--host", loadtest_app, "--csv", str(prefix),
         "--only-summary", "--api-key", "wrong", "--think-time", "0.2:0.2"],
        capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert proc.returncode == 1  # Locust: failures -> exit code 1
    result = run_result(prefix, "joint", 1)
    assert result.requests > 0 and result.failures == result.requests
    assert result.ttft_p50_ms is None
    assert any("HTTP 401" in e["error"] and "API key" in e["error"] for e in result.errors), result.errors


def test_report_of_every_arm(arm_apps, tmp_path):
    """The real tooling, briefly: each arm at 2 users and at 3 requests/s, the report written from it. Windows of
    4 s: in 2 s windows, a clean clone run beside a replay on this 2-core box saw `none` at 3/s finish no request."""
    from loadtest import run
    from loadtest.report import write_report

    opts = run.parse_args(["--users", "2", "--rates", "3", "--repeats", "1", "--duration", "4", "--ramp", "1",
                           "--max-tokens", "4:12", "--prompt-chars", "16:120", "--seed", "1",
                           "--status-timeout", "5", "--ttft-ms", "60000", "--tpot-ms", "10000"])
    work, out = tmp_path / "work", tmp_path / "report"
    work.mkdir()
    runs: list[dict] = []
    for arm, base in arm_apps.items():
        target = run.Target(base, KEY, MODEL)
        run.measure_arm(arm, [run.Point("users", 2)], lambda: [3.0], target, opts, work, _get_json(base), runs)
    run.copy_raw(runs, work, out)
    record = write_report(out, runs, {"setup": {"repeats": 1, "ramp_s": 1, "duration_s": 4, "work": str(work),
                                                "objectives": {"ttft_ms": 60000, "tpot_ms": 10000}},
                                      "arms": {}, "machine": {}})

    assert {(p["arm"], p["kind"]) for p in record["points"]} == {(a, k) for a in ARMS for k in ("users", "rate")}
    good_tokens = dict.fromkeys(ARMS, 0.0)
    for p in record["points"]:
        s = {k: v["median"] for k, v in p["summary"].items()}
        where = f"{p['arm']} {p['kind']} {p['load']}"
        assert s["requests"] > 0 and s["failures"] == 0, where
        assert 0 < s["goodput_requests_per_s"] <= s["requests_per_s"], where
        # Tokens count where they arrive: in a short window on a loaded box, the one good request that finished in it
        # may have streamed every token before it (seen in a clean-clone run beside other jobs: `full` at 3/s).
        assert 0 <= s["goodput_tokens_per_s"] <= s["output_tokens_per_s"], where
        good_tokens[p["arm"]] += s["goodput_tokens_per_s"]
        for lat in LATENCIES:
            values = [s[f"{lat}_p{q}_ms"] for q in PERCENTILES]
            assert None not in values and 0 < values[0] <= values[1] <= values[2], (where, lat, values)
        if p["arm"] == "none":  # no drafter: nothing to accept or cut
            assert s["mean_accepted_length"] is None and s["keep_ratio"] is None, where
        else:  # the replica's step totals moved during the point
            assert s["mean_accepted_length"] is not None and 0 <= s["mean_accepted_length"] <= 7, where
            if p["arm"] in ("full", "dynamic"):  # every draft verified
                assert s["keep_ratio"] == pytest.approx(1.0), where
            else:  # joint may draft nothing over a whole point (width 0: no keep ratio), or draft and keep
                # nothing (this tiny pair's drafts are never accepted, and the cut learns it)
                assert s["keep_ratio"] is None or 0 <= s["keep_ratio"] <= 1, where
    assert all(tokens > 0 for tokens in good_tokens.values()), good_tokens
    assert [r["requests_log"].startswith("raw/") for r in record["runs"]] == [True] * len(runs)
    assert all((out / r["requests_log"]).stat().st_size > 0 for r in record["runs"])

    assert {k: [s["arm"] for s in v] for k, v in record["stops_paying"].items()} == \
        {"users": ["full", "dynamic", "joint"], "rate": ["full", "dynamic", "joint"]}
    md = (out / "results.md").read_text()
    lines = [line for line in md.splitlines() if line.startswith("- **")]
    assert len(lines) == 2 and all(f"`{a}`" in line for line in lines for a in ("full", "dynamic", "joint")), lines
    for name in ("throughput.png", "latency.png"):
        assert (out / name).stat().st_size > 10_000, name
    text = (out / "results.json").read_text()
    assert str(REPO) not in text and str(tmp_path) not in text, "committed reports carry no machine paths"

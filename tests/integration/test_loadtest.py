"""The load test against a real Serve app, and the results table on real Locust CSV output.

The app runs on the shared local Ray instance (tests/conftest.py) as its own application
``loadtest`` under ``/loadtest`` (tests.tiny_models target + DFlash head, K=7, D-Cut auto, one
engine replica, API key on); Locust runs headless in a subprocess for a few seconds with 3 users.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loadtest.results import markdown_table, run_result, write_report

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PORT = int(os.environ.get("DCUT_TEST_HTTP_PORT", 8765))
BASE = f"http://127.0.0.1:{PORT}/loadtest"
KEY = "loadtest-key"
MODEL = "tiny-lt"
COMMITTED_CSV = REPO / "docs" / "loadtest" / "csv"


@pytest.fixture(scope="module")
def loadtest_app(ray_cluster, tiny_models, tmp_path_factory):
    from ray import serve

    from app.builder import build_app

    dcut = {"mode": "joint", "profile_batch_sizes": [1, 4], "profile_warmups": 0, "profile_repeats": 1,
            "cache_dir": str(tmp_path_factory.mktemp("loadtest-cache"))}
    args = {
        "engine": {"model": str(tiny_models["target"]), "draft": str(tiny_models["dflash"]), "method": "dflash",
                   "num_speculative_tokens": 7, "max_num_seqs": 8, "max_model_len": 256, "enforce_eager": True,
                   "served_model_name": MODEL, "dcut": dcut},
        "engine_replica": {"num_cpus": 0.3, "telemetry_interval_s": 1.0, "max_ongoing_requests": 8,
                           "max_queued_requests": 16, "profile_wait_s": 60,
                           "autoscaling": {"min_replicas": 1, "max_replicas": 1, "initial_replicas": 1}},
        "ingress": {"api_key": KEY, "num_cpus": 0.05},
        "controller": {"num_cpus": 0.02},
    }
    serve.run(build_app(args), name="loadtest", route_prefix="/loadtest", blocking=False)
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.post(f"{BASE}/v1/completions", json=body, headers=headers, timeout=30).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the loadtest app did not answer a completion within 120 s"
        time.sleep(1)
    yield BASE
    serve.delete("loadtest")


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

    result = run_result(prefix, "dcut", 3)
    assert result.failures == 0 and result.user_errors == 0 and not result.errors
    assert result.output_tokens > 0 and result.output_tokens_per_s > 0 and result.ttft_p50_ms > 0
    write_report(tmp_path / "report", [result], {"setup": {}})
    assert f"| on | 3 | {result.requests} | 0 |" in (tmp_path / "report" / "results.md").read_text()


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
    result = run_result(prefix, "dcut", 1)
    assert result.requests > 0 and result.failures == result.requests
    assert result.ttft_p50_ms is None
    assert any("HTTP 401" in e["error"] and "API key" in e["error"] for e in result.errors), result.errors


def _committed_runs() -> list[tuple[Path, str, int]]:
    runs = []
    for path in sorted(COMMITTED_CSV.glob("*_stats.csv")):
        mode, _, users = path.name.removesuffix("_stats.csv").partition("-u")
        runs.append((path.with_name(path.name.removesuffix("_stats.csv")), mode, int(users)))
    return runs


def test_results_table_from_real_locust_csv(tmp_path):
    """The table builder on the Locust CSV files of the committed comparison (docs/loadtest/csv)."""
    runs = _committed_runs()
    if not runs:
        pytest.skip("no committed load-test CSV under docs/loadtest/csv")
    results = [run_result(prefix, mode, users) for prefix, mode, users in runs]
    for (prefix, _, _), r in zip(runs, results, strict=True):
        rows = _rows(prefix)
        posts = [v for (t, n), v in rows.items() if t == "POST" and n.startswith("/v1/")]
        assert r.requests == sum(int(v["Request Count"]) for v in posts)
        assert r.failures == sum(int(v["Failure Count"]) for v in posts)
        streamed = sum(int(rows[("SSE", n)]["Request Count"]) * float(rows[("SSE", n)]["Average Content Size"])
                       for n in ("TTFT", "ITL") if ("SSE", n) in rows)
        assert r.output_tokens == round(streamed)
        if r.window_s:
            assert r.output_tokens_per_s == pytest.approx(streamed / r.window_s, rel=1e-6)
        assert r.ttft_p50_ms is None or r.ttft_p50_ms <= r.ttft_p99_ms
    table = markdown_table(results)
    assert len(table.splitlines()) == 2 + len(results)
    assert all(f"| {r.mode} | {r.users} |" in table for r in results)

    write_report(tmp_path, results, {"setup": {"from": str(COMMITTED_CSV)}})
    data = json.loads((tmp_path / "results.json").read_text())
    assert {(r["mode"], r["users"]) for r in data["runs"]} == {(m, u) for _, m, u in runs}
    assert (tmp_path / "tokens_per_s.png").stat().st_size > 0 and (tmp_path / "ttft_p99.png").stat().st_size > 0
    assert table in (tmp_path / "results.md").read_text()
    assert data["setup"]["from"] == str(COMMITTED_CSV.relative_to(REPO)), "committed reports carry no machine paths"

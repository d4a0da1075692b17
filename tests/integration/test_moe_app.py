"""The embedded MoE pair, tensor-parallel over 2 ranks, served through the app beside a Dense one (issue 15).

Two applications on the shared local Ray instance, as ``app.two-models.config.yaml`` composes them: ``moe``
(models/moe + its DFlash drafter, TP=2: vLLM's multiprocess executor, one rank per core) and ``dense-tp1`` (the
session's tiny Dense pair, TP=1). Each has its own ingress route, model name and controller; the MoE replica and
its cost table (fingerprint with TP 2) show in its own controller and not in the other's.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from dcut.settings import EMBEDDED_MODELS, engine_env
from tests.serve_apps import delete_apps, wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PORT = int(os.environ.get("DCUT_TEST_HTTP_PORT", 8765))
BASE = f"http://127.0.0.1:{PORT}"


def _args(model: str, draft: str, name: str, tp: int, env: dict, cache_dir: Path) -> dict:
    dcut = {"mode": "joint", "profile_batch_sizes": [1, 4], "profile_warmups": 0, "profile_repeats": 1,
            "cache_dir": str(cache_dir)}
    return {"engine": {"model": model, "draft": draft, "method": "dflash", "num_speculative_tokens": 7,
                       "tensor_parallel_size": tp, "max_num_seqs": 4, "max_model_len": 256, "enforce_eager": True,
                       "served_model_name": name, "dcut": dcut},
            "engine_replica": {"num_cpus": 0.2, "telemetry_interval_s": 1.0, "env": env,
                               "autoscaling": {"min_replicas": 1, "max_replicas": 1}},
            "ingress": {"num_cpus": 0.02}, "controller": {"num_cpus": 0.02}}


def _status(route: str) -> dict:
    r = httpx.get(f"{BASE}{route}/dcut/status", timeout=10)
    return r.json() if r.status_code == 200 else {}


@pytest.fixture(scope="module")
def two_apps(ray_cluster, tiny_models, tmp_path_factory):
    from ray import serve

    from app.builder import build_app

    moe_target, moe_draft = (str(REPO / p) for p in EMBEDDED_MODELS["moe"])
    tp_env = {**engine_env(tensor_parallel_size=2, kv_cache_gib=1), "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    moe = _args(moe_target, moe_draft, "moe", 2, tp_env, tmp_path_factory.mktemp("moe-cache"))
    dense = _args(str(tiny_models["target"]), str(tiny_models["dflash"]), "dense-tp1", 1,
                  engine_env(kv_cache_gib=1), tmp_path_factory.mktemp("dense-cache"))
    serve.run_many([serve.RunTarget(build_app(moe), name="moe", route_prefix="/moe"),
                    serve.RunTarget(build_app(dense), name="dense-tp1", route_prefix="/dense-tp1")])
    wait_until(lambda: _status("/moe").get("cost_tables") and _status("/dense-tp1").get("cost_tables"), 300,
               "cost table in both controllers", every_s=1)
    yield
    delete_apps("moe", "dense-tp1")


def test_moe_tensor_parallel_answers_through_the_ingress(two_apps):
    body = {"model": "moe", "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{BASE}/moe/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 12
    assert [m["id"] for m in httpx.get(f"{BASE}/moe/v1/models", timeout=10).json()["data"]] == ["moe"]
    wrong = httpx.post(f"{BASE}/moe/v1/completions", json={**body, "model": "dense-tp1"}, timeout=30)
    assert wrong.status_code == 404  # each application serves its own model only


def test_each_controller_keeps_its_own_model(two_apps):
    moe, dense = _status("/moe"), _status("/dense-tp1")
    assert [r["model"] for r in moe["replicas"]] == ["moe"]
    assert [r["model"] for r in dense["replicas"]] == ["dense-tp1"]
    moe_tables = [t["table"]["fingerprint"] for t in moe["cost_tables"].values()]
    dense_tables = [t["table"]["fingerprint"] for t in dense["cost_tables"].values()]
    assert [f["tensor_parallel_size"] for f in moe_tables] == [2] and moe_tables[0]["model"].endswith("models/moe")
    assert [f["tensor_parallel_size"] for f in dense_tables] == [1]
    assert set(moe["cost_tables"]).isdisjoint(dense["cost_tables"])
    assert moe["replicas"][0]["cost_source"] in ("profiled", "cache")

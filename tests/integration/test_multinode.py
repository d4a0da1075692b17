"""The app on a Ray cluster of three nodes on this machine (issue 15): the session's head node and two worker nodes
joined for this module (``ray.cluster_utils.Cluster``: each its own raylet with one CPU and one ``dcut_engine``).
Placement is ``app.multinode.config.yaml``'s, on the session's tiny pair: one engine replica per ``dcut_engine``
node, the ingress and the D-Cut controller on the head, a Serve proxy on every node that runs a replica.

A worker node running a replica is then killed (its raylet and every process on it, SIGKILL) under concurrent
non-streaming load: no request fails, and Serve replaces the replica on a surviving node, which starts from the
controller's cost table. Requests whose HTTP connection went through the dead node's proxy lose that connection
before any response; the client sends them again, as the OpenAI SDK does (counted, printed).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import pytest
import yaml

from dcut.settings import engine_env
from tests.serve_apps import wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PORT = int(os.environ.get("DCUT_TEST_HTTP_PORT", 8765))
BASE = f"http://127.0.0.1:{PORT}/multi"
MODEL = "tiny-multi"


def _args(models: dict, cache_dir: Path) -> dict:
    """``app.multinode.config.yaml``'s application with the tiny pair, a small start-up profile, fast reports."""
    args = yaml.safe_load((REPO / "app.multinode.config.yaml").read_text())["applications"][0]["args"]
    args["engine"] = {"model": str(models["target"]), "draft": str(models["dflash"]), "method": "dflash",
                      "num_speculative_tokens": 7, "max_num_seqs": 4, "max_model_len": 256, "enforce_eager": True,
                      "served_model_name": MODEL,
                      "dcut": {"mode": "joint", "profile_batch_sizes": [1, 4], "profile_warmups": 0,
                               "profile_repeats": 1, "cache_dir": str(cache_dir)}}
    args["engine_replica"].update(num_cpus=0.2, max_ongoing_requests=4, telemetry_interval_s=1.0,
                                  profile_wait_s=300, env=engine_env(kv_cache_gib=1),
                                  autoscaling={"min_replicas": 2, "max_replicas": 2, "initial_replicas": 2})
    args["ingress"]["num_cpus"] = args["controller"]["num_cpus"] = 0.02
    return args


def _status() -> dict:
    r = httpx.get(f"{BASE}/dcut/status", timeout=30)
    return r.json() if r.status_code == 200 else {"replicas": []}


def _actor_node(name_part: str) -> str:
    """Node id of the live Ray actor whose name contains ``name_part``."""
    from ray._private import state

    (node,) = {a["Address"]["NodeID"] for a in state.actors(actor_state_name="ALIVE").values()
               if name_part in a["Name"]}
    return node


@pytest.fixture(scope="module")
def multinode(ray_cluster, tiny_models, tmp_path_factory):
    import ray
    from ray import serve

    from app.builder import build_app

    args = _args(tiny_models, tmp_path_factory.mktemp("multi-cache"))
    head = next(n for n in ray.nodes() if n["NodeID"] == ray_cluster.head_node.node_id)
    assert head["Resources"].keys() >= args["engine_replica"]["resources"].keys(), "the head runs an engine too"
    workers = [ray_cluster.add_node(num_cpus=1, resources=args["engine_replica"]["resources"]) for _ in range(2)]
    ray_cluster.wait_for_nodes()
    t0 = time.monotonic()
    serve.run(build_app(args), name="multi", route_prefix="/multi")
    wait_until(lambda: len(_status()["replicas"]) == 2, 180, "two replicas reporting to the controller")
    print(f"multi-node app ready in {time.monotonic() - t0:.1f} s")
    yield workers
    serve.delete("multi")
    for node in workers:
        if node in ray_cluster.worker_nodes:
            ray_cluster.remove_node(node)


def test_replicas_spread_over_nodes_warm_start_and_a_proxy_on_each(multinode, ray_cluster):
    from ray import serve

    replicas = _status()["replicas"]
    nodes = {r["node_id"] for r in replicas}
    head = ray_cluster.head_node.node_id
    assert len(nodes) == 2 and nodes <= {head, *(w.node_id for w in multinode)}, nodes
    # one replica profiled; the other, on another node, started from the controller's table of the same engine
    assert sorted(r["cost_source"] for r in replicas) == ["given", "profiled"]
    assert len({r["fingerprint"] for r in replicas}) == 1
    assert _actor_node("multi#Ingress") == head and _actor_node("multi#DCutController") == head
    proxies = serve.status().proxies
    assert nodes | {head} <= set(proxies), proxies
    assert all(str(s).endswith("HEALTHY") for s in proxies.values()), proxies
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
    for _ in range(4):  # new connections each time: the kernel spreads them over the proxies (SO_REUSEPORT)
        r = httpx.post(f"{BASE}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text


def _replicas() -> list[dict]:
    """The replicas reporting now; none while the request went through the killed node's proxy (shared port)."""
    try:
        return _status()["replicas"]
    except httpx.TransportError:
        return []


def test_worker_node_killed_under_load(multinode, ray_cluster):
    """Load spans the kill; a second load starts after it, so each of its successes is a request the app took in
    after losing the node: some while the replacement is not running yet (one replica serving), more after it."""
    from loadtest.faults import Load

    before = {r["node_id"]: r["replica_id"] for r in _status()["replicas"]}
    victim = next(w for w in multinode if w.node_id in before)
    killed = before[victim.node_id]
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 16, "ignore_eos": True}
    replicas: list[dict] = []

    def replaced() -> bool:
        replicas[:] = _replicas()
        return len(replicas) == 2 and killed not in {r["replica_id"] for r in replicas}

    def replacement_running() -> bool:
        """Serve runs a replica besides the two it started with, past its start-up: routers may send it requests."""
        from ray import serve
        from ray._private import state

        names = [a["Name"] for a in state.actors(actor_state_name="ALIVE").values()
                 if "multi#EngineReplica#" in a["Name"]]
        new = [name for name in names if not any(name.endswith(f"#{rid}") for rid in before.values())]
        states = serve.status().applications["multi"].deployments["EngineReplica"].replica_states
        return bool(new) and not states.get("STARTING")

    def new_replica_served() -> bool:
        new = [r for r in _replicas() if r["replica_id"] not in before.values()]
        return bool(new) and new[0]["load"]["generated_tokens_total"] > 0

    async def drill():
        async with httpx.AsyncClient(base_url=BASE, timeout=120) as c:
            async with Load(c, body, users=3, client_retries=2) as load:
                await asyncio.to_thread(wait_until, lambda: load.outcomes["200"] >= 3, 60, "successes before the kill")
                t0 = time.monotonic()
                await asyncio.to_thread(ray_cluster.remove_node, victim, False)  # SIGKILL, no drain
                async with Load(c, body, users=2, client_retries=2) as after:  # every request sent after the kill
                    await asyncio.to_thread(wait_until, lambda: after.outcomes["200"] >= 4, 60,
                                            lambda: f"successes of requests sent after the kill: {after.outcomes}")
                    served_s = time.monotonic() - t0
                    # served with one replica: the replacement needs seconds to start its engine
                    degraded = not await asyncio.to_thread(replacement_running)
                    await asyncio.to_thread(wait_until, replaced, 240, lambda: f"replacement reporting: {replicas}")
                    replaced_s = time.monotonic() - t0
                    at_replacement = after.outcomes["200"]
                    await asyncio.to_thread(wait_until, new_replica_served, 60, "request served by the replacement")
                    await asyncio.to_thread(wait_until, lambda: after.outcomes["200"] >= at_replacement + 4, 60,
                                            "successes after the replacement")
            return load, after, degraded, served_s, replaced_s

    load, after, degraded, served_s, replaced_s = asyncio.run(drill())
    print(f"worker node killed: load across the kill {dict(load.outcomes)} (client reconnects "
          f"{dict(load.reconnects)}), load sent after it {dict(after.outcomes)} (reconnects {dict(after.reconnects)}),"
          f" 4 requests sent after the kill served {served_s:.1f} s after it, replaced in {replaced_s:.1f} s")
    assert not load.failed and not after.failed, (load.outcomes, after.outcomes)
    assert degraded, "the replacement was running before 4 requests sent after the kill were served"
    (new,) = [r for r in replicas if r["replica_id"] not in before.values()]
    survivors = {ray_cluster.head_node.node_id, *(w.node_id for w in multinode if w is not victim)}
    assert new["node_id"] in survivors and new["node_id"] != victim.node_id
    assert new["cost_source"] == "given", "the replacement starts from the controller's table, no profiling"

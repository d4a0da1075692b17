"""Shared fixtures. Integration fixtures are session-scoped: one set of tiny models, one local Ray instance."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dcut.settings import engine_env

# Engines started in this process (in-process vLLM, 1 GiB KV cache, nothing from a hub); the user's
# environment wins.
for _key, _value in engine_env(kv_cache_gib=1).items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """A random Qwen3 target with a chat template and its DFlash head (``tests.tiny_models``)."""
    from tests.tiny_models import build_tiny_models

    return build_tiny_models(tmp_path_factory.mktemp("tiny-models"))


# Nodes of the session's Ray cluster that may run a multi-node app's engine replicas (tests/integration/
# test_multinode.py adds worker nodes declaring it too); the other apps ask for no custom resource.
ENGINE_NODE_RESOURCE = "dcut_engine"


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster per pytest session: a head node of 2 CPUs (token auth off, fast autoscaling metrics)
    that tests may join worker nodes to (``ray.cluster_utils.Cluster``, each node its own raylet)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 2, "include_dashboard": False, "resources": {ENGINE_NODE_RESOURCE: 1}}
    for attempt in (1, 2):  # Ray waits a fixed 30 s for its raylet, too short on a saturated box: retry once
        try:
            cluster = Cluster(initialize_head=True, head_node_args=head)
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
    ray.init(address=cluster.address, log_to_driver=False)
    serve.start(proxy_location="EveryNode",
                http_options={"host": "127.0.0.1", "port": int(os.environ.get("DCUT_TEST_HTTP_PORT", 8765))})
    yield cluster
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()

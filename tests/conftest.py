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


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance per pytest session (2 CPUs, token auth off, fast autoscaling metrics)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    import ray
    from ray import serve

    for attempt in (1, 2):  # Ray waits a fixed 30 s for its raylet, too short on a saturated box: retry once
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            ray.shutdown()
    serve.start(http_options={"host": "127.0.0.1", "port": int(os.environ.get("DCUT_TEST_HTTP_PORT", 8765))})
    yield ray
    serve.shutdown()
    ray.shutdown()

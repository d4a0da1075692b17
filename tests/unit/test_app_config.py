"""The committed app configs validate as the app will read them, a TP > 1 engine asks for processes, and the
deployments are placed on the cluster's nodes as the settings say."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from app.config import AppConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["app.config.yaml", "app.two-models.config.yaml", "app.gpu.config.yaml",
                                  "app.reasoning.config.yaml", "app.multinode.config.yaml"])
def test_committed_configs_validate(name: str) -> None:
    apps = yaml.safe_load((REPO / name).read_text())["applications"]
    configs = [AppConfig.model_validate(a["args"]) for a in apps]
    names = [c.engine.served_model_name for c in configs]
    assert len(set(names)) == len(names), "each application serves its own model name"
    assert len({a["route_prefix"] for a in apps}) == len(apps)


def test_two_models_config_serves_the_moe_pair_tensor_parallel() -> None:
    apps = {a["name"]: AppConfig.model_validate(a["args"])
            for a in yaml.safe_load((REPO / "app.two-models.config.yaml").read_text())["applications"]}
    assert apps["moe"].engine.tensor_parallel_size == 2 and apps["moe"].engine.model.endswith("models/moe")
    assert apps["deep"].engine.tensor_parallel_size == 1


def test_tensor_parallel_with_an_in_process_engine_is_refused() -> None:
    with pytest.raises(ValidationError, match="VLLM_ENABLE_V1_MULTIPROCESSING"):
        AppConfig.model_validate({"engine": {"tensor_parallel_size": 2}})  # the TP=1 default environment
    ok = AppConfig.model_validate({"engine": {"tensor_parallel_size": 2},
                                   "engine_replica": {"env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}})
    assert ok.engine.tensor_parallel_size == 2


def test_mode_auto_is_refused_naming_its_new_name() -> None:
    """``auto`` was renamed ``reference``: a config still saying ``auto`` fails validation and says so (no alias);
    a config saying nothing gets ``joint``, the product's default."""
    from dcut.settings import DCutSettings

    with pytest.raises(ValidationError, match="mode 'auto' was renamed to 'reference'"):
        AppConfig.model_validate({"engine": {"dcut": {"mode": "auto"}}})
    with pytest.raises(ValidationError, match="renamed to 'reference'"):
        DCutSettings(mode="auto")
    assert AppConfig.model_validate({"engine": {"dcut": {"mode": "reference"}}}).engine.dcut.mode == "reference"
    assert DCutSettings().mode == "joint" and AppConfig().engine.dcut.mode == "joint"


@pytest.mark.parametrize("routing", [{"policy": "dcut"}, {"policy": "default"}, {}])
def test_routing_is_refused_saying_the_dcut_router_was_removed(routing: dict) -> None:
    """The D-Cut request router lost to Serve's default router and was removed (docs/history.md §6): a config
    that still sets ``engine_replica.routing`` (even to ``default``) fails naming the field and why."""
    with pytest.raises(ValidationError, match=r"engine_replica\.routing .*D-Cut request router was removed") as e:
        AppConfig.model_validate({"engine_replica": {"routing": routing}})
    assert e.value.errors()[0]["loc"] == ("engine_replica",)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_engine_replicas_use_serves_default_router() -> None:
    config = _deployments("app.config.yaml")["EngineReplica"]._deployment_config
    assert config.request_router_config.request_router_class.endswith(":PowerOfTwoChoicesRequestRouter")


def _deployments(config: str, app: str | None = None) -> dict:
    """Each deployment of ``config``'s application (the first, or ``app``) as the builder binds it, by name."""
    from app.builder import build_app

    apps = yaml.safe_load((REPO / config).read_text())["applications"]
    args = next(a for a in apps if app in (None, a["name"]))["args"]
    found, todo = {}, [build_app(args)]
    while todo:
        d = todo.pop()._bound_deployment
        found[d.name] = d
        todo += [a for a in d.init_args if hasattr(a, "_bound_deployment")]
    return found


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_multinode_config_places_one_engine_per_node_and_the_front_on_the_head() -> None:
    d = _deployments("app.multinode.config.yaml")
    assert d["EngineReplica"].ray_actor_options["resources"] == {"dcut_engine": 1}
    assert d["EngineReplica"].ray_actor_options["num_cpus"] == 0.5
    for name in ("Ingress", "DCutController"):
        assert d[name].ray_actor_options["resources"] == {"node:__internal_head__": 0.001}
    assert yaml.safe_load((REPO / "app.multinode.config.yaml").read_text())["proxy_location"] == "EveryNode"


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_gpu_config_runs_tensor_parallel_ranks_in_placement_group_bundles() -> None:
    engine = _deployments("app.gpu.config.yaml", "moe")["EngineReplica"]
    rc = engine._replica_config
    assert rc.placement_group_strategy == "STRICT_PACK"
    assert [b["GPU"] for b in rc.placement_group_bundles] == [1, 1]
    assert engine.ray_actor_options["num_gpus"] == 0


def test_ray_executor_without_enough_bundles_is_refused() -> None:
    engine = {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}
    replica = {"env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}
    with pytest.raises(ValidationError, match="at least 2 bundles"):
        AppConfig.model_validate({"engine": engine, "engine_replica": replica})
    with pytest.raises(ValidationError, match="must hold the replica"):
        AppConfig.model_validate({"engine": engine, "engine_replica": {
            **replica, "num_cpus": 2, "placement_group_bundles": [{"CPU": 1, "GPU": 1}, {"GPU": 1}]}})
    ok = AppConfig.model_validate({"engine": engine, "engine_replica": {
        **replica, "num_cpus": 1, "placement_group_bundles": [{"CPU": 2, "GPU": 1}, {"CPU": 1, "GPU": 1}]}})
    assert ok.engine_replica.placement()["placement_group_bundles"][1] == {"CPU": 1, "GPU": 1}


def test_jemalloc_is_preloaded_from_the_installed_ray() -> None:
    from deployments.settings import EngineReplicaSettings

    env = EngineReplicaSettings(allocator="jemalloc", env={"LD_PRELOAD": "/opt/other.so"}).placement()[
        "ray_actor_options"]["runtime_env"]["env_vars"]
    first, other = env["LD_PRELOAD"].split(":")
    assert Path(first).is_file() and first.endswith("libjemalloc.so") and other == "/opt/other.so"
    system = EngineReplicaSettings().placement()["ray_actor_options"]["runtime_env"]["env_vars"]
    assert "LD_PRELOAD" not in system

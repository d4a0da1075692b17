"""The committed app configs validate as the app will read them, and a TP > 1 engine asks for processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from app.config import AppConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["app.config.yaml", "app.two-models.config.yaml", "app.gpu.config.yaml",
                                  "app.reasoning.config.yaml"])
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

"""The engine seam: the replica talks to `deployments.engine.Engine`, the builder chooses the class, and the mock
engine's path through the whole application (ingress, replica, controller) needs neither vLLM nor torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dcut.settings import EngineSettings
from deployments.engine import Engine
from deployments.vllm_engine import VLLMEngine
from tests.mock_engine import MockEngine

REPO = Path(__file__).resolve().parents[2]

# The whole mock application serves a request, then says which of torch and vLLM it imported.
MOCK_APP_SERVES = """
import asyncio, sys, warnings
warnings.simplefilter("ignore")
from tests.mock_app import MODEL, local_app

async def main(app):
    async with app.client() as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 3, "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\\n\\n"), r.text
        assert (await c.get("/dcut/status")).status_code == 200

app = local_app()
asyncio.run(main(app))
app.shutdown()
print(sorted(m for m in ("torch", "vllm") if m in sys.modules))
"""


def test_mock_engine_path_imports_neither_vllm_nor_torch():
    out = subprocess.run([sys.executable, "-c", MOCK_APP_SERVES], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


@pytest.mark.parametrize("engine_cls", [VLLMEngine, MockEngine])
def test_each_engine_implements_the_whole_door(engine_cls):
    assert not getattr(engine_cls, "__abstractmethods__", None)
    engine = engine_cls(EngineSettings(), max_prompt_tokens=7)  # building one starts nothing
    assert isinstance(engine, Engine) and engine.max_prompt_tokens == 7 and engine.load.ongoing_requests == 0


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_builder_hands_the_replicas_their_engine_class():
    """`serve run` calls the config's builder with exactly one argument (Serve refuses any other signature): the
    engine class is chosen by ``compose_app``, which tests call."""
    import inspect

    from app.builder import build_app, compose_app

    assert len(inspect.signature(build_app).parameters) == 1

    def replica_engine(app) -> type:
        replica = app._bound_deployment.init_args[1]._bound_deployment
        assert replica.name == "EngineReplica"
        return replica.init_kwargs["engine_cls"]

    assert replica_engine(build_app({})) is VLLMEngine
    assert replica_engine(compose_app({}, engine_cls=MockEngine)) is MockEngine

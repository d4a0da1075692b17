"""The vLLM patches refuse to run on what they were not written for."""

from __future__ import annotations

import pytest

from dcut.vllm import patches


def test_every_patch_names_the_vllm_function_it_wraps() -> None:
    from vllm.config import VllmConfig
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def wrapped() -> list:
        return [VllmConfig.__post_init__, SpecDecodeBaseProposer.propose, SpecDecodeBaseProposer._sample_draft_tokens,
                GPUModelRunner.execute_model, GPUModelRunner._prepare_inputs, GPUModelRunner.propose_draft_token_ids,
                GPUModelRunner.take_draft_token_ids]

    was_installed = bool(patches._originals)
    patches.install()
    names = [getattr(fn, "__dcut_wraps__", None) for fn in wrapped()]
    assert all(n and n.startswith("vllm.") for n in names), names
    patches.uninstall()  # reversible: vLLM's own functions come back
    assert not any(hasattr(fn, "__dcut_wraps__") for fn in wrapped())
    if was_installed:
        patches.install()


def test_changed_vllm_signature_fails_loudly() -> None:
    class Runner:
        def propose_draft_token_ids(self, scheduler_output, hidden_states):  # parameters moved
            return None

    with pytest.raises(RuntimeError, match="expects"):
        patches._wrap(Runner, "propose_draft_token_ids", lambda original: original, patches._RUNNER_PROPOSE_PARAMS)


def test_missing_vllm_function_fails_loudly() -> None:
    class Fake:
        pass

    with pytest.raises(RuntimeError, match="Fake.gone not found"):
        patches._wrap(Fake, "gone", lambda original: original)


def test_version_mismatch_refuses_dcut_but_not_plain_engines() -> None:
    calls = []
    post_init = patches._config_post_init("9.9.9")(lambda self: calls.append(self))

    class Config:
        additional_config: dict = {}

    plain = Config()
    post_init(plain)  # no D-Cut asked for: vLLM runs as usual
    assert calls == [plain]
    asked = Config()
    asked.additional_config = {"dcut": {"mode": "auto"}}
    with pytest.raises(RuntimeError, match="written for vLLM 0.32.0; vLLM 9.9.9 is installed"):
        post_init(asked)


def test_bad_setting_is_named() -> None:
    class Config:
        additional_config = {"dcut": {"mode": "auto", "fixed_ratio": 3}}

    with pytest.raises(ValueError, match="fixed_ratio"):
        patches._config_post_init(None)(lambda self: None)(Config())

"""The vLLM patches refuse to run on what they were not written for."""

from __future__ import annotations

import pytest

from dcut.vllm import patches


def test_every_patch_names_the_vllm_function_it_wraps() -> None:
    from vllm.config import VllmConfig
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def wrapped() -> list:
        return [VllmConfig.__post_init__, SpecDecodeBaseProposer.propose, SpecDecodeBaseProposer._sample_draft_tokens,
                GPUModelRunner.execute_model, GPUModelRunner._prepare_inputs, GPUModelRunner.propose_draft_token_ids,
                GPUModelRunner.take_draft_token_ids, rejection_sampler.expand_batch_to_tokens,
                rejection_sampler.apply_sampling_constraints]

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


def test_expand_to_tokens_repeats_each_request_value_per_token() -> None:
    import torch

    top_k = torch.tensor([5, 0, 7], dtype=torch.int32)
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # 2 tokens, none, 3
    assert patches.expand_to_tokens(top_k, cu, 5).tolist() == [5, 5, 7, 7, 7]
    temperature = torch.tensor([-1.0, 0.5])  # greedy (-1) becomes 1, as vLLM asks
    out = patches.expand_to_tokens(temperature, torch.tensor([1, 3]), 3, replace_from=-1, replace_to=1)
    assert out.dtype == torch.float32 and out.tolist() == [1.0, 0.5, 0.5]
    assert patches.expand_to_tokens(top_k[:0], cu[:0], 0).numel() == 0


def test_vllm_cpu_expand_kernel_still_writes_into_a_copy() -> None:
    """Why ``expand_batch_to_tokens`` is replaced on CPU: vLLM 0.32's CPU kernel converts a float32 or int32
    output to int64 and writes the copy, leaving the caller's tensor as it was. If this starts failing, vLLM
    fixed it and the patch can go."""
    import torch
    import vllm._C  # noqa: F401 - registers torch.ops._C
    from vllm.utils.cpu_triton_utils import _expand_kernel_impl

    for dtype in (torch.int32, torch.float32):
        out = torch.full((3,), -7, dtype=dtype)
        _expand_kernel_impl(out, torch.tensor([5], dtype=dtype), torch.tensor([3], dtype=torch.int32), 0, 0)
        assert out.tolist() == [-7, -7, -7]


def test_sampling_constraints_over_no_draft_tokens() -> None:
    """vLLM's constraints over zero tokens raise in ``apply_top_k_only`` (``k.max()`` of nothing); wrapped,
    the empty logits come back untouched and any other call goes to vLLM."""
    import torch

    calls = []
    apply = patches._sampling_constraints_over_no_tokens(lambda logits, *a: calls.append(a) or logits * 2)
    empty = torch.empty(0, 16)
    assert apply(empty, torch.tensor([0]), None) is empty and calls == []
    assert apply(torch.ones(1, 16), torch.tensor([1]), None).sum().item() == 32 and len(calls) == 1

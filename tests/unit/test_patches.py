"""The vLLM patches refuse to run on what they were not written for, and can be undone."""

from __future__ import annotations

import pytest

from dcut.vllm import EXPECTED_VLLM_VERSION, engine_config, patches, vllm_fixes


def _wrapped() -> list[tuple[patches.Patch, object]]:
    """Each patch of the registry with the function its owner holds now (optional owners that do not import
    are left out, as install leaves them)."""
    owners = [(p, patches.owner_of(p)) for p in patches.PATCHES]
    return [(p, owner.__dict__[p.name]) for p, owner in owners if owner is not None]


def test_every_patch_names_the_vllm_function_it_wraps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_fixes.OPT_OUT, raising=False)
    was_installed = bool(patches._originals)
    patches.uninstall()
    patches.install()
    try:
        found = _wrapped()
        assert {p for p, _ in found} >= {p for p in patches.PATCHES if not p.optional}
        for patch, fn in found:
            name = getattr(fn, "__dcut_wraps__", None)
            assert name and name.startswith("vllm.") and name.endswith(f".{patch.name}"), (patch, name)
        assert len(patches._originals) == len(found)
    finally:
        patches.uninstall()  # reversible: vLLM's own functions come back
    assert not any(hasattr(fn, "__dcut_wraps__") for _, fn in _wrapped())
    if was_installed:
        patches.install()


def test_wrappers_say_which_vllm_function_they_wrap() -> None:
    """Each wrapper factory's docstring names the function it wraps, as imported (``module.Class.name``)."""
    for patch in patches.PATCHES:
        owner = patch.owner.replace(":", ".")
        assert f"{owner}.{patch.name}" in (patch.make.__doc__ or ""), patch


def test_vllm_fixes_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    was_installed = bool(patches._originals)
    patches.uninstall()
    monkeypatch.setenv(vllm_fixes.OPT_OUT, "0")
    patches.install()
    try:
        for patch, fn in _wrapped():
            assert hasattr(fn, "__dcut_wraps__") != patch.vllm_fix, patch
    finally:
        patches.uninstall()
    monkeypatch.delenv(vllm_fixes.OPT_OUT)
    if was_installed:
        patches.install()


def test_another_vllm_version_gets_only_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a vLLM the patches were not written for, only ``VllmConfig.__post_init__`` is wrapped (it refuses
    engines that ask for D-Cut: ``test_version_mismatch_refuses_dcut_but_not_plain_engines``)."""
    import vllm

    was_installed = bool(patches._originals)
    patches.uninstall()
    monkeypatch.setattr(vllm, "__version__", "9.9.9")
    patches.install()
    try:
        assert [hasattr(fn, "__dcut_wraps__") for _, fn in _wrapped()] == [p.any_version for p, _ in _wrapped()]
        assert any(p.any_version for p in patches.PATCHES)
    finally:
        patches.uninstall()
    monkeypatch.undo()
    if was_installed:
        patches.install()


def test_changed_vllm_signature_fails_loudly() -> None:
    class Runner:
        def propose_draft_token_ids(self, scheduler_output, hidden_states):  # parameters moved
            return None

    params = next(p.params for p in patches.PATCHES if p.name == "propose_draft_token_ids")
    with pytest.raises(RuntimeError, match="expects"):
        patches._wrap(Runner, "propose_draft_token_ids", lambda original: original, params)


def test_missing_vllm_function_fails_loudly() -> None:
    class Fake:
        pass

    with pytest.raises(RuntimeError, match="Fake.gone not found"):
        patches._wrap(Fake, "gone", lambda original: original)


def test_version_mismatch_refuses_dcut_but_not_plain_engines() -> None:
    calls = []
    post_init = engine_config.wrap_post_init(lambda self: calls.append(self), installed="9.9.9")

    class Config:
        additional_config: dict = {}

    plain = Config()
    post_init(plain)  # no D-Cut asked for: vLLM runs as usual
    assert calls == [plain]
    asked = Config()
    asked.additional_config = {"dcut": {"mode": "fixed"}}
    with pytest.raises(RuntimeError, match=f"written for vLLM {EXPECTED_VLLM_VERSION}; vLLM 9.9.9 is installed"):
        post_init(asked)


def test_bad_setting_is_named() -> None:
    class Config:
        additional_config = {"dcut": {"mode": "fixed", "fixed_ratio": 3}}

    with pytest.raises(ValueError, match="fixed_ratio"):
        engine_config.wrap_post_init(lambda self: None, installed=EXPECTED_VLLM_VERSION)(Config())


def test_expand_to_tokens_repeats_each_request_value_per_token() -> None:
    import torch

    top_k = torch.tensor([5, 0, 7], dtype=torch.int32)
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # 2 tokens, none, 3
    assert vllm_fixes.expand_to_tokens(top_k, cu, 5).tolist() == [5, 5, 7, 7, 7]
    temperature = torch.tensor([-1.0, 0.5])  # greedy (-1) becomes 1, as vLLM asks
    out = vllm_fixes.expand_to_tokens(temperature, torch.tensor([1, 3]), 3, replace_from=-1, replace_to=1)
    assert out.dtype == torch.float32 and out.tolist() == [1.0, 0.5, 0.5]
    assert vllm_fixes.expand_to_tokens(top_k[:0], cu[:0], 0).numel() == 0


def test_vllm_cpu_expand_kernel_still_writes_into_a_copy() -> None:
    """Why ``expand_batch_to_tokens`` is replaced on CPU: vLLM 0.32's CPU kernel converts a float32 or int32
    output to int64 and writes the copy, leaving the caller's tensor as it was. If this starts failing, vLLM
    fixed it and the patch can go."""
    import torch
    from vllm.platforms import current_platform
    from vllm.utils.cpu_triton_utils import _expand_kernel_impl

    # Registers torch.ops._C from the build this CPU runs (vllm._C itself is the AVX-512 BF16 build: on a CPU
    # without AVX-512 importing it is an illegal instruction, the whole test process gone).
    current_platform.import_kernels()

    for dtype in (torch.int32, torch.float32):
        out = torch.full((3,), -7, dtype=dtype)
        _expand_kernel_impl(out, torch.tensor([5], dtype=dtype), torch.tensor([3], dtype=torch.int32), 0, 0)
        assert out.tolist() == [-7, -7, -7]


def test_sampling_constraints_over_no_draft_tokens() -> None:
    """vLLM's constraints over zero tokens raise in ``apply_top_k_only`` (``k.max()`` of nothing); wrapped,
    the empty logits come back untouched and any other call goes to vLLM."""
    import torch

    calls = []
    apply = vllm_fixes.wrap_apply_sampling_constraints(lambda logits, *a: calls.append(a) or logits * 2)
    empty = torch.empty(0, 16)
    assert apply(empty, torch.tensor([0]), None) is empty and calls == []
    assert apply(torch.ones(1, 16), torch.tensor([1]), None).sum().item() == 32 and len(calls) == 1


def test_one_hooks_object_on_the_runner_and_its_drafter() -> None:
    """The only state hung on vLLM's objects: one ``RunnerHooks``, on the runner and on its drafter; a plain
    engine's drafter is left alone."""
    from types import SimpleNamespace as NS

    import torch

    from dcut.vllm.runner_hooks import ATTRIBUTE, RunnerHooks, drafter_hooks, hooks_for

    spec = NS(method="dflash", model="d", num_speculative_tokens=4)

    def runner(extra: dict) -> NS:
        config = NS(additional_config=extra, speculative_config=spec, parallel_config=NS(tensor_parallel_size=1),
                    model_config=NS(model="m", dtype=torch.float32, enforce_eager=False),
                    compilation_config=NS(cudagraph_mode=NS(name="NONE")))
        return NS(vllm_config=config, speculative_config=spec, num_spec_tokens=4, drafter=NS(),
                  device=torch.device("cpu"))

    on = runner({"dcut": {"mode": "joint"}})
    hooks = hooks_for(on)
    assert hooks_for(on) is hooks and drafter_hooks(on.drafter) is hooks
    assert hooks.dcut is not None and hooks.dcut.k == 4 and hooks.specexit is None and hooks.stash is not None
    assert hooks.stash.host  # a CPU engine's positions and slots are copied as numpy
    assert [a for o in (on, on.drafter) for a in vars(o) if "dcut" in a] == [ATTRIBUTE, ATTRIBUTE]
    plain = runner({})
    assert hooks_for(plain) == RunnerHooks(None, None, None) and not vars(plain.drafter)


def test_draft_pass_shapes_confidences_like_the_drafts() -> None:
    import torch

    from dcut.vllm.draft_pass import DraftPass

    parallel = DraftPass()  # DFlash: bs*K rows sampled at once
    parallel.sink.append(torch.arange(6.0))
    parallel.finish(torch.zeros(2, 3, dtype=torch.long))
    assert parallel.sink is None and parallel.log_conf.tolist() == [[0, 1, 2], [3, 4, 5]]
    autoregressive = DraftPass()  # K batches of [bs]
    autoregressive.sink.extend([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    autoregressive.finish(torch.zeros(2, 2, dtype=torch.long))
    assert autoregressive.log_conf.tolist() == [[1, 3], [2, 4]]
    mismatched = DraftPass()
    mismatched.sink.extend([torch.zeros(2), torch.zeros(2)])
    mismatched.finish(torch.zeros(2, 3, dtype=torch.long))
    assert mismatched.log_conf is None


def test_vllm_still_rewinds_a_discarded_sample_by_generator_offset() -> None:
    """Why ``sample_tokens`` is wrapped: vLLM 0.32's ``_bookkeeping_sync`` rewinds the generator of a request whose
    token is discarded by its offset, which a CPU generator does not have. If this starts failing, vLLM changed
    the rewind (or torch gave CPU generators an offset) and the fix can go."""
    import inspect

    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert "gen.set_offset(gen.get_offset() - 4)" in inspect.getsource(GPUModelRunner._bookkeeping_sync)
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        torch.Generator().get_offset()


def test_discarded_cpu_generators_sit_the_step_out() -> None:
    """Only the CPU generators of discarded requests are taken out for the step, and all are back after it,
    even when the step raises."""
    import numpy as np
    import torch

    gens = {0: torch.Generator().manual_seed(1), 2: torch.Generator().manual_seed(2), 3: torch.Generator()}
    discard = np.array([True, True, False, True])
    assert vllm_fixes.discarded_cpu_generators(gens, discard) == {0: gens[0], 3: gens[3]}
    assert vllm_fixes.discarded_cpu_generators(gens, discard[:1]) == {0: gens[0]}  # index 3 past num_reqs

    seen: list[set[int]] = []

    class Runner:
        input_batch = type("Batch", (), {"generators": dict(gens), "num_reqs": 4})()
        discard_request_mask = type("Buf", (), {"np": np.concatenate([discard, [True] * 4])})()

    def sample_tokens(self, grammar_output):
        seen.append(set(self.input_batch.generators))
        raise RuntimeError("step failed")

    runner = Runner()
    with pytest.raises(RuntimeError, match="step failed"):
        vllm_fixes.wrap_sample_tokens(sample_tokens)(runner, None)
    assert seen == [{2}] and runner.input_batch.generators == gens

"""The GPU path, checked on this CPU: vLLM's configuration built as it resolves on CUDA (``tests.cuda_platform``).

Per engine, in any build order: a D-Cut engine runs the V1 runner, synchronous scheduling and piecewise CUDA
graphs (``docs/gpu.md`` says why); every other engine keeps what vLLM gives it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dcut.settings import EMBEDDED_MODELS, EngineSettings
from tests.cuda_platform import cuda_like, engine_config

ROOT = Path(__file__).resolve().parents[2]
TARGET, DRAFT = (str(ROOT / p) for p in EMBEDDED_MODELS["deep"])
DCUT = EngineSettings(model=TARGET, draft=DRAFT)  # D-Cut, mode joint
FULL = DCUT.model_copy(update={"dcut": DCUT.dcut.model_copy(update={"mode": "full"})})  # D-Cut counting
VLLM_DFLASH = DCUT.model_copy(update={"dcut": None})  # vLLM's own DFlash: the stock speculative baseline
PLAIN = DCUT.model_copy(update={"method": "none", "draft": None, "dcut": None})  # no speculation


@pytest.fixture
def cuda() -> Iterator[Any]:
    """vLLM's configuration resolves as on a CUDA GPU in the test."""
    with cuda_like() as platform:
        yield platform


def _resolved(config) -> tuple[bool, bool, str]:
    return (config.use_v2_model_runner, config.scheduler_config.async_scheduling,
            config.compilation_config.cudagraph_mode.name)


@pytest.mark.usefixtures("cuda")
def test_dcut_engine_left_unset_ends_piecewise() -> None:
    """Defect 1 of issue 63: checked before vLLM had chosen (None), full graphs stayed on."""
    assert _resolved(engine_config(DCUT)) == (False, False, "PIECEWISE")


@pytest.mark.usefixtures("cuda")
def test_runner_is_chosen_per_engine_not_for_the_process() -> None:
    """Defect 2: a D-Cut engine's V1 runner came from a process-wide environment variable, so a stock engine
    built after it got V1 too."""
    assert engine_config(PLAIN).use_v2_model_runner
    dcut = engine_config(DCUT)
    assert not dcut.use_v2_model_runner and engine_config(PLAIN).use_v2_model_runner
    assert not dcut.use_v2_model_runner


@pytest.mark.usefixtures("cuda")
def test_stock_speculative_baseline_keeps_async_scheduling() -> None:
    """Defect 3: every engine with a drafter was made synchronous, vLLM's own DFlash included."""
    assert engine_config(VLLM_DFLASH).scheduler_config.async_scheduling is True


@pytest.mark.parametrize("order", [(DCUT, FULL, VLLM_DFLASH, PLAIN), (PLAIN, VLLM_DFLASH, FULL, DCUT)],
                         ids=["dcut-first", "dcut-last"])
@pytest.mark.usefixtures("cuda")
def test_each_engine_gets_its_own_runner_scheduling_and_graphs(order) -> None:
    """D-Cut engines: V1, synchronous, piecewise. Stock engines built in the same process, before or after:
    vLLM's CUDA defaults (V2, asynchronous, full graphs)."""
    expected = {id(DCUT): (False, False, "PIECEWISE"), id(FULL): (False, False, "PIECEWISE"),
                id(VLLM_DFLASH): (True, True, "FULL_AND_PIECEWISE"), id(PLAIN): (True, True, "FULL_AND_PIECEWISE")}
    configs = [(settings, engine_config(settings)) for settings in order]
    for settings, config in configs:
        assert _resolved(config) == expected[id(settings)], settings
    for settings, config in configs:  # read again after every engine is built: nothing leaked between them
        assert _resolved(config) == expected[id(settings)], settings


@pytest.mark.parametrize("mode", ["FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "PIECEWISE"])
@pytest.mark.usefixtures("cuda")
def test_dcut_ends_piecewise_whatever_graph_mode_is_asked(mode: str) -> None:
    """A graph mode the user passes does not give a D-Cut engine full graphs; eager stays eager."""
    config = engine_config(DCUT, compilation_config={"cudagraph_mode": mode})
    assert config.compilation_config.cudagraph_mode.name == "PIECEWISE"
    assert engine_config(DCUT.model_copy(update={"enforce_eager": True})).compilation_config.cudagraph_mode.name == \
        "NONE"


@pytest.mark.usefixtures("cuda")
def test_async_scheduling_asked_of_a_dcut_engine_is_refused_quietly() -> None:
    """Set on a D-Cut engine, asynchronous scheduling is turned off for it alone (one log line); set off on a
    stock engine, it is off there."""
    assert _resolved(engine_config(DCUT.model_copy(update={"async_scheduling": True}))) == (False, False, "PIECEWISE")
    assert engine_config(VLLM_DFLASH.model_copy(update={"async_scheduling": False})).scheduler_config \
        .async_scheduling is False


@pytest.mark.usefixtures("cuda")
def test_vllm_itself_makes_per_batch_size_k_piecewise_on_v1(monkeypatch: pytest.MonkeyPatch) -> None:
    """What D-Cut follows: vLLM's own DFlash with a K per batch size, on the V1 runner, ends PIECEWISE."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    dynamic = VLLM_DFLASH.model_copy(update={"spec_schedule": [(1, 4, 15), (5, 64, 3)]})
    assert _resolved(engine_config(dynamic)) == (False, True, "PIECEWISE")


def test_on_cpu_every_engine_runs_v1_synchronously_without_graphs() -> None:
    """Why no CPU figure of this repository shows what D-Cut's GPU choices cost: on CPU vLLM gives every engine
    the V1 runner, synchronous scheduling and no CUDA graphs, D-Cut's or not."""
    for settings in (DCUT, VLLM_DFLASH, PLAIN):
        assert _resolved(engine_config(settings)) == (False, False, "NONE"), settings


def test_dcut_start_up_runs_before_vllm_watches_the_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect 7: D-Cut's profiling ran after ``Worker.compile_or_warm_up_model`` had started vLLM's JIT monitor
    and GPU sync check. vLLM's own warm-up is run here (the installed patches, a stand-in worker, device work
    stubbed) and the order recorded."""
    from types import SimpleNamespace as NS

    import vllm.utils.jit_monitor
    import vllm.v1.worker.gpu_worker as gpu_worker
    from vllm.config import CompilationMode

    from dcut.vllm import patches, profiling

    patches.install()
    events: list[str] = []
    monkeypatch.setattr(vllm.utils.jit_monitor, "activate", lambda **kw: events.append("jit monitor"))
    monkeypatch.setattr(gpu_worker, "enable_gpu_sync_check", lambda: events.append("sync check"))
    for name in ("kernel_warmup", "freeze_gc_heap", "maybe_attach_gc_debug_callback", "set_random_seed"):
        monkeypatch.setattr(gpu_worker, name, lambda *a, **kw: None)
    settings = NS(profile_batch_sizes=[1], profile_context_lens=[], profile_context_len=8)
    state = NS(cost_source="pending", joint=False, k=2, settings=settings,
               load_or_profile=lambda *a: events.append("dcut profile"))
    monkeypatch.setattr(profiling, "hooks_for", lambda runner: NS(dcut=state))
    compilation = NS(mode=CompilationMode.NONE, backend="", compilation_time=0.0, encoder_compilation_time=0.0)
    worker = object.__new__(gpu_worker.Worker)
    vars(worker).update(
        vllm_config=NS(compilation_config=compilation, kernel_config=NS(enable_jit_warmup=True)),
        compilation_config=compilation, use_v2_model_runner=False, model_config=NS(enforce_eager=True, seed=0),
        cache_config=NS(kv_cache_memory_bytes=1), parallel_config=NS(data_parallel_index=0),
        observability_config=NS(jit_monitor_mode="warn", jit_monitor_verbose=False),
        model_runner=NS(maybe_remove_all_loras=lambda lora: None, lora_config=None, max_num_tokens=64,
                        max_model_len=64, scheduler_config=NS(max_num_seqs=1)))
    monkeypatch.setattr(gpu_worker, "get_pp_group", lambda: NS(is_last_rank=False))
    gpu_worker.Worker.compile_or_warm_up_model(worker)
    assert events == ["dcut profile", "jit monitor", "sync check"]


@pytest.mark.parametrize("drafted", [None, [2, 1]], ids=["width-0 step", "after a verify"])
def test_catch_up_writes_the_positions_dflash_reads_on_mrope_targets(drafted) -> None:
    """Defect 5: the width-0 stash took the runner's 1-D positions, which on an M-RoPE target (Qwen3.5) are not
    the positions vLLM's DFlash writes context at after an image. Request a: 1 token + 2 drafts (1 accepted),
    b: 1 + 1 (none accepted); M-RoPE positions shifted by 40 (an image before), the 1-D ones not."""
    from types import SimpleNamespace as NS

    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from dcut.vllm.catch_up import ContextStash
    from dcut.vllm.step_hooks import _stash_context

    n = 5
    sequence = torch.tensor([7, 8, 9, 3, 4, 0, 0])  # the runner's buffers run past the step's tokens
    mrope = torch.stack([sequence + 40, sequence + 41, sequence + 42])
    runner = NS(use_aux_hidden_state_outputs=False, positions=sequence, uses_mrope=True,
                mrope_positions=NS(gpu=mrope))
    written = []
    drafter = NS(combine_hidden_states=lambda h: h,
                 precompute_and_store_context_kv=lambda h, positions, slots: written.append(positions))
    stash = ContextStash(host=True)
    _stash_context(runner, stash, NS(num_scheduled_tokens={"a": 3, "b": 2}, total_num_scheduled_tokens=n),
                   ["a", "b"], torch.tensor([[11, 12, -1], [13, -1, -1]]), torch.zeros(n + 2, 4), None,
                   None if drafted is None else NS(num_draft_tokens=drafted),
                   NS(slot_mapping=torch.arange(n + 2) + 100))
    stash.flush(drafter)
    dflash_reads = GPUModelRunner._get_positions(runner, n)[0]  # what its kernel loads: row 0 of the view
    rows = [0, 1, 2, 3, 4] if drafted is None else [0, 1, 3]
    assert written[0].tolist() == dflash_reads[rows].tolist() == [p + 40 for p in sequence[rows].tolist()]


@pytest.mark.usefixtures("cuda")
def test_fingerprint_names_the_engines_gpu_and_how_its_steps_are_launched() -> None:
    """Defect 6: the replica read the hardware with torch, which sees no GPU in a replica of ``num_gpus: 0`` (as
    in this process), while the engine's worker named the GPU; and a table profiled eager was reused compiled."""
    import torch

    from dcut.vllm.fingerprint import fingerprint

    assert not torch.cuda.is_available()
    compiled, eager = fingerprint(DCUT), fingerprint(DCUT.model_copy(update={"enforce_eager": True}))
    assert compiled.key() != eager.key()
    assert compiled.hardware == eager.hardware == "NVIDIA H100 80GB HBM3"  # vLLM's platform, as the worker reads it
    assert (compiled.cudagraph_mode, compiled.enforce_eager, eager.cudagraph_mode, eager.enforce_eager) == \
        ("PIECEWISE", False, "NONE", True)


def _with_adaptive_verification(settings: EngineSettings):
    from vllm.engine.arg_utils import AsyncEngineArgs

    from dcut.vllm.engine import engine_kwargs

    kw = engine_kwargs(settings)
    kw["speculative_config"] |= {"enable_adaptive_verification": True}
    return AsyncEngineArgs(**kw).create_engine_config()


def test_vllm_adaptive_verification_is_v2_only_and_refused_on_cpu() -> None:
    """What docs/gpu.md says of vLLM 0.32's own adaptive verification: on this CPU (no Triton: the V1 runner) it is
    refused."""
    with pytest.raises(ValueError, match="Model Runner V1 does not support: adaptive draft verification"):
        _with_adaptive_verification(VLLM_DFLASH)


@pytest.mark.usefixtures("cuda")
def test_vllm_adaptive_verification_needs_full_graphs_and_not_dcut() -> None:
    """On CUDA: it runs on the V2 runner with full graphs and asynchronous scheduling; eager is refused, and so is
    a D-Cut engine (the V1 runner)."""
    assert _resolved(_with_adaptive_verification(VLLM_DFLASH)) == (True, True, "FULL_AND_PIECEWISE")
    with pytest.raises(ValueError, match="Adaptive verification requires full CUDA graphs"):
        _with_adaptive_verification(VLLM_DFLASH.model_copy(update={"enforce_eager": True}))
    with pytest.raises(ValueError, match="Model Runner V1 does not support: adaptive draft verification"):
        _with_adaptive_verification(DCUT)


@pytest.mark.usefixtures("cuda")
def test_make_compare_builds_every_arm_as_its_user_would_run_it() -> None:
    """``dcut compare``'s arms as the Makefile names them, built in one process as it builds them: the D-Cut arms
    run V1, synchronous, piecewise; the arms a user runs instead keep what vLLM gives them on CUDA."""
    from dcut.bench.interleaved import arms_for
    from tests.make_targets import compare_modes

    arms = arms_for(DCUT, compare_modes(), [(1, 1, 15), (2, 4, 7), (5, 64, 3)])
    resolved = {a.name: _resolved(engine_config(a.settings)) for a in arms}
    dcut = {a.name for a in arms if a.settings.with_dcut}
    assert dcut == {"full", "dynamic", "joint", "joint-noshift"}
    assert {resolved[m] for m in dcut} == {(False, False, "PIECEWISE")}
    # (vLLM keeps full graphs for its per-batch-size K on V2; on V1 it makes them piecewise, as tested above)
    assert resolved["none"] == resolved["vllm"] == resolved["vllm-dynamic"] == (True, True, "FULL_AND_PIECEWISE")

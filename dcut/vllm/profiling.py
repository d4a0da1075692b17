"""The cost table, once the KV cache exists: loaded, or profiled with the engine's own dummy steps; and the
drafter's input kernel warmed up for every width mode ``joint`` may draft.

Runs where vLLM's own warm-up is done but before it starts watching the steps: on CUDA, in
``Worker._maybe_activate_jit_monitor``, which ``Worker.compile_or_warm_up_model`` calls after graph capture and the
sampler warm-up and just before the JIT monitor and the GPU sync check start (D-Cut's dummy steps and the DFlash
kernel's compiles would trip both); on CPU, which has neither, after ``CPUWorker.compile_or_warm_up_model``.
Where a table comes from (given, cache, profiled, fallback) is ``RunnerDCut.load_or_profile``'s choice; this
module only says how to run one verify step and one drafter pass of a given shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from dcut.context_cost import default_lengths
from dcut.vllm.runner_hooks import hooks_for
from dcut.vllm.state import RunnerDCut


def wrap_activate_jit_monitor(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``vllm.v1.worker.gpu_worker.Worker._maybe_activate_jit_monitor``: D-Cut's start-up first."""
    def _maybe_activate_jit_monitor(self: Any) -> None:
        start_dcut(self)
        original(self)
    return _maybe_activate_jit_monitor


def wrap_compile_or_warm_up_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``vllm.v1.worker.cpu_worker.CPUWorker.compile_or_warm_up_model`` (which never calls the JIT monitor's
    hook): D-Cut's start-up after vLLM's warm-up."""
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        start_dcut(self)
        return result
    return compile_or_warm_up_model


def start_dcut(worker: Any) -> None:
    """Load or profile the cost table and warm up the drafter's widths, on a worker whose warm-up is done."""
    runner = worker.model_runner
    state = hooks_for(runner).dcut  # a pair SpecExit cannot run on fails here, at start-up
    if state is None:
        return
    compiled = worker.compilation_config.compilation_time  # what vLLM's CompilationTimes reports (CPU: 0)
    state.compile_s = float(compiled) + float(worker.compilation_config.encoder_compilation_time or 0.0) \
        if compiled else None
    if state.cost_source == "pending":
        state.load_or_profile(functools.partial(_profile_step, runner, state),
                              functools.partial(_profile_draft, runner),
                              _profile_batch_sizes(runner, state), _profile_context_lens(runner, state))
        from vllm.utils.torch_utils import set_random_seed

        set_random_seed(worker.model_config.seed)  # profiling must not shift the sampling RNG
    if state.joint:
        _warm_up_widths(runner, state)


def _profile_batch_sizes(runner: Any, state: RunnerDCut) -> list[int]:
    """Powers of two up to max_num_seqs (and it), whose full-width verify fits one step."""
    max_seqs = runner.scheduler_config.max_num_seqs
    sizes = state.settings.profile_batch_sizes
    if sizes is None:
        sizes = sorted({*(1 << i for i in range(max_seqs.bit_length()) if 1 << i <= max_seqs), max_seqs})
    return [b for b in sizes if b <= max_seqs and b * (state.k + 1) <= runner.max_num_tokens]


def _profile_context_lens(runner: Any, state: RunnerDCut) -> list[int]:
    """The context lengths the verify cost's growth with context is profiled at (``dcut.context_cost``): those
    set, else the defaults; only those a full-width verify step fits in ``max_model_len``."""
    lens, longest = state.settings.profile_context_lens, runner.max_model_len - state.k - 2
    if lens is None:
        lens = default_lengths(runner.max_model_len, state.k, state.settings.profile_context_len)
    return sorted({c for c in lens if c <= longest} - {state.settings.profile_context_len})


def _profile_step(runner: Any, state: RunnerDCut, bs: int, verify_tokens: int, context: int | None = None) -> None:
    """One dummy verify step of ``verify_tokens`` spread over ``bs`` requests, without the drafter, each request
    at ``context`` tokens before its verify tokens (default: ``profile_context_len``).

    ``GPUModelRunner._dummy_run`` spreads tokens over ``min(tokens, max_num_seqs)`` requests, so
    max_num_seqs is set to ``bs`` for the call; logits are computed for every verify token, as a
    real verify step does. ``_dummy_run`` also runs the drafter's dummy pass over all the verify
    tokens, which a verify step does not pay (the drafter's cost is measured apart, per width):
    it is switched off for the call. Inputs are random, not zeros: with zeros every token of an
    MoE target routes to the same experts and the step is unrealistically cheap.
    """
    sched = runner.scheduler_config
    saved = sched.max_num_seqs
    sched.max_num_seqs = bs
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:
        drafter.dummy_run = _no_drafter_pass
    try:
        context = (state.settings.profile_context_len if context is None else context) + verify_tokens // bs + 1
        hidden, _ = runner._dummy_run(verify_tokens, force_attention=True, profile_seq_lens=context,
                                      randomize_inputs=True)
        runner.model.compute_logits(hidden[:verify_tokens])
        runner._sync_device()
    finally:
        sched.max_num_seqs = saved
        if drafter is not None:
            del drafter.dummy_run


def _no_drafter_pass(*args: Any, **kwargs: Any) -> None:
    """Stands in for the drafter's dummy pass while a verify step is profiled."""


def _profile_draft(runner: Any, bs: int, width: int) -> None:
    """The drafter's pass for ``bs`` requests drafting ``width`` positions each.

    DFlash: the context K/V projection for one token per request (a decode step's new context),
    then the query pass over ``bs * (1 + width)`` tokens and the LM head over ``bs * width``
    rows (nothing is written to the cache). Width 0 costs the context projection only (what the
    catch-up path pays, batched, before the next drafting pass). Other drafters: their own dummy
    pass at ``bs * max(1, width)`` tokens. Live steps refine every cell (``CostTable.refine_draft``).
    """
    drafter = runner.drafter
    if runner.speculative_config.method != "dflash":
        drafter.dummy_run(bs * max(1, width))
        runner._sync_device()
        return
    from vllm.forward_context import set_forward_context

    with torch.inference_mode():
        drafter.model.precompute_and_store_context_kv(drafter.hidden_states[:bs],
                                                      drafter._context_positions_buffer[:bs])
        if width:
            queries = min(bs * (1 + width), drafter.max_query_tokens)
            mode, padded, across_dp = drafter._determine_batch_execution_and_padding(queries, use_cudagraphs=False)
            with set_forward_context(None, drafter.vllm_config, num_tokens=padded, num_tokens_across_dp=across_dp,
                                     cudagraph_runtime_mode=mode):
                hidden = drafter.model(input_ids=drafter.input_ids[:padded],
                                       positions=drafter._get_positions(padded), inputs_embeds=None)
            drafter.model.compute_logits(hidden[: bs * width]).argmax(dim=-1)
    runner._sync_device()


def _warm_up_widths(runner: Any, state: RunnerDCut) -> None:
    """Compile the DFlash input kernel for every width mode ``joint`` may draft (the kernel
    specialises on its integer arguments; vLLM warms up only the engine's K). The warm-up goes
    through Triton's JIT, which exists on CUDA-like platforms only; on CPU the first step at each
    width pays its own specialisation, which the live draft-cost refinement absorbs."""
    from vllm.platforms import current_platform

    if runner.speculative_config.method != "dflash" or not current_platform.is_cuda_alike():
        return
    from vllm.v1.spec_decode.utils import _copy_and_expand_dflash_inputs

    drafter = runner.drafter
    stride = (drafter.max_model_len + drafter.block_size - 1) // drafter.block_size
    for width in state.widths:
        if width != state.k:
            _copy_and_expand_dflash_inputs.warmup(
                block_table_stride=stride, parallel_drafting_token_id=drafter.parallel_drafting_token_id,
                block_size=drafter.block_size, num_speculative_tokens=width)

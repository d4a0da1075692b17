"""The cost table, once the KV cache exists: loaded, or profiled with the engine's own dummy steps; and the
drafter's input kernel warmed up for every width mode ``joint`` may draft.

Runs from the worker's ``compile_or_warm_up_model`` (``Worker`` and ``CPUWorker``), after vLLM's own warm-up.
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


def wrap_compile_or_warm_up_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``vllm.v1.worker.gpu_worker.Worker.compile_or_warm_up_model`` and
    ``vllm.v1.worker.cpu_worker.CPUWorker.compile_or_warm_up_model``."""
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        runner = self.model_runner
        state = hooks_for(runner).dcut  # a pair SpecExit cannot run on fails here, at start-up
        if state is not None:  # vLLM's CompilationTimes (the CPU worker compiled earlier and says 0)
            compiled = getattr(result, "language_model", None)
            state.compile_s = float(compiled) + float(getattr(result, "encoder", 0.0) or 0.0) if compiled else None
        if state is not None and state.cost_source == "pending":
            state.load_or_profile(functools.partial(_profile_step, runner, state),
                                  functools.partial(_profile_draft, runner),
                                  _profile_batch_sizes(runner, state), _profile_context_lens(runner, state))
            from vllm.utils.torch_utils import set_random_seed

            set_random_seed(self.model_config.seed)  # profiling must not shift the sampling RNG
        if state is not None and state.joint:
            _warm_up_widths(runner, state)
        return result
    return compile_or_warm_up_model


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

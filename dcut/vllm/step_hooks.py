"""D-Cut and SpecExit in the model runner's step: the wrappers of vLLM's ``GPUModelRunner`` (V1).

One engine step, as the wrappers see it (``dcut.vllm.state`` and ``dcut.vllm.specexit`` say what each state does):

- ``execute_model`` — start the step clock, note the step's shape; drop finished or preempted requests from
  the width-0 context stash before their KV blocks can change hands, and finished ones from SpecExit.
- ``_prepare_inputs`` — (mode ``joint``) a step with no drafts to verify is built as a plain decode step: no
  speculative metadata, no rejection sampler over zero drafts.
- ``_sample`` — (SpecExit) end a request's thinking at a paragraph end: cut its row of sampled tokens there
  and put ``</think>`` in the next slot.
- ``propose_draft_token_ids`` — choose the drafted width (mode ``joint``) and time the drafter; at width 0
  keep the drafter in sync (``dcut.vllm.catch_up``); never draft wider than the batch's largest per-request cap
  (``dcut.speculation``); decide keep depths right after drafting; fold SpecExit's
  signals from the drafter pass in.
- ``take_draft_token_ids`` — cut the drafts (to D-Cut's depths and each request's cap) before the scheduler
  takes them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from vllm.sampling_params import SamplingType

from dcut.vllm.catch_up import ContextStash
from dcut.vllm.runner_hooks import hooks_for


def wrap_execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model``."""
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        hooks = hooks_for(self)
        if hooks.specexit is not None and scheduler_output.finished_req_ids:
            hooks.specexit.drop(scheduler_output.finished_req_ids)
        state = hooks.dcut
        if state is not None:
            gone = scheduler_output.finished_req_ids | (scheduler_output.preempted_req_ids or set())
            if hooks.stash and gone:
                hooks.stash.drop(gone)  # their blocks may be handed to new requests now
            if scheduler_output.finished_req_ids:
                state.finished(scheduler_output.finished_req_ids)
            state.begin_step(scheduler_output.num_scheduled_tokens,
                             scheduler_output.scheduled_spec_decode_tokens)
        return original(self, scheduler_output, *args, **kwargs)
    return execute_model


def wrap_prepare_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs``."""
    def _prepare_inputs(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        state = hooks_for(self).dcut
        if state is None or not state.joint or any(scheduler_output.scheduled_spec_decode_tokens.values()):
            return original(self, scheduler_output, *args, **kwargs)
        # No drafts to verify in this step (width 0 was drafted): build the inputs of a plain
        # decode step, so the target samples normally instead of running the rejection sampler
        # over zero drafts. The only read of speculative_config in _prepare_inputs picks the branch.
        spec, self.speculative_config = self.speculative_config, None
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            self.speculative_config = spec
    return _prepare_inputs


def wrap_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample`` (SpecExit's cut)."""
    def _sample(self: Any, logits: Any, spec_decode_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, logits, spec_decode_metadata, *args, **kwargs)
        specexit = hooks_for(self).specexit
        if specexit is not None:
            req_ids = list(self.input_batch.req_ids)
            if all(r in self.requests for r in req_ids):  # not a dummy (profiling, warm-up) step
                specexit.apply(req_ids, self.requests, out.sampled_token_ids)
        return out
    return _sample


def wrap_propose_draft_token_ids(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids``."""
    def propose_draft_token_ids(self: Any, scheduler_output: Any, sampled_token_ids: Any,
                                sampling_metadata: Any, hidden_states: Any, sample_hidden_states: Any,
                                aux_hidden_states: Any, spec_decode_metadata: Any, common_attn_metadata: Any,
                                *args: Any, **kwargs: Any) -> Any:
        hooks = hooks_for(self)
        state, specexit, stash = hooks.dcut, hooks.specexit, hooks.stash
        if state is None:
            drafts = original(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                              sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                              *args, **kwargs)
            if specexit is not None:
                specexit.on_drafted(list(self.input_batch.req_ids), self.requests, self.num_spec_tokens)
            return drafts
        req_ids = list(self.input_batch.req_ids)
        if state.history is not None:  # which requests sample: a kind of their own (dcut.history; vLLM's live set)
            state.history.sampled = self.input_batch.random_reqs
        context = self.input_batch.num_tokens_no_spec[:len(req_ids)]  # each request's tokens so far (numpy)
        # every cost lookup of the step prices the batch's mean context (unless told to decide at the profiled one)
        # (summed in Python: numpy's mean of a few ints cost 85 us a step on the CPU engine, its caches cold after the
        # forward; the same float, the sum being exact)
        state.context = sum(context.tolist()) / len(req_ids) if len(req_ids) and state.settings.context_cost else None
        width = _agreed(self, state.choose_width(len(req_ids), scheduler_output.num_spec_tokens_to_schedule, req_ids))
        # never wider than the batch's largest cap (caps are the requests', the same on every rank); at width 0 they
        # bound nothing, and are not read
        caps = state.requests.caps_for(req_ids, functools.partial(_cap_inputs, self.requests)) if width else None
        width = min(width, max(caps, default=width)) if caps else width
        state.width = width
        if width == 0 and stash is not None and torch.is_tensor(sampled_token_ids):
            _stash_context(self, stash, scheduler_output, req_ids, sampled_token_ids, hidden_states,
                           aux_hidden_states, spec_decode_metadata, common_attn_metadata)
            # As a list, not a [bs, 0] tensor: vLLM then skips its device-to-host copy of the drafts and its
            # hand-over passes the list through (its n-gram drafter's path; 0.03 ms of a width-0 step at bs 1)
            drafts = [[] for _ in req_ids]
        else:
            if stash:
                rows, start = len(stash), state.mark()  # (a device mark: the flush's launches return at once)
                stash.flush(self.drafter.model)  # before the drafter reads its cache
                state.on_flush(start, rows)
            if width != scheduler_output.num_spec_tokens_to_schedule:
                scheduler_output = dataclasses.replace(scheduler_output, num_spec_tokens_to_schedule=width)
            drafts = original(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                              sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                              *args, **kwargs)
        if specexit is not None:
            specexit.on_drafted(req_ids, self.requests, width)
        drafted = hooks.draft if torch.is_tensor(drafts) and width else None
        log_conf = None if drafted is None else drafted.log_conf
        num_draft = None if spec_decode_metadata is None else spec_decode_metadata.num_draft_tokens
        state.on_drafted(req_ids, log_conf, sampled_token_ids, num_draft,
                         None if state.tracer is None else context.tolist(), caps)
        return drafts
    return propose_draft_token_ids


def _stash_context(runner: Any, stash: ContextStash, scheduler_output: Any, req_ids: list[str],
                   sampled_token_ids: torch.Tensor, hidden_states: torch.Tensor, aux_hidden_states: Any,
                   spec_decode_metadata: Any, common_attn_metadata: Any) -> None:
    """Keep this step's drafter context: every scheduled token, except drafts that were rejected.

    Request i scheduled ``counts[i]`` tokens, of which its last ``d_i`` were drafts; ``a_i`` of
    those were accepted, so its context is its first ``counts[i] - d_i + a_i`` tokens (the tokens
    DFlash's own first pass writes context K/V for and attends to; a rejected draft's slot is
    written again when that position is decoded for real).
    """
    # The target's outputs are fresh tensors every step (no CUDA graph on this path): kept as views, sliced and
    # concatenated at flush (one copy of many steps instead of one per step).
    hidden = aux_hidden_states if runner.use_aux_hidden_state_outputs else [hidden_states]
    positions, slots = context_positions(runner), common_attn_metadata.slot_mapping
    counts = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
    drafted = None if spec_decode_metadata is None else spec_decode_metadata.num_draft_tokens
    if drafted is None or not any(drafted):
        stash.add(hidden, positions, slots, req_ids, counts)
        return
    n = scheduler_output.total_num_scheduled_tokens
    drafted_t, counts_t = torch.tensor(drafted), torch.tensor(counts)
    accepted = ((sampled_token_ids != -1).sum(dim=1).cpu() - 1).clamp(min=0)
    rows = counts_t - drafted_t + torch.minimum(accepted, drafted_t)
    owner = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
    within = torch.arange(n) - (torch.cumsum(counts_t, 0) - counts_t)[owner]
    keep = (within < rows[owner]).to(slots.device)
    stash.add([h[:n][keep] for h in hidden], positions[:n][keep], slots[:n][keep], req_ids, rows.tolist())


def context_positions(runner: Any) -> torch.Tensor:
    """The positions DFlash's own first pass writes context K/V at, as one row over the step's tokens: the runner's
    1-D buffer, or on an M-RoPE target the first (temporal) row of its [3, n] positions, the row vLLM's DFlash input
    kernel reads (it is handed ``_get_positions``' [3, n] view and loads ``target_positions_ptr + i``). The two
    differ after an image, where M-RoPE positions no longer count tokens."""
    return runner.mrope_positions.gpu[0] if runner.uses_mrope else runner.positions


def _cap_inputs(requests: dict[str, Any], req_id: str) -> tuple[dict | None, bool]:
    """A request's ``SamplingParams.extra_args``, where its cap travels, and whether it is seeded and sampled as
    vLLM reads it (``SamplingType.RANDOM_SEED``; ``dcut.speculation.cap_of``); (None, False) for a dummy step's
    requests."""
    cached = requests.get(req_id)
    params = None if cached is None else getattr(cached, "sampling_params", None)
    if params is None:
        return None, False
    return params.extra_args, params.sampling_type == SamplingType.RANDOM_SEED


def _agreed(runner: Any, width: int) -> int:
    """Rank 0's width on every tensor-parallel rank: each rank times its own steps, but the
    drafter's forward has collectives, so all ranks must draft the same width."""
    if runner.parallel_config.tensor_parallel_size == 1:
        return width
    from vllm.distributed import get_tp_group

    return int(get_tp_group().broadcast_object(width, src=0))


def wrap_take_draft_token_ids(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.take_draft_token_ids``: the cut."""
    def take_draft_token_ids(self: Any) -> Any:
        out = original(self)
        state = hooks_for(self).dcut
        if state is None or out is None:
            return out
        return type(out)(out.req_ids, state.cut(out.req_ids, out.draft_token_ids))
    return take_draft_token_ids

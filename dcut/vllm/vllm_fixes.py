"""Three fixes of vLLM 0.32 bugs in sampling on CPU — nothing to do with D-Cut.

Active for EVERY engine in the environment once dcut-serve is installed: vLLM loads the plugin in every
process (``vllm.general_plugins``), and these two wrappers apply whether or not an engine asks for D-Cut or
SpecExit. Set ``DCUT_VLLM_FIXES=0`` in the environment of the processes that start engines to leave vLLM's
sampling as it is (the D-Cut patches are not affected). Each was found killing an engine core: one request with
``top_k`` and ``temperature > 0`` (``loadtest.fuzz``); seeded sampled requests in a batch whose prefill is chunked.

- ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` — on CPU its kernel (``cpu_triton_utils.
  _expand_kernel_impl``) writes into an int64 *copy* of the output, so the per-token temperatures and top-k
  of every sampled request were uninitialised memory (garbage ``k`` raised "selected index k out of range").
  On CPU: ``repeat_interleave``, the same result; elsewhere vLLM's kernel.
- ``vllm.v1.sample.rejection_sampler.apply_sampling_constraints`` — over zero draft tokens (a DFlash prefill
  step; a step whose drafts were all cut) it reaches ``apply_top_k_only``, whose ``k.max()`` of an empty
  tensor raises. No tokens: nothing to constrain, the empty logits are returned as they are.

- ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.sample_tokens`` — a request whose prompt is still being
  prefilled in chunks samples a token that is thrown away, and ``_bookkeeping_sync`` then rewinds its seeded
  generator (``gen.set_offset(gen.get_offset() - 4)``) so that its samples do not depend on the chunking; a CPU
  generator has no offset ("CPU Generator does not use offset") and the engine core dies. On CPU such a request's
  generator is left out of that step's sampling (its thrown-away token is drawn from the default generator), which
  leaves the generator exactly where vLLM's rewind puts a CUDA one; elsewhere vLLM's own rewind.

``tests/unit/test_patches.py`` holds canaries that fail once vLLM fixes these (the CPU kernel stops writing into a
copy; ``_bookkeeping_sync`` stops asking a CPU generator for its offset).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

OPT_OUT = "DCUT_VLLM_FIXES"


def enabled() -> bool:
    """False when the environment says ``DCUT_VLLM_FIXES=0`` (or false/no/off)."""
    return os.environ.get(OPT_OUT, "1").strip().lower() not in ("0", "false", "no", "off")


def expand_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: float = 0,
                     replace_to: float = 0) -> torch.Tensor:
    """``x[i]`` repeated for each of request i's tokens (``cu_num_tokens``: cumulative counts), with
    ``replace_from`` values replaced by ``replace_to`` — what vLLM's ``expand_kernel`` computes."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return out.masked_fill(out == replace_from, replace_to)


def wrap_expand_batch_to_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens``: ``expand_to_tokens`` on CPU."""
    def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                               replace_from: float = 0, replace_to: float = 0) -> torch.Tensor:
        if x.device.type != "cpu":
            return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        return expand_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)
    return expand_batch_to_tokens


def wrap_apply_sampling_constraints(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``vllm.v1.sample.rejection_sampler.apply_sampling_constraints``: no tokens, nothing to constrain."""
    def apply_sampling_constraints(logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if logits.shape[0] == 0:
            return logits
        return original(logits, *args, **kwargs)
    return apply_sampling_constraints


def wrap_sample_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.sample_tokens``: the seeded CPU generators of
    requests whose sampled token is discarded (a partial prefill) sit this step out, so vLLM has nothing to
    rewind."""
    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        generators: dict[int, torch.Generator] = self.input_batch.generators
        hidden = {} if not generators else discarded_cpu_generators(
            generators, self.discard_request_mask.np[: self.input_batch.num_reqs])
        for index in hidden:
            del generators[index]
        try:
            return original(self, grammar_output)
        finally:
            generators.update(hidden)
    return sample_tokens


def discarded_cpu_generators(generators: dict[int, torch.Generator], discard: Any) -> dict[int, torch.Generator]:
    """The CPU generators of the requests ``discard`` (a boolean per request index) marks: those vLLM would rewind."""
    return {i: g for i, g in generators.items() if i < len(discard) and discard[i] and g.device.type == "cpu"}

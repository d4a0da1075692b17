"""Two fixes of vLLM 0.32 bugs in the rejection sampler's sampling constraints — nothing to do with D-Cut.

Active for EVERY engine in the environment once dcut-serve is installed: vLLM loads the plugin in every
process (``vllm.general_plugins``), and these two wrappers apply whether or not an engine asks for D-Cut or
SpecExit. Set ``DCUT_VLLM_FIXES=0`` in the environment of the processes that start engines to leave vLLM's
rejection sampler as it is (the D-Cut patches are not affected). Found by ``loadtest.fuzz``: one request with
``top_k`` and ``temperature > 0`` killed the engine core.

- ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` — on CPU its kernel (``cpu_triton_utils.
  _expand_kernel_impl``) writes into an int64 *copy* of the output, so the per-token temperatures and top-k
  of every sampled request were uninitialised memory (garbage ``k`` raised "selected index k out of range").
  On CPU: ``repeat_interleave``, the same result; elsewhere vLLM's kernel.
- ``vllm.v1.sample.rejection_sampler.apply_sampling_constraints`` — over zero draft tokens (a DFlash prefill
  step; a step whose drafts were all cut) it reaches ``apply_top_k_only``, whose ``k.max()`` of an empty
  tensor raises. No tokens: nothing to constrain, the empty logits are returned as they are.

``tests/unit/test_patches.py`` holds a canary that fails once vLLM's CPU kernel stops writing into a copy.
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

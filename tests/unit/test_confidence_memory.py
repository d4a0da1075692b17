"""The drafter's log-confidences without a float32 copy of its logits (issue 61, item 4).

``dcut.cut.log_confidence`` must give what the float32 ``logit[tok] - logsumexp`` gave, and computing it at
bs 64, width 15 and a 151,936-token vocabulary (bf16 logits, 0.29 GB) must allocate at most a quarter of the logits'
size beyond them: a float32 copy alone is twice their size, and vLLM's memory profiling never sees it.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import dcut.cut
from dcut.cut import log_confidence, log_confidence_of_probs


def _float32_reference(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The computation before issue 61: the whole logits in float32."""
    logits = logits.float()
    return logits.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


class LiveBytes(TorchDispatchMode):
    """The bytes of tensor storage allocated under the mode and still alive, and their peak. An op's output that
    shares storage with one of its inputs (a view, an in-place or ``out=`` op) allocated nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._live: dict[int, list[Any]] = {}  # storage address -> [bytes, ids of the tensors holding it]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self._hold(t)
        return out

    def _hold(self, t: torch.Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [t.untyped_storage().nbytes(), set()]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1].add(id(t))
        weakref.finalize(t, self._release, key, id(t))

    def _release(self, key: int, holder: int) -> None:
        entry = self._live.get(key)
        if entry is not None:
            entry[1].discard(holder)
            if not entry[1]:
                self.now -= entry[0]
                del self._live[key]


def _extra_peak(fn: Any, *args: torch.Tensor) -> int:
    with LiveBytes() as mode:
        result = fn(*args)
    del result
    return mode.peak


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 50), (3, 5, 300), (130, 40)])
def test_log_confidence_is_the_float32_logsumexp(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                 shape: tuple[int, ...]) -> None:
    """Greedy tokens and random ones, over chunks that split the rows unevenly (a chunk of 8 rows here)."""
    monkeypatch.setattr(dcut.cut, "CONFIDENCE_CHUNK_BYTES", 8 * 4 * shape[-1])
    generator = torch.Generator().manual_seed(sum(shape))
    logits = (torch.randn(shape, generator=generator) * 4).to(dtype)
    before = logits.clone()
    for tokens in (logits.argmax(-1), torch.randint(0, shape[-1], shape[:-1], generator=generator)):
        got = log_confidence(logits, tokens)
        assert got.dtype == torch.float32 and got.shape == shape[:-1]
        torch.testing.assert_close(got, _float32_reference(logits, tokens), atol=1e-5, rtol=1e-5)
    assert torch.equal(logits, before)  # float32 logits are not written to


def test_a_masked_vocabulary_and_a_row_of_minus_infinity_match_too() -> None:
    logits = torch.randn(3, 64)
    logits[0, 10:] = -torch.inf  # a constrained (heterogeneous) vocabulary
    logits[1] = -torch.inf
    tokens = torch.tensor([3, 0, 5])
    torch.testing.assert_close(log_confidence(logits, tokens), _float32_reference(logits, tokens), equal_nan=True)


def test_log_confidence_of_probs_is_the_log_of_the_probabilities() -> None:
    generator = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(40, 500, generator=generator) * 3, dim=-1)
    probs[0, 7] = 0.0  # floored at 1e-30, as before
    tokens = torch.randint(0, 500, (40,), generator=generator)
    tokens[0] = 7
    torch.testing.assert_close(log_confidence_of_probs(probs, tokens),
                               _float32_reference(probs.clamp_min(1e-30).log(), tokens), atol=1e-5, rtol=1e-5)


def test_the_tracker_sees_a_float32_copy() -> None:
    """The measure has the power to see what the bound is there for."""
    logits = torch.randn(64, 4096).to(torch.bfloat16)
    assert _extra_peak(_float32_reference, logits, logits.argmax(-1)) >= 2 * logits.nbytes


def test_confidences_at_bs_64_width_15_allocate_at_most_a_quarter_of_the_logits() -> None:
    """Qwen3's vocabulary, bf16 logits of a DFlash block of 15 drafts for 64 requests (278 MiB). Measured: 31.9 MiB
    (one chunk buffer, ``CONFIDENCE_CHUNK_BYTES``, and the per-row results); with the float32 copy put back, 588 MiB
    (and 1.1 GB of peak RSS beyond the logits, the log-sum-exp's own temporary included)."""
    logits = torch.empty(64 * 15, 151_936, dtype=torch.bfloat16).normal_(generator=torch.Generator().manual_seed(0))
    tokens = logits.argmax(-1)
    extra = _extra_peak(log_confidence, logits, tokens)
    assert extra <= logits.nbytes / 4, f"{extra / 2**20:.1f} MiB beyond {logits.nbytes / 2**20:.1f} MiB of logits"

"""Width 0 without holes: keep the drafter's context K/V in sync lazily (DFlash).

A DFlash drafter's state is the K/V it writes, for every token the target processed, from the
target's hidden states. Not drafting a step still owes it those writes, and vLLM's own K=0 path
pays them with a whole drafter pass every step (several plain steps' worth on small targets).
``ContextStash`` keeps the step's hidden states, positions and slots instead, and writes them all
in one batched ``precompute_and_store_context_kv`` before the drafter next reads its cache, or
before any KV block could change hands (a request finished or was preempted). The K/V written
is exactly what the per-step path would have written, so acceptance is unaffected.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

MAX_STASHED_TOKENS = 8192  # bounds memory; a longer run of width-0 steps is written out early


class ContextStash:
    """Target hidden states of width-0 steps, waiting to become drafter K/V."""

    def __init__(self) -> None:
        self._hidden: list[Tensor] = []
        self._positions: list[Tensor] = []
        self._slots: list[Tensor] = []
        self.tokens = 0

    def __len__(self) -> int:
        return self.tokens

    def add(self, hidden: Tensor, positions: Tensor, slots: Tensor) -> None:
        """Keep one step's context (copied: the runner reuses its buffers)."""
        self._hidden.append(hidden.clone())
        self._positions.append(positions.clone())
        self._slots.append(slots.clone())
        self.tokens += hidden.shape[0]

    def flush(self, drafter_model: Any) -> None:
        """Write every kept token's context K/V into the drafter's cache, then forget them."""
        if not self.tokens:
            return
        hidden = self._hidden[0] if len(self._hidden) == 1 else torch.cat(self._hidden)
        positions = self._positions[0] if len(self._positions) == 1 else torch.cat(self._positions)
        slots = self._slots[0] if len(self._slots) == 1 else torch.cat(self._slots)
        self._hidden, self._positions, self._slots, self.tokens = [], [], [], 0
        drafter_model.precompute_and_store_context_kv(drafter_model.combine_hidden_states(hidden), positions, slots)

"""Width 0 without holes: keep the drafter's context K/V in sync lazily (DFlash).

A DFlash drafter's state is the K/V it writes, for every token the target processed, from the
target's hidden states. Not drafting a step still owes it those writes, and vLLM's own K=0 path
pays them with a whole drafter pass every step (several plain steps' worth on small targets).
``ContextStash`` keeps the step's hidden states, positions and slots instead, and writes them all
in one batched ``precompute_and_store_context_kv`` before the drafter next reads its cache. Rows
of a request that finished or was preempted are dropped, never written: their K/V would never be
read, and their KV blocks may already belong to another request. The K/V written is exactly what
the per-step path would have written, so acceptance is unaffected; a run of width-0 steps that
ends with its requests costs nothing at all. A run longer than ``MAX_STASHED_TOKENS`` tokens
forgets its oldest steps instead of writing them: width 0 that long means drafting does not pay
here, and if it resumes those positions are holes in the drafter's context (lower acceptance,
never a different output: verification is unchanged).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

MAX_STASHED_TOKENS = 16384  # bounds memory (x the target's aux hidden width x 4 bytes)


@dataclass
class _Entry:
    hidden: list[Tensor]  # the target's hidden states the drafter reads (several layers for DFlash), as given
    ids: np.ndarray | Tensor  # [2, n]: positions, slots (one copy of both, split at flush)
    owners: list[str]  # the request of each run of rows, in order
    counts: list[int]  # rows per owner
    live: int  # rows still to be written
    gone: set[str] | None = None  # owners dropped since: their rows are never written

    def drop(self, req_ids: set[str]) -> int:
        """Mark the rows of ``req_ids`` as never to be written; how many rows that took off."""
        before = self.live
        gone = self.gone = self.gone or set()
        for r, n in zip(self.owners, self.counts, strict=True):
            if r in req_ids and r not in gone:
                gone.add(r)
                self.live -= n
        return before - self.live

    def layers(self) -> list[Tensor]:
        """The step's rows of each hidden layer (its hidden states may run past them)."""
        n = self.ids.shape[1]
        return [h if h.shape[0] == n else h[:n] for h in self.hidden]

    def keep(self) -> np.ndarray:
        """Which of the step's rows are still to be written."""
        gone = self.gone or set()
        return np.repeat([r not in gone for r in self.owners], self.counts)


class ContextStash:
    """Target hidden states of width-0 steps, waiting to become drafter K/V."""

    def __init__(self, host: bool = False) -> None:
        """``host``: positions and slots are host tensors (a CPU engine), copied as numpy: a torch op on a few
        integers costs about three numpy ones with the caches cold after the forward."""
        self._entries: deque[_Entry] = deque()
        self.tokens = 0
        self.host = host

    def __len__(self) -> int:
        return self.tokens

    def add(self, hidden: list[Tensor], positions: Tensor, slots: Tensor, owners: list[str],
            counts: list[int]) -> None:
        """Keep one step's context, ``sum(counts)`` rows: the first rows of ``hidden``, the target's hidden states
        per layer the drafter reads (fresh tensors, kept as they are), of ``positions`` and of ``slots`` (copied:
        the runner reuses those buffers); rows belong to ``owners[j]`` in runs of ``counts[j]``. Slicing,
        concatenation and the drafter's input projection run at flush, batched: on CPU, small per-step ops cost
        more than the stash."""
        rows = sum(counts)
        ids = np.array((positions.numpy()[:rows], slots.numpy()[:rows])) if self.host else \
            torch.stack((positions[:rows], slots[:rows].to(positions.dtype)))
        self._entries.append(_Entry(hidden, ids, owners, counts, rows))
        self.tokens += rows
        while self.tokens > MAX_STASHED_TOKENS and len(self._entries) > 1:
            self.tokens -= self._entries.popleft().live

    def drop(self, req_ids: set[str]) -> None:
        """Forget the rows of requests that finished or were preempted: their K/V will never be
        read (a preempted request recomputes its context), and their slots may change hands.

        Only marked here; the rows are left out at flush. Under steady traffic a request finishes
        every few steps, and cutting its rows out of every stashed step at once copied the whole
        stash each time (profiled: 12 ms a call at bs 64); a step none of them drafted in is passed
        over at C speed (``isdisjoint``). A preempted request that resumes stashes its new rows in
        new entries, which its old mark does not touch."""
        kept: deque[_Entry] = deque()
        for e in self._entries:
            if not req_ids.isdisjoint(e.owners):
                self.tokens -= e.drop(req_ids)
            if e.live:
                kept.append(e)
        self._entries = kept

    def flush(self, drafter_model: Any) -> None:
        """Write every kept token's context K/V into the drafter's cache, then forget them."""
        if not self.tokens:
            return
        entries, self._entries, self.tokens = self._entries, deque(), 0
        # each layer's rows over all steps, then the layers side by side (one cat per layer, not one per step)
        hidden = torch.cat([torch.cat(rows) for rows in zip(*(e.layers() for e in entries), strict=True)], dim=-1)
        ids = torch.from_numpy(np.concatenate([e.ids for e in entries], axis=1)).to(hidden.device) if self.host \
            else torch.cat([e.ids for e in entries], dim=1)
        positions, slots = ids
        if any(e.gone for e in entries):
            keep = torch.from_numpy(np.concatenate([e.keep() for e in entries])).to(hidden.device)
            hidden, positions, slots = hidden[keep], positions[keep], slots[keep]
        drafter_model.precompute_and_store_context_kv(drafter_model.combine_hidden_states(hidden), positions, slots)

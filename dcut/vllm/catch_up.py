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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

MAX_STASHED_TOKENS = 16384  # bounds memory (x the target's aux hidden width x 4 bytes)


@dataclass
class _Entry:
    hidden: list[Tensor]  # the target's hidden states the drafter reads (several layers for DFlash)
    ids: Tensor  # [2, rows]: positions, slots (one copy of both, split at flush)
    owners: list[str]  # the request of each run of rows, in order
    counts: list[int]  # rows per owner
    live: int  # rows still to be written
    gone: set[str] = field(default_factory=set)  # owners dropped since: their rows are never written

    def drop(self, req_ids: set[str]) -> int:
        """Mark the rows of ``req_ids`` as never to be written; how many rows that took off."""
        before = self.live
        for r, n in zip(self.owners, self.counts, strict=True):
            if r in req_ids and r not in self.gone:
                self.gone.add(r)
                self.live -= n
        return before - self.live

    def rows(self) -> tuple[Tensor, Tensor, Tensor]:
        """Hidden states (layers side by side), positions and slots of the rows still to be written."""
        hidden, (positions, slots) = torch.cat(self.hidden, dim=-1), self.ids
        if not self.gone:
            return hidden, positions, slots
        keep = torch.repeat_interleave(torch.tensor([r not in self.gone for r in self.owners]),
                                       torch.tensor(self.counts)).to(slots.device)
        return hidden[keep], positions[keep], slots[keep]


class ContextStash:
    """Target hidden states of width-0 steps, waiting to become drafter K/V."""

    def __init__(self) -> None:
        self._entries: deque[_Entry] = deque()
        self.tokens = 0

    def __len__(self) -> int:
        return self.tokens

    def add(self, hidden: list[Tensor], positions: Tensor, slots: Tensor, owners: list[str],
            counts: list[int]) -> None:
        """Keep one step's context: ``hidden`` the target's hidden states per layer the drafter reads
        (fresh tensors, not copied); positions and slots copied (the runner reuses those buffers);
        rows belong to ``owners[j]`` in runs of ``counts[j]``. Concatenation and the drafter's input
        projection run at flush, batched: on CPU, small per-step ops cost more than the stash."""
        rows = positions.shape[0]
        self._entries.append(_Entry(hidden, torch.stack((positions, slots.to(positions.dtype))), owners, counts,
                                    rows))
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
        hidden, positions, slots = (torch.cat(parts) for parts in zip(*(e.rows() for e in entries), strict=True))
        drafter_model.precompute_and_store_context_kv(drafter_model.combine_hidden_states(hidden), positions, slots)

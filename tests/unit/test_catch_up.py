"""The width-0 context stash (`dcut.vllm.catch_up`): what reaches the drafter's cache, on synthetic tensors."""

from __future__ import annotations

import pytest
import torch

from dcut.vllm.catch_up import MAX_STASHED_TOKENS, ContextStash


class _Drafter:
    """Records what a flush writes: the drafter's input projection is the identity here."""

    def __init__(self) -> None:
        self.written: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def combine_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def precompute_and_store_context_kv(self, hidden: torch.Tensor, positions: torch.Tensor,
                                        slots: torch.Tensor) -> None:
        self.written.append((hidden, positions, slots))


def _step(stash: ContextStash, owners: list[str], counts: list[int], base: int, padding: int = 0) -> None:
    """One step's rows: row j has hidden value, position and slot ``base + j`` (two hidden layers), as the runner
    hands them: its hidden states and buffers may run ``padding`` rows past the step's, which must never be
    written (their values here: -1)."""
    n = sum(counts)
    pad = torch.full((padding,), -1)
    values = torch.cat((torch.arange(base, base + n), pad)).float()
    stash.add([values[:, None], -values[:, None]], torch.cat((torch.arange(base, base + n), pad)),
              torch.cat((torch.arange(base, base + n) + 1000, pad)), owners, counts)


@pytest.mark.parametrize("host", [False, True])
def test_flush_writes_every_live_row_once_in_order_and_skips_dropped_owners(host: bool):
    stash, drafter = ContextStash(host), _Drafter()
    _step(stash, ["a", "b", "c"], [1, 2, 1], 0)  # rows 0 (a), 1-2 (b), 3 (c)
    _step(stash, ["a", "b"], [1, 1], 10, padding=3)  # rows 10 (a), 11 (b)
    stash.drop({"b"})
    assert len(stash) == 3
    _step(stash, ["b"], [1], 20)  # b preempted and resumed: its new row is kept
    stash.flush(drafter)
    (hidden, positions, slots), = drafter.written
    assert positions.tolist() == [0, 3, 10, 20]
    assert slots.tolist() == [1000, 1003, 1010, 1020]
    assert hidden.tolist() == [[0.0, -0.0], [3.0, -3.0], [10.0, -10.0], [20.0, -20.0]]  # layers side by side
    assert len(stash) == 0
    stash.flush(drafter)
    assert len(drafter.written) == 1  # nothing left to write


@pytest.mark.parametrize("host", [False, True])
def test_a_flush_with_nobody_dropped_writes_the_steps_rows_and_no_padding(host: bool):
    stash, drafter = ContextStash(host), _Drafter()
    _step(stash, ["a"], [2], 0, padding=5)
    _step(stash, ["a", "b"], [1, 1], 2, padding=1)
    stash.flush(drafter)
    (hidden, positions, slots), = drafter.written
    assert positions.tolist() == [0, 1, 2, 3] and slots.tolist() == [1000, 1001, 1002, 1003]
    assert hidden.tolist() == [[float(i), -float(i)] for i in range(4)]


@pytest.mark.parametrize("host", [False, True])
def test_a_step_whose_owners_all_left_is_forgotten_and_the_stash_stays_bounded(host: bool):
    stash, drafter = ContextStash(host), _Drafter()
    _step(stash, ["a"], [4], 0)
    stash.drop({"a", "z"})
    assert len(stash) == 0
    stash.flush(drafter)
    assert drafter.written == []
    steps = MAX_STASHED_TOKENS // 64 + 4
    for i in range(steps):
        _step(stash, [f"r{i}"], [64], 64 * i)
    assert len(stash) <= MAX_STASHED_TOKENS
    stash.flush(drafter)
    (_, positions, _), = drafter.written
    assert positions.shape[0] == len(positions.unique()) <= MAX_STASHED_TOKENS
    assert int(positions[-1]) == 64 * steps - 1  # the oldest steps are the ones forgotten

"""Replay of the small committed trace: every policy's figures, asserted exactly.

Replay is deterministic, so a change to any decision code (selection, width choice, calibration,
realized rates, another engine's rule) shows here as a diff of figures, to be re-committed on purpose:

    dcut replay --trace tests/data/replay/deep-small.npz --costs tests/data/replay/deep-small-costs.json \\
        --bs 1,8,32 --steps 80 --warmup 20 --out tests/data/replay/expected
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dcut.replay.cases import custom_case
from dcut.replay.report import STARTS, replay_case, summarize

DATA = Path(__file__).resolve().parents[1] / "data" / "replay"


@pytest.fixture(scope="module")
def replayed() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `dcut replay` runs
    try:
        case = custom_case(DATA / "deep-small.npz", DATA / "deep-small-costs.json", "1,8,32")
        return summarize(case, replay_case(case, steps=80, warmup=20, progress=False))
    finally:
        torch.set_num_threads(threads)


def test_every_policy_matches_the_committed_figures(replayed):
    expected = json.loads((DATA / "expected" / "replay.json").read_text())["cases"]["deep-small"]
    got = json.loads(json.dumps(replayed, sort_keys=True))  # the JSON form, as the report writes it
    want = {(r["policy"], r["bs"]): r for r in expected["rows"]}
    assert {(r["policy"], r["bs"]) for r in got["rows"]} == set(want)
    for row in got["rows"]:
        assert row == want[(row["policy"], row["bs"])], (row["policy"], row["bs"])


def test_the_oracle_bounds_every_policy_and_plain_decoding_is_the_unit(replayed):
    for row in replayed["rows"]:
        assert row["fraction_of_oracle"] <= 1.0 + 1e-9, row["policy"]
        if row["policy"] == "none":
            assert row["speedup_vs_none"] == 1.0 and row["widths"] == {"0": 80 * STARTS}


def test_the_oracle_bounds_every_policy_from_every_start(replayed):
    """Pooled, a policy could pass the oracle from one start and trail it from another: each start is bounded."""
    oracle = {r["bs"]: r["by_start"] for r in replayed["rows"] if r["policy"] == "oracle"}
    for row in replayed["rows"]:
        assert len(row["by_start"]) == STARTS
        assert all(mine <= best * (1 + 1e-9) for mine, best in zip(row["by_start"], oracle[row["bs"]], strict=True)), \
            (row["policy"], row["bs"])

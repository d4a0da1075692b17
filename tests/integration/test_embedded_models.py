"""The shipped pairs (`dcut.settings.EMBEDDED_MODELS`: dense, deep, moe, reasoning) load in vLLM on CPU and
greedy output with DFlash speculative decoding equals greedy output without it.

The check is `train.verify.run_verify` (what ``python -m train.verify`` runs), on in-process
engines in the test session's engine environment (``tests/conftest.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dcut.prompts import load_prompts
from dcut.settings import EMBEDDED_MODELS
from train.verify import run_verify

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "models"
PAIRS = [tuple(Path(folder).name for folder in pair) for pair in EMBEDDED_MODELS.values()]


def _trained(name: str) -> bool:
    return (MODELS / name / "config.json").exists() and any((MODELS / name).glob("*.safetensors"))


@pytest.mark.integration
@pytest.mark.parametrize("target,drafter", PAIRS, ids=[p[0] for p in PAIRS])
def test_pair_loads_and_dflash_is_lossless(target, drafter):
    assert _trained(target) and _trained(drafter), f"models/{target} or models/{drafter} missing: they ship in the repo"
    prompts = load_prompts(MODELS / "heldout_prompts.jsonl")[:2]
    res = run_verify(str(MODELS / target), str(MODELS / drafter), prompts, max_tokens=32, k=15)
    assert res["all_identical"], res
    assert res["num_drafts"] > 0 and len(res["acceptance_per_pos"]) == 15
    if target != "moe":
        assert res["num_accepted_tokens"] > 0, res

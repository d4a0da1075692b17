"""The shipped pairs (`dcut.settings.EMBEDDED_MODELS`: dense, deep, moe) load in vLLM on CPU and greedy
output with DFlash speculative decoding equals greedy output without it.

vLLM runs in a subprocess (``python -m dcut.train.verify``: the engine needs a ``__main__`` guard) in the
test session's engine environment (``tests/conftest.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dcut.settings import EMBEDDED_MODELS

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "models"
PAIRS = [tuple(Path(folder).name for folder in pair) for pair in EMBEDDED_MODELS.values()]


def _trained(name: str) -> bool:
    return (MODELS / name / "config.json").exists() and any((MODELS / name).glob("*.safetensors"))


@pytest.mark.integration
@pytest.mark.parametrize("target,drafter", PAIRS, ids=[p[0] for p in PAIRS])
def test_pair_loads_and_dflash_is_lossless(target, drafter, tmp_path):
    if not (_trained(target) and _trained(drafter)):
        pytest.skip(f"models/{target} or models/{drafter} not trained yet (run `dcut train all`)")
    out = tmp_path / "verify.json"
    cmd = [sys.executable, "-m", "dcut.train.verify", "--target", str(MODELS / target),
           "--drafter", str(MODELS / drafter), "--prompts", str(MODELS / "heldout_prompts.jsonl"),
           "--num-prompts", "2", "--max-tokens", "32", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.exists(), (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(out.read_text())
    assert res["all_identical"], res
    assert res["num_drafts"] > 0 and len(res["acceptance_per_pos"]) == 15
    if target != "moe":
        assert res["num_accepted_tokens"] > 0, res

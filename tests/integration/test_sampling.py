"""Sampling at temperature 1: D-Cut leaves vLLM's verification as it is (it only shortens drafts, using
information from the drafter alone), so a cut samples as if fewer drafts had been proposed, and speculative
decoding with D-Cut samples from the target's own distribution."""

from __future__ import annotations

import gc
import math
from collections import Counter
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from dcut.settings import DCutSettings, EngineSettings
from dcut.speculation import EXTRA_ARG
from tests.tiny_models import build_tiny_models

pytestmark = pytest.mark.integration
N = 600
POSITIONS = 4


def _sharpen(folder: Path, scale: float) -> None:
    """Scale the final norm so the random model's next-token distribution is peaked (few outcomes)."""
    path = folder / "model.safetensors"
    state = load_file(path)
    state["model.norm.weight"] = state["model.norm.weight"] * scale
    save_file(state, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    paths = build_tiny_models(tmp_path_factory.mktemp("sampling"))
    _sharpen(paths["target"], 12.0)
    _sharpen(paths["draft"], 7.0)  # same weights, flatter: a drafter that is often but not always right
    return paths


def _samples(model: Path, draft: Path | None, mode: str | None, k: int = 3) -> list[tuple[int, ...]]:
    from vllm import LLM, SamplingParams

    from dcut.vllm.engine import engine_kwargs

    dcut = None if mode is None else DCutSettings(mode=mode, per_request_depth=1, profile=False)
    settings = EngineSettings(model=str(model), draft=None if draft is None else str(draft),
                              method="none" if draft is None else "draft_model", num_speculative_tokens=k,
                              max_num_seqs=64, max_model_len=128, enforce_eager=True, dcut=dcut)
    llm = LLM(**engine_kwargs(settings))
    # seeded for a repeatable test; a cap of their own, or D-Cut would decode seeded requests plainly
    # (dcut.speculation) and never cut a sampled draft
    params = [SamplingParams(temperature=1.0, max_tokens=POSITIONS, seed=i, ignore_eos=True,
                             extra_args={EXTRA_ARG: k}) for i in range(N)]
    out = llm.generate(["def add(a, b):"] * N, params, use_tqdm=False)
    del llm
    gc.collect()
    return [tuple(o.outputs[0].token_ids) for o in out]


def _chi2_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square homogeneity test; categories under 10 expected pooled. Wilson-Hilferty p."""
    na, nb = sum(a.values()), sum(b.values())
    keys = [k for k in set(a) | set(b) if (a[k] + b[k]) * min(na, nb) / (na + nb) >= 10]
    cats = [(a[k], b[k]) for k in keys]
    rest = (na - sum(x for x, _ in cats), nb - sum(y for _, y in cats))
    if sum(rest):
        cats.append(rest)
    stat = 0.0
    for x, y in cats:
        total = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = total * n / (na + nb)
            stat += (obs - exp) ** 2 / exp if exp else 0.0
    df = max(1, len(cats) - 1)
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def samples(pair) -> dict[str, list[tuple[int, ...]]]:
    return {"cut_to_1": _samples(pair["target"], pair["draft"], "per_request"),
            "vllm_k1": _samples(pair["target"], pair["draft"], None, k=1),
            "joint": _samples(pair["target"], pair["draft"], "joint"),
            "target": _samples(pair["target"], None, None),
            "drafter": _samples(pair["draft"], None, None)}


def _p(a: list[tuple[int, ...]], b: list[tuple[int, ...]], t: int) -> float:
    return _chi2_p(Counter(s[t] for s in a), Counter(s[t] for s in b))


def test_temperature_one_a_cut_samples_as_if_fewer_drafts_were_proposed(samples):
    """What D-Cut owns: the cut. Drafting K=3 and cutting every request to 1 draft (mode per_request)
    samples exactly as vLLM drafting K=1 with the plugin off, through the same verifier."""
    for t in range(1, POSITIONS):  # positions produced by speculative steps
        p_same = _p(samples["vllm_k1"], samples["cut_to_1"], t)
        assert p_same > 1e-3, f"position {t}: a cut to 1 draft samples unlike vLLM's K=1 (p={p_same:.2e})"
    # Power check: the drafter's own distribution is told apart by the same test.
    p_draft = min(_p(samples["vllm_k1"], samples["drafter"], t) for t in range(1, POSITIONS))
    assert p_draft < 1e-3, f"test has no power: drafter distribution not distinguished (p={p_draft:.2e})"


def test_temperature_one_samples_the_targets_distribution(samples):
    """Lossless in distribution: speculative decoding (vLLM's K=1, D-Cut's cut to 1, D-Cut's default mode
    ``joint`` choosing widths) samples each position as the target alone does. vLLM 0.32's CPU verifier did not
    (p=9e-15 at position 1 with the plugin off: its per-token temperatures were uninitialised memory) until
    ``dcut.vllm.vllm_fixes`` replaced ``expand_batch_to_tokens`` on CPU."""
    for arm in ("vllm_k1", "cut_to_1", "joint"):
        for t in range(POSITIONS):
            p_same = _p(samples["target"], samples[arm], t)
            assert p_same > 1e-3, f"{arm}, position {t}: samples unlike the target alone (p={p_same:.2e})"

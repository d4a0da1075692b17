"""Every sampling parameter the OpenAI API and vLLM accept, greedy and at temperature 1, sent together to one
engine in each mode the project ships (no drafter, vLLM's own speculation, D-Cut full, D-Cut joint): no request
may take the engine down. The batch is larger than one step's token budget, so prompts are prefilled in chunks:
with a seed, that is what killed engines (``dcut.vllm.vllm_fixes.wrap_sample_tokens``). Then seeded sampling is
checked for what vLLM promises: the same request alone twice gives the same text, and, with no drafter, a
request's sample does not depend on how its prompt was chunked."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dcut.settings import DCutSettings, EngineSettings

pytestmark = pytest.mark.integration

BUDGET = 128  # tokens a step: 32 prompts of ~40-50 tokens take several steps, most requests prefilled in chunks
MAX_TOKENS = 24
PROMPTS = [f"# case {i}\n" + "def add(a, b):\n    return a + b\n" * (3 + i % 3) for i in range(8)]
# One entry per parameter (or family); vLLM refuses min_p and logit_bias with speculative decoding (a 400 over
# HTTP), which is not a crash: they are sent alone below.
CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "seed": {"seed": 1},
    "top_k": {"top_k": 5, "seed": 2},
    "top_p": {"top_p": 0.8},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
    "logprobs": {"logprobs": 3, "seed": 3},
    "n": {"n": 3, "seed": 4},
    "stop": {"stop": ["\n\n", "return b"]},
}
REFUSED_WITH_DRAFTS = {"min_p": {"min_p": 0.1}, "logit_bias": {"logit_bias": {5: 10.0}}}
MODES = ["none", "stock", "full", "joint"]
# the no-drafter engine's outputs (its module-scoped engine runs first): greedy, and one seeded sample
GREEDY: dict[str, list] = {}
SEEDED: dict[str, list] = {}


def _settings(models: dict[str, Path], mode: str) -> EngineSettings:
    drafter = {} if mode == "none" else {"draft": str(models["dflash"]), "method": "dflash"}
    dcut = DCutSettings(mode=mode, profile=False) if mode in ("full", "joint") else None
    return EngineSettings(model=str(models["target"]), **({"draft": None, "method": "none"} | drafter),
                          num_speculative_tokens=7, max_num_seqs=32, max_model_len=512,
                          max_num_batched_tokens=BUDGET, enforce_eager=True, prefix_caching=False, dcut=dcut)


@pytest.fixture(scope="module", params=MODES)
def engine(request, tiny_models) -> Iterator[tuple[str, Any]]:
    from vllm import LLM

    from dcut.vllm.engine import engine_kwargs

    llm = LLM(**engine_kwargs(_settings(tiny_models, request.param)))
    yield request.param, llm
    del llm
    gc.collect()


def _params(temperature: float, **extra: Any):
    from vllm import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, ignore_eos=True, **extra)


def test_every_sampling_parameter_at_once_keeps_the_engine(engine) -> None:
    from vllm.exceptions import VLLMValidationError  # a client error: a 400 over HTTP

    mode, llm = engine
    # vLLM refuses n > 1 when greedy (a 400 over HTTP): the n case runs sampled only, twice as many
    batch = [(name, t, prompt) for name in CASES for t in (0.0, 1.0) for prompt in PROMPTS[:2]
             if name != "n" or t == 1.0] + [("n", 1.0, p) for p in PROMPTS[2:4]]
    out = llm.generate([p for _, _, p in batch], [_params(t, **CASES[name]) for name, t, _ in batch],
                       use_tqdm=False)
    assert len(out) == len(batch) == 32
    for (name, _, _), o in zip(batch, out, strict=True):
        assert len(o.outputs) == CASES[name].get("n", 1), (mode, name)
        for c in o.outputs:
            assert c.token_ids, (mode, name)
            if name == "stop":
                assert "return b" not in c.text and "\n\n" not in c.text, (mode, c.text)
            else:
                assert len(c.token_ids) == MAX_TOKENS, (mode, name, len(c.token_ids))
            if name == "logprobs":
                assert len(c.logprobs) == len(c.token_ids) and all(len(p) >= 3 for p in c.logprobs)
    for extra in REFUSED_WITH_DRAFTS.values():
        for t in (0.0, 1.0):
            if mode == "none" or _params(t, **extra).min_p == 0 and not _params(t, **extra).logit_bias:
                # greedy drops min_p: nothing left to refuse
                assert llm.generate(PROMPTS[0], _params(t, **extra), use_tqdm=False)[0].outputs[0].token_ids
            else:
                with pytest.raises(VLLMValidationError, match="not yet supported with speculative decoding"):
                    llm.generate(PROMPTS[0], _params(t, **extra), use_tqdm=False)
    with pytest.raises(VLLMValidationError, match="n must be 1 when using greedy sampling"):
        _params(0.0, n=3)  # refused as the request is made, before any engine sees it
    # the engine still serves, and greedy output is the target's alone (the no-drafter engine's, run first)
    greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], _params(0.0), use_tqdm=False)]
    if mode == "none":
        GREEDY["none"] = greedy
    assert greedy == GREEDY.get("none", greedy), mode  # (a run of one mode alone has nothing to compare with)


def test_seeded_sample_is_reproducible(engine) -> None:
    """vLLM's promise for ``seed``: the same request gives the same text, alone twice and inside a batch whose
    prefill is chunked (the fix leaves a generator where vLLM's rewind would). With D-Cut a seeded sampled request
    is decoded plainly unless it asks for drafts (``dcut.speculation``): its text is the target's alone."""
    from dcut.speculation import EXTRA_ARG

    mode, llm = engine
    alone = [llm.generate(PROMPTS[5], _params(1.0, seed=7), use_tqdm=False)[0].outputs[0].token_ids
             for _ in range(2)]
    assert alone[0] == alone[1], mode
    seeds = [7 if i == 5 else 100 + i for i in range(32)]
    batch = llm.generate(PROMPTS * 4, [_params(1.0, seed=s) for s in seeds], use_tqdm=False)
    assert batch[13].outputs[0].token_ids != alone[0]  # the same prompt, another seed: the checks have power
    assert batch[5].outputs[0].token_ids == alone[0], mode
    if mode == "none":
        SEEDED["none"] = alone[0]
    elif mode in ("full", "joint") and "none" in SEEDED:
        assert alone[0] == SEEDED["none"], mode
        capped = _params(1.0, seed=7, extra_args={EXTRA_ARG: 7})  # asks for drafts: still served, still sampled
        assert len(llm.generate(PROMPTS[5], capped, use_tqdm=False)[0].outputs[0].token_ids) == MAX_TOKENS

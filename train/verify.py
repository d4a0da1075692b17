"""Load a target/drafter pair in vLLM (CPU), check greedy output with DFlash equals without, and
read the acceptance metrics. Run as a script (vLLM needs the ``__main__`` guard):

    python -m train.verify --target models/dense --drafter models/dense-dflash \
        --prompts models/heldout_prompts.jsonl --num-prompts 16 --max-tokens 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from dcut.prompts import load_prompts


def _environment() -> None:
    from dcut.settings import engine_env

    for key, value in engine_env(kv_cache_gib=1).items():
        os.environ.setdefault(key, value)


def check_engine(target: str, drafter: str | None = None, k: int = 15, max_num_seqs: int = 8, eager: bool = True,
         **extra):
    """An engine for the checks, through the project's one engine-argument builder, without D-Cut: the target alone
    (``none``) without a drafter, else vLLM's own speculation (every draft verified, vLLM's acceptance metrics)."""
    from vllm import LLM

    from dcut.settings import EngineSettings
    from dcut.vllm.engine import engine_kwargs

    settings = EngineSettings(model=target, draft=drafter, method="dflash" if drafter else "none",
                              num_speculative_tokens=k, max_num_seqs=max_num_seqs, max_model_len=1024,
                              enforce_eager=eager, dcut=None)
    return LLM(**engine_kwargs(settings), **extra)


def _metrics(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = list(m.values) if hasattr(m, "values") else getattr(m, "value", None)
    return out


def _delta(after: dict, before: dict) -> dict:
    d = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, list):
            d[k] = [x - (b[i] if b else 0) for i, x in enumerate(v)]
        elif v is not None:
            d[k] = v - (b or 0)
    return d


def run_verify(target: str, drafter: str | None, prompts: list[str], max_tokens: int, k: int,
               max_num_seqs: int = 8, ignore_eos: bool = True) -> dict:
    """``ignore_eos``: every output runs to ``max_tokens`` (steady-state acceptance); False stops at EOS, as a
    reasoning pair's answers end (its texts are returned to be scored)."""
    _environment()
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    res: dict = {"target": target, "drafter": drafter, "num_prompts": len(prompts), "max_tokens": max_tokens}
    t0 = time.time()
    llm = check_engine(target, max_num_seqs=max_num_seqs, disable_log_stats=False)
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    res["none_seconds"] = round(time.time() - t0, 1)  # the target alone: no speculation (none)
    del llm
    import gc

    gc.collect()
    if drafter is None:
        res["outputs"] = [list(b) for b in base]
        return res
    t0 = time.time()
    llm = check_engine(target, drafter, k, max_num_seqs=max_num_seqs, disable_log_stats=False)
    before = _metrics(llm)
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    m = _delta(_metrics(llm), before)
    res["spec_seconds"] = round(time.time() - t0, 1)
    res["identical"] = [list(a) == list(b) for a, b in zip(base, spec, strict=True)]
    res["all_identical"] = all(res["identical"])
    drafts = m.get("vllm:spec_decode_num_drafts") or 0
    per_pos = m.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    accepted = m.get("vllm:spec_decode_num_accepted_tokens") or 0
    res["num_drafts"] = drafts
    res["num_draft_tokens"] = m.get("vllm:spec_decode_num_draft_tokens")
    res["num_accepted_tokens"] = accepted
    res["acceptance_per_pos"] = [round(x / drafts, 4) if drafts else 0.0 for x in per_pos]
    res["mean_accepted_per_step"] = round(accepted / drafts, 4) if drafts else 0.0
    res["sample_text"] = llm.get_tokenizer().decode(spec[0][:64])
    if not ignore_eos:
        res["texts"] = [llm.get_tokenizer().decode(s, skip_special_tokens=True) for s in spec]
        res["generated_tokens"] = [len(s) for s in spec]
    return res


def generate_greedy_vllm(target: str, tokens_npy: str, n: int, prompt_len: int, total_len: int, seed: int,
                         out_npy: str) -> None:
    """Self-distillation data with vLLM (much faster than HF generate on CPU): real-text prompts
    of prompt_len tokens from the training split, continued greedily to total_len tokens."""
    _environment()
    import numpy as np
    from vllm import SamplingParams

    tokens = np.load(tokens_npy, mmap_mode="r")
    rng = np.random.default_rng([seed, 777])
    starts = rng.integers(0, len(tokens) - prompt_len - 1, size=n)
    prompts = [{"prompt_token_ids": [int(t) for t in tokens[s:s + prompt_len]]} for s in starts]
    llm = check_engine(target, max_num_seqs=64)
    sp = SamplingParams(temperature=0.0, max_tokens=total_len - prompt_len, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    seqs = [list(p["prompt_token_ids"]) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    np.save(out_npy, np.asarray([q[:total_len] for q in seqs], dtype=np.uint16))


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "generate":
        g = argparse.ArgumentParser()
        g.add_argument("cmd")
        for a in ("--target", "--tokens", "--out"):
            g.add_argument(a, required=True)
        for a in ("--n", "--prompt-len", "--total-len", "--seed"):
            g.add_argument(a, type=int, required=True)
        a = g.parse_args()
        generate_greedy_vllm(a.target, a.tokens, a.n, a.prompt_len, a.total_len, a.seed, a.out)
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter")
    ap.add_argument("--prompts", required=True, help="jsonl with {'prompt': ...}")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=15)
    ap.add_argument("--stop-at-eos", action="store_true", help="stop outputs at EOS and return their texts")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    prompts = load_prompts(a.prompts)[: a.num_prompts]
    res = run_verify(a.target, a.drafter, prompts, a.max_tokens, a.num_speculative_tokens,
                     ignore_eos=not a.stop_at_eos)
    res.pop("outputs", None)
    text = json.dumps(res, indent=2)
    print("VERIFY_RESULT " + json.dumps(res))
    if a.json:
        with open(a.json, "w") as fh:
            fh.write(text + "\n")
    return 0 if res.get("all_identical", True) else 1


if __name__ == "__main__":
    sys.exit(main())


def offline_acceptance(target, drafter, tokenizer, prompts: list[str], max_tokens: int) -> dict:
    """Exact PyTorch simulation of vLLM's greedy DFlash loop (no vLLM): greedy-decode with the
    target, then replay the steps: draft a block at anchor p (context = tokens < p), accept the
    leading drafts equal to the target's greedy tokens, next anchor = p + accepted + 1."""
    import torch

    from train import models as M

    block = drafter.dspec.block_size
    per_pos = [0] * (block - 1)
    steps = 0
    accepted_total = 0
    target.eval()
    drafter.eval()
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer.encode(prompt).ids
            x = torch.tensor([ids])
            out = target.generate(x, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens,
                                  pad_token_id=4, eos_token_id=None)
            seq = out[:, : len(ids) + max_tokens]
            _, aux = M.target_aux_hidden(target, seq, drafter.dspec.target_layer_ids)
            end = seq.shape[1]
            p = len(ids)
            while p < end - 1:
                a = torch.tensor([[p]])
                dl = M.drafter_logits(drafter, target, aux, seq, a)[0, 0, 1:]
                drafts = dl.argmax(-1)
                truth = seq[0, p + 1: p + block]
                n = 0
                for i in range(min(len(truth), block - 1)):
                    if int(drafts[i]) != int(truth[i]):
                        break
                    n += 1
                for i in range(n):
                    per_pos[i] += 1
                accepted_total += n
                steps += 1
                p = p + n + 1
    return {"steps": steps, "acceptance_per_pos": [round(c / steps, 4) for c in per_pos] if steps else [],
            "mean_accepted_per_step": round(accepted_total / steps, 4) if steps else 0.0}

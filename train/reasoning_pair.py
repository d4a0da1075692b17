"""Stages of the embedded reasoning pair (SpecExit, issue 13): traces + tokenizer -> target -> DFlash drafter
-> the target's own greedy thinking -> signal head -> vLLM check. The target and drafter stages are the other
pairs' (`pipeline.stage_target`, `pipeline.stage_drafter`) run on this pair's data folder."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from dcut.specexit import SpecExitSettings
from train import command_line
from train import loop as L
from train import pipeline as P
from train import reasoning as R
from train import tokenizer as TK

TARGET, DRAFTER = "reasoning", "reasoning-dflash"
HELDOUT_FILE = "reasoning_heldout.jsonl"
CHAT_SHARE = 0.25  # share of training problems posed through the chat template (the chat route's prompts)
# SpecExit settings replayed offline on the held-out completions: the defaults (EWMA alpha 0.1) and a faster EWMA.
REPLAY_SETTINGS = {"alpha 0.1 (default)": SpecExitSettings(), "alpha 0.5": SpecExitSettings(alpha=0.5)}


def stage_data(out: Path, runs: Path, n_train: int, n_heldout: int, vocab_size: int = 512, seed: int = 0) -> dict:
    """Traces of training and held-out problems, the BPE trained on the training traces, token streams
    ``EOS prompt completion EOS ...`` under ``runs/data`` and the held-out problems (prompt + answer)."""
    meta_path = runs / "data" / "meta.json"
    if P._done(runs / "tokenizer") and meta_path.exists() and (out / HELDOUT_FILE).exists():
        return json.loads(meta_path.read_text())
    t0 = time.time()
    rng = random.Random(seed)
    splits = {"train": R.problems(n_train, seed, heldout=False), "heldout": R.problems(n_heldout, seed, heldout=True)}
    texts = {name: [(R.chat_prompt(p) if rng.random() < CHAT_SHARE else p.prompt) + R.make_trace(p, rng).text
                    for p in ps] for name, ps in splits.items()}
    tok = TK.train_tokenizer(texts["train"], vocab_size, added=(R.THINK_START, R.THINK_END, R.PARAGRAPH),
                             individual_digits=True)
    TK.save_hf_tokenizer(tok, runs / "tokenizer")
    (runs / "data").mkdir(parents=True, exist_ok=True)
    for name, split in texts.items():
        ids = [i for enc in tok.encode_batch(split) for i in (TK.EOS_ID, *enc.ids)]
        np.save(runs / "data" / f"{name}.npy", np.asarray(ids, dtype=np.uint16))
    with (out / HELDOUT_FILE).open("w") as fh:
        for p in splits["heldout"][:64]:
            fh.write(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n")
    meta = {"task": "addition", "digits": list(R.DIGITS), "train_problems": n_train, "heldout_problems": n_heldout,
            "heldout_percent": R.HELDOUT_PERCENT, "recheck_weights": list(R.RECHECK_WEIGHTS),
            "chat_share": CHAT_SHARE, "vocab_size": tok.get_vocab_size(),
            "think_start_id": tok.token_to_id(R.THINK_START), "think_end_id": tok.token_to_id(R.THINK_END),
            "paragraph_id": tok.token_to_id(R.PARAGRAPH), "settled_ids": tok.encode(R.SETTLED).ids,
            "train_tokens": int(np.load(runs / "data" / "train.npy", mmap_mode="r").shape[0]),
            "heldout_tokens": int(np.load(runs / "data" / "heldout.npy", mmap_mode="r").shape[0]),
            "seed": seed, "seconds": round(time.time() - t0, 1)}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    P._mark_done(runs / "tokenizer", meta)
    L.log("reasoning data: " + json.dumps(meta))
    return meta


def _ids(meta: dict) -> dict:
    """The token ids `reasoning.think_span` looks for."""
    return {k: meta[k] for k in ("think_start_id", "think_end_id", "settled_ids", "paragraph_id")}


@torch.no_grad()
def greedy_completions(target, prompts: list[list[int]], max_new_tokens: int, batch: int = 32) -> list[list[int]]:
    """The target's greedy completion of each prompt, up to and including its EOS (HF generate; prompts of one
    length share a batch, so nothing is padded)."""
    target.eval()
    out: list[list[int]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for n, rows in sorted(by_len.items()):
        for j in range(0, len(rows), batch):
            chunk = rows[j:j + batch]
            x = torch.tensor([prompts[i] for i in chunk])
            y = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=TK.EOS_ID, pad_token_id=TK.PAD_ID)[:, n:].tolist()
            for i, seq in zip(chunk, y, strict=True):
                out[i] = seq[:seq.index(TK.EOS_ID) + 1] if TK.EOS_ID in seq else seq
    return out


def completion_figures(prompt: list[int], completion: list[int], answer: str, tok, meta: dict) -> dict:
    """One greedy completion: right answer, generated tokens, and where its thinking settled."""
    span = R.think_span(prompt + completion, **_ids(meta))
    text = tok.decode(completion, skip_special_tokens=True)
    rec = {"correct": R.answer_of(text) == answer, "generated": len(completion), "closed": span is not None}
    if span is not None:
        n = len(prompt)
        rec.update(thinking=span.end - span.start, after_settled=n + len(completion) - span.settled,
                   perfect_exit=span.settled - n + (n + len(completion) - span.end))
    return rec


def summarise(records: list[dict]) -> dict:
    """Accuracy, mean generated tokens, and how much of the output comes after the settled point: the share a
    perfect exit (``</think>`` right after the sum is stated, then the answer) would save."""
    closed = [r for r in records if r["closed"]]
    generated = sum(r["generated"] for r in closed) or 1
    return {"problems": len(records), "accuracy": round(float(np.mean([r["correct"] for r in records])), 4),
            "closed_thinking": len(closed), "mean_generated_tokens": round(float(np.mean(
                [r["generated"] for r in records])), 1),
            "mean_thinking_tokens": round(float(np.mean([r["thinking"] for r in closed])), 1) if closed else None,
            "share_after_settled": round(sum(r["after_settled"] for r in closed) / generated, 4),
            "perfect_exit_saving": round(1 - sum(r["perfect_exit"] for r in closed) / generated, 4)}


def heldout_problems(out: Path) -> list[tuple[str, str]]:
    return [(r["prompt"], r["answer"]) for r in map(json.loads, (out / HELDOUT_FILE).read_text().splitlines())]


def stage_head(out: Path, runs: Path, meta: dict, n_train: int = 256, anchors: int = 48, max_new_tokens: int = 700,
               seed: int = 0) -> dict:
    """Greedy completions of training prompts (the head's data: what the drafter sees when serving) and of the
    held-out problems (the pair's accuracy and over-thinking, the head's metrics); then the signal head."""
    from train import models as M
    from train import specexit_head as H

    folder = out / DRAFTER
    info = json.loads((folder / ".done").read_text())
    if info.get("specexit"):
        return info
    target = P.load_target(out / TARGET)
    drafter = M.load_drafter(folder, M.spec_from_hf_config(target.config)).eval()
    tok = TK.load_tokenizer(out / TARGET)
    t0 = time.time()
    sets = {"train": [(p.prompt, p.answer) for p in R.problems(n_train, seed + 1, heldout=False)],
            "heldout": heldout_problems(out)}
    examples, figures, spans = {}, {}, {}
    for name, items in sets.items():
        prompts = [tok.encode(q).ids for q, _ in items]
        completions = greedy_completions(target, prompts, max_new_tokens)
        records = [completion_figures(p, c, a, tok, meta) for p, c, (_, a) in zip(prompts, completions, items,
                                                                                   strict=True)]
        figures[name] = summarise(records)
        L.log(f"reasoning greedy {name}: " + json.dumps(figures[name]))
        spans[name] = [(p + c, len(p), span) for p, c in zip(prompts, completions, strict=True)
                       if (span := R.think_span(p + c, **_ids(meta))) is not None]
        examples[name] = H.HeadExamples.cat([H.head_examples(target, drafter, ids, span, anchors, seed + i)
                                             for i, (ids, _, span) in enumerate(spans[name])])
    generation_s = time.time() - t0
    head = H.train_head(examples["train"], seed=seed)
    metrics = {name: H.head_metrics(head, ex) for name, ex in examples.items()}
    L.log("specexit head: " + json.dumps(metrics))
    texts = [tok.decode([i]) for i in range(tok.get_vocab_size())]
    replay = {label: H.replay_summary([(H.replay_exit(target, drafter, head, ids, n, span, texts, settings), n, span,
                                        len(ids)) for ids, n, span in spans["heldout"]])
              for label, settings in REPLAY_SETTINGS.items()}
    L.log("specexit replay: " + json.dumps(replay))
    trained_on = (f"drafter hidden states at draft slots 1..{drafter.dspec.block_size - 1} of {anchors} blocks per "
                  f"sequence anchored in the thinking of the target's greedy completions of {n_train} training "
                  "problems (widths as `loop.sample_widths`)")
    H.save_head(head, folder, {"think_start": R.THINK_START, "think_end": R.THINK_END,
                               "think_start_id": meta["think_start_id"], "think_end_id": meta["think_end_id"],
                               "trained_on": trained_on})
    info["specexit"] = {"greedy": figures, "head": metrics, "replay": replay, "trained_on": trained_on,
                        "anchors": anchors,
                        "generation_seconds": round(generation_s, 1), "seconds": round(time.time() - t0, 1),
                        "command": command_line()}
    P._mark_done(folder, info)
    return info

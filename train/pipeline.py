"""Stages of `python -m train`: data+tokenizer -> dense -> dense drafter -> moe -> moe drafter.

Each stage is skipped when its output folder is complete (``.done`` marker written last) and
resumes from its checkpoint under ``runs/`` otherwise.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from train import command_line
from train import data as D
from train import loop as L
from train import models as M
from train import tokenizer as TK

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DISTILL_PROMPT_LEN = 64  # real-text tokens before the target's greedy continuation, per distillation sequence


def _done(folder: Path) -> bool:
    return (folder / ".done").exists()


def _mark_done(folder: Path, info: dict) -> None:
    (folder / ".done").write_text(json.dumps(info, indent=2) + "\n")


def stage_tokenizer(out: Path, runs: Path, vocab_size: int = 4096, n_prompts: int = 64,
                    max_files: int | None = None) -> dict:
    """Train the tokenizer, tokenize both splits to runs/data/*.npy, write held-out prompts."""
    tok_dir = runs / "tokenizer"
    data_dir = runs / "data"
    meta_path = data_dir / "meta.json"
    if _done(tok_dir) and meta_path.exists() and (out / "heldout_prompts.jsonl").exists():
        return json.loads(meta_path.read_text())
    t0 = time.time()
    files = D.list_sources()
    if max_files:
        files = files[:max_files]
    train, held = D.split_sources(files)
    L.log(f"data: {len(files)} stdlib files from {D.stdlib_dir()}: {len(train)} train, {len(held)} held out")
    tok = TK.train_tokenizer([f.text for f in train], vocab_size=vocab_size)
    TK.save_hf_tokenizer(tok, tok_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, split in (("train", train), ("heldout", held)):
        ids: list[int] = []
        for enc in tok.encode_batch([f.text for f in split]):
            ids.append(TK.EOS_ID)
            ids.extend(enc.ids)
        np.save(data_dir / f"{name}.npy", np.asarray(ids, dtype=np.uint16))
    prompts = D.heldout_prompts(held, tok, n=n_prompts)
    D.write_prompts(out / "heldout_prompts.jsonl", prompts)
    meta = {
        "stdlib": _installation_relative(D.stdlib_dir()), "files": len(files), "train_files": len(train),
        "heldout_files": len(held), "heldout_percent": D.HELDOUT_PERCENT,
        "train_tokens": int(np.load(data_dir / "train.npy", mmap_mode="r").shape[0]),
        "heldout_tokens": int(np.load(data_dir / "heldout.npy", mmap_mode="r").shape[0]),
        "vocab_size": tok.get_vocab_size(), "fingerprint": D.corpus_fingerprint(files),
        "prompts": len(prompts), "seconds": round(time.time() - t0, 1),
    }
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    _mark_done(tok_dir, meta)
    L.log("data: " + json.dumps(meta))
    return meta


def load_tokens(runs: Path) -> tuple[np.ndarray, np.ndarray]:
    return np.load(runs / "data" / "train.npy"), np.load(runs / "data" / "heldout.npy")


def copy_tokenizer(runs: Path, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copy(runs / "tokenizer" / f, folder / f)


def stage_target(name: str, spec: M.TargetSpec, out: Path, runs: Path, budget: L.Budget, seed: int) -> dict:
    folder = out / name
    if _done(folder):
        return json.loads((folder / ".done").read_text())
    tokens, held = load_tokens(runs)
    t0 = time.time()
    model, state = L.train_target(spec, tokens, held, runs / name, budget, seed)
    if folder.exists():
        shutil.rmtree(folder)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(runs, folder)
    info = {"name": name, "spec": asdict(spec), "params": state["params"], "steps": state["step"],
            "train_seconds": round(state["elapsed"], 1), "wall_seconds": round(time.time() - t0, 1),
            "tokens_seen": state["step"] * budget.batch * budget.seq_len,
            "budget": asdict(budget), "seed": seed, "threads": torch.get_num_threads(), "command": command_line(),
            "history": state["history"], "eval": state.get("eval")}
    _mark_done(folder, info)
    return info


def load_target(folder: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    model.eval()
    return model


def stage_drafter(name: str, target_name: str, dspec: M.DrafterSpec, out: Path, runs: Path,
                  budget: L.Budget, seed: int, gamma: float = 7.0, blocks_per_seq: int = 32) -> dict:
    folder = out / name
    if _done(folder):
        return json.loads((folder / ".done").read_text())
    tokens, held = load_tokens(runs)
    target = load_target(out / target_name)
    t0 = time.time()
    drafter, state = L.train_drafter(target, dspec, tokens, held, runs / name, budget, seed, gamma=gamma,
                                      blocks_per_seq=blocks_per_seq)
    if folder.exists():
        shutil.rmtree(folder)
    M.save_drafter(drafter, folder)
    info = {"name": name, "target": target_name, "dspec": asdict(dspec), "params": state["params"],
            "steps": state["step"], "train_seconds": round(state["elapsed"], 1),
            "wall_seconds": round(time.time() - t0, 1), "gamma": gamma, "budget": asdict(budget),
            "blocks_per_seq": blocks_per_seq, "vary_width": state.get("vary_width", False),
            "threads": torch.get_num_threads(), "command": command_line(),
            "seed": seed, "history": state["history"], "eval": state.get("eval")}
    _mark_done(folder, info)
    return info


def distill_rounds(info: dict) -> list[dict]:
    """A drafter's distillation rounds, oldest first (records before rounds existed hold one dict)."""
    rounds = info.get("distill") or []
    return [rounds] if isinstance(rounds, dict) else rounds


def stage_drafter_distill(name: str, target_name: str, out: Path, runs: Path, budget: L.Budget, seed: int,
                          n_seqs: int = 256, gamma: float = 7.0, blocks_per_seq: int = 32,
                          greedy_share: float = 0.5) -> dict:
    """Fine-tune a trained drafter on a mix of real text and the target's own greedy continuations.

    One round per sequence length, each starting from the weights the previous one left: a second
    round on shorter sequences puts the anchors where a served request's first tokens are."""
    folder = out / name
    info = json.loads((folder / ".done").read_text())
    rounds = distill_rounds(info)
    if any(r["budget"]["seq_len"] == budget.seq_len for r in rounds):
        return info
    target = load_target(out / target_name)
    data = runs / f"{name}-greedy-{budget.seq_len}.npy"
    if not data.exists():
        t0 = time.time()
        import os
        import subprocess

        from dcut.settings import engine_env

        cmd = [sys.executable, "-m", "train.verify", "generate", "--target", str(out / target_name),
               "--tokens", str(runs / "data" / "train.npy"), "--out", str(data), "--n", str(n_seqs),
               "--prompt-len", str(DISTILL_PROMPT_LEN), "--total-len", str(budget.seq_len), "--seed", str(seed)]
        env = {**os.environ, **engine_env(kv_cache_gib=1)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if not data.exists():  # fall back to HF generate
            L.log(f"{name}: vLLM greedy generation failed (rc {proc.returncode}): {proc.stderr[-1500:]}")
            np.save(data, L.generate_greedy(target, load_tokens(runs)[0], n_seqs, budget.seq_len,
                                            prompt_len=DISTILL_PROMPT_LEN, seed=seed))
        L.log(f"{name}: {n_seqs} greedy sequences in {time.time() - t0:.0f}s")
    greedy = np.load(data)
    tokens, held = load_tokens(runs)
    init = M.load_drafter(folder, M.spec_from_hf_config(target.config))
    t0 = time.time()
    drafter, state = L.train_drafter(target, init.dspec, tokens, held, runs / f"{name}-distill-{budget.seq_len}",
                                     budget, seed, gamma=gamma, blocks_per_seq=blocks_per_seq, greedy=greedy,
                                     init=init, greedy_share=greedy_share)
    M.save_drafter(drafter, folder)
    info["distill"] = [*rounds, {
        "greedy_sequences": int(len(greedy)), "vary_width": state.get("vary_width", False),
        "greedy_share": greedy_share, "command": command_line(), "seed": seed, "steps": state["step"],
        "train_seconds": round(state["elapsed"], 1), "wall_seconds": round(time.time() - t0, 1),
        "budget": asdict(budget), "history": state["history"], "eval": state.get("eval")}]
    for stale in runs.glob(f"verify-{target_name}*.json"):  # measured with the drafter before this fine-tune
        stale.unlink()
    _mark_done(folder, info)
    return info


def _installation_relative(path: Path) -> str:
    """``path`` inside the Python installation as ``<python>/lib/python3.X`` (model cards are committed:
    no machine paths in them)."""
    try:
        return f"<python>/{path.relative_to(sys.base_prefix)}"
    except ValueError:
        return path.name


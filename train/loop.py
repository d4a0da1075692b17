"""Training loops (target LM and DFlash drafter) with time/step budgets and resumable checkpoints."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from train import models as M


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Budget:
    max_steps: int = 100_000
    time_s: float = 600.0
    seq_len: int = 512
    batch: int = 4
    lr: float = 1e-3
    warmup: int = 50
    ckpt_every_s: float = 120.0
    log_every: int = 20


def sample_batch(tokens: np.ndarray, batch: int, seq: int, seed: int, step: int) -> torch.Tensor:
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
    return torch.from_numpy(np.stack([tokens[s:s + seq].astype(np.int64) for s in starts]))


def eval_windows(tokens: np.ndarray, n: int, seq: int) -> torch.Tensor:
    """Fixed, evenly spaced windows (deterministic)."""
    starts = np.linspace(0, len(tokens) - seq - 1, n).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[s:s + seq].astype(np.int64) for s in starts]))


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _progress(total: int, initial: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, file=sys.stderr, mininterval=15,
                dynamic_ncols=False, ncols=110, unit="%")


def _run_loop(name, params, step_fn, run_dir: Path, budget: Budget, seed: int, state_extra: dict,
              model_for_ckpt, eval_fn=None):
    """Shared loop: AdamW, warmup+cosine, budget in steps and seconds, resumable."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = run_dir / "ckpt.pt"
    opt = torch.optim.AdamW(params, lr=budget.lr, betas=(0.9, 0.95), weight_decay=0.1)
    state = {"step": 0, "elapsed": 0.0, "history": [], **state_extra}
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        model_for_ckpt.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log(f"{name}: resumed from {ckpt} at step {state['step']} ({state['elapsed']:.0f}s elapsed)")

    def save():
        _atomic_save({"model": model_for_ckpt.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)

    def progress() -> float:
        return max(state["step"] / budget.max_steps, state["elapsed"] / budget.time_s)

    bar = _progress(100, int(100 * progress()), name)
    last_ckpt = time.time()
    t_seg = time.time()
    el0 = state["elapsed"]
    run_loss, run_n = 0.0, 0
    while progress() < 1.0:
        step = state["step"]
        lr = M.scheduled_lr(step, progress(), budget.lr, budget.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, extra = step_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        state["step"] = step + 1
        state["elapsed"] = el0 + (time.time() - t_seg)
        run_loss += loss.item()
        run_n += 1
        bar.update(max(0, min(100, int(100 * progress())) - bar.n))
        if state["step"] % budget.log_every == 0:
            rec = {"step": state["step"], "loss": run_loss / run_n, "lr": lr, "elapsed": round(state["elapsed"], 1),
                   **extra}
            state["history"].append(rec)
            bar.set_postfix(step=state["step"], loss=f"{rec['loss']:.3f}")
            log(f"{name}: " + json.dumps(rec))
            run_loss, run_n = 0.0, 0
        if time.time() - last_ckpt > budget.ckpt_every_s:
            save()
            last_ckpt = time.time()
    bar.close()
    if eval_fn is not None:
        state["eval"] = eval_fn()
        log(f"{name}: eval " + json.dumps(state["eval"]))
    save()
    return state


# ----------------------------------------------------------------------------------------------


def train_target(spec: M.TargetSpec, tokens: np.ndarray, heldout: np.ndarray, run_dir: Path,
                 budget: Budget, seed: int = 0):
    torch.manual_seed(seed)
    model = M.build_target(spec, seed)
    model.train()
    nparams = M.count_params(model)
    log(f"target[{spec.kind}]: {nparams / 1e6:.2f}M params, seq {budget.seq_len} x batch {budget.batch}")
    evb = eval_windows(heldout, 16, budget.seq_len)

    def step_fn(step):
        x = sample_batch(tokens, budget.batch, budget.seq_len + 1, seed, step)
        out = model(input_ids=x[:, :-1], use_cache=False)
        loss = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]).float(), x[:, 1:].reshape(-1))
        return loss, {}

    @torch.no_grad()
    def eval_fn():
        model.eval()
        losses = []
        for i in range(0, len(evb), 4):
            x = evb[i:i + 4]
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
            losses.append(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))))
        model.train()
        return {"heldout_loss": float(np.mean(losses))}

    state = _run_loop(f"target-{spec.kind}", [p for p in model.parameters() if p.requires_grad], step_fn,
                      run_dir, budget, seed, {"spec": asdict(spec), "params": nparams}, model, eval_fn)
    return model, state


def _drafter_batch_outputs(drafter, target, x, anchors, gamma, widths=None):
    """Loss, per-slot correctness [B, nb, K] and accepted drafts per block. With ``widths`` [B, nb]
    each block drafts only that many positions: its later slots count neither in the loss nor as
    accepted."""
    block = drafter.dspec.block_size
    with torch.no_grad():
        tlogits, aux = M.target_aux_hidden(target, x, drafter.dspec.target_layer_ids)
        am = tlogits.argmax(-1)  # [B, T] target's greedy next token at each position
    dl = M.drafter_logits(drafter, target, aux, x, anchors, widths)[:, :, 1:]  # [B, nb, block-1, V]
    idx = anchors[:, :, None] + torch.arange(block - 1)  # slot k predicts position a+k: argmax at a+k-1
    labels = torch.gather(am, 1, idx.view(x.shape[0], -1)).view_as(idx)
    w = M.position_weights(block, gamma).expand_as(labels)
    if widths is not None:
        w = w * (torch.arange(1, block) <= widths[..., None])
    ce = F.cross_entropy(dl.reshape(-1, dl.shape[-1]).float(), labels.reshape(-1), reduction="none").view_as(labels)
    loss = (ce * w).sum() / w.sum()
    correct = (dl.argmax(-1) == labels) & (w > 0)  # [B, nb, K]
    accepted = torch.cumprod(correct.int(), dim=-1).sum(-1).float()  # leading correct drafts per block
    return loss, correct, accepted


def sample_widths(batch: int, nb: int, block: int, seed: int, step: int, full_share: float = 0.5) -> torch.Tensor:
    """Drafted width per training block: the full block for ``full_share`` of blocks, otherwise
    uniform over 1..block-1 -- mode ``joint`` drafts any width, so every width is trained."""
    g = torch.Generator().manual_seed(seed * 1_000_033 + step)
    uniform = torch.randint(1, block, (batch, nb), generator=g)
    full = torch.rand(batch, nb, generator=g) < full_share
    return torch.where(full, torch.full_like(uniform, block - 1), uniform)


def sample_anchors(batch: int, T: int, nb: int, block: int, seed: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.stack([torch.randperm(T - block, generator=g)[:nb] + 1 for _ in range(batch)]).sort(-1).values


@torch.no_grad()
def generate_greedy(target, tokens: np.ndarray, n_seqs: int, total_len: int, prompt_len: int = 64,
                    batch: int = 16, seed: int = 0) -> np.ndarray:
    """Self-distillation data: real-text prompts continued by the target's own greedy decoding
    (the distribution the drafter meets at serving time, where acceptance is measured)."""
    target.eval()
    rng = np.random.default_rng([seed, 777])
    out = []
    bar = _progress(n_seqs, 0, "greedy-data")
    for i in range(0, n_seqs, batch):
        b = min(batch, n_seqs - i)
        starts = rng.integers(0, len(tokens) - prompt_len - 1, size=b)
        x = torch.from_numpy(np.stack([tokens[s:s + prompt_len].astype(np.int64) for s in starts]))
        y = target.generate(x, max_new_tokens=total_len - prompt_len, min_new_tokens=total_len - prompt_len,
                            do_sample=False, pad_token_id=4, attention_mask=torch.ones_like(x))
        out.append(y[:, :total_len].numpy().astype(np.uint16))
        bar.update(b)
    bar.close()
    return np.concatenate(out)


def train_drafter(target, dspec: M.DrafterSpec, tokens: np.ndarray, heldout: np.ndarray, run_dir: Path,
                  budget: Budget, seed: int = 0, blocks_per_seq: int = 16, gamma: float = 7.0,
                  greedy: np.ndarray | None = None, greedy_share: float = 0.5, init=None, vary_width: bool = True):
    """Train (or, with ``init``, fine-tune) a DFlash drafter against the frozen target. With ``greedy``
    (sequences from `generate_greedy`), a ``greedy_share`` of batches comes from those sequences;
    with ``vary_width`` each block drafts a random width (`sample_widths`). Evaluation is at full width."""
    torch.manual_seed(seed + 1)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tspec = M.spec_from_hf_config(target.config)
    drafter = M.DFlashDrafter(tspec, dspec)
    if init is not None:
        drafter.load_state_dict(init.state_dict())
    drafter.train()
    nparams = M.count_params(drafter)
    log(f"drafter: {nparams / 1e6:.2f}M trainable params, layers {dspec.num_hidden_layers}, "
        f"block {dspec.block_size}, target_layer_ids {dspec.target_layer_ids}")
    T = budget.seq_len
    evb = eval_windows(heldout, 8, T)
    if greedy is not None:  # also report on held-out greedy continuations (last rows, never trained on)
        n_ev = min(4, len(greedy) // 8)
        evb = torch.cat([evb, torch.from_numpy(greedy[len(greedy) - n_ev:, :T].astype(np.int64))])
        greedy = greedy[: len(greedy) - n_ev]

    def step_fn(step):
        rng = np.random.default_rng([seed, step, 1])
        if greedy is not None and rng.random() < greedy_share:
            rows = rng.integers(0, len(greedy), size=budget.batch)
            x = torch.from_numpy(greedy[rows, :T].astype(np.int64))
        else:
            x = sample_batch(tokens, budget.batch, T, seed, step)
        anchors = sample_anchors(budget.batch, T, blocks_per_seq, dspec.block_size, seed, step)
        widths = sample_widths(budget.batch, blocks_per_seq, dspec.block_size, seed, step) if vary_width else None
        loss, correct, accepted = _drafter_batch_outputs(drafter, target, x, anchors, gamma, widths)
        return loss, {"acc1": round(float(correct[..., 0].float().mean()), 3),
                      "tau": round(float(accepted.mean()), 3)}

    @torch.no_grad()
    def eval_fn():
        drafter.eval()
        corr, acc, losses = [], [], []
        for i in range(0, len(evb), 4):
            x = evb[i:i + 4]
            anchors = sample_anchors(x.shape[0], T, blocks_per_seq, dspec.block_size, 12345, i)
            loss, correct, accepted = _drafter_batch_outputs(drafter, target, x, anchors, gamma)
            corr.append(correct.float().reshape(-1, correct.shape[-1]))
            acc.append(accepted.reshape(-1))
            losses.append(float(loss))
        drafter.train()
        c = torch.cat(corr)
        a = torch.cat(acc)
        return {"heldout_loss": float(np.mean(losses)),
                "heldout_teacher_forced_acc_per_pos": [round(float(v), 3) for v in c.mean(0)],
                "heldout_mean_accepted_teacher_forced": round(float(a.mean()), 3)}

    state = _run_loop("drafter", [p for p in drafter.parameters() if p.requires_grad], step_fn, run_dir,
                      budget, seed, {"dspec": asdict(dspec), "params": nparams, "gamma": gamma,
                                                  "vary_width": vary_width}, drafter, eval_fn)
    return drafter, state

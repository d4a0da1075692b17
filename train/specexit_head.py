"""The SpecExit signal head (issue 13): a ``Linear(hidden, 3)`` on the frozen DFlash drafter's final-normed
hidden states -- the states vLLM's proposer samples drafts from, so serving reads the signals off the drafter
pass that already runs. Raw outputs ``[confidence logit, progress logit, log(remaining + 1)]``; serving
activates them with sigmoid, sigmoid, exp (`dcut.specexit.step_signals`), so ``exp`` of the third estimates
the thinking tokens left plus one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dcut.specexit import Smoother, SpecExitSettings, exit_index, step_signals, tail_of
from train import loop as L
from train import models as M
from train.reasoning import ThinkSpan

SIGNALS = ("confidence", "progress", "log_remaining")
HEAD_FILE, CONFIG_FILE = "specexit_head.safetensors", "specexit.json"


@dataclass(frozen=True)
class HeadExamples:
    """Drafter hidden states at draft slots whose position lies in the thinking, with that position's labels."""

    hidden: Tensor  # [N, H]
    labels: Tensor  # [N, 3]: confidence (0/1), progress (0..1), remaining tokens

    @staticmethod
    def cat(parts: list[HeadExamples]) -> HeadExamples:
        return HeadExamples(torch.cat([p.hidden for p in parts]), torch.cat([p.labels for p in parts]))


@torch.no_grad()
def head_examples(target, drafter: M.DFlashDrafter, ids: list[int], span: ThinkSpan, anchors: int,
                  seed: int) -> HeadExamples:
    """Up to ``anchors`` draft blocks anchored in one sequence's thinking (at the widths `loop.sample_widths`
    draws: mode ``joint`` drafts any width); slot k of a block anchored at a labels position a + k."""
    block = drafter.dspec.block_size
    x = torch.tensor([ids])
    _, aux = M.target_aux_hidden(target, x, drafter.dspec.target_layer_ids)
    g = torch.Generator().manual_seed(seed)
    first = span.start - 1  # slot 1 of a block anchored here drafts the first thinking token
    starts = first + torch.randperm(span.end - first, generator=g)[:anchors].sort().values
    widths = L.sample_widths(1, len(starts), block, seed, 0)
    hidden = M.drafter_hidden(drafter, target, aux, x, starts[None], widths)[0, :, 1:]  # [nb, block-1, H]
    slots = torch.arange(1, block)
    pos = starts[:, None] + slots
    keep = (pos >= span.start) & (pos <= span.end) & (slots <= widths[0, :, None])
    table = torch.tensor([lab for _, *lab in span.labels()], dtype=torch.float32)  # row i: position start + i
    return HeadExamples(hidden[keep], table[pos[keep] - span.start])


def head_loss(raw: Tensor, labels: Tensor) -> Tensor:
    """BCE on confidence and progress, Huber on log(remaining + 1) (the log that serving's exp inverts)."""
    return (F.binary_cross_entropy_with_logits(raw[:, 0], labels[:, 0])
            + F.binary_cross_entropy_with_logits(raw[:, 1], labels[:, 1])
            + F.huber_loss(raw[:, 2], torch.log1p(labels[:, 2])))


def train_head(data: HeadExamples, steps: int = 1500, lr: float = 1e-2, seed: int = 0) -> nn.Linear:
    """Full-batch Adam: the inputs are fixed (drafter frozen), so the head trains in seconds."""
    torch.manual_seed(seed)
    head = nn.Linear(data.hidden.shape[1], len(SIGNALS))
    with torch.no_grad():
        head.weight.mul_(0.1)
        head.bias.copy_(torch.tensor([0.0, 0.0, float(torch.log1p(data.labels[:, 2]).mean())]))
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = M.scheduled_lr(step, step / steps, lr, warmup=20)
        loss = head_loss(head(data.hidden), data.labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 500 == 0:
            L.log(f"specexit head: step {step + 1} loss {loss.item():.4f}")
    return head


def _auc(score: np.ndarray, positive: np.ndarray) -> float:
    """Probability that a random positive outranks a random negative (ties count half)."""
    neg = np.sort(score[~positive])
    pos = score[positive]
    below = (np.searchsorted(neg, pos, "left") + np.searchsorted(neg, pos, "right")) / 2
    return float(below.mean() / len(neg))


@torch.no_grad()
def head_metrics(head: nn.Linear, data: HeadExamples) -> dict:
    """Per draft slot, as serving activates them: confidence AUC / accuracy at 0.5 / precision and recall
    above 0.8 (the default exit threshold), progress MAE, remaining's median relative error."""
    raw = head(data.hidden)
    conf, prog = torch.sigmoid(raw[:, 0]).numpy(), torch.sigmoid(raw[:, 1]).numpy()
    remaining = torch.exp(raw[:, 2]).numpy() - 1.0
    settled = data.labels[:, 0].numpy() > 0.5
    true_rem = data.labels[:, 2].numpy()
    high = conf > 0.8
    return {"examples": len(conf), "settled_share": round(float(settled.mean()), 3),
            "confidence_auc": round(_auc(conf, settled), 4),
            "confidence_accuracy_at_0.5": round(float(((conf > 0.5) == settled).mean()), 4),
            "confidence_precision_above_0.8": round(float(settled[high].mean()) if high.any() else 0.0, 4),
            "confidence_recall_above_0.8": round(float(high[settled].mean()), 4),
            "progress_mae": round(float(np.abs(prog - data.labels[:, 1].numpy()).mean()), 4),
            "remaining_median_relative_error": round(float(np.median(np.abs(remaining - true_rem)
                                                                       / np.maximum(true_rem, 1.0))), 4),
            "remaining_median_abs_error_tokens": round(float(np.median(np.abs(remaining - true_rem))), 1)}


@torch.no_grad()
def replay_exit(target, drafter: M.DFlashDrafter, head: nn.Linear, ids: list[int], prompt_len: int, span: ThinkSpan,
                texts: list[str], settings: SpecExitSettings) -> int | None:
    """Where SpecExit would end the thinking of one greedy completion (the position of the last token kept before
    ``</think>``), or None: vLLM's greedy DFlash loop replayed with full-width drafts (as
    `verify.offline_acceptance`), the head's signals smoothed per step and `dcut.specexit.exit_index` applied
    to each step's accepted tokens and bonus token."""
    block = drafter.dspec.block_size
    x = torch.tensor([ids])
    _, aux = M.target_aux_hidden(target, x, drafter.dspec.target_layer_ids)
    smoother, tail, p, signals = Smoother(settings), "", prompt_len, None
    while p < span.end:
        hidden = M.drafter_hidden(drafter, target, aux, x, torch.tensor([[p]]))[0, 0, 1:]
        truth = x[0, p + 1:p + block]
        n = int(torch.cumprod((target.lm_head(hidden).argmax(-1)[:len(truth)] == truth).int(), 0).sum())
        thinking = span.start - 1 <= p
        if thinking:
            signals = smoother.update(step_signals(head(hidden)))
        accepted = [texts[t] for t in ids[p + 1:p + n + 2]]
        i = exit_index(accepted, thinking, signals, settings, tail)
        if i is not None:
            return p + 1 + i
        tail = tail_of(tail + "".join(accepted), settings)
        p += n + 1
    return None


def replay_summary(exits: list[tuple[int | None, int, ThinkSpan, int]]) -> dict:
    """``exits``: (exit position, prompt length, span, sequence length) per completion -> generated tokens with
    and without the exit (an exit keeps the answer after ``</think>`` as the greedy completion has it) and how
    many exits came before the settled point (where the answer may change)."""
    plain = sum(n - prompt for _, prompt, _, n in exits)
    kept = sum(n - prompt if at is None else at + 1 - prompt + n - span.end for at, prompt, span, n in exits)
    return {"completions": len(exits), "exits": sum(at is not None for at, *_ in exits),
            "exits_before_settled": sum(at is not None and at + 1 < span.settled for at, _, span, _ in exits),
            "generated_no_exit": plain, "generated_with_exit": kept, "saving": round(1 - kept / plain, 4)}


def save_head(head: nn.Linear, folder: Path, config: dict) -> None:
    """``specexit_head.safetensors`` (``weight`` [3, H], ``bias`` [3], float32) and ``specexit.json`` beside the
    drafter, plus ``model.safetensors.index.json`` naming the drafter's own file: vLLM loads every
    ``*.safetensors`` of a folder without an index, and would take the head for drafter weights."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    index = {"metadata": {"total_size": (folder / "model.safetensors").stat().st_size},
             "weight_map": dict.fromkeys(names, "model.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    save_file({"weight": head.weight.detach().float().contiguous(), "bias": head.bias.detach().float().contiguous()},
              str(folder / HEAD_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps({"signals": list(SIGNALS), "hidden_size": head.in_features,
                                                  **config}, indent=2) + "\n")

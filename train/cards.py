"""Model cards (README.md) for the embedded models, from the stage records and vLLM checks."""

from __future__ import annotations

import json
from pathlib import Path

from train import reasoning as R
from train.data import LICENCE
from train.pipeline import DISTILL_PROMPT_LEN, distill_rounds


def _calibration_section(runs: Path, target: str) -> str:
    """Reliability of the drafter's confidence per position (`python -m train calibration`), or how to measure it."""
    path = runs / f"calibration-{target}.json"
    if not path.exists():
        return "**Calibration / reliability:** not measured yet (`python -m train calibration <pair>`).\n"
    rec = json.loads(path.read_text())

    def row(values: list) -> str:
        return ", ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in values)

    return (
        f"**Calibration / reliability** (measured with `{rec['command']}`: full-width verification, greedy, "
        f"bs {rec['batch_size']}, {rec['max_tokens']} tokens, held-out prompts; every draft verified, so every "
        "reached position is observed):\n\n"
        f"- observations per position 1..{len(rec['observations'])}: {row(rec['observations'])}\n"
        f"- observed conditional acceptance per position: {row(rec['acceptance_rate'])}\n"
        f"- expected calibration error of the raw confidence per position: {row(rec['ece_raw'])}\n"
        "- ECE after D-Cut's online calibration (each prediction scored before its outcome is counted): "
        f"{row(rec['ece_calibrated'])}\n"
    )


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e6


def _loss_line(info: dict) -> str:
    hist = info.get("history") or []
    first = hist[0]["loss"] if hist else float("nan")
    last = hist[-1]["loss"] if hist else float("nan")
    return f"training loss {first:.3f} (step {hist[0]['step'] if hist else 0}) → {last:.3f} (step {info['steps']})"


def _data_section(meta: dict) -> str:
    return (
        "## Data and licence\n\n"
        f"Python {meta.get('python', '3.11')} standard-library source (`{meta['stdlib']}`; excluding tests, "
        "site-packages, encodings, lib2to3, pydoc_data, turtledemo, ensurepip), "
        f"{meta['files']} files split by a hash of their path: {meta['train_files']} training files "
        f"({meta['train_tokens']:,} tokens), {meta['heldout_files']} held-out files ({meta['heldout_tokens']:,} "
        "tokens) that no model saw; `models/heldout_prompts.jsonl` holds prompts cut from held-out functions.\n\n"
        f"Licence of the training data: {LICENCE}. The weights are derived from that text.\n\n"
        f"Tokenizer: byte-level BPE (`tokenizers`), vocabulary {meta['vocab_size']}, trained on the training split; "
        "special tokens `<|endoftext|>` (0, bos/eos), `<|im_start|>` (1), `<|im_end|>` (2), `<|mask|>` (3, DFlash "
        "mask token), `<|pad|>` (4); a ChatML-style chat template is in `tokenizer_config.json`.\n"
    )


def _acceptance_section(ver: dict | None) -> str:
    if not ver:
        return "## Speculative decoding in vLLM\n\n_Not measured yet._\n"
    per = ver.get("acceptance_per_pos", [])
    rows = " | ".join(str(i + 1) for i in range(len(per)))
    vals = " | ".join(f"{v:.3f}" for v in per)
    off = ver.get("offline") or {}
    lines = [
        "## Speculative decoding in vLLM (measured)\n",
        f"Command: `{ver.get('command', '')}`\n",
        f"vLLM 0.32 (CPU), dtype float32, greedy, {ver['num_prompts']} held-out prompts × "
        f"{'up to ' if 'texts' in ver else ''}{ver['max_tokens']} tokens{' (until EOS)' if 'texts' in ver else ''}, "
        "DFlash with 15 speculative tokens (block 16). Greedy output with DFlash identical to "
        f"without: **{ver.get('all_identical')}**.\n",
        f"Mean accepted drafts per step: **{ver['mean_accepted_per_step']:.3f}** "
        f"({ver['num_accepted_tokens']} accepted of {ver['num_draft_tokens']} drafted over {ver['num_drafts']} "
        "steps).\n",
        "Acceptance rate per draft position (fraction of steps whose draft k was accepted):\n",
        f"| k | {rows} |\n|" + "---|" * (len(per) + 1) + f"\n| rate | {vals} |\n",
    ]
    if off:
        lines.append(
            f"PyTorch replay of the same loop (`train.verify.offline_acceptance`): mean accepted "
            f"{off.get('mean_accepted_per_step')} over {off.get('steps')} steps.\n")
    return "\n".join(lines)


def _width_line(info: dict) -> str:
    if not (info.get("vary_width") or any(r.get("vary_width") for r in distill_rounds(info))):
        return ""
    return (" Drafted width varied per block as mode `joint` varies it per step: half the blocks at full "
            "width, the rest uniform over 1..15, each block holding only its `1 + width` slots (`sample_widths`).")


def _share(distill: dict) -> float:
    """Share of distillation batches from greedy sequences (older records stored 1-in-N)."""
    return distill.get("greedy_share") or 1 / distill.get("greedy_every", 2)


def _distill_line(info: dict) -> str:
    return "".join(_round_line(dd, again=i > 0) for i, dd in enumerate(distill_rounds(info)))


def _round_line(dd: dict, again: bool) -> str:
    ev = dd.get("eval") or {}
    cmd = f" (`{dd['command']}`)" if dd.get("command") else ""
    seq_len = dd["budget"]["seq_len"]
    return (
        f"\nThen fine-tuned{' again' if again else ''}{cmd} on the target's own greedy continuations: "
        f"{dd['greedy_sequences']} sequences of {seq_len} tokens ({DISTILL_PROMPT_LEN}-token real-text prompt + "
        f"{seq_len - DISTILL_PROMPT_LEN} greedy tokens), {_share(dd):.0%} of batches from them, the others "
        f"real text; {dd['steps']} steps, peak lr {dd['budget']['lr']}, {dd['train_seconds'] / 60:.1f} min; "
        f"held-out (real text + unseen greedy sequences) weighted loss {ev.get('heldout_loss', float('nan')):.3f}, "
        f"teacher-forced mean accepted length {ev.get('heldout_mean_accepted_teacher_forced', 'n/a')}.\n"
    )


def target_card(folder: Path, info: dict, meta: dict, ver: dict | None, command: str, calibration: str) -> str:
    spec = info["spec"]
    kind = spec["kind"]
    arch = "Qwen3ForCausalLM" if kind == "dense" else "Qwen3MoeForCausalLM"
    moe = (f", {spec['num_experts']} experts, top-{spec['num_experts_per_tok']}, expert intermediate "
           f"{spec['moe_intermediate_size']}" if kind == "moe" else f", MLP intermediate {spec['intermediate_size']}")
    ev = info.get("eval") or {}
    return f"""# dcut-serve embedded {kind} target: `{folder.name}`

A small code language model trained from scratch on this machine (2-core CPU, no model hub), an
embedded {kind} target of dcut-serve. It writes Python-looking code; it is not a useful assistant.

## Architecture

`{arch}`: hidden {spec['hidden_size']}, {spec['num_hidden_layers']} layers, {spec['num_attention_heads']} heads,
{spec['num_key_value_heads']} KV heads, head_dim {spec['head_dim']}{moe}, vocabulary {spec['vocab_size']},
max positions {spec['max_position_embeddings']}, RoPE θ {spec['rope_theta']:g}, tied embeddings.
{info['params']:,} parameters; weights stored in bfloat16 ({_size_mb(folder):.1f} MB); run it in float32 on
CPU (`dtype="float32"`: bf16 is slower on AVX2).
Drafter: `models/{folder.name}-dflash` (DFlash, block 16).

{_data_section(meta)}
## Training

Command: `{command}` (seed {info['seed']}).
{info['steps']} steps of {info['budget']['batch']} × {info['budget']['seq_len']} tokens
({info['tokens_seen']:,} tokens), AdamW (β 0.9/0.95, wd 0.1), peak lr {info['budget']['lr']}, warmup + cosine,
fp32 on {info.get('threads', 1)} CPU thread(s) of a shared 2-core machine,
{info['train_seconds'] / 60:.1f} min.
{_loss_line(info)}; held-out loss {ev.get('heldout_loss', float('nan')):.3f} nats/token.
{info.get('note', '')}
Quality: heavily undertrained ({info.get('threads', 1)} CPU thread(s) of a 2-core machine shared with other work,
about {info['tokens_seen'] / meta['train_tokens']:.1f} epoch); greedy output soon falls into repetition loops, which is
also part of why drafts get accepted.

{_acceptance_section(ver)}
{calibration}"""


def drafter_card(folder: Path, info: dict, meta: dict, ver: dict | None, command: str, calibration: str) -> str:
    d = info["dspec"]
    ev = info.get("eval") or {}
    return f"""# dcut-serve embedded DFlash drafter: `{folder.name}`

DFlash block-diffusion drafter for `models/{info['target']}`, in the format vLLM 0.32's
`speculative_config={{"method": "dflash", ...}}` loads (`DFlashDraftModel`, `qwen3_dflash.py`).

## Architecture

{d['num_hidden_layers']} Qwen3 decoder layers (non-causal attention), MLP intermediate {d['intermediate_size']},
`fc` projecting the concatenated outputs of target layers {d['target_layer_ids']} (before the final norm) to the
hidden size, then `hidden_norm`; context K/V come from that projection through each draft layer's
k/v projections. Block size {d['block_size']} (`[anchor, <|mask|> × {d['block_size'] - 1}]`), mask token id 3.
Embeddings and LM head are the target's (not stored here). {info['params']:,} trainable parameters,
{_size_mb(folder):.1f} MB in bfloat16.

{_data_section(meta)}
## Training

Command: `{command}` (seed {info['seed']}).
Target frozen. Per sequence of {info['budget']['seq_len']} tokens, random anchor positions; each block sees the
target features strictly before its anchor and itself bidirectionally; slot k predicts the *target's greedy
(argmax) token* at position anchor + k (teacher-forced on the training text), cross-entropy weighted by
exp(-(k-1)/{info['gamma']:g}).{_width_line(info)}
{info['steps']} steps, batch {info['budget']['batch']}, peak lr {info['budget']['lr']},
{info.get('blocks_per_seq', 16)} blocks per sequence, {info['train_seconds'] / 60:.1f} min on
{info.get('threads', 1)} CPU thread(s) of a shared 2-core machine.
{_loss_line(info)}; held-out weighted loss {ev.get('heldout_loss', float('nan')):.3f}; held-out teacher-forced
mean accepted length {ev.get('heldout_mean_accepted_teacher_forced', 'n/a')}.
{_distill_line(info)}
{_acceptance_section(ver)}
{calibration}"""


def _regime(runs: Path, target: str) -> str:
    """The pair's cost-regime section (`python -m train regime`), or nothing before it is measured."""
    from train.regime import regime_section

    path = runs / f"regime-{target}.json"
    if not path.exists():
        return ""
    rec = json.loads(path.read_text())
    rows = {int(bs): {**r, "draft_ms": {int(w): v for w, v in r["draft_ms"].items()}} for bs, r in rec["rows"].items()}
    return "\n" + regime_section(rows, {int(w): a for w, a in rec["acceptance"].items()}, rec["source"])


def write_cards(out: Path, runs: Path, pair: tuple[str, str], command: str) -> None:
    meta = json.loads((runs / "data" / "meta.json").read_text())
    ver_path = runs / f"verify-{pair[0]}.json"
    ver = json.loads(ver_path.read_text()) if ver_path.exists() else None
    regime = _regime(runs, pair[0])
    tgt, drf = out / pair[0], out / pair[1]
    calibration = _calibration_section(runs, pair[0])
    if (tgt / ".done").exists():
        info = json.loads((tgt / ".done").read_text())
        card = target_card(tgt, info, meta, ver, info.get("command") or command, calibration)
        (tgt / "README.md").write_text(card + regime)
    if (drf / ".done").exists():
        info = json.loads((drf / ".done").read_text())
        card = drafter_card(drf, info, meta, ver, info.get("command") or command, calibration)
        (drf / "README.md").write_text(card + regime)


def _reasoning_data(meta: dict) -> str:
    return (
        "## Data\n\n"
        "Synthetic, generated by `train/reasoning.py` (no external data): `What is A + B?` with A, B of "
        f"{meta['digits'][0]}-{meta['digits'][1]} digits, completed by `<think>` paragraphs that add column by "
        "column, state the sum (`So the sum is S.`: "
        "the settled point), then re-check it `n` times (`Check k: ...`, restating known numbers only) with "
        f"P(n = 0..12) ∝ {meta['recheck_weights']}, so greedy decoding re-checks 10 times (stopping after check k "
        "is likelier than going on only at k = 10), then `The answer is S.` `</think>` and the answer, then "
        f"`<|endoftext|>`; {R.EARLY_EXIT_SHARE:.0%} of traces instead close the thinking right after the paragraph "
        "break that follows the sum or one of the checks (what SpecExit's forced `</think>` looks like: without "
        f"them an earlier target answered only 39% right after an exit). {meta['train_problems']:,} training "
        f"problems ({meta['train_tokens']:,} tokens, "
        f"{meta['chat_share']:.0%} posed through the chat template), held-out problems split off by a hash of "
        f"the problem ({meta['heldout_percent']}%); `models/reasoning_heldout.jsonl` holds 64 of them with answers.\n\n"
        f"Tokenizer: byte-level BPE, vocabulary {meta['vocab_size']}, one token per digit; special tokens as the "
        "other pairs (`<|endoftext|>` 0, `<|im_start|>` 1, `<|im_end|>` 2, `<|mask|>` 3, `<|pad|>` 4); "
        f"`<think>` ({meta['think_start_id']}), `</think>` ({meta['think_end_id']}) and the paragraph break "
        f"`\\n\\n` ({meta['paragraph_id']}) are single added tokens that are *not* special (they stay in decoded "
        "text, and a paragraph always ends on one token: where SpecExit may cut).\n"
    )


def _greedy_section(figures: dict, ver: dict | None) -> str:
    g = figures["heldout"]
    lines = ["## Greedy reasoning (measured)\n",
             f"HF `generate`, greedy, until EOS, {g['problems']} held-out problems (`models/reasoning_heldout.jsonl`): "
             f"accuracy **{g['accuracy']:.1%}**, {g['closed_thinking']} closed their thinking, mean generated tokens "
             f"**{g['mean_generated_tokens']}**, mean thinking tokens {g['mean_thinking_tokens']}; "
             f"**{g['share_after_settled']:.1%}** of generated tokens come after the settled point, and a perfect "
             f"exit (`</think>` right after `So the sum is S.`) would save **{g['perfect_exit_saving']:.1%}**. "
             f"On training problems: accuracy {figures['train']['accuracy']:.1%}, "
             f"{figures['train']['share_after_settled']:.1%} after the settled point.\n"]
    if ver and "accuracy" in ver:
        lines.append(f"In vLLM with the DFlash drafter (below), {ver['num_prompts']} held-out problems: accuracy "
                     f"{ver['accuracy']:.1%}, mean generated tokens {ver['mean_generated_tokens']:.1f}.\n")
    return "\n".join(lines)


def _head_section(spec: dict) -> str:
    h, t = spec["head"]["heldout"], spec["head"]["train"]
    return (
        "## SpecExit signal head\n\n"
        "`specexit_head.safetensors`: `weight` [3, hidden], `bias` [3] (float32), a `Linear` on the drafter's "
        "final-normed hidden states (what the target's `lm_head` reads to draft); raw outputs `[confidence "
        "logit, progress logit, log(remaining + 1)]`, activated with sigmoid, sigmoid, exp "
        "(`dcut.specexit.step_signals`); `specexit.json` names them and the think tokens. Trained with the "
        f"drafter frozen on {spec['trained_on']}; labels per position p in the thinking: confidence = p is at or "
        "after the settled point, progress = share of the thinking before p, remaining = tokens to `</think>`; "
        "BCE, BCE and Huber on log(remaining + 1).\n\n"
        "| per draft slot | held-out | training |\n|---|---|---|\n"
        f"| examples (settled share) | {h['examples']:,} ({h['settled_share']:.0%}) | {t['examples']:,} "
        f"({t['settled_share']:.0%}) |\n"
        f"| confidence AUC | {h['confidence_auc']:.3f} | {t['confidence_auc']:.3f} |\n"
        f"| confidence accuracy at 0.5 | {h['confidence_accuracy_at_0.5']:.3f} | "
        f"{t['confidence_accuracy_at_0.5']:.3f} |\n"
        f"| precision / recall of confidence > 0.8 | {h['confidence_precision_above_0.8']:.3f} / "
        f"{h['confidence_recall_above_0.8']:.3f} | {t['confidence_precision_above_0.8']:.3f} / "
        f"{t['confidence_recall_above_0.8']:.3f} |\n"
        f"| progress MAE | {h['progress_mae']:.3f} | {t['progress_mae']:.3f} |\n"
        f"| remaining: median relative error (median abs. tokens) | {h['remaining_median_relative_error']:.3f} "
        f"({h['remaining_median_abs_error_tokens']}) | {t['remaining_median_relative_error']:.3f} "
        f"({t['remaining_median_abs_error_tokens']}) |\n\n"
        "Offline replay on the held-out greedy completions (`specexit_head.replay_exit`: vLLM's greedy DFlash "
        "loop at full width, the head's signals averaged per step and smoothed, `dcut.specexit.exit_index` on each "
        "step's accepted tokens; confidence > 0.8, progress > 0.3, remaining < 200):\n\n"
        "| EWMA | exits | exits before the settled point | generated tokens, no exit → with exit | "
        "saving |\n|---|---|---|---|---|\n"
        + "".join(f"| {label} | {r['exits']} / {r['completions']} | {r['exits_before_settled']} | "
                  f"{r['generated_no_exit']:,} → {r['generated_with_exit']:,} | {r['saving']:.1%} |\n"
                  for label, r in spec["replay"].items())
    )


def _reasoning_target_card(folder: Path, info: dict, meta: dict, figures: dict, ver: dict | None) -> str:
    spec, ev = info["spec"], info.get("eval") or {}
    return f"""# dcut-serve embedded reasoning target: `{folder.name}`

A small model that adds numbers with visible `<think> … </think>` reasoning and over-thinks in a checkable way:
after the sum is settled it keeps re-checking. The SpecExit pair (issue 13), trained from scratch on this
machine; its drafter with the SpecExit signal head is `models/{folder.name}-dflash`.

## Architecture

`Qwen3ForCausalLM`: hidden {spec['hidden_size']}, {spec['num_hidden_layers']} layers,
{spec['num_attention_heads']} heads, {spec['num_key_value_heads']} KV heads, head_dim {spec['head_dim']},
MLP intermediate {spec['intermediate_size']}, vocabulary {spec['vocab_size']}, max positions
{spec['max_position_embeddings']}, tied embeddings.
{info['params']:,} parameters; weights in bfloat16 ({_size_mb(folder):.1f} MB); run it in float32 on CPU.

{_reasoning_data(meta)}
## Training

Command: `{info['command']}` (seed {info['seed']}).
Next-token loss on the flat stream `<|endoftext|> prompt completion <|endoftext|> …` of training problems:
{info['steps']} steps of {info['budget']['batch']} × {info['budget']['seq_len']} tokens ({info['tokens_seen']:,}
tokens), AdamW, peak lr {info['budget']['lr']}, warmup + cosine, fp32 on {info.get('threads', 1)} CPU threads of
a shared 2-core machine, {info['train_seconds'] / 60:.1f} min. {_loss_line(info)}; held-out loss
{ev.get('heldout_loss', float('nan')):.3f} nats/token.

{_greedy_section(figures, ver)}
{_acceptance_section(ver)}"""


def _reasoning_drafter_card(folder: Path, info: dict, meta: dict, ver: dict | None) -> str:
    d, ev = info["dspec"], info.get("eval") or {}
    return f"""# dcut-serve embedded DFlash drafter with SpecExit head: `{folder.name}`

DFlash drafter for `models/{info['target']}` in the format vLLM 0.32's `"method": "dflash"` loads, plus the
SpecExit signal head (`specexit_head.safetensors`, `specexit.json`), which vLLM ignores.

## Architecture

{d['num_hidden_layers']} Qwen3 decoder layer(s) (non-causal attention), MLP intermediate {d['intermediate_size']},
`fc` over the outputs of target layers {d['target_layer_ids']}, block size {d['block_size']}, mask token id 3;
embeddings and LM head are the target's. {info['params']:,} trainable parameters, {_size_mb(folder):.1f} MB
(drafter in bfloat16, head in float32).

{_reasoning_data(meta)}
## Training

Command: `{info['command']}` (seed {info['seed']}). Target frozen; slot k learns the target's greedy token at
anchor + k on the training stream, cross-entropy weighted by exp(-(k-1)/{info['gamma']:g}).{_width_line(info)}
{info['steps']} steps, batch {info['budget']['batch']} × {info['budget']['seq_len']}, peak lr {info['budget']['lr']},
{info['train_seconds'] / 60:.1f} min. {_loss_line(info)}; held-out weighted loss
{ev.get('heldout_loss', float('nan')):.3f}; held-out teacher-forced mean accepted length
{ev.get('heldout_mean_accepted_teacher_forced', 'n/a')}.

{_head_section(info['specexit'])}
{_greedy_section(info['specexit']['greedy'], ver)}
{_acceptance_section(ver)}"""


def write_reasoning_cards(out: Path, runs: Path, target: str, drafter: str, ver: dict | None) -> None:
    """Both cards of the reasoning pair, once its drafter holds the signal head."""
    meta = json.loads((runs / "data" / "meta.json").read_text())
    tinfo = json.loads((out / target / ".done").read_text())
    dinfo = json.loads((out / drafter / ".done").read_text())
    figures = dinfo["specexit"]["greedy"]
    (out / target / "README.md").write_text(_reasoning_target_card(out / target, tinfo, meta, figures, ver))
    (out / drafter / "README.md").write_text(_reasoning_drafter_card(out / drafter, dinfo, meta, ver))

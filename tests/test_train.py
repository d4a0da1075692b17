"""Fast checks of the training code (`python -m train`): tiny slices, a few dozen steps, seconds each."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from train import data as D  # noqa: E402
from train import loop as L  # noqa: E402
from train import models as M  # noqa: E402
from train import tokenizer as TK  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, intermediate_size=128, max_position_embeddings=256)


@pytest.fixture(scope="module")
def files():
    return D.list_sources()


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a shared 2-core box two threads are several times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def corpus(files):
    assert len(files) > 100
    train, held = D.split_sources(files)
    assert held and train and not {f.rel for f in train} & {f.rel for f in held}
    small = [f.text for f in train if f.rel in {"textwrap.py", "bisect.py", "heapq.py", "shlex.py", "copy.py"}]
    tok = TK.train_tokenizer(small, vocab_size=512)
    ids = []
    for t in small:
        ids += [TK.EOS_ID] + tok.encode(t).ids
    return tok, np.asarray(ids, dtype=np.uint16), held


def test_split_is_deterministic(files):
    a, b = D.split_sources(files)
    a2, b2 = D.split_sources(list(reversed(files)))
    assert sorted(f.rel for f in b) == sorted(f.rel for f in b2)
    assert all(not f.rel.startswith(("test/", "site-packages/")) for f in a + b)


def test_tokenizer_specials_and_hf_files(corpus, tmp_path):
    tok, _, held = corpus
    assert [tok.token_to_id(s) for s in TK.SPECIAL_TOKENS] == list(range(5))
    TK.save_hf_tokenizer(tok, tmp_path)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.eos_token_id == TK.EOS_ID and hf.mask_token_id == TK.MASK_ID
    chat = hf.apply_chat_template([{"role": "user", "content": "def f():"}], tokenize=False,
                                  add_generation_prompt=True)
    assert chat == "<|im_start|>user\ndef f():<|im_end|>\n<|im_start|>assistant\n"
    text = "def f(x):\n    return x  # ok\n"
    assert hf.decode(hf(text)["input_ids"]) == text
    prompts = D.heldout_prompts(held[:3], tok, n=2, min_tokens=20, max_tokens=60)
    assert prompts and all(20 <= len(tok.encode(p).ids) <= 60 for p in prompts)


@pytest.fixture(scope="module")
def tiny_target(corpus, tmp_path_factory):
    _, ids, _ = corpus
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    spec = M.TargetSpec(kind="dense", **TINY)
    budget = L.Budget(max_steps=30, time_s=1e9, seq_len=64, batch=4, lr=3e-3, warmup=5, log_every=10)
    run_dir = tmp_path_factory.mktemp("target")
    model, state = L.train_target(spec, ids, ids, run_dir, budget, seed=0)
    torch.set_num_threads(n)
    return spec, budget, run_dir, model, state


def test_target_loss_decreases(corpus, tiny_target):
    _, ids, _ = corpus
    spec, budget, run_dir, _, state = tiny_target
    hist = state["history"]
    assert state["step"] == 30 and hist[-1]["loss"] < hist[0]["loss"] - 0.3
    assert state["eval"]["heldout_loss"] < 7.0
    # resumable: a finished checkpoint resumes without taking more steps
    _, state2 = L.train_target(spec, ids, ids, run_dir, budget, seed=0)
    assert state2["step"] == 30


def test_moe_target_saves_per_expert_names(tmp_path):
    spec = M.TargetSpec(kind="moe", **{**TINY, "vocab_size": 128}, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32)
    model = M.build_target(spec)
    model.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys
    assert "model.layers.0.mlp.gate.weight" in keys


def test_block_mask_semantics():
    m = M.block_attention_mask(torch.tensor([[3, 7]]), T=10, block=4)[0, 0]
    assert m.shape == (8, 18)
    assert m[0, :3].all() and not m[0, 3:10].any()  # block 0 sees context < 3
    assert m[5, :7].all() and not m[5, 7:10].any()  # block 1 sees context < 7
    assert m[1, 10:14].all() and not m[1, 14:].any()  # bidirectional within its own block only
    assert m[6, 14:].all() and not m[6, 10:14].any()


def test_drafter_trains_and_saves_vllm_format(corpus, tiny_target, tmp_path):
    _, ids, _ = corpus
    spec, _, _, target, _ = tiny_target
    dspec = M.DrafterSpec(num_hidden_layers=1, intermediate_size=96, block_size=8, target_layer_ids=[0, 1])
    db = L.Budget(max_steps=20, time_s=1e9, seq_len=64, batch=4, lr=3e-3, warmup=5, log_every=10)
    drafter, state = L.train_drafter(target, dspec, ids, ids, tmp_path / "d", db, seed=0, blocks_per_seq=4)
    assert state["history"][-1]["loss"] < state["history"][0]["loss"]
    assert len(state["eval"]["heldout_teacher_forced_acc_per_pos"]) == 7
    assert all(not p.requires_grad for p in target.parameters())
    M.save_drafter(drafter, tmp_path / "dflash")
    cfg = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"] == {"mask_token_id": TK.MASK_ID, "target_layer_ids": [0, 1]}
    assert cfg["num_hidden_layers"] == 1 and cfg["target_hidden_size"] == 64 and cfg["block_size"] == 8
    from safetensors import safe_open

    with safe_open(str(tmp_path / "dflash" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("fc.weight").shape == (64, 128)
    layer = {"input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj"}
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.0.{n}.weight" for n in layer}
    assert keys == expected  # no embed_tokens / lm_head: vLLM shares the target's
    back = M.load_drafter(tmp_path / "dflash", spec)
    x = torch.from_numpy(ids[:64].astype(np.int64))[None]
    with torch.no_grad():
        _, aux = M.target_aux_hidden(target, x, [0, 1])
        a = torch.tensor([[10, 30]])
        y1 = M.drafter_logits(drafter.eval(), target, aux, x, a)
        y2 = M.drafter_logits(back.eval(), target, aux, x, a)
    assert (y1.argmax(-1) == y2.argmax(-1)).float().mean() > 0.9  # bf16 round trip


def test_cli_parses_all():
    import argparse

    from train import cli as cmd

    p = argparse.ArgumentParser()
    cmd.configure(p)
    a = p.parse_args(["all", "--out", "m", "--seed", "1", "--dense-minutes", "3", "--pairs", "dense"])
    assert a.stage == "all" and a.dense_minutes == 3 and a.pairs == ["dense"] and a.seed == 1
    assert isinstance(cmd.HELP, str)


def test_distill_sequence_length_is_an_option_and_too_short_is_refused(tmp_path, capsys):
    import argparse

    from train import cli as cmd

    p = argparse.ArgumentParser()
    cmd.configure(p)
    assert p.parse_args(["deep-drafter-distill"]).seq_len == cmd.SEQ_LEN
    assert p.parse_args(["deep-drafter-distill", "--seq-len", "192"]).seq_len == 192
    assert cmd.main(["deep-drafter-distill", "--out", "models", "--runs", str(tmp_path), "--seq-len", "64"]) == 2
    assert "--seq-len must leave room" in capsys.readouterr().err


def _round(seq_len: int, command: str) -> dict:
    return {"greedy_sequences": 8, "vary_width": True, "greedy_share": 0.75, "command": command, "seed": 1,
            "steps": 10, "train_seconds": 60.0, "budget": {"seq_len": seq_len, "lr": 1e-3},
            "eval": {"heldout_loss": 2.5, "heldout_mean_accepted_teacher_forced": 3.1}}


def test_distill_rounds_read_single_records_and_skip_a_recorded_length(tmp_path):
    from train import pipeline as P

    first = _round(512, "first")
    assert P.distill_rounds({}) == []
    assert P.distill_rounds({"distill": first}) == [first]  # a record from before rounds existed
    assert P.distill_rounds({"distill": [first, _round(192, "second")]})[1]["command"] == "second"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".done").write_text(json.dumps({"distill": first}))
    budget = L.Budget(max_steps=1, time_s=1.0, seq_len=512, batch=2, lr=1e-3, warmup=1)
    # a round at a recorded length returns before loading the (here missing) target or training
    assert P.stage_drafter_distill("d", "no-target", tmp_path, tmp_path, budget, seed=0)["distill"] == first


def test_card_states_every_distill_round_and_the_measured_calibration(tmp_path):
    from train import cards as C

    text = C._distill_line({"distill": [_round(512, "cmd-a"), _round(192, "cmd-b")]})
    assert "Then fine-tuned (`cmd-a`)" in text and "Then fine-tuned again (`cmd-b`)" in text
    assert "sequences of 192 tokens (64-token real-text prompt + 128 greedy tokens)" in text
    assert "not measured yet" in C._calibration_section(tmp_path, "t")
    rec = {"command": "dcut generate --mode full", "batch_size": 16, "max_tokens": 128, "observations": [40, 20],
           "acceptance_rate": [0.5, 0.25], "ece_raw": [0.1, 0.3], "ece_calibrated": [0.05, 0.125]}
    (tmp_path / "calibration-t.json").write_text(json.dumps(rec))
    section = C._calibration_section(tmp_path, "t")
    assert "`dcut generate --mode full`" in section and "bs 16, 128 tokens" in section
    assert "position 1..2: 40, 20" in section and "acceptance per position: 0.50, 0.25" in section
    assert section.endswith("counted): 0.05, 0.12\n")


def test_block_mask_holds_only_the_drafted_width():
    m = M.block_attention_mask(torch.tensor([[3, 7]]), T=10, block=4, widths=torch.tensor([[1, 3]]))[0, 0]
    assert m[0, 10:12].all() and not m[0, 12:14].any()  # width 1: the anchor and one mask slot
    assert m[3, 10:12].all() and not m[3, 12:14].any()  # padding slots attend to the held slots only
    assert m[4, 14:18].all() and m[4, :7].all()  # full width: the whole block and its context


def test_sampled_widths_cover_every_width_and_weight_the_full_block():
    w = L.sample_widths(64, 32, 16, seed=0, step=3)
    assert w.min() >= 1 and w.max() == 15 and set(w.unique().tolist()) == set(range(1, 16))
    assert 0.45 < float((w == 15).float().mean()) < 0.62
    assert torch.equal(w, L.sample_widths(64, 32, 16, seed=0, step=3))


def test_short_widths_drop_later_slots_from_loss_and_acceptance(corpus, tiny_target):
    _, ids, _ = corpus
    spec, _, _, target, _ = tiny_target
    dspec = M.DrafterSpec(num_hidden_layers=1, intermediate_size=96, block_size=8, target_layer_ids=[0, 1])
    drafter = M.DFlashDrafter(spec, dspec)
    x = torch.from_numpy(ids[:64].astype(np.int64))[None]
    anchors = torch.tensor([[10, 30]])
    _, correct, accepted = L._drafter_batch_outputs(drafter, target, x, anchors, 7.0, torch.tensor([[2, 7]]))
    assert not correct[0, 0, 2:].any() and accepted[0, 0] <= 2

"""The embedded reasoning pair (issue 13): token-level signal labels, the tokenizer's think tokens, the shipped
SpecExit head."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from safetensors.torch import load_file

from train import reasoning as R
from train import specexit_head as H
from train.tokenizer import SPECIAL_TOKENS, load_tokenizer

TARGET, DRAFTER = Path("models/reasoning"), Path("models/reasoning-dflash")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TARGET)


def _ids(tok) -> dict:
    return {"think_start_id": tok.token_to_id(R.THINK_START), "think_end_id": tok.token_to_id(R.THINK_END),
            "settled_ids": tok.encode(R.SETTLED).ids, "paragraph_id": tok.token_to_id(R.PARAGRAPH)}


def test_labels_from_tokens_follow_the_trace(tok) -> None:
    rng = random.Random(0)
    for p in R.problems(20, seed=5, heldout=True):
        ids = tok.encode(p.prompt + R.make_trace(p, rng).text).ids + [0]
        span = R.think_span(ids, **_ids(tok))
        assert span is not None and ids[span.start - 1] == tok.token_to_id(R.THINK_START)
        assert ids[span.end] == tok.token_to_id(R.THINK_END)
        assert tok.decode(ids[span.start:span.settled]).endswith(f"So the sum is {p.answer}.\n\n")
        labels = span.labels()
        positions, conf, prog, rem = (list(c) for c in zip(*labels, strict=True))
        assert positions == list(range(span.start, span.end + 1))
        assert prog[0] == 0.0 and prog[-1] == 1.0 and all(a < b for a, b in zip(prog, prog[1:], strict=False))
        assert rem[-1] == 0.0 and all(a - b == 1.0 for a, b in zip(rem, rem[1:], strict=False))
        flip = conf.index(1.0)
        assert positions[flip] == span.settled and set(conf[:flip]) == {0.0} and set(conf[flip:]) == {1.0}


def test_think_span_needs_a_closed_thinking_and_a_stated_sum(tok) -> None:
    ids = tok.encode("What is 12 + 30?\n<think>\nAdd 12 and 30.\n\nSo the sum is 42.\n\nCheck 1: 42").ids
    assert R.think_span(ids, **_ids(tok)) is None  # never closed
    ids = tok.encode("What is 12 + 30?\n<think>\nAdd 12 and 30.\n\nThe answer is 42.\n</think>\n42").ids
    assert R.think_span(ids, **_ids(tok)) is None  # no settled paragraph


def test_think_tokens_are_single_and_not_special(tok) -> None:
    config = json.loads((TARGET / "tokenizer_config.json").read_text())
    added = {v["content"]: v for v in config["added_tokens_decoder"].values()}
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i and added[s]["special"]
    for s in (R.THINK_START, R.THINK_END, R.PARAGRAPH):
        assert len(tok.encode(s).ids) == 1 and not added[s]["special"]
    text = "<think>\nSo the sum is 1234.\n\n</think>\n1234"
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=True) == text  # what vLLM's detokenizer shows
    assert [tok.id_to_token(i) for i in tok.encode("1234").ids] == ["1", "2", "3", "4"]
    assert "chat_template" in config


def test_shipped_head_has_the_documented_shape(tok) -> None:
    tensors = load_file(str(DRAFTER / H.HEAD_FILE))
    config = json.loads((DRAFTER / H.CONFIG_FILE).read_text())
    hidden = json.loads((DRAFTER / "config.json").read_text())["hidden_size"]
    assert set(tensors) == {"weight", "bias"}
    assert tuple(tensors["weight"].shape) == (3, hidden) and tuple(tensors["bias"].shape) == (3,)
    assert all(str(t.dtype) == "torch.float32" for t in tensors.values())
    assert config["signals"] == ["confidence", "progress", "log_remaining"] and config["hidden_size"] == hidden
    assert config["think_start_id"] == tok.token_to_id(config["think_start"]) == tok.token_to_id(R.THINK_START)
    assert config["think_end_id"] == tok.token_to_id(config["think_end"]) == tok.token_to_id(R.THINK_END)

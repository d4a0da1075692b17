"""Byte-level BPE tokenizer trained reproducibly on the training split, saved as HF files."""

from __future__ import annotations

import json
from pathlib import Path

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END, MASK, PAD]  # ids 0..4 in this order
EOS_ID, IM_START_ID, IM_END_ID, MASK_ID, PAD_ID = range(5)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int = 4096, added: tuple[str, ...] = (),
                    individual_digits: bool = False):
    """Train a byte-level BPE tokenizer (deterministic for a given text list). ``added``: strings that are
    always one token and stay in decoded text (not special: vLLM's ``skip_special_tokens`` keeps them);
    ``individual_digits``: one token per digit (column arithmetic then sees each digit alone)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if individual_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    tok.add_tokens([AddedToken(a, special=False, normalized=False) for a in added])
    return tok


def save_hf_tokenizer(tok, folder: Path, model_max_length: int = 1024) -> None:
    """Write tokenizer.json + tokenizer_config.json (+ special_tokens_map.json) for PreTrainedTokenizerFast."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    added = {
        str(i): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": t.special}
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "mask_token": MASK,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    smap = {"bos_token": EOS, "eos_token": EOS, "pad_token": PAD, "mask_token": MASK,
            "additional_special_tokens": [IM_START, IM_END]}
    (folder / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n")


def load_tokenizer(folder: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))

"""Tiny random models built inside the tests: a Qwen3 target, a DFlash head and a draft model.

Random weights are enough to check losslessness (the verifier decides every token); the
draft model is a copy of the target so that drafts are actually accepted and cut.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, Qwen3Model

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
] * 20


def build_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def _config(vocab: int, layers: int, hidden: int = 128) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=0,
                       bos_token_id=0, pad_token_id=0)


def build_tiny_models(root: Path, seed: int = 0) -> dict[str, Path]:
    """Write target/, dflash/ and draft/ under ``root``; returns their paths."""
    torch.manual_seed(seed)
    paths = {name: root / name for name in ("target", "dflash", "draft")}
    fast = build_tokenizer(paths["target"])
    vocab = len(fast)
    target = Qwen3ForCausalLM(_config(vocab, 4)).eval()
    target.save_pretrained(paths["target"], safe_serialization=True)
    target.save_pretrained(paths["draft"], safe_serialization=True)
    fast.save_pretrained(paths["draft"])

    head_cfg = _config(vocab, 1)
    head = Qwen3Model(head_cfg)
    state = {k: v for k, v in head.state_dict().items() if "embed_tokens" not in k}
    layer_ids = [1, 3]
    state["fc.weight"] = torch.randn(head_cfg.hidden_size, head_cfg.hidden_size * len(layer_ids)) * 0.02
    state["hidden_norm.weight"] = torch.ones(head_cfg.hidden_size)
    paths["dflash"].mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, paths["dflash"] / "model.safetensors")
    cfg = head_cfg.to_dict()
    mask_id = fast.convert_tokens_to_ids("<|mask|>")
    cfg.update(architectures=["DFlashDraftModel"], model_type="qwen3", target_hidden_size=head_cfg.hidden_size,
               block_size=16, dflash_config={"mask_token_id": mask_id, "target_layer_ids": layer_ids})
    (paths["dflash"] / "config.json").write_text(json.dumps(cfg, indent=1))
    return paths

"""The embedded pairs the trainer builds: shapes and default time budgets of each target and its drafter."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dcut.settings import EMBEDDED_MODELS


@dataclass(frozen=True)
class Refine:
    """A second distillation round on shorter sequences (`<kind>-drafter-distill --seq-len`)."""

    minutes: float
    seq_len: int
    sequences: int
    seed: int  # not the first round's: other prompts for the greedy continuations
    greedy_share: float


@dataclass(frozen=True)
class Pair:
    """One embedded target and its DFlash drafter (folders: `dcut.settings.EMBEDDED_MODELS`): shapes and
    default time budgets (minutes)."""

    name: str
    target_shape: dict
    drafter_shape: dict
    target_minutes: float
    drafter_minutes: float
    distill_minutes: float
    greedy_share: float = 0.5  # share of distillation batches drawn from the target's greedy output
    distill_sequences: int = 128  # greedy sequences of the first distillation round
    refine: Refine | None = None

    @property
    def target(self) -> str:
        return Path(EMBEDDED_MODELS[self.name][0]).name

    @property
    def drafter(self) -> str:
        return Path(EMBEDDED_MODELS[self.name][1]).name


PAIRS = {
    "dense": Pair("dense", {"kind": "dense"},
                  {"num_hidden_layers": 2, "intermediate_size": 768, "target_layer_ids": [0, 1, 2, 3]},
                  20.0, 14.0, 8.0),
    # D-Cut's regime (issue 11): the target's forward, not the engine's per-step overhead, dominates
    # a `none` step (no speculation); a 1-layer drafter reading five target layers costs ~0.1 of the target per token.
    "deep": Pair("deep",
                 {"kind": "dense", "hidden_size": 384, "num_hidden_layers": 16, "num_attention_heads": 6,
                  "num_key_value_heads": 2, "intermediate_size": 1024},
                 {"num_hidden_layers": 1, "intermediate_size": 1024, "target_layer_ids": [1, 5, 9, 12, 15]},
                 40.0, 8.0, 30.0, greedy_share=0.75, distill_sequences=384,
                 refine=Refine(minutes=40.0, seq_len=192, sequences=1024, seed=1, greedy_share=0.75)),
    "moe": Pair("moe", {"kind": "moe"},
                {"num_hidden_layers": 2, "intermediate_size": 768, "target_layer_ids": [0, 1, 2, 3]},
                10.0, 7.0, 0.0),
}


SEQ_LEN = 512  # tokens per training sequence
REASONING_STAGES = ("data", "target", "drafter", "head", "verify")
# The reasoning target: the dense pair's shape with this task's vocabulary (set from the data stage).
REASONING_TARGET = {"kind": "dense", "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768}
REASONING_DRAFTER = {"num_hidden_layers": 1, "intermediate_size": 768, "target_layer_ids": [0, 1, 2, 3]}

"""The drafter's confidence in each token it drafts, kept from the logits it computes anyway.

Two wrappers of vLLM's shared drafter base (``SpecDecodeBaseProposer``, which DFlash, draft-model and EAGLE
proposers derive from): ``propose`` opens a ``DraftPass`` on the runner's hooks, ``_sample_draft_tokens`` adds
``log p(token)`` of each batch of tokens it samples. The drafter's outputs are unchanged. SpecExit's signal head
reads the same hidden states here (``dcut.vllm.specexit``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dcut.cut import log_confidence, log_confidence_of_probs
from dcut.vllm.draft_pass import DraftPass
from dcut.vllm.runner_hooks import drafter_hooks


def wrap_propose(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer.propose``: with D-Cut on, record
    the pass (``RunnerHooks.draft``) for the runner to read after drafting."""
    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        hooks = drafter_hooks(self)
        if hooks is None or hooks.dcut is None:  # (SpecExit alone needs only _sample_draft_tokens)
            return original(self, *args, **kwargs)
        record = hooks.draft = DraftPass()
        drafts = original(self, *args, **kwargs)
        record.finish(drafts)
        return drafts
    return propose


def wrap_sample_draft_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer._sample_draft_tokens``: run
    SpecExit's head on the drafter's hidden states; during a recorded pass, keep each token's log-probability."""
    def _sample_draft_tokens(self: Any, hidden_states: torch.Tensor, sampling_metadata: Any) -> Any:
        hooks = drafter_hooks(self)
        if hooks is not None and hooks.specexit is not None:
            hooks.specexit.raw = hooks.specexit.head(hidden_states)
        sink = None if hooks is None or hooks.draft is None else hooks.draft.sink
        if sink is None:
            return original(self, hidden_states, sampling_metadata)
        greedy = not self._enable_probabilistic_draft_probs or sampling_metadata.all_greedy
        if greedy and not self.use_local_argmax_reduction and not self.use_heterogeneous_vocab:
            # The same logits and argmax as vLLM's _greedy_sample; we also keep log p(token), without a float32
            # or log-probability copy of the [rows, vocab] logits (dcut.cut.log_confidence).
            logits = self.model.compute_logits(hidden_states)
            tokens = logits.argmax(dim=-1)
            sink.append(log_confidence(logits, tokens))
            return tokens, None
        tokens, probs = original(self, hidden_states, sampling_metadata)
        if probs is not None:  # sampled drafting: the probability of the sampled token
            sink.append(log_confidence_of_probs(probs, tokens))
        else:  # rare paths (local argmax / heterogeneous vocab): recompute the logits
            logits = self.model.compute_logits(hidden_states)
            if self.use_heterogeneous_vocab:
                logits = self.vocab_mapping.constrain_draft_logits(logits)
                tokens_in_draft_vocab = logits.argmax(dim=-1)
                sink.append(log_confidence(logits, tokens_in_draft_vocab))
            else:
                sink.append(log_confidence(logits, tokens))
        return tokens, probs
    return _sample_draft_tokens

"""SpecExit inside a vLLM model runner: signals from the drafter pass that already runs, the cut in the verifier.

One ``RunnerSpecExit`` lives on a model runner whose engine has ``{"specexit": {...}}`` in its
``additional_config``. The flow of one engine step, driven by ``dcut.vllm.step_hooks`` and ``dcut.vllm.confidence``:

1. ``GPUModelRunner._sample`` — after the rejection sampler: for each request that is thinking, if its smoothed
   signals pass and one of this step's accepted tokens ends a paragraph, the row of sampled tokens is cut after
   that token and ``</think>`` takes the next slot (as a rejected draft's place is taken by the target's own
   token). Everything downstream (the request's state, the drafter's next pass, the scheduler, the output)
   reads that row, so the cut is the only change: every token before it is the target's own.
2. ``SpecDecodeBaseProposer._sample_draft_tokens`` — the head (``specexit_head.safetensors`` in the drafter's
   folder) reads the drafter's final hidden states, the ones its LM head reads: three raw signals per draft.
3. ``GPUModelRunner.propose_draft_token_ids`` — each thinking request's signals, averaged over its drafts,
   update its smoother; the next step's cut uses them.

A request may override the engine's settings, or turn SpecExit off, through ``SamplingParams.extra_args
["specexit"]`` (a JSON object, or ``false``; the serving layer validates it). Per request the runner keeps what
the response's usage reports: tokens spent thinking, whether and where it exited, and the head's estimate of
the thinking tokens the exit saved.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dcut.specexit import Smoother, SpecExitSettings, exit_index, step_signals, tail_of, with_overrides
from dcut.vllm.engine import additional_settings

logger = logging.getLogger("vllm.dcut")

HEAD_FILE = "specexit_head.safetensors"
PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID: a slot of the sampled row with no token
KEPT_RECORDS = 4096  # finished requests whose usage can still be read


def engine_settings(vllm_config: Any) -> SpecExitSettings | None:
    """The validated engine-wide SpecExit settings, or None when SpecExit is not asked for."""
    return additional_settings(vllm_config, "specexit", SpecExitSettings)


def request_settings(engine: SpecExitSettings, extra_args: dict | None) -> SpecExitSettings | None:
    """A request's settings: the engine's, overridden by ``extra_args["specexit"]`` (a JSON object, its JSON
    text, or false/0/"false" for off)."""
    raw = (extra_args or {}).get("specexit")
    if raw is None:
        return engine
    if isinstance(raw, str):
        raw = json.loads(raw) if raw.strip().startswith("{") else raw.strip().lower() not in ("false", "0", "off")
    if raw is False or raw == 0:
        return None
    if raw is True or raw == 1:
        return engine
    return with_overrides(engine, raw)


@dataclass
class RequestUsage:
    """What a request's response reports about its thinking."""

    reasoning_tokens: int = 0  # generated while thinking, ``</think>`` included
    exited: bool = False  # SpecExit ended the thinking
    exit_at: int | None = None  # thinking tokens before the forced ``</think>``
    predicted_saved: float | None = None  # the head's remaining-tokens estimate at the exit
    signals: dict[str, float] | None = None  # smoothed, at the exit


@dataclass
class _Request:
    smoother: Smoother | None  # None: off for this request
    thinking: bool
    tail: str = ""
    pending_exit: bool = False  # a paragraph ended on the last slot of a step: ``</think>`` comes first next
    usage: RequestUsage = field(default_factory=RequestUsage)

    @property
    def settings(self) -> SpecExitSettings | None:
        return self.smoother.settings if self.smoother else None


@dataclass
class Totals:
    requests: int = 0
    exits: int = 0
    reasoning_tokens: int = 0
    predicted_saved_tokens: float = 0.0


class RunnerSpecExit:
    """SpecExit attached to one model runner: the head, the token texts, per-request state."""

    def __init__(self, settings: SpecExitSettings, weight: Tensor, bias: Tensor, texts: list[str],
                 think_start_id: int, think_end_id: int) -> None:
        if weight.ndim != 2 or weight.shape[0] != 3 or bias.shape != (3,):
            raise ValueError(f"SpecExit head must be weight [3, hidden] and bias [3], got "
                             f"{tuple(weight.shape)} and {tuple(bias.shape)}")
        self.settings = settings
        self.weight, self.bias = weight.float(), bias.float()
        self.texts = texts
        self.think_start_id, self.think_end_id = think_start_id, think_end_id
        self.requests: dict[str, _Request] = {}
        self.finished: OrderedDict[str, RequestUsage] = OrderedDict()
        self.totals = Totals()
        self.raw: Tensor | None = None  # the head's output for the last drafter pass [rows, 3]

    @classmethod
    def from_config(cls, vllm_config: Any) -> RunnerSpecExit | None:
        """Built at model load; fails loudly when SpecExit is asked for and the pair cannot do it."""
        settings = engine_settings(vllm_config)
        if settings is None:
            return None
        from safetensors.torch import load_file
        from transformers import AutoTokenizer

        spec = vllm_config.speculative_config
        if spec is None or spec.method != "dflash":
            raise ValueError("SpecExit reads the signals of a DFlash drafter: set speculative method 'dflash'")
        head_path = Path(spec.draft_model_config.model) / HEAD_FILE
        if not head_path.exists():
            raise ValueError(f"SpecExit needs a signal head: {head_path} not found (train the reasoning pair)")
        head = load_file(str(head_path))
        tok = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        ids = {t: tok.convert_tokens_to_ids(t) for t in (settings.think_start, settings.think_end)}
        for t, i in ids.items():
            if i is None or i == tok.unk_token_id or tok.decode([i]) != t:
                raise ValueError(f"SpecExit: {t!r} is not one token of this model's tokenizer")
        texts = [tok.decode([i]) for i in range(len(tok))]
        logger.info("SpecExit on: %s", settings.model_dump_json())
        return cls(settings, head["weight"], head["bias"], texts, ids[settings.think_start],
                   ids[settings.think_end])

    # -- per request --------------------------------------------------------------------------
    def _request(self, req_id: str, cached: Any) -> _Request:
        state = self.requests.get(req_id)
        if state is None:
            params = getattr(cached, "sampling_params", None)
            settings = request_settings(self.settings, getattr(params, "extra_args", None))
            ids = list(getattr(cached, "prompt_token_ids", None) or []) + list(getattr(cached, "output_token_ids",
                                                                                      []) or [])
            state = self.requests[req_id] = _Request(Smoother(settings) if settings else None,
                                                     thinking=_thinking_after(ids, self.think_start_id,
                                                                              self.think_end_id))
            self.totals.requests += settings is not None
        return state

    def drop(self, req_ids: set[str]) -> None:
        """Requests that finished: keep their usage (bounded) for the serving layer to read."""
        for req_id in req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None and state.settings is not None:
                self.finished[req_id] = state.usage
                while len(self.finished) > KEPT_RECORDS:
                    self.finished.popitem(last=False)

    def usage(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Usage of the requests whose engine id starts with ``prefix`` (vLLM appends a suffix to the id the
        serving layer gave), finished or running."""
        found = {r: u for r, u in self.finished.items() if r.startswith(prefix)}
        found |= {r: s.usage for r, s in self.requests.items() if r.startswith(prefix) and s.settings is not None}
        return {r: asdict(u) for r, u in found.items()}

    def stats(self) -> dict[str, Any]:
        return {"settings": self.settings.model_dump(mode="json"), **asdict(self.totals),
                "thinking_now": sum(1 for s in self.requests.values() if s.settings and s.thinking)}

    # -- signals --------------------------------------------------------------------------------
    def head(self, hidden: Tensor) -> Tensor:
        """Raw signals [rows, 3] (confidence and progress logits, log remaining) of the drafter's states."""
        return torch.nn.functional.linear(hidden.float(), self.weight.to(hidden.device),
                                          self.bias.to(hidden.device))

    def on_drafted(self, req_ids: list[str], cached: dict[str, Any], width: int) -> None:
        """Fold the last drafter pass's signals into each thinking request's smoother."""
        raw, self.raw = self.raw, None
        if raw is None or width <= 0 or raw.shape[0] != len(req_ids) * width:
            return
        rows = raw.detach().to("cpu").view(len(req_ids), width, 3)
        for i, req_id in enumerate(req_ids):
            state = self._request(req_id, cached.get(req_id))
            if state.smoother is not None and state.thinking:
                state.smoother.update(step_signals(rows[i]))

    # -- the cut --------------------------------------------------------------------------------
    def apply(self, req_ids: list[str], cached: dict[str, Any], sampled: Tensor) -> Tensor:
        """Cut each thinking request's sampled row where the exit rule says, in place (a device tensor is
        edited on the host and copied back). Rows: [requests, slots], ``PLACEHOLDER`` after the last token."""
        host = sampled.to("cpu") if sampled.device.type != "cpu" else sampled
        changed = False
        for i, req_id in enumerate(req_ids):
            state = self._request(req_id, cached.get(req_id))
            if state.settings is None:
                continue
            row = host[i]
            n = int((row != PLACEHOLDER).sum())
            if n == 0:
                continue
            if state.pending_exit and state.thinking:
                row[0], row[1:] = self.think_end_id, PLACEHOLDER
                self._exited(state)
                changed, n = True, 1
            else:
                tokens = row[:n].tolist()
                value = state.smoother.value if state.smoother else None
                cut = exit_index([self.texts[t] for t in tokens], state.thinking, value, state.settings, state.tail)
                if cut is not None and cut + 1 < row.shape[0]:
                    row[cut + 1], row[cut + 2:] = self.think_end_id, PLACEHOLDER
                    self._exited(state)
                    changed, n = True, cut + 2
                elif cut is not None:  # the paragraph ended on the row's last slot: no room for </think>
                    state.pending_exit = True
            self._advance(state, row[:n].tolist())
        if changed and host is not sampled:
            sampled.copy_(host)
        return sampled

    def _exited(self, state: _Request) -> None:
        value = state.smoother.value
        u = state.usage
        u.exited = True  # exit_at is set in _advance, where the forced </think> is counted
        u.predicted_saved = round(value.remaining, 1)
        u.signals = {"confidence": round(value.confidence, 4), "progress": round(value.progress, 4),
                     "remaining": round(value.remaining, 1)}
        state.pending_exit = False
        self.totals.exits += 1
        self.totals.predicted_saved_tokens += value.remaining

    def _advance(self, state: _Request, tokens: list[int]) -> None:
        """Follow the request through this step's kept tokens: thinking or not, tokens spent thinking, the
        text a split string may continue."""
        text = state.tail
        for t in tokens:
            if state.thinking:
                state.usage.reasoning_tokens += 1
                self.totals.reasoning_tokens += 1
                if t == self.think_end_id:
                    state.thinking = False
                    if state.usage.exited:
                        state.usage.exit_at = state.usage.reasoning_tokens - 1
            elif t == self.think_start_id and not state.usage.reasoning_tokens:
                state.thinking = True
            text += self.texts[t]
        state.tail = tail_of(text, state.settings)


def _thinking_after(ids: list[int], start: int, end: int) -> bool:
    """Inside the thinking after these tokens: the last ``<think>`` is not closed."""
    last_start = max((i for i, t in enumerate(ids) if t == start), default=-1)
    last_end = max((i for i, t in enumerate(ids) if t == end), default=-1)
    return last_start > last_end

"""SpecExit: end over-long reasoning early from the drafter's own signals (engine-agnostic part).

A small linear head on the drafter's hidden states predicts, per draft position, three signals: **confidence**
that cutting the thinking now still gives the right answer (sigmoid), **progress** through the thinking
(sigmoid) and **remaining** thinking tokens (exp). A step's signals are their mean over its draft positions,
smoothed across steps per request (``Smoother``: EWMA, momentum, or the mean of a window). Only while a request
is thinking, and only at an accepted token that ends a paragraph (``split_strings``), if every configured
signal passes its threshold, the step's accepted tokens are cut after that token and ``think_end`` takes the
bonus token's place (``exit_index``); the answer then decodes as usual. Everything before the cut is the
target's own output.

What is here: the settings, the head's activations, smoothing and the exit rule, all pure. The head is trained
with the reasoning pair (``python -m train reasoning``, `train/`); ``dcut.vllm.specexit`` applies the rule inside vLLM.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:  # the settings are read by the ingress and the controller too, which need no torch
    from torch import Tensor


class SpecExitSettings(BaseModel):
    """When to end the thinking; a threshold set to None is not checked. Defaults: the source paper's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    confidence_min: float | None = Field(0.8, ge=0.0, le=1.0, description="Exit only above this confidence.")
    progress_min: float | None = Field(0.3, ge=0.0, le=1.0, description="Exit only past this share of thinking.")
    remaining_max: float | None = Field(200.0, gt=0.0, description="Exit only under this many tokens left.")
    smoothing: Literal["ewma", "momentum", "window"] = "ewma"
    alpha: float = Field(0.1, gt=0.0, le=1.0, description="EWMA / momentum weight of the newest step.")
    window: int = Field(8, ge=1, description="Steps averaged by smoothing 'window'.")
    split_strings: tuple[str, ...] = Field(("\n\n",), min_length=1,
                                           description="An accepted token ending with one of these ends a "
                                           "paragraph: the only places an exit may happen.")
    think_start: str = "<think>"
    think_end: str = "</think>"

    @model_validator(mode="after")
    def _something_to_check(self) -> SpecExitSettings:
        if self.confidence_min is None and self.progress_min is None and self.remaining_max is None:
            raise ValueError("SpecExit needs at least one of confidence_min, progress_min, remaining_max")
        if any(not s for s in self.split_strings):
            raise ValueError("split_strings must not contain an empty string")
        return self


def with_overrides(settings: SpecExitSettings, overrides: dict) -> SpecExitSettings:
    """A request's settings: ``settings`` with some of its fields replaced, validated as a whole."""
    return SpecExitSettings.model_validate({**settings.model_dump(), **overrides})


@dataclass(frozen=True)
class Signals:
    confidence: float
    progress: float
    remaining: float


def step_signals(raw: Tensor) -> Signals:
    """A step's signals from the head's raw outputs ``[positions, 3]`` (confidence, progress, log-remaining
    logits): activated per position, then averaged over the step's draft positions."""
    if raw.ndim != 2 or raw.shape[-1] != 3 or raw.shape[0] == 0:
        raise ValueError(f"expected raw signals [positions >= 1, 3], got {tuple(raw.shape)}")
    raw = raw.double()
    conf = raw[:, 0].sigmoid().mean()
    prog = raw[:, 1].sigmoid().mean()
    remaining = raw[:, 2].clamp(max=30.0).exp().mean()
    return Signals(float(conf), float(prog), float(remaining))


class Smoother:
    """One request's smoothed signals across its steps.

    ``ewma``: ``s = a x + (1 - a) s``; ``momentum``: the EWMA plus the EWMA of its own step-to-step change (it
    leads a trend instead of lagging it); ``window``: the mean of the last ``window`` steps. The first step is
    taken as it is."""

    def __init__(self, settings: SpecExitSettings) -> None:
        self.settings = settings
        self.value: Signals | None = None
        self._trend = (0.0, 0.0, 0.0)
        self._recent: deque[Signals] = deque(maxlen=settings.window)

    def update(self, x: Signals) -> Signals:
        s, a = self.settings, self.settings.alpha
        new = (x.confidence, x.progress, x.remaining)
        if s.smoothing == "window":
            self._recent.append(x)
            n = len(self._recent)
            self.value = Signals(*(sum(getattr(r, f) for r in self._recent) / n
                                   for f in ("confidence", "progress", "remaining")))
            return self.value
        if self.value is None:
            self.value = x
            return x
        old = (self.value.confidence, self.value.progress, self.value.remaining)
        ewma = tuple(a * n + (1 - a) * o for n, o in zip(new, old, strict=True))
        if s.smoothing == "momentum":
            self._trend = tuple(a * (e - o) + (1 - a) * t for e, o, t in zip(ewma, old, self._trend, strict=True))
            ewma = tuple(e + t for e, t in zip(ewma, self._trend, strict=True))
        self.value = Signals(*ewma)
        return self.value


def passes(signals: Signals, settings: SpecExitSettings) -> bool:
    """Every configured threshold met."""
    return ((settings.confidence_min is None or signals.confidence > settings.confidence_min)
            and (settings.progress_min is None or signals.progress > settings.progress_min)
            and (settings.remaining_max is None or signals.remaining < settings.remaining_max))


def exit_index(accepted_texts: Sequence[str], thinking: bool, signals: Signals | None,
               settings: SpecExitSettings, tail: str = "") -> int | None:
    """Where to end the thinking in this step: keep ``accepted_texts[:i + 1]`` and emit ``think_end`` next, or
    None to carry on. ``accepted_texts``: the step's accepted tokens, decoded, in order; ``thinking``: the
    request is inside its thinking section; ``signals``: its smoothed signals; ``tail``: the text just before
    this step (a split string may span tokens: ``"\n"`` then ``"\n"``). The cut is at the first accepted token
    that ends a paragraph, so the thinking always ends on a paragraph boundary."""
    if not thinking or signals is None or not passes(signals, settings):
        return None
    text = tail
    for i, piece in enumerate(accepted_texts):
        if settings.think_end in piece:  # the target ended the thinking itself
            return None
        text += piece
        if text.endswith(settings.split_strings):
            return i
    return None


def tail_of(text: str, settings: SpecExitSettings) -> str:
    """The end of ``text`` that a later token could complete a split string with."""
    keep = max(len(s) for s in settings.split_strings) - 1
    return text[-keep:] if keep else ""

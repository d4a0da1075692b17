"""TensorRT-LLM ``draft_len_schedule``: a static batch size -> draft length table, with its acceptance gate."""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np

from dcut.replay.anchors.full_verification import verify_all
from dcut.replay.costs import CostModel
from dcut.replay.policy import Verified, nearest_width


class TRTLLMSchedule:
    """TensorRT-LLM ``draft_len_schedule``: a static batch size -> draft length table, 0 above its last key.

    Sources read: NVIDIA/TensorRT-LLM PR #10860 ("[TRTLLM-10319][feat] Dynamic draft length on spec
    decode one-model path", merged 2026-03-13) and ``tensorrt_llm/_torch/speculative/utils.py``
    ``get_draft_len_for_batch_size`` (the draft length of the first key >= bs, 0 beyond the last
    key: "implicit max concurrency control"); PR #12262 ("[TRTLLM-11556][feat] Expand dynamic
    speculation to all spec decode algorithms": DFlash, MTP, PARD, ...); PR #12905
    ("[TRTLLM-11558][feat] BREAKING: Acceptance rate based speculation off in one model path") and
    ``tensorrt_llm/_torch/speculative/speculation_gate.py`` (``SpeculationGate.record_acceptance_rate``)
    with its construction in ``PyExecutor.__init__`` (``pyexecutor/py_executor.py``: a gate only
    when both ``acceptance_rate_window_size`` and ``acceptance_rate_threshold`` are set; default
    None, off). PR #8194's older ``Drafter.get_draft_len_for_batch_size`` (``drafter.py``: the
    largest key <= bs) is superseded by #10860's and not followed.

    The rule: width = ``schedule[first key >= bs]``, 0 above the last key (values above ``k`` or
    between available widths go to ``nearest_width``); every draft is verified. With the gate on,
    every speculating step records its batch acceptance rate (accepted / verified drafts over the
    requests that drafted: ``PyExecutor._update_batch_acceptance_rate``, known from a third-party
    reading of py_executor.py, not from the file itself); once ``window`` rates are recorded, a
    rolling mean of the last ``window`` below ``threshold`` turns speculation off for good.

    ``from_costs`` builds the table a user would: how to choose it is not documented (source not
    found in the index: PR #10860 shows only the example ``{4: 4, 8: 2, 32: 1}``, and DESIGN.md
    section 3 calls such tables hand-written), so it is the quick benchmark sweep dcut's replay
    brief describes: per profiled batch size, the width with the best tokens per ms, against no
    speculation (``none``). ``cost`` is otherwise unused: the rule itself is a static table.
    """

    name = "trtllm-schedule"

    def __init__(self, cost: CostModel, k: int, widths: list[int], *, schedule: dict[int, int],
                 acceptance_rate_window_size: int | None = None,
                 acceptance_rate_threshold: float | None = None) -> None:
        self.keys = sorted(schedule)
        self.lengths = [nearest_width(min(schedule[key], k), widths) for key in self.keys]
        self.gate: tuple[int, float] | None = None  # (window, threshold): PR #12905's switch-off
        if acceptance_rate_window_size and acceptance_rate_threshold is not None:
            self.gate = (acceptance_rate_window_size, acceptance_rate_threshold)
        self.rates: deque[float] = deque(maxlen=acceptance_rate_window_size or None)
        self.recorded = 0
        self.disabled = False

    @classmethod
    def from_costs(cls, cost: CostModel, k: int, widths: list[int], expected_accepted_by_width: dict[int, float],
                   *, acceptance_rate_window_size: int | None = None,
                   acceptance_rate_threshold: float | None = None) -> TRTLLMSchedule:
        """The table from a quick benchmark: at each profiled batch size the width maximising
        ``bs (1 + E[accepted at w]) / (verify(bs, bs (1 + w)) + draft(bs, w) + overhead)``, 0 where no
        width beats no speculation (``bs / (none(bs) + overhead)``: a server without a drafter, what a
        user compares against). Keys are written the way #10860 reads them ("up to this batch size"):
        runs of equal lengths merge into their last key, and a trailing 0 band is left implicit."""
        choices = [w for w in widths if 0 < w <= k and w in expected_accepted_by_width]
        best: list[tuple[int, int]] = []
        for bs in cost.batch_sizes():
            rates = {0: bs / (cost.none(bs) + cost.overhead(bs))}
            for w in choices:
                tokens = bs * (1.0 + expected_accepted_by_width[w])
                rates[w] = tokens / (cost.verify(bs, bs * (1 + w)) + cost.draft(bs, w) + cost.overhead(tokens))
            best.append((bs, max(sorted(rates), key=lambda w: rates[w])))  # ties go to the smaller width
        while best and best[-1][1] == 0:
            best.pop()
        schedule = {bs: w for i, (bs, w) in enumerate(best) if i + 1 == len(best) or best[i + 1][1] != w}
        return cls(cost, k, widths, schedule=schedule, acceptance_rate_window_size=acceptance_rate_window_size,
                   acceptance_rate_threshold=acceptance_rate_threshold)

    def width(self, bs: int, last: Verified | None) -> int:
        if last is not None and self.gate is not None and not self.disabled:
            self._record(last, *self.gate)
        if self.disabled:
            return 0
        i = bisect.bisect_left(self.keys, bs)
        return self.lengths[i] if i < len(self.keys) else 0

    def keep(self, log_conf: np.ndarray) -> np.ndarray:
        return verify_all(log_conf)

    def _record(self, last: Verified, window: int, threshold: float) -> None:
        """``SpeculationGate.record_acceptance_rate`` for one step; steps that drafted nothing are not recorded."""
        drafted = int(np.sum(last.kept))
        if drafted == 0:
            return
        self.rates.append(float(np.sum(last.accepted)) / drafted)
        self.recorded += 1
        if self.recorded >= window and sum(self.rates) / len(self.rates) < threshold:
            self.disabled = True

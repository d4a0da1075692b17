"""The records ``RunnerDCut`` (``dcut.vllm.state``) hands from one stage of a step to the next."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dcut.selection import Decision
from dcut.telemetry import StepRecord
from dcut.width import WidthChoice


@dataclass
class Pending:
    """What ``on_drafted`` decided, waiting for ``cut`` (on the host)."""

    keep: np.ndarray | None  # None: keep every draft (full width, a probe)
    decision: Decision | None
    log_conf: np.ndarray  # the raw log-confidences [bs, width], float32
    selection_us: float
    expected: np.ndarray | None = None  # mode joint: the block's marginal gains [width] (dcut.width.marginal_gains)
    block: np.ndarray | None = None  # mode joint: each request's kept drafts' calibrated prefix scores, summed [bs]


@dataclass
class Verified:
    """Outcome of the verification done in this step (for stats and calibration)."""

    req_ids: list[str]
    num_draft: np.ndarray  # drafts verified per request (what was scheduled), int64
    accepted: np.ndarray  # drafts accepted per request, int64
    width: int  # the width those drafts were drafted at
    accepted_total: int  # drafts accepted across the batch


@dataclass
class Cycle:
    """A width's cost from its drafter pass to the verification of its drafts (mode joint)."""

    bucket: int  # covering batch size
    width: int
    probe: bool  # a probe verifies everything: a lower bound of what the width delivers under the policy
    ms: float
    clean: bool = False  # the engine went straight on to the next step
    predicted_tokens: float = 0.0  # what the decision expected the cycle to emit, and to cost (ms)
    predicted_ms: float = 0.0
    gains: np.ndarray | None = None  # what each position of the block is worth per request (None: nothing drafted)


@dataclass
class LastDrafts:
    """The raw confidences of the drafts handed to the scheduler, for calibration next step."""

    req_ids: list[str]  # the batch, in row order
    log_conf: np.ndarray  # [bs, width], float32
    width: int
    expected: np.ndarray | None = None  # mode joint: what calibration expected of each row's kept drafts [bs]

    def rows(self, req_ids: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
        """Where the requests of ``req_ids`` that are in these drafts sit: their positions in ``req_ids`` and their
        rows here. None when ``req_ids`` is this very batch, in order: the usual step, found by one list comparison
        (it used to build and walk a dict of the batch every step, twice)."""
        if req_ids == self.req_ids:
            return None
        index = {r: i for i, r in enumerate(self.req_ids)}
        mine = [i for i, r in enumerate(req_ids) if r in index]
        return np.array(mine, dtype=np.int64), np.array([index[req_ids[i]] for i in mine], dtype=np.int64)


@dataclass
class Held:
    """One step, held for ``RunnerDCut.settle`` to count with the next steps' (``ACCOUNT_STEPS``): its record, whose
    per-position counts and device-side figures (kept, budget, ratio) are filled in then, and what they come from."""

    record: StepRecord
    pending: Pending | None
    verified: Verified | None
    last: LastDrafts | None  # the drafts ``verified`` is the outcome of
    raw: np.ndarray | None  # this step's raw log-confidences [bs, width], float32
    shape: tuple[int, int] | None = None  # (bs, verify tokens) of a pure decode step, which refines the cost table
    context: float | None = None  # the batch's mean context its costs are priced at
    finished: Cycle | None = None  # the cycle it finished (measured at settle)
    cycle: Cycle | None = None  # the cycle it started (priced at settle)


@dataclass
class Decided:
    """A width decision for one batch size (mode joint), held for a few steps: taken at choice ``step``, the
    covering bucket (None: beyond the cost table), the chosen width (None: no cost known) and, for exploration,
    the width it would try (``dcut.width.Explorer.candidate``) and each width's estimated step time."""

    step: int
    bucket: int | None
    chosen: WidthChoice | None
    explore: int | None = None
    step_ms: dict[int, float] = field(default_factory=dict)
    zero: WidthChoice | None = None  # width 0's estimate, where it is a candidate
    hold: int = 0  # choices it is taken again after (``dcut.vllm.state.MAX_HOLD_STEPS``)

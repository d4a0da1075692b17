"""Step traces: what a drafter proposed and what full verification accepted, step by step.

A trace is the ground truth replay (``dcut.replay``) judges policies on. It is recorded by an
engine that verifies every draft (``DCutSettings.trace``), so the true accepted length of each
request is known for every position, and a policy that would have kept fewer drafts is credited
with ``min(accepted, kept)``. DFlash acceptance depends on the drafted width (the block is
non-causal), so a recording rotates over several widths, one per step.

Per step: batch size, drafted width, measured verify / drafter / engine-overhead times. Per
request of a step (a row): context length, the log-confidence of each drafted position (NaN past
the width), and the accepted length (-1 where the drafts were not all verified: the request
finished or was cut). Stored as one compressed ``.npz`` (float16 confidences: a few MB).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

UNKNOWN = -1


@dataclass
class Trace:
    """Steps and their request rows; ``step_offsets[s]:step_offsets[s+1]`` are step s's rows."""

    k: int
    step_bs: np.ndarray  # int32 [S]
    step_width: np.ndarray  # int16 [S]
    verify_ms: np.ndarray  # float32 [S], NaN where unknown
    draft_ms: np.ndarray  # float32 [S]
    overhead_ms: np.ndarray  # float32 [S]
    step_offsets: np.ndarray  # int64 [S + 1]
    ctx_len: np.ndarray  # int32 [R]
    accepted: np.ndarray  # int16 [R], UNKNOWN where not fully verified
    log_conf: np.ndarray  # float16 [R, k], NaN past the step's width
    meta: dict[str, Any] = field(default_factory=dict)
    _request_ids: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def steps(self) -> int:
        return len(self.step_bs)

    def widths(self) -> list[int]:
        """The drafted widths with at least one known row."""
        known = self.accepted >= 0
        return sorted({int(w) for w in np.unique(self.row_width()[known]) if w > 0})

    def row_width(self) -> np.ndarray:
        """The width each row was drafted at."""
        return np.repeat(self.step_width.astype(np.int64), np.diff(self.step_offsets))

    def pool(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """``(log_conf [n, width] float64, accepted [n] int64)`` of every known row drafted at ``width``,
        in recording order: the rows replay draws from when a policy drafts ``width``."""
        rows = self._pooled(width)
        return (self.log_conf[rows, :width].astype(np.float64), self.accepted[rows].astype(np.int64))

    def request_ids(self) -> np.ndarray:
        """Which recorded request each row is a step of (int64 ``[R]``, numbered by first appearance; every row 0
        where no context was recorded, as in synthetic traces).

        A trace keeps no request ids. A row continues a row of the step before whose context it follows by 1 to
        k + 1 tokens (a step's context is counted before its own verification, so by what the step before
        accepted, plus one), preferring the row at the same place in the batch, where an engine keeps a running
        request; a row that continues none starts a request. Worked out once per trace (a Python pass over its rows;
        every width's pool reads it)."""
        if self._request_ids is None:
            self._request_ids = self._linked_requests()
        return self._request_ids

    def _linked_requests(self) -> np.ndarray:
        ids = np.zeros(len(self.ctx_len), dtype=np.int64)
        if not (self.ctx_len > 0).any():
            return ids
        fresh, prev_ctx, prev_ids = 0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        for s in range(self.steps):
            a, b = int(self.step_offsets[s]), int(self.step_offsets[s + 1])
            ctx = self.ctx_len[a:b].astype(np.int64)
            free = np.ones(len(prev_ctx), dtype=bool)
            for j, c in enumerate(ctx):
                gap = c - prev_ctx
                fits = free & (gap >= 1) & (gap <= self.k + 1)
                match = j if j < len(fits) and fits[j] else (int(np.argmax(fits)) if fits.any() else -1)
                if match < 0:
                    ids[a + j], fresh = fresh, fresh + 1
                else:
                    ids[a + j], free[match] = prev_ids[match], False
            prev_ctx, prev_ids = ctx, ids[a:b].copy()
        return ids

    def pool_context(self, width: int) -> np.ndarray:
        """The context length (int64) of each row of ``pool(width)``, in the same order (0: not recorded)."""
        return self.ctx_len[self._pooled(width)].astype(np.int64)

    def pool_requests(self, width: int) -> np.ndarray:
        """The recorded request (``request_ids``) of each row of ``pool(width)``, in the same order."""
        return self.request_ids()[self._pooled(width)]

    def _pooled(self, width: int) -> np.ndarray:
        return (self.row_width() == width) & (self.accepted >= 0)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, k=np.int64(self.k), step_bs=self.step_bs, step_width=self.step_width,
                            verify_ms=self.verify_ms, draft_ms=self.draft_ms, overhead_ms=self.overhead_ms,
                            step_offsets=self.step_offsets, ctx_len=self.ctx_len, accepted=self.accepted,
                            log_conf=self.log_conf, meta=np.asarray(json.dumps(self.meta, sort_keys=True)))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        with np.load(path) as z:
            return cls(int(z["k"]), z["step_bs"], z["step_width"], z["verify_ms"], z["draft_ms"], z["overhead_ms"],
                       z["step_offsets"], z["ctx_len"], z["accepted"], z["log_conf"], json.loads(str(z["meta"])))

    @classmethod
    def concat(cls, traces: list[Trace], meta: dict[str, Any] | None = None) -> Trace:
        """One trace of several, steps in order (all of the same ``k``)."""
        if not traces or len({t.k for t in traces}) != 1:
            raise ValueError("concat needs at least one trace, all of the same k")
        offsets, base = [np.zeros(1, dtype=np.int64)], 0
        for t in traces:
            offsets.append(t.step_offsets[1:] + base)
            base += int(t.step_offsets[-1])
        cat = np.concatenate
        return cls(traces[0].k, cat([t.step_bs for t in traces]), cat([t.step_width for t in traces]),
                   cat([t.verify_ms for t in traces]), cat([t.draft_ms for t in traces]),
                   cat([t.overhead_ms for t in traces]), cat(offsets), cat([t.ctx_len for t in traces]),
                   cat([t.accepted for t in traces]), cat([t.log_conf for t in traces]),
                   meta if meta is not None else dict(traces[0].meta))


def from_rows(k: int, steps: list[dict[str, Any]], meta: dict[str, Any] | None = None) -> Trace:
    """A trace from per-step dicts: ``bs, width, verify_ms, draft_ms, overhead_ms`` and the rows'
    ``ctx_len [bs]``, ``accepted [bs]``, ``log_conf [bs, width]`` (synthetic traces are built this way)."""
    n_rows = sum(int(s["bs"]) for s in steps)
    log_conf = np.full((n_rows, k), np.nan, dtype=np.float16)
    accepted = np.full(n_rows, UNKNOWN, dtype=np.int16)
    ctx = np.zeros(n_rows, dtype=np.int32)
    offsets = np.zeros(len(steps) + 1, dtype=np.int64)
    for i, s in enumerate(steps):
        a, bs, w = int(offsets[i]), int(s["bs"]), int(s["width"])
        offsets[i + 1] = a + bs
        if w:
            log_conf[a:a + bs, :w] = np.asarray(s["log_conf"], dtype=np.float64)[:, :w]
        accepted[a:a + bs] = np.asarray(s["accepted"])
        ctx[a:a + bs] = np.asarray(s.get("ctx_len", np.zeros(bs)))

    def column(name: str, dtype: Any) -> np.ndarray:
        return np.asarray([s.get(name, np.nan) for s in steps], dtype=dtype)

    return Trace(k, column("bs", np.int32), column("width", np.int16), column("verify_ms", np.float32),
                 column("draft_ms", np.float32), column("overhead_ms", np.float32), offsets, ctx, accepted,
                 log_conf, dict(meta or {}))


class TraceWriter:
    """Builds a trace inside an engine: one ``step`` per drafting pass, and the next step's
    verification fills in what the previous step's drafts achieved (``verified``)."""

    def __init__(self, k: int, meta: dict[str, Any] | None = None) -> None:
        self.k, self.meta = k, dict(meta or {})
        self._steps: list[dict[str, Any]] = []
        self._open: dict[str, tuple[int, int, int]] = {}  # req id -> (step index, row, width) awaiting verification

    def __len__(self) -> int:
        return len(self._steps)

    def verified(self, req_ids: list[str], num_draft: list[int], accepted: list[int]) -> None:
        """What verification of the last step's drafts showed (request order of the verifying step)."""
        for r, n, a in zip(req_ids, num_draft, accepted, strict=True):
            found = self._open.get(r)
            if found is not None:
                step, row, width = found
                if n == width:  # every draft verified: the accepted length is the truth
                    self._steps[step]["accepted"][row] = min(int(a), width)
        self._open = {}

    def step(self, req_ids: list[str], ctx_len: list[int], width: int, log_conf: np.ndarray | None,
             verify_ms: float | None, draft_ms: float | None, overhead_ms: float | None) -> None:
        """One drafting pass: ``log_conf [bs, width]`` (None at width 0) and the step's timings."""
        bs = len(req_ids)
        conf = np.full((bs, width), np.nan) if log_conf is None else np.asarray(log_conf, dtype=np.float64)
        self._steps.append({"bs": bs, "width": width, "ctx_len": list(ctx_len), "log_conf": conf,
                            "accepted": [UNKNOWN] * bs, "verify_ms": _nan(verify_ms), "draft_ms": _nan(draft_ms),
                            "overhead_ms": _nan(overhead_ms)})
        index = len(self._steps) - 1
        self._open = {r: (index, i, width) for i, r in enumerate(req_ids)} if width else {}

    def trace(self) -> Trace:
        return from_rows(self.k, self._steps, self.meta)

    def save(self, path: str | Path) -> Trace:
        """Write what was recorded so far (and keep recording)."""
        t = self.trace()
        t.save(path)
        return t

    def clear(self) -> None:
        self._steps, self._open = [], {}


def _nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)

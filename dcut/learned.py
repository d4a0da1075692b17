"""What a ``joint`` runner has learned, as a record a new replica can start from (``DCutSettings.learned``).

A replica that starts cold explores widths and learns acceptance and calibration from scratch, and
every step of that is paid by traffic. The controller already hands a starting replica the cluster's
cost table; this is the rest of what the fleet knows for the same fingerprint: acceptance per width
and position, the drafts' worth per width, the calibration tables, each width's measured rate per
batch-size bucket and the engine's overhead outside the model. Counts are merged by adding them,
means by weighting them with their counts.

Plain lists, no tensors: the Serve controller reads and merges these and imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

Matrix = list[list[float]]


class CalibrationState(BaseModel):
    """``dcut.calibration.Calibrator``'s counts, per (position, bin)."""

    model_config = ConfigDict(extra="forbid")

    count: Matrix
    accepted: Matrix
    raw_sum: Matrix
    cal_count: Matrix
    cal_accepted: Matrix
    cal_sum: Matrix


class RealizedCell(BaseModel):
    """One (bucket, width) of ``dcut.width.RealizedRates``."""

    model_config = ConfigDict(extra="forbid")

    bucket: int
    width: int
    tokens: float
    ms: float
    predicted_tokens: float
    predicted_ms: float
    rate: float
    rate_var: float
    n: int
    ratio_var: float = 0.0  # of a cycle's realized over predicted tokens (0: a state saved before it was kept)
    time_var: float = 0.0  # of a cycle's time over predicted
    # what each position of its blocks was worth per request, and requests per cycle (None: a state saved before
    # they were kept; the width is then judged on its own prediction until it drafts again)
    gains: list[float] | None = None
    requests: float = 0.0


class LearnedState(BaseModel):
    """A ``joint`` runner's learned state for one fingerprint."""

    model_config = ConfigDict(extra="forbid")

    fingerprint: str = Field(description="`Fingerprint.key()` of the engine that learned it.")
    k: int
    widths: list[int]
    reached: Matrix = Field(description="`WidthStats.reached` [widths, k].")
    accepted: Matrix
    expected: Matrix = Field(description="`WidthStats.expected`: marginal gains per width and position.")
    expected_requests: list[float]
    calibration: dict[int, CalibrationState] = Field(default_factory=dict, description="Per width.")
    pooled_calibration: CalibrationState | None = None
    realized: list[RealizedCell] = Field(default_factory=list)
    overhead_ms: tuple[float, float] = Field((0.0, 0.0), description="`EngineOverhead`: per step, per emitted token.")


def merge(states: Sequence[LearnedState]) -> LearnedState:
    """One state from several replicas' of the same fingerprint, K and widths."""
    if not states:
        raise ValueError("merge needs at least one state")
    first = states[0]
    if any((s.fingerprint, s.k, s.widths) != (first.fingerprint, first.k, first.widths) for s in states[1:]):
        raise ValueError("cannot merge learned states of different fingerprints, K or widths")
    requests = np.asarray([s.expected_requests for s in states])  # [replicas, widths]
    expected = np.asarray([s.expected for s in states])  # [replicas, widths, k]
    weights = requests / np.maximum(requests.sum(0), 1e-12)
    calibrations = {w: _sum_calibration([s.calibration[w] for s in states if w in s.calibration])
                    for w in sorted({w for s in states for w in s.calibration})}
    pooled = [s.pooled_calibration for s in states if s.pooled_calibration is not None]
    cells: dict[tuple[int, int], list[RealizedCell]] = {}
    for s in states:
        for c in s.realized:
            cells.setdefault((c.bucket, c.width), []).append(c)
    return LearnedState(
        fingerprint=first.fingerprint, k=first.k, widths=first.widths,
        reached=_sum([s.reached for s in states]), accepted=_sum([s.accepted for s in states]),
        expected=(expected * weights[:, :, None]).sum(0).tolist(), expected_requests=requests.sum(0).tolist(),
        calibration=calibrations, pooled_calibration=_sum_calibration(pooled) if pooled else None,
        realized=[_merge_cells(group) for _, group in sorted(cells.items())],
        overhead_ms=tuple(np.mean([s.overhead_ms for s in states], axis=0).tolist()))


def _sum(matrices: Sequence[Matrix]) -> Matrix:
    return np.sum(np.asarray(matrices, dtype=np.float64), axis=0).tolist()


def _sum_calibration(states: Sequence[CalibrationState]) -> CalibrationState:
    return CalibrationState(**{f: _sum([getattr(s, f) for s in states]) for f in CalibrationState.model_fields})


def _merge_cells(cells: Sequence[RealizedCell]) -> RealizedCell:
    """Means weighted by cycles; the spreads pooled (within-replica variance plus between)."""
    n = np.asarray([c.n for c in cells], dtype=np.float64)
    w = n / max(n.sum(), 1e-12)

    def mean(field: str) -> float:
        return float(sum(wi * getattr(c, field) for wi, c in zip(w, cells, strict=True)))

    def pooled(means: Sequence[float], variances: Sequence[float]) -> float:
        m = float(np.dot(w, means))
        return float(sum(wi * (v + (x - m) ** 2) for wi, x, v in zip(w, means, variances, strict=True)))

    def ratio(num: str, den: str) -> list[float]:
        return [getattr(c, num) / getattr(c, den) if getattr(c, den) > 0 else 0.0 for c in cells]

    return RealizedCell(bucket=cells[0].bucket, width=cells[0].width, tokens=mean("tokens"), ms=mean("ms"),
                        predicted_tokens=mean("predicted_tokens"), predicted_ms=mean("predicted_ms"), rate=mean("rate"),
                        rate_var=pooled([c.rate for c in cells], [c.rate_var for c in cells]), n=int(n.sum()),
                        ratio_var=pooled(ratio("tokens", "predicted_tokens"), [c.ratio_var for c in cells]),
                        time_var=pooled(ratio("ms", "predicted_ms"), [c.time_var for c in cells]),
                        **_mean_gains(cells))


def _mean_gains(cells: Sequence[RealizedCell]) -> dict[str, Any]:
    """The cells' gains per position and requests per cycle, weighted by cycles, over the cells that kept them."""
    kept = [c for c in cells if c.gains is not None and c.n > 0]
    if not kept or len({len(c.gains or ()) for c in kept}) > 1:
        return {}
    w = np.asarray([c.n for c in kept], dtype=np.float64)
    w /= w.sum()
    return {"gains": (np.asarray([c.gains for c in kept]) * w[:, None]).sum(0).tolist(),
            "requests": float(np.dot(w, [c.requests for c in kept]))}

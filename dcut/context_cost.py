"""How a verify step's cost grows with the requests' context length (issue 24 §3).

The cost table's verify rows are profiled at one context length, ``c0`` (``DCutSettings.profile_context_len``).
Attention makes a step dearer as contexts grow: each verify token attends to every context token of its
request, and each request's cached keys and values are read once per step whatever its verify width. So, at
mean context ``c``, a step of ``bs`` requests verifying ``tokens`` tokens costs

    table(bs, tokens) + (c - c0) * (step_slope(bs) + slope(bs) * tokens)

with ``slope`` in ms per verify token per context token and ``step_slope`` in ms per context token for the whole
step (the per-request reads). Both are fitted, non-negative, on steps profiled at a few context lengths: the
full-width step at each length and the plain step (one token per request) at the longest, which is what tells
the two terms apart. A batch size takes the slopes of the next larger profiled one, as the table does. A
table without this section has no context term: it costs what it did before.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

Fitted = tuple[float, float]  # (step_slope, slope) of one batch size


class ContextCost:
    """The context term of one cost table: the slopes per profiled batch size, and where they were measured.

    ``samples``: profiled steps behind each batch size's slopes (merging weighs by them); ``measured``: those steps,
    ``(verify tokens, context, ms)``, kept so a reader can judge a fit (a loaded machine makes any profile noise)."""

    def __init__(self, profiled_at: int, lengths: Sequence[int] = (), slope: dict[int, float] | None = None,
                 step_slope: dict[int, float] | None = None, samples: dict[int, int] | None = None,
                 measured: dict[int, list[Sequence[float]]] | None = None) -> None:
        self.profiled_at = int(profiled_at)
        self.lengths = sorted({int(c) for c in lengths})
        self.slope = {int(b): float(v) for b, v in (slope or {}).items()}
        self.step_slope = {int(b): float(v) for b, v in (step_slope or {}).items()}
        self.samples = {int(b): int(n) for b, n in (samples or {}).items()}
        self.measured = {int(b): [(int(p[0]), int(p[1]), float(p[2])) for p in rows]
                         for b, rows in (measured or {}).items()}
        self._sizes = sorted(set(self.slope) | set(self.step_slope))

    def terms(self, cover: int, context: float | None) -> Fitted | None:
        """``(ms for the step, ms per verify token)`` a mean ``context`` adds to the profiled row of batch size
        ``cover`` (negative below the profiled context); None when there is nothing to add."""
        if context is None or not self._sizes:
            return None
        i = bisect.bisect_left(self._sizes, cover)
        key = self._sizes[min(i, len(self._sizes) - 1)]  # the next larger profiled, else the largest
        delta = max(float(context), 0.0) - self.profiled_at
        step, slope = self.step_slope.get(key, 0.0) * delta, self.slope.get(key, 0.0) * delta
        return None if step == 0.0 and slope == 0.0 else (step, slope)

    def apply(self, costs: Any, tokens: Any, cover: int, context: float | None) -> Any:
        """``costs`` (numpy or one float, ms) of steps verifying ``tokens`` at mean ``context``. Below the
        profiled context a step gets cheaper by at most half (there the line is extrapolated, not measured)."""
        terms = self.terms(cover, context)
        if terms is None:
            return costs
        shifted = costs + (terms[0] + terms[1] * tokens)
        if terms[0] >= 0.0 and terms[1] >= 0.0:
            return shifted
        floor = 0.5 * costs
        return max(shifted, floor) if isinstance(shifted, float) else np.maximum(shifted, floor)

    @classmethod
    def merge(cls, parts: Sequence[ContextCost | None]) -> ContextCost | None:
        """One context term from several replicas' (None where a table has none): slopes weighted by samples."""
        present = [p for p in parts if p is not None]
        if not present:
            return None
        sizes = sorted({b for p in present for b in p._sizes})
        slope, step, samples, measured = {}, {}, {}, {}
        for b in sizes:
            rows = [(p.slope.get(b, 0.0), p.step_slope.get(b, 0.0), max(1, p.samples.get(b, 1)))
                    for p in present if b in p._sizes]
            total = sum(n for _, _, n in rows)
            slope[b] = sum(s * n for s, _, n in rows) / total
            step[b] = sum(s * n for _, s, n in rows) / total
            samples[b] = total
            measured[b] = [m for p in present for m in p.measured.get(b, [])]
        return cls(present[0].profiled_at, [c for p in present for c in p.lengths], slope, step, samples,
                   {b: rows for b, rows in measured.items() if rows})

    def to_json(self) -> dict[str, Any]:
        return {"profiled_at": self.profiled_at, "lengths": self.lengths,
                "slope_ms": {str(b): v for b, v in sorted(self.slope.items())},
                "step_slope_ms": {str(b): v for b, v in sorted(self.step_slope.items())},
                "samples": {str(b): n for b, n in sorted(self.samples.items())},
                "measured": {str(b): [list(m) for m in rows] for b, rows in sorted(self.measured.items())}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ContextCost:
        return cls(data["profiled_at"], data.get("lengths", ()), {int(b): v for b, v in data["slope_ms"].items()},
                   {int(b): v for b, v in data.get("step_slope_ms", {}).items()},
                   {int(b): n for b, n in data.get("samples", {}).items()},
                   {int(b): rows for b, rows in data.get("measured", {}).items()})


def fit_slopes(tokens: np.ndarray, delta: np.ndarray, extra_ms: np.ndarray) -> Fitted:
    """``(step_slope, slope)``, both >= 0: least squares of ``extra_ms = delta * (step_slope + slope * tokens)``
    (``delta``: context minus the profiled context). With one token count the terms cannot be told apart and the
    whole growth is put on the tokens; a term that would come out negative is dropped and the other refitted."""
    columns = np.column_stack([delta, delta * tokens]).astype(np.float64)
    y = np.asarray(extra_ms, dtype=np.float64)
    if len(y) >= 2 and np.ptp(tokens) > 0:
        both = np.linalg.lstsq(columns, y, rcond=None)[0]
        if (both >= 0).all():
            return float(both[0]), float(both[1])
    best, fit = np.inf, (0.0, 0.0)
    for i in ((1,) if np.ptp(tokens) == 0 else (0, 1)):
        x = columns[:, i]
        value = max(0.0, float(x @ y / (x @ x))) if x @ x > 0 else 0.0
        residual = float(((y - value * x) ** 2).sum())
        if residual < best:
            best, fit = residual, ((value, 0.0) if i == 0 else (0.0, value))
    return fit


def default_lengths(max_model_len: int, k: int, profiled_at: int) -> list[int]:
    """Where the context term is profiled: about a quarter and half of ``max_model_len`` and the longest context a
    full-width verify step fits (``max_model_len - k - 2``), less the table's own context."""
    longest = max_model_len - k - 2
    return sorted({c for c in (max_model_len // 4, max_model_len // 2, longest) if 1 <= c <= longest} - {profiled_at})


def profile_context(run_step: Callable[[int, int, int], None], base: Callable[[int, int], float | None],
                    batch_sizes: Sequence[int], k: int, profiled_at: int, lengths: Sequence[int],
                    warmups: int = 2, repeats: int = 3, timer: Callable[[], float] = time.perf_counter,
                    progress: bool = True) -> ContextCost:
    """Time ``run_step(bs, tokens, context)`` (it must block until done) at full width at each length and as a
    plain step at the longest; fit each batch size's slopes on what the steps cost beyond ``base(bs, tokens)``,
    the table's profiled row at ``profiled_at``."""
    longest = max(lengths)
    shapes = [(bs, bs * (k + 1), c) for bs in batch_sizes for c in lengths] + [(bs, bs, longest) for bs in batch_sizes]
    rows: dict[int, list[tuple[int, int, float]]] = {}  # (tokens, context - profiled_at, ms beyond the base)
    measured: dict[int, list[tuple[int, int, float]]] = {}
    for bs, tokens, context in tqdm(shapes, desc="dcut profile (context)", unit="shape", disable=not progress):
        for _ in range(warmups):
            run_step(bs, tokens, context)
        times = []
        for _ in range(repeats):
            start = timer()
            run_step(bs, tokens, context)
            times.append((timer() - start) * 1000.0)
        reference, ms = base(bs, tokens), statistics.median(times)
        measured.setdefault(bs, []).append((tokens, context, ms))
        if reference is not None:
            rows.setdefault(bs, []).append((tokens, context - profiled_at, ms - reference))
    fits = {bs: fit_slopes(*(np.asarray(col, dtype=np.float64) for col in zip(*r, strict=True)))
            for bs, r in rows.items()}
    return ContextCost(profiled_at, lengths, {b: f[1] for b, f in fits.items()}, {b: f[0] for b, f in fits.items()},
                       {b: len(r) for b, r in rows.items()}, measured)

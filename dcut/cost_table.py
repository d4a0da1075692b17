"""Measured step cost by batch size and verify tokens (docs/algorithm.md, section 3).

Costs are measured, never assumed: dense and MoE curves differ by 2x. A table carries the
fingerprint of what it was measured on, so a replica can reuse a table profiled elsewhere on the
same hardware and model instead of profiling again, and never a table from anything else.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict
from tqdm import tqdm

import dcut
from dcut.buckets import REFERENCE_RATIOS, bucket_budget
from dcut.context_cost import ContextCost
from dcut.machine import cpu_model

PROFILE_RATIOS = (0.0, *REFERENCE_RATIOS)  # 0.0: a plain decode step, no drafts


class Fingerprint(BaseModel):
    """What a cost table was measured on; tables are only shared between equal fingerprints."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hardware: str
    model: str
    drafter: str | None = None
    k: int
    tensor_parallel_size: int = 1
    dtype: str = "float32"
    # A step's cost depends on how it is launched: CUDA graphs (vLLM's resolved mode, NONE on CPU) or eager.
    # None: not recorded (tables from before these fields), never equal to a recorded value.
    cudagraph_mode: str | None = None
    enforce_eager: bool | None = None
    vllm_version: str = ""
    dcut_version: str = dcut.__version__

    def key(self) -> str:
        """A short stable hash, usable as a cache file name."""
        blob = json.dumps(self.model_dump(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class FingerprintMismatch(ValueError):
    """A cost table measured on something else than what asks for it."""


def current_hardware() -> str:
    """The GPU name when CUDA is available, else the CPU model and core count."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{cpu_model()} x{os.cpu_count()}"


Point = tuple[int, float, int]  # (verify tokens, ms, samples)


class CostTable:
    """Two measured costs per profiled batch size: verification and drafting.

    ``points``: sorted ``verify_tokens -> ms`` with sample counts, the target's step (forward,
    sampling, rejection) without any drafter work. ``draft``: ``width -> ms`` with sample counts,
    the drafter's pass at each drafted width (0: what keeping the drafter in sync costs).

    A batch size not in the table uses the next larger profiled one (its dummy requests cover
    ours); beyond the largest there is no cost. Between points the cost is linear in tokens (or
    width), and flat outside the profiled range. Each batch size also carries a verify correction
    learned from live steps (see ``refine``): an ``offset`` added to every point of its row and a
    ``gain`` on the row's rise above its first point; draft cells are refined in place (``refine_draft``).
    ``context``: how verify costs grow with the requests' mean context (``dcut.context_cost``; None: priced
    as at the profiled context); every verify lookup takes that context.
    """

    def __init__(self, fingerprint: Fingerprint, points: dict[int, Iterable[Sequence[float]]],
                 offsets: dict[int, Sequence[float]] | None = None,
                 draft: dict[int, dict[int, Sequence[float]]] | None = None,
                 plain_offsets: dict[int, Sequence[float]] | None = None, context: ContextCost | None = None,
                 gains: dict[int, Sequence[float]] | None = None) -> None:
        self.fingerprint, self.context = fingerprint, context
        self.offsets: dict[int, tuple[float, int]] = {int(b): (float(o[0]), int(o[1]))
                                                      for b, o in (offsets or {}).items()}
        # Steps that verify no drafts run the engine's plain path (no rejection sampler): their
        # correction is learned apart from that of steps verifying drafts.
        self.plain_offsets: dict[int, tuple[float, int]] = {int(b): (float(o[0]), int(o[1]))
                                                            for b, o in (plain_offsets or {}).items()}
        self.gains: dict[int, tuple[float, int]] = {int(b): (float(g[0]), int(g[1])) for b, g in (gains or {}).items()}
        self._fits: dict[int, _LineFit] = {}  # per batch size: the running line behind its offset and gain
        self.draft: dict[int, dict[int, tuple[float, int]]] = {
            int(b): {int(w): (float(c[0]), int(c[1])) for w, c in row.items()} for b, row in (draft or {}).items()}
        self.points: dict[int, list[Point]] = {}
        for bs, row in points.items():
            merged: dict[int, Point] = {}
            for p in row:
                t, ms, n = int(p[0]), float(p[1]), int(p[2]) if len(p) > 2 else 1
                merged[t] = _combine(merged[t], (t, ms, n)) if t in merged else (t, ms, n)
            if merged:
                self.points[int(bs)] = sorted(merged.values())
        self._sizes = sorted(self.points)
        self._dense: dict[int, np.ndarray] = {}  # per covering batch size: ``costs``' row
        # Each row's (tokens, ms) as arrays, for host lookups (the rows never change after this); and as lists, for
        # the single lookups a step makes (``lookup``: in pure Python, as numpy's per-call overhead is most of their
        # cost on the step's cold caches: in an engine, ``refine`` took 71 us a step through numpy).
        self._lists = {bs: ([float(p[0]) for p in row], [p[1] for p in row]) for bs, row in self.points.items()}
        self._rows = {bs: (np.asarray(xs), np.asarray(ys)) for bs, (xs, ys) in self._lists.items()}

    def covering(self, bs: int) -> int | None:
        """The smallest profiled batch size ``>= bs``, or None beyond the table."""
        i = bisect.bisect_left(self._sizes, bs)
        return self._sizes[i] if i < len(self._sizes) else None

    def lookup(self, bs: int, verify_tokens: int, context: float | None = None) -> float | None:
        """Cost in ms of one step, or None when no profiled batch size covers ``bs``: ``lookup_many`` for one
        token count, to the last bit, without numpy (``_lists`` says why)."""
        cover = self.covering(bs)
        if cover is None:
            return None
        cost = self._corrected(cover, _interp(float(verify_tokens), *self._lists[cover]))
        if verify_tokens <= bs:
            cost = cost + (self.offset(cover, plain=True) - self.offset(cover))
        return cost if self.context is None else float(self.context.apply(cost, verify_tokens, cover, context))

    def offset(self, cover: int, plain: bool = False) -> float:
        """The live-step correction of a profiled batch size's row (ms): of steps verifying
        drafts, or of plain steps (0 until one was seen: the optimistic prior lets a plain step
        be tried, and the try measures it)."""
        return (self.plain_offsets if plain else self.offsets).get(cover, (0.0, 0))[0]

    def gain(self, cover: int) -> float:
        """The live-step correction of a profiled batch size's row's rise above its first point (a plain step):
        live cost = profiled + offset + gain * (profiled - first point). 0 until live steps show one."""
        return self.gains.get(cover, (0.0, 0))[0]

    def _corrected(self, cover: int, base: Any) -> Any:
        """Profiled costs ``base`` (one float or numpy) with the row's live correction (``gain``, ``offset``)."""
        gain = self.gain(cover)
        line = base * (1.0 + gain) - gain * self._lists[cover][1][0] if gain else base
        return line + self.offset(cover)

    def costs(self, bs: int, verify_tokens: np.ndarray, context: float | None = None) -> np.ndarray | None:
        """Vectorised ``lookup`` (implements ``dcut.selection.CostLookup``).

        Interpolates once per covering batch size onto every integer token count up to the last
        point, so a step's lookup is a single gather; the live correction (``refine``, every step) is
        added after, so refining never rebuilds the row (rebuilding it each step cost more than the
        rest of the verify-budget choice).
        """
        cover = self.covering(bs)
        if cover is None:
            return None
        dense = self._dense.get(cover)
        if dense is None:  # once per batch size
            row = self.points[cover]
            grid = np.arange(row[-1][0] + 1)
            dense = self._dense[cover] = np.interp(grid, [p[0] for p in row], [p[1] for p in row]).astype(np.float32)
        costs = self._corrected(cover, dense[np.minimum(np.maximum(verify_tokens, 0), dense.shape[0] - 1)])
        delta = self.offset(cover, plain=True) - self.offset(cover)
        costs = costs + (verify_tokens <= bs) * delta if delta else costs
        return costs if self.context is None else self.context.apply(costs, verify_tokens, cover, context)

    def lookup_many(self, bs: int, verify_tokens: np.ndarray, context: float | None = None) -> np.ndarray | None:
        """``lookup`` for many token counts at once (host side)."""
        cover = self.covering(bs)
        if cover is None:
            return None
        tokens, ms = self._rows[cover]
        costs = self._corrected(cover, np.interp(verify_tokens, tokens, ms))
        costs = costs + (np.asarray(verify_tokens) <= bs) * (self.offset(cover, plain=True) - self.offset(cover))
        return costs if self.context is None else self.context.apply(costs, np.asarray(verify_tokens), cover, context)

    def draft_cost(self, bs: int, width: int) -> float | None:
        """The drafter's cost in ms at ``width`` for ``bs`` requests; None when not profiled."""
        cover = self.covering(bs)
        cell = None if cover is None else self.draft.get(cover, {}).get(width)
        if cell is not None:  # a measured width (the usual case, several times a step): no interpolation
            return cell[0]
        costs = self.draft_costs(bs, np.asarray([width]))
        return None if costs is None else float(costs[0])

    def draft_costs(self, bs: int, widths: np.ndarray) -> np.ndarray | None:
        """``draft_cost`` for many widths at once, linear between measured widths."""
        cover = self.covering(bs)
        row = self.draft.get(cover) if cover is not None else None
        if not row:
            return None
        measured = sorted(row)
        return np.interp(widths, measured, [row[w][0] for w in measured])

    def refine_draft(self, bs: int, width: int, ms: float, weight: float = 0.05) -> None:
        """Fold one timed drafter pass into its (covering batch size, width) cell.

        The profiled value counts as one sample; then a running mean, then a moving average, with
        the sample clipped to [0.5x, 2x] of the cell (a GC pause must not wreck it). A width that
        was never profiled gets its own cell from its first live sample.
        """
        cover = self.covering(bs)
        if cover is None:
            return
        row = self.draft.setdefault(cover, {})
        if width not in row:
            row[width] = (ms, 1)
            return
        value, n = row[width]
        sample = min(max(ms, 0.5 * value), 2.0 * value)
        w = max(weight, 1.0 / (n + 1))
        row[width] = (value + w * (sample - value), n + 1)

    def smoothed(self) -> CostTable:
        """A copy whose cost never decreases with more tokens (cummax per batch size)."""
        points = {}
        for bs, row in self.points.items():
            ms = np.maximum.accumulate([p[1] for p in row])
            points[bs] = [(t, float(m), n) for (t, _, n), m in zip(row, ms, strict=True)]
        return CostTable(self.fingerprint, points, self.offsets, self.draft, self.plain_offsets, self.context,
                         self.gains)

    def refine(self, bs: int, verify_tokens: int, ms: float, weight: float = 0.05,
               context: float | None = None) -> None:
        """Fold in one timed live step as a correction of the whole row of the covering batch size.

        Dummy profiling steps leave out work whose cost does not depend on the verify budget
        (sampling, rejection, input preparation): a constant per batch size. They can also miss work
        that grows with the tokens verified: on a Xeon the deep pair's live verify steps at bs 16 rose 0.22 ms
        a verify token (31-102 tokens, every step logged) where the profiled row, its context term included,
        rose 0.19, so every extra draft looked a little cheaper than it was. So a line is learned: live cost =
        profiled + offset + gain * (profiled - the row's first point), fitted by least squares on the steps'
        (rise, live - profiled): its level as running means over the first ``1/weight`` samples and moving
        averages after, its slope over five times as many (``_LineFit``). The gain is shrunk towards its prior
        (0, or a loaded table's) where the steps' rises barely vary: a fixed shape says nothing of the slope,
        and the line's level at the steps' mean is right whatever the gain.

        The sample is clipped to [0.5x, 2x] of the prediction first, so one noisy step (a GC pause, a
        prefill sharing the step) cannot wreck the table; the gain is kept within [-0.5, 2], so the row
        stays increasing. A step verifying no drafts (``verify_tokens <= bs``) refines the plain-step
        correction instead (a constant). The prediction includes the step's ``context`` term, so steps at
        long context do not inflate the row.
        """
        cover = self.covering(bs)
        if cover is None:
            return
        plain = verify_tokens <= bs
        predicted = self.lookup(bs, verify_tokens, context)
        if predicted is None or predicted <= 0.0:
            return
        sample = min(max(ms, 0.5 * predicted), 2.0 * predicted)
        # A shift may lower the row at most to half its cheapest point: every cost stays positive. (Without
        # this floor, a row whose profile has one slow point was shifted below zero at its other points, and
        # the clip above, taken around a negative prediction, then pushed the offset down without bound.)
        floor = -0.5 * self.points[cover][0][1]
        if plain:
            offset, n = self.plain_offsets.get(cover, (0.0, 0))
            w = max(weight, 1.0 / (n + 1))
            self.plain_offsets[cover] = (max(offset + w * (sample - predicted), floor), n + 1)
            return
        xs, ys = self._lists[cover]
        rise = _interp(float(verify_tokens), xs, ys) - ys[0]
        offset, n = self.offsets.get(cover, (0.0, 0))
        gain, _ = self.gains.get(cover, (0.0, 0))
        fit = self._fits.get(cover)
        if fit is None:  # starts on the line it has (a loaded table's, or none), as if its samples lay there
            fit = self._fits[cover] = _LineFit(rise, offset + gain * rise, gain)
        # live - profiled, context included: the step's residual before any correction
        fit.add(rise, sample - (predicted - offset - gain * rise), max(weight, 1.0 / (n + 1)))
        # a handful of samples, or rises spread over less than a few % of the row's, weigh less than the prior
        gain, offset = fit.line(4.0 * (0.05 * (ys[-1] - ys[0])) ** 2, weight)
        self.gains[cover] = (gain, n + 1)
        self.offsets[cover] = (max(offset, floor), n + 1)

    @classmethod
    def merge(cls, tables: Sequence[CostTable]) -> CostTable:
        """One table from several replicas' tables of the same fingerprint.

        Points at the same (batch size, tokens) average weighted by sample count; all points are
        kept, and the result is made monotone again (`smoothed`); context slopes weighted by samples.
        """
        if not tables:
            raise ValueError("merge needs at least one table")
        fingerprint = tables[0].fingerprint
        for table in tables[1:]:
            if table.fingerprint != fingerprint:
                raise ValueError(f"cannot merge tables of different fingerprints: "
                                 f"{_differences(fingerprint, table.fingerprint)}")
        rows: dict[int, list[Point]] = {}
        corrections: dict[int, list[tuple[float, int]]] = {}
        plain_corrections: dict[int, list[tuple[float, int]]] = {}
        gain_corrections: dict[int, list[tuple[float, int]]] = {}
        drafts: dict[int, dict[int, list[tuple[float, int]]]] = {}
        for table in tables:
            for bs, row in table.points.items():
                rows.setdefault(bs, []).extend(row)
            for bs, off in table.offsets.items():
                corrections.setdefault(bs, []).append(off)
            for bs, off in table.plain_offsets.items():
                plain_corrections.setdefault(bs, []).append(off)
            for bs, gain in table.gains.items():
                gain_corrections.setdefault(bs, []).append(gain)
            for bs, cells in table.draft.items():
                for width, cell in cells.items():
                    drafts.setdefault(bs, {}).setdefault(width, []).append(cell)
        offsets = {bs: _weighted(offs) for bs, offs in corrections.items()}
        draft = {bs: {w: _weighted(cells) for w, cells in row.items()} for bs, row in drafts.items()}
        plain = {bs: _weighted(offs) for bs, offs in plain_corrections.items()}
        gains = {bs: _weighted(g) for bs, g in gain_corrections.items()}
        context = ContextCost.merge([t.context for t in tables])
        return cls(fingerprint, rows, offsets, draft, plain, context, gains).smoothed()

    def to_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint.model_dump(),
            "points": {str(bs): [list(p) for p in row] for bs, row in sorted(self.points.items())},
            "offsets": {str(bs): list(o) for bs, o in sorted(self.offsets.items())},
            "plain_offsets": {str(bs): list(o) for bs, o in sorted(self.plain_offsets.items())},
            "gains": {str(bs): list(g) for bs, g in sorted(self.gains.items())},
            "draft": {str(bs): {str(w): list(c) for w, c in sorted(row.items())}
                      for bs, row in sorted(self.draft.items())},
            **({"context": self.context.to_json()} if self.context is not None else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostTable:
        return cls(Fingerprint(**data["fingerprint"]), {int(bs): row for bs, row in data["points"].items()},
                   {int(bs): o for bs, o in data.get("offsets", {}).items()},
                   {int(bs): {int(w): c for w, c in row.items()} for bs, row in data.get("draft", {}).items()},
                   {int(bs): o for bs, o in data.get("plain_offsets", {}).items()},
                   ContextCost.from_json(data["context"]) if data.get("context") else None,
                   {int(bs): g for bs, g in data.get("gains", {}).items()})

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")  # per process: TP ranks save at once
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)  # atomic: a replica never reads a half-written table

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        return cls.from_json(json.loads(Path(path).read_text()))

    @classmethod
    def load_for(cls, path: str | Path, fingerprint: Fingerprint) -> CostTable:
        """Load a table, refusing one measured on anything other than ``fingerprint``."""
        table = cls.load(path)
        if table.fingerprint != fingerprint:
            raise FingerprintMismatch(f"cost table {path} was measured on something else: "
                                      f"{_differences(fingerprint, table.fingerprint)}")
        return table


class _LineFit:
    """A running least-squares line ``y = offset + gain * x``: the means move at the caller's weight (the
    level follows the steps closely), the co-moments at a fifth of it (a slope needs many steps to see);
    the gain is shrunk towards ``prior`` by a ridge that weighs as ``ridge`` (x units squared) would over
    one sample."""

    def __init__(self, x: float, y: float, prior: float) -> None:
        self.mx, self.my, self.sxx, self.sxy, self.prior, self.n = x, y, 0.0, 0.0, prior, 0

    def add(self, x: float, y: float, weight: float) -> None:
        slow = max(weight / 5.0, 1.0 / (self.n + 1))
        dx, dy = x - self.mx, y - self.my
        self.mx += weight * dx
        self.my += weight * dy
        self.sxx = (1.0 - slow) * (self.sxx + slow * dx * dx)
        self.sxy = (1.0 - slow) * (self.sxy + slow * dx * dy)
        self.n += 1

    def line(self, ridge: float, weight: float) -> tuple[float, float]:
        """``(gain, offset)``: the gain within [-0.5, 2], the line through the means."""
        samples = min(self.n, 5.0 / weight)  # what the co-moments average over
        gain = (samples * self.sxy + ridge * self.prior) / (samples * self.sxx + ridge) if ridge > 0 or self.sxx > 0 \
            else self.prior
        gain = min(max(gain, -0.5), 2.0)
        return gain, self.my - gain * self.mx


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """``np.interp(x, xs, ys)`` for one ``x``, with numpy's arithmetic (flat outside ``xs``)."""
    j = bisect.bisect_right(xs, x) - 1
    if j < 0:
        return ys[0]
    if j >= len(xs) - 1 or xs[j] == x:
        return ys[j]
    return (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]) * (x - xs[j]) + ys[j]


class StepCost:
    """A whole step's cost, as the verify-budget choice needs it (``dcut.selection.CostLookup``):
    verifying ``tokens`` at mean ``context`` plus the drafter's pass at ``width`` (already paid, but part
    of the step the tokens are spread over) plus the engine's per-step overhead."""

    def __init__(self, table: CostTable, width: int, overhead_ms: float = 0.0, context: float | None = None) -> None:
        self.table, self.width, self.overhead_ms, self.context = table, width, overhead_ms, context

    def costs(self, bs: int, verify_tokens: np.ndarray) -> np.ndarray | None:
        verify = self.table.costs(bs, verify_tokens, self.context)
        if verify is None:
            return None
        return verify + ((self.table.draft_cost(bs, self.width) or 0.0) + self.overhead_ms)


def profile_token_points(bs: int, k: int, ratios: Sequence[float] = PROFILE_RATIOS) -> list[int]:
    """The verify-token counts profiled for one batch size: ``bs + bucket_budget(ratio)``."""
    return sorted({bs + bucket_budget(r, bs, k) for r in ratios})


def profile_cost_table(
    run_step: Callable[[int, int], None],
    batch_sizes: Sequence[int],
    k: int,
    fingerprint: Fingerprint,
    warmups: int = 2,
    repeats: int = 3,
    ratios: Sequence[float] = PROFILE_RATIOS,
    timer: Callable[[], float] = time.perf_counter,
    progress: bool = True,
    run_draft: Callable[[int, int], None] | None = None,
    widths: Sequence[int] = (),
) -> CostTable:
    """Time ``run_step(bs, verify_tokens)`` at each bucket's shape, and ``run_draft(bs, width)`` at
    each width; median of the repeats, verify rows smoothed.

    Both callables must block until the work is done (synchronise the device) so the timing is real.
    """
    shapes = [("verify", bs, t) for bs in batch_sizes for t in profile_token_points(bs, k, ratios)]
    if run_draft is not None:
        shapes += [("draft", bs, w) for bs in batch_sizes for w in widths]
    points: dict[int, list[Point]] = {}
    draft: dict[int, dict[int, tuple[float, int]]] = {}
    for kind, bs, n in tqdm(shapes, desc="dcut profile", unit="shape", disable=not progress):
        run = run_step if kind == "verify" else run_draft
        assert run is not None
        for _ in range(warmups):
            run(bs, n)
        times = []
        for _ in range(repeats):
            start = timer()
            run(bs, n)
            times.append((timer() - start) * 1000.0)
        if kind == "verify":
            points.setdefault(bs, []).append((n, statistics.median(times), repeats))
        else:
            draft.setdefault(bs, {})[n] = (statistics.median(times), 1)
    return CostTable(fingerprint, points, draft=draft).smoothed()


def _weighted(cells: Sequence[tuple[float, int]]) -> tuple[float, int]:
    """Sample-count-weighted mean of (value, samples) cells, and the total sample count."""
    total = sum(n for _, n in cells)
    return (sum(v * n for v, n in cells) / max(1, total), total)


def _combine(a: Point, b: Point) -> Point:
    """Sample-count-weighted mean of two measurements of the same shape."""
    n = a[2] + b[2]
    return (a[0], (a[1] * a[2] + b[1] * b[2]) / n if n else (a[1] + b[1]) / 2, n)


def _differences(want: Fingerprint, got: Fingerprint) -> str:
    """``field: wanted 'x', table has 'y'`` for every field that differs."""
    mine, theirs = want.model_dump(), got.model_dump()
    return "; ".join(f"{name}: wanted {mine[name]!r}, table has {theirs[name]!r}"
                     for name in mine if mine[name] != theirs[name])


DEFAULT_CACHE_DIR = Path.home() / ".cache" / "dcut" / "cost_tables"


def cached_table_path(cache_dir: str | None, key: str) -> Path:
    """Where an engine caches the table of fingerprint ``key`` (``DCutSettings.cache_dir``, else the default)."""
    return (Path(cache_dir) if cache_dir else DEFAULT_CACHE_DIR) / f"{key}.json"

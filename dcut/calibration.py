"""Online calibration of draft confidence against observed acceptance, per draft position.

A drafter's softmax probability is not the probability that the target accepts the draft, and
the gap differs by position. D-Cut ranks drafts across requests by these numbers, so a drafter
that is over-confident at late positions makes it keep the wrong drafts. The calibrator counts,
per (position, confidence bin), how often a draft that was actually reached was accepted, and
maps a raw confidence to that rate, smoothed in two levels: a bin's rate is shrunk towards the raw
value scaled by its position's ratio of acceptances to raw confidence (how far off the drafter is there),
and that ratio towards 1. A sparse bin thus keeps its rank among its position's drafts but is corrected
by what its position shows; only a position nothing has verified keeps the raw value.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dcut.learned import CalibrationState

# A position verified fewer times than this takes the fallback (pooled) calibrator's counts there, where it has
# seen the position this often.
BORROW_BELOW = 32
# A position verified fewer times than this (and not by the fallback) is mapped as the deepest earlier position
# verified more often. Raw confidence there would be the alternative, and for a drafter that is under-confident deep
# in its block (the MoE pair's: ECE about 0.6 from position 3) raw makes those drafts look worthless, so the policy
# cuts them, so they are never verified, so they are never calibrated: a width stays judged on numbers nothing ever
# checked. Only this thin: a position seen more often is calibrated on its own counts (the two levels of smoothing
# hold a thin bin to its position's rate). Borrowed up to BORROW_BELOW, an all-or-nothing drafter's deep positions,
# accepted whenever reached, took position 0's rate (0.57 in 64 blocks of the MoE pair's requests, mostly at their
# start), every position compounding it: width 15 was priced at half a plain step and never drafted again.
EARLIER_BELOW = 8


class Calibrator:
    """Maps raw confidence to the observed conditional acceptance probability, per position.

    ``prior`` is the strength, in pseudo-observations, of each level's prior: a bin's rate is centred on raw
    times its position's ratio (acceptances over summed raw confidence), that ratio on 1. Bins or positions
    with fewer than ``min_count`` observations are not used (a bin takes the scaled raw value, a position
    passes raw through).

    Why two levels: a drafter's raw confidence can be far off (the MoE pair's deep drafts: raw about 0.05,
    accepted 99% of the time). Centred on raw, every bin with few outcomes mapped to nearly raw, so a block
    whose deep drafts fell in thin bins was priced far below what it delivered. Centred on the position's
    rate instead, the thin low-confidence bins of a drafter that ranks its drafts well were priced above.
    """

    def __init__(self, k: int, bins: int = 10, prior: float = 4.0, min_count: int = 8,
                 fallback: Calibrator | None = None) -> None:
        """``fallback``: a calibrator (of as many bins, at least ``k`` positions) whose counts a position verified
        too rarely here takes first (``_rows``)."""
        if k < 1 or bins < 1 or prior < 0 or min_count < 0:
            raise ValueError("need k >= 1, bins >= 1, prior >= 0, min_count >= 0")
        if fallback is not None and (fallback.k < k or fallback.bins != bins):
            raise ValueError("a fallback calibrator needs as many bins and at least as many positions")
        self.k, self.bins, self.prior, self.min_count, self.fallback = k, bins, prior, min_count, fallback
        self.version = 0  # counts changed (a calibrator that falls back on this one rebuilds its table)
        self.first_drafts = 0.0  # observations at position 0 (read every drafting step: kept, not summed)
        # Per (position, raw-confidence bin): observations, acceptances, sum of raw confidence.
        self.count = np.zeros((k, bins))
        self.accepted = np.zeros((k, bins))
        self.raw_sum = np.zeros((k, bins))
        # The same for the calibrated prediction made *before* each observation was counted
        # (binned by calibrated value): an honest, out-of-sample reliability measure.
        self.cal_count = np.zeros((k, bins))
        self.cal_accepted = np.zeros((k, bins))
        self.cal_sum = np.zeros((k, bins))
        self._table: tuple[int, np.ndarray, np.ndarray] | None = None  # ``_lut``: fallback version, a, b
        self._held: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # outcomes ``observe`` has not counted yet

    def observe(self, log_conf: np.ndarray, proposed_depths: np.ndarray, accepted: np.ndarray) -> None:
        """``update``, deferred until ``flush``: counting costs a few dozen small array operations whatever the
        rows, so the engine counts a few steps' outcomes in one update (``dcut.vllm.state.ACCOUNT_STEPS``).
        Reading the counts (``state``, ``reliability``) counts what is held first."""
        self._held.append((log_conf[:, : self.k], proposed_depths, accepted))

    def flush(self) -> None:
        """Count every held outcome (rows of narrower blocks padded with drafts of confidence 0, never
        reached: a row verified only its own drafts)."""
        held, self._held = self._held, []
        if not held:
            return
        width = max(c.shape[1] for c, _, _ in held)
        conf = np.full((sum(c.shape[0] for c, _, _ in held), width), -np.inf)
        row = 0
        for c, _, _ in held:
            conf[row: row + c.shape[0], : c.shape[1]] = c
            row += c.shape[0]
        self.update(conf, np.concatenate([p for _, p, _ in held]), np.concatenate([a for _, _, a in held]))

    def update(self, log_conf: np.ndarray, proposed_depths: np.ndarray, accepted: np.ndarray) -> None:
        """Count one step's outcomes.

        ``log_conf`` ``[n, K]`` are the raw log-confidences of the drafts; request i verified its
        first ``proposed_depths[i]`` drafts and the first ``accepted[i]`` were accepted. Draft t
        was reached (an observation) iff ``t <= accepted[i]`` and ``t < proposed_depths[i]``;
        it was accepted iff ``t < accepted[i]``.
        """
        log_conf = np.asarray(log_conf, dtype=np.float64)[:, : self.k]
        if log_conf.shape[0] == 0:
            return
        k = log_conf.shape[1]
        proposed = np.minimum(np.maximum(np.asarray(proposed_depths, dtype=np.int64), 0), k)[:, None]
        acc = np.asarray(accepted, dtype=np.int64)[:, None]
        positions = np.arange(k)
        observed = (positions <= acc) & (positions < proposed)
        hit = (positions < acc).astype(np.float64)
        raw = _prob(log_conf)
        # The prediction before counting this step (the out-of-sample reliability), from the table the step's
        # drafts were priced with: rebuilding the smoothed rates on the host cost more than the counting.
        calibrated = np.exp(self.calibrate(log_conf)).astype(np.float64)
        self._count(self.count, self.accepted, self.raw_sum, raw, observed, hit)
        self._count(self.cal_count, self.cal_accepted, self.cal_sum, calibrated, observed, hit)
        self._changed()

    def calibrate(self, log_conf: np.ndarray) -> np.ndarray:
        """Log of the calibrated acceptance probability (float32, on the host), same shape as ``log_conf``.

        The smoothed bin rates are a lookup table rebuilt (once per update, off the decide path) as
        ``cal = a[cell] + b[cell] * raw``. Positions beyond the calibrator's ``k`` pass through unchanged.
        """
        log_conf = np.asarray(log_conf, dtype=np.float32)
        k = min(self.k, log_conf.shape[-1])
        a, b = self._lut()
        raw = _prob(log_conf[..., :k])  # (ufuncs, not np.clip / np.nan_to_num: dcut.selection.prefix_scores)
        cell = np.arange(0, k * self.bins, self.bins) + self._bin(raw)
        with np.errstate(divide="ignore"):  # a rate of 0: log -inf, a draft no budget keeps
            calibrated = np.minimum(np.log(a[cell] + b[cell] * raw), 0.0)
        return calibrated if k == log_conf.shape[-1] else np.concatenate([calibrated, log_conf[..., k:]], axis=-1)

    def lookup_table(self) -> tuple[np.ndarray, np.ndarray]:
        """``(a, b)``, each ``[k, bins]`` float32, with ``calibrated = a + b * raw`` per (position, bin): the table
        the device-side cut gathers from (``dcut.cut.CalibrationTable``), rebuilt here when the counts change."""
        a, b = self._lut()
        return a.reshape(self.k, self.bins), b.reshape(self.k, self.bins)

    def state(self) -> CalibrationState:
        """The counts, for ``dcut.learned`` (a new replica starts from them)."""
        self.flush()
        return CalibrationState(**{f: getattr(self, f).tolist() for f in CalibrationState.model_fields})

    def load(self, state: CalibrationState) -> None:
        """Take over ``state``'s counts (same positions and bins)."""
        for f in CalibrationState.model_fields:
            values = np.array(getattr(state, f), dtype=np.float64)
            if values.shape != getattr(self, f).shape:
                raise ValueError(f"calibration state of shape {tuple(values.shape)}, "
                                 f"expected {tuple(self.count.shape)}")
            setattr(self, f, values)
        self._held = []
        self._changed()

    def reliability(self) -> dict[str, Any]:
        """Per-position expected calibration error of raw and of calibrated confidence.

        ECE = sum over bins of (bin share) x |acceptance rate - mean confidence|. The calibrated
        ECE uses predictions made before each outcome was counted, so it is out-of-sample.
        """
        self.flush()
        return {
            "observations": self.count.sum(1).astype(np.int64).tolist(),
            "ece_raw": _ece(self.count, self.accepted, self.raw_sum),
            "ece_calibrated": _ece(self.cal_count, self.cal_accepted, self.cal_sum),
            "acceptance_rate": _safe_div(self.accepted.sum(1), self.count.sum(1)),
        }

    def _changed(self) -> None:
        """The counts changed: the lookup table is rebuilt at its next use, a calibrator falling back on this one
        rebuilds its own (``version``), and the position-0 count is taken again."""
        self._table = None
        self.version += 1
        self.first_drafts = float(self.count[0].sum())

    def _bin(self, prob: np.ndarray) -> np.ndarray:
        return np.minimum((prob * self.bins).astype(np.int64), self.bins - 1)  # (prob >= 0)

    def _rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Observations, acceptances and summed raw confidence per (position, bin) to calibrate with. A position
        verified fewer than ``BORROW_BELOW`` times takes the fallback's counts there, if it has enough; one verified
        fewer than ``EARLIER_BELOW`` times, the counts of the deepest earlier position verified more (why: above).
        The fallback first: a drafter's raw confidence at a deep position is distributed as at that position, not
        as at an earlier one (the MoE pair's width 15, borrowing position 1's mapping, priced its deep drafts at 0.07
        where 99 % were accepted; the pooled calibrator had seen hundreds of them from width-7 blocks)."""
        count, accepted, raw_sum = self.count, self.accepted, self.raw_sum
        n = count.sum(1)
        if self.fallback is not None:
            f_count, f_accepted, f_raw = (t[: self.k] for t in self.fallback._rows())
            use = ((n < BORROW_BELOW) & (f_count.sum(1) >= BORROW_BELOW))[:, None]
            count, accepted, raw_sum = (np.where(use, f, o) for f, o in
                                        ((f_count, count), (f_accepted, accepted), (f_raw, raw_sum)))
            n = count.sum(1)
        source, last = list(range(self.k)), None
        for t, seen in enumerate(n.tolist()):
            if seen >= EARLIER_BELOW:
                last = t
            elif last is not None:
                source[t] = last
        return count[source], accepted[source], raw_sum[source]

    def _lut(self) -> tuple[np.ndarray, np.ndarray]:
        """``(a, b)`` per (position, bin), flattened, with ``calibrated = a + b * raw``: both levels of smoothing
        are linear in raw (``tests/unit/test_calibration.py`` writes the formula out, and checks the table by it)."""
        version = -1 if self.fallback is None else self.fallback.version
        found = self._table
        if found is None or found[0] != version:
            count, accepted, raw_sum = self._rows()
            scale = self._scales(count, accepted, raw_sum)[:, None]  # the centre: raw * scale
            denom = np.maximum(count + self.prior, 1e-12)
            used = count >= max(self.min_count, 1)
            a = np.where(used, accepted / denom, 0.0)
            b = np.where(used, self.prior * scale / denom, scale)
            found = self._table = (version, a.reshape(-1).astype(np.float32), b.reshape(-1).astype(np.float32))
        return found[1], found[2]

    def _scales(self, count: np.ndarray, accepted: np.ndarray, raw_sum: np.ndarray) -> np.ndarray:
        """Per position, acceptances over summed raw confidence, shrunk towards 1 by ``prior`` observations of a
        raw confidence 1 (1 where the position has fewer than ``min_count`` observations)."""
        used = count.sum(1) >= max(self.min_count, 1)
        return np.where(used, (accepted.sum(1) + self.prior) / np.maximum(raw_sum.sum(1) + self.prior, 1e-12), 1.0)

    def _count(self, count: np.ndarray, accepted: np.ndarray, conf_sum: np.ndarray, prob: np.ndarray,
               observed: np.ndarray, hit: np.ndarray) -> None:
        """Add the observed drafts to their (position, bin) cells (``bincount``: one pass, no Python loop)."""
        cell = (np.arange(prob.shape[1]) * self.bins + self._bin(prob))[observed]
        size = count.size
        count += np.bincount(cell, minlength=size).reshape(count.shape)
        accepted += np.bincount(cell, weights=hit[observed], minlength=size).reshape(count.shape)
        conf_sum += np.bincount(cell, weights=prob[observed], minlength=size).reshape(count.shape)


def _prob(log_conf: np.ndarray) -> np.ndarray:
    """Probability in [0, 1]; NaN counts as 0 (``fmax`` drops a NaN)."""
    return np.minimum(np.fmax(np.exp(log_conf), 0.0), 1.0)


def _ece(count: np.ndarray, accepted: np.ndarray, conf_sum: np.ndarray) -> list[float | None]:
    total = count.sum(1)
    gap = np.abs(accepted - conf_sum).sum(1)  # sum_b n_b * |rate_b - conf_b|
    return _safe_div(gap, total)


def _safe_div(num: np.ndarray, den: np.ndarray) -> list[float | None]:
    """Elementwise ratio as floats; None where the denominator is 0 (nothing observed)."""
    return [None if d == 0 else float(x / d) for x, d in zip(num.tolist(), den.tolist(), strict=True)]


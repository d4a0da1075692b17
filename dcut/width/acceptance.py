"""What verification shows of each width: acceptance learned per (width, position), from the counted
outcomes and from the drafts' calibrated confidences, with an optimistic bound for widths little seen."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from dcut.selection import prefix_scores

OPTIMISM = 1.5  # upper confidence bound, in standard errors, on an unmeasured width's acceptance
BLOCKS = 64  # drafted blocks per width whose raw confidences ``rescore`` prices again (the moving average's span)


def marginal_gains(log_conf: np.ndarray) -> np.ndarray:
    """``g[j]`` = expected accepted drafts per request from the (j+1)-th draft per request of a block
    ``[bs, W]``, when drafts are kept by D-Cut's global top-k of prefix scores: the expected tokens of a
    budget of ``d * bs`` drafts are ``bs * (1 + sum(g[:d]))``. Non-increasing, in [0, 1]; at bs 1 it is
    the prefix score itself. (The mean prefix score per position would price a uniform depth per
    request, and miss what the global top-k is for: spending the budget on the requests that will
    accept it.) Blocks stacked ``[n, bs, W]`` give ``[n, W]``."""
    *lead, bs, w = log_conf.shape
    scores = -np.sort(-prefix_scores(log_conf).reshape(*lead, bs * w), axis=-1)
    running = np.zeros((*lead, bs * w + 1))
    np.cumsum(scores, axis=-1, out=running[..., 1:])
    return per_request_gains(running, bs)


def per_request_gains(cumulative: np.ndarray, bs: int) -> np.ndarray:
    """``marginal_gains`` from the running sum of a block's prefix scores sorted best first (``[..., bs*W + 1]``,
    from 0: what ``dcut.selection.select`` computes anyway, so a step need not sort twice)."""
    return np.diff(cumulative[..., :: bs], axis=-1) / bs  # the top j*bs drafts, per request


def position_counts(verified: np.ndarray, accepted: np.ndarray, k: int, step: np.ndarray | None = None,
                    steps: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per draft position t < k, over requests: how many verified draft t, how many reached it
    (verified it with every earlier draft accepted), how many accepted it. Request i verified its
    first ``verified[i]`` drafts and the first ``accepted[i]`` of those were accepted. With ``step``
    (request i's step, of ``steps``): the counts of each step, ``[steps, k]``."""
    positions = np.arange(k)
    n = np.minimum(np.maximum(np.asarray(verified, dtype=np.int64), 0), k)[:, None]
    a = np.minimum(np.asarray(accepted, dtype=np.int64)[:, None], n)
    masks = np.stack((positions < n, (positions < n) & (positions <= a), positions < a)).astype(np.int64)
    if step is None:
        return masks[0].sum(0), masks[1].sum(0), masks[2].sum(0)
    counts = (np.arange(steps)[:, None] == np.asarray(step)[None, :]).astype(np.int64) @ masks  # [3, steps, k]
    return counts[0], counts[1], counts[2]


class WidthStats:
    """Per (width, position): requests that reached the position and how many were accepted.

    ``reached[w, t]`` counts verified drafts at position t of a block drafted at width ``w``
    whose earlier drafts were all accepted; ``accepted[w, t]`` those accepted too. The ratio is the
    conditional acceptance ``q_w[t]``; its running product the survival ``s_w[t]``. Counts are
    capped (scaled down together) so the estimate follows a changing workload.
    """

    def __init__(self, widths: Sequence[int], k: int, prior_q: float = 0.5, prior_weight: float = 2.0,
                 cap: float = 4096.0) -> None:
        self.widths = list(widths)
        self.k = k
        self.prior_q, self.prior_weight, self.cap = prior_q, prior_weight, cap
        # numpy: the counts are small and read on the host (a torch op on them costs several numpy ones)
        self.reached = np.zeros((len(self.widths), k))
        self.accepted = np.zeros((len(self.widths), k))
        self._index = {w: i for i, w in enumerate(self.widths)}
        self._survival: dict[float, np.ndarray] = {}
        # Mean (calibrated) prefix score of every drafted block, per width: the survival the drafter's own
        # confidences predict, over all drafts, cut or not.
        self.expected = np.zeros((len(self.widths), k))
        self.expected_requests = np.zeros(len(self.widths))
        self._blocks: dict[int, deque[np.ndarray]] = {w: deque(maxlen=BLOCKS) for w in self.widths if w}

    def observe(self, width: int, reached: np.ndarray, accepted: np.ndarray) -> None:
        """Count per-position ``reached`` and ``accepted`` (``position_counts``, on the host) for ``width``."""
        i = self._index.get(width)
        if i is None or width == 0:
            return
        self.reached[i] += np.asarray(reached, dtype=np.float64)
        self.accepted[i] += np.asarray(accepted, dtype=np.float64)
        self._survival = {}
        self._cap()

    def _cap(self) -> None:
        """Scale a width's counts down together where they pass ``cap`` (so the estimate follows the workload)."""
        scale = self.cap / np.maximum(self.reached.max(axis=1, keepdims=True), self.cap)
        self.reached *= scale
        self.accepted *= scale

    def observe_scores(self, width: int, gains: np.ndarray, requests: int, weight: float = 0.02) -> None:
        """Fold in one drafted block's ``marginal_gains`` (``[width]``, from calibrated confidences).

        Counted acceptance alone is biased wherever D-Cut cuts: only the most confident drafts are
        verified, so the acceptance counted at late positions is that of the best drafts, not of the
        block. Calibrated confidences cover every draft, cut or not, and price the block as D-Cut will
        spend it: a mean over the first ``1/weight`` requests, then a moving average."""
        i = self._index.get(width)
        if i is None or width == 0 or requests <= 0:
            return
        n = float(self.expected_requests[i])
        w = max(weight, requests / (n + requests))
        self.expected[i, :width] += w * (gains[:width] - self.expected[i, :width])
        self.expected_requests[i] += requests
        self._survival = {}

    def observe_block(self, log_conf: np.ndarray) -> None:
        """Keep a drafted block's raw log-confidences (``[bs, W]``) for ``rescore``."""
        blocks = self._blocks.get(log_conf.shape[-1])
        if blocks is not None and log_conf.shape[0]:
            blocks.append(log_conf)

    def rescore(self, calibrate: Callable[[int, np.ndarray], np.ndarray]) -> None:
        """Price each width again from its last ``BLOCKS`` drafted blocks under the calibration of now
        (``calibrate(width, log_conf)``): the mean of their ``marginal_gains``, by requests.

        ``observe_scores`` prices a block once, under the calibration of the moment it was drafted. A width
        drafted a few times early, when calibration was thin (raw passes through), keeps that price however
        much is learned later; for a drafter under-confident deep in its block (the MoE pair's), that price is
        far too low, the width is never drafted again and nothing ever corrects it (seen: width 15 priced at
        half what it delivered, and ``joint`` stuck at width 7 at 0.6x of drafting 15)."""
        for i, w in enumerate(self.widths):
            blocks = self._blocks.get(w)
            if not blocks:
                continue
            by_bs: dict[int, list[np.ndarray]] = {}
            for b in blocks:
                by_bs.setdefault(b.shape[0], []).append(b)
            total = np.zeros(w)
            for bs, group in by_bs.items():
                total += marginal_gains(calibrate(w, np.stack(group))).sum(0) * bs
            self.expected[i, :w] = total / sum(b.shape[0] for b in blocks)
        self._survival = {}

    def load(self, reached: Sequence[Sequence[float]], accepted: Sequence[Sequence[float]],
             expected: Sequence[Sequence[float]], expected_requests: Sequence[float]) -> None:
        """Take over counts and gains learned elsewhere (``dcut.learned``), capped like this stats' own."""
        self.reached = np.array(reached, dtype=np.float64)
        self.accepted = np.array(accepted, dtype=np.float64)
        self._cap()
        self.expected = np.array(expected, dtype=np.float64)
        self.expected_requests = np.array(expected_requests, dtype=np.float64)
        self._survival = {}

    def conditional(self) -> np.ndarray:
        """``q[w, t]``, Beta-smoothed towards the pooled rate of position t over all widths."""
        accepted, reached = self.accepted, self.reached
        pooled = (accepted.sum(0) + self.prior_weight * self.prior_q) / (reached.sum(0) + self.prior_weight)
        return (accepted + self.prior_weight * pooled) / (reached + self.prior_weight)

    def survival(self, optimism: float = 0.0) -> np.ndarray:
        """``s[w, t]`` = P(drafts 0..t of a width-w block all accepted); 0 past each width.

        A width that has been drafted: the mean prefix score of its blocks (``observe_scores``). One
        never drafted: at positions some wider block reached, those blocks' mean prefix scores (DFlash
        acceptance depends on the width, so this is a prior); elsewhere the product of counted
        conditional rates, pooled over widths. With ``optimism`` > 0 each is raised by that many
        standard errors of a Beta posterior on its observations (``q + z sqrt(q (1 - q) / (n + prior))``,
        at most 1): an upper confidence bound, so an untried width looks as good as it might be until
        there is evidence. Recomputed only after new observations
        (it is read before every drafting pass)."""
        found = self._survival.get(optimism)
        if found is None:
            z, prior = optimism, self.prior_weight
            q = self.conditional()
            if z:
                q = np.minimum(q + z * np.sqrt(q * (1 - q) / (self.reached + prior)), 1.0)
            s = np.cumprod(q, axis=1)
            # Drafted widths: what their confidences predict. Widths not drafted yet: where a wider block was
            # drafted, what its confidences predict at the same positions (pooled over blocks, by requests).
            expected, drafted = self.expected, self.expected_requests
            beyond = np.arange(self.k)[None, :] >= np.asarray(self.widths)[:, None]
            requests = drafted[:, None] * ~beyond
            pooled_n = requests.sum(0)
            pooled = (requests * expected).sum(0) / np.maximum(pooled_n, 1e-9)
            scored = (drafted > 0)[:, None]
            e = np.where(scored, expected, pooled[None, :])
            n = np.where(scored, drafted[:, None], pooled_n[None, :])
            if z:  # the same bound, on as many observations as requests drafted at those positions
                e = np.minimum(e + z * np.sqrt(np.maximum(e * (1 - e) / (n + prior), 0.0)), 1.0)
                e = np.minimum.accumulate(e, axis=1)
            found = self._survival[optimism] = np.where(beyond, 0.0, np.where(n > 0, e, s))
        return found

    def observations(self) -> dict[int, int]:
        """Requests observed at position 0, per width (how much each width's estimate rests on)."""
        return {w: int(self.reached[i, 0]) for i, w in enumerate(self.widths) if w}

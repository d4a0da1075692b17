"""Keep-ratio buckets: how many drafts a keep ratio keeps. Pure arithmetic, no torch: the cost table's
profiling grid is built from it, and the Serve control plane (ingress, controller) reads cost tables without
loading torch."""

from __future__ import annotations

import math

REFERENCE_RATIOS = (0.25, 0.5, 0.75, 1.0)  # mode reference's four buckets


def bucket_budget(ratio: float, bs: int, k: int) -> int:
    """Drafts kept across the batch for keep ratio ``ratio``.

    We follow the reference implementation, not the seed text's ``ceil(ratio*bs*(D-1))``: the
    ratio applies to all ``bs*(k+1)`` verify slots including the ``bs`` anchor slots, which are
    then removed: ``max(0, ceil(ratio*bs*(k+1)) - bs)``, clamped to ``bs*k``. Both agree at
    ratio 1; ours prunes harder at small ratios (ratio 0.25, k=15 keeps 3 drafts per request).
    """
    slots = ratio * bs * (k + 1)
    return min(bs * k, max(0, math.ceil(slots - 1e-9 * max(1.0, slots)) - bs))

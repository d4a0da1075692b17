"""What D-Cut reads from one pass of the drafter: the log-confidence of each token it drafts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class DraftPass:
    """One ``SpecDecodeBaseProposer.propose`` call, as ``dcut.vllm.confidence`` records it.

    While the drafter runs, ``sink`` collects ``log p(token)`` of each batch of tokens it samples, in the
    order it samples them; ``finish`` turns them into ``log_conf``, which the runner reads after drafting.
    """

    sink: list[Tensor] | None = field(default_factory=list)  # None once the pass is over
    log_conf: Tensor | None = None  # [bs, width], the drafts' shape; None: not captured, or shapes differ

    def finish(self, drafts: Any) -> None:
        """Close the sink and shape its parts like ``drafts``: parallel drafting (DFlash) samples bs*K rows
        at once, autoregressive drafters K batches of [bs]."""
        parts, self.sink = self.sink, None
        if torch.is_tensor(drafts) and parts:
            log_conf = parts[0].view(drafts.shape) if len(parts) == 1 else torch.stack(parts, dim=1)
            self.log_conf = log_conf if log_conf.shape == drafts.shape else None

"""Cost models for replay: the engine's two-part cost table plus the engine's time outside the model.

A cost model is the cost-table JSON the engine uses (``dcut.cost_table.CostTable.to_json``: verify
cost by batch size and verify tokens, drafter cost by batch size and width) with two extra keys the
engine ignores: ``overhead`` (``{"per_step_ms", "per_token_ms"}``: the engine's work outside the
model, per step and per emitted token) and ``none`` (``{bs: ms}``, optional: a step of ``none``, no speculation,
an engine with no drafter at all; when absent, the verify cost of ``bs`` tokens; cost models written before it was
named ``none`` call it ``plain``, read as well), ``host`` (optional: D-Cut's own host work a step, charged to the
policies that decide with it, ``dcut.replay.host``) and ``notes`` (how it was made).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcut.cost_table import CostTable
from dcut.replay.host import HostWork


@dataclass
class CostModel:
    """What a step costs in a replay (ms)."""

    name: str
    table: CostTable
    per_step_ms: float = 0.0
    per_token_ms: float = 0.0
    none_ms: dict[int, float] = field(default_factory=dict)  # a step of ``none`` per batch size
    notes: list[str] = field(default_factory=list)
    prior: CostTable | None = None  # what a policy starts from (an engine's profiled table), when not the truth
    host: HostWork | None = None  # D-Cut's decision's host work a step (None: free)

    def for_policies(self) -> CostModel:
        """The costs a policy is handed: the prior table where there is one (an engine profiles dummy steps
        at start and refines from live ones), else these."""
        if self.prior is None:
            return self
        return CostModel(self.name, self.prior, self.per_step_ms, self.per_token_ms, {}, self.notes, host=self.host)

    def verify(self, bs: int, tokens: int, context: float | None = None) -> float:
        """The target's step verifying ``tokens`` (bs anchors + kept drafts) for ``bs`` requests at mean
        ``context`` (priced only where the table has a context term, ``dcut.context_cost``)."""
        cost = self.table.lookup(bs, tokens, context)
        if cost is None:
            raise ValueError(f"cost model {self.name} does not cover batch size {bs}")
        return cost

    def draft(self, bs: int, width: int) -> float:
        """The drafter's pass at ``width`` (0: keeping the drafter in sync without drafting)."""
        cost = self.table.draft_cost(bs, width)
        if cost is None:
            raise ValueError(f"cost model {self.name} has no drafter cost at batch size {bs}")
        return cost

    def none(self, bs: int, context: float | None = None) -> float:
        """A step of ``none`` (no speculation: no drafter in the engine), overhead excluded; a measured one pays
        the table's context term for its ``bs`` tokens as well."""
        cover = self.table.covering(bs)
        if cover is not None and cover in self.none_ms:
            extra = 0.0 if self.table.context is None else self.verify(bs, bs, context) - self.verify(bs, bs)
            return self.none_ms[cover] + extra if extra else self.none_ms[cover]
        return self.verify(bs, bs, context)

    def overhead(self, tokens: float) -> float:
        """The engine's time outside the model for a step emitting ``tokens``."""
        return self.per_step_ms + self.per_token_ms * tokens

    def host_ms(self, bs: int, width: int) -> float:
        """D-Cut's decision's host work on a step of ``bs`` requests drafting ``width`` (0 where none is modelled)."""
        return 0.0 if self.host is None else self.host.ms(bs, width)

    def batch_sizes(self) -> list[int]:
        return sorted(self.table.points)

    def to_json(self) -> dict[str, Any]:
        data = self.table.to_json()
        data["name"] = self.name
        data["overhead"] = {"per_step_ms": self.per_step_ms, "per_token_ms": self.per_token_ms}
        data["none"] = {str(b): ms for b, ms in sorted(self.none_ms.items())}
        data["notes"] = list(self.notes)
        if self.prior is not None:
            data["policy_table"] = self.prior.to_json()
        if self.host is not None:
            data["host"] = self.host.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], name: str | None = None) -> CostModel:
        overhead = data.get("overhead") or {}
        none = data["none"] if "none" in data else data.get("plain")  # "plain": the key's name before "none"
        # Monotone in tokens as the engine's profiled tables are (raw medians of a noisy run may not be).
        return cls(name or data.get("name") or data["fingerprint"]["model"], CostTable.from_json(data).smoothed(),
                   float(overhead.get("per_step_ms", 0.0)), float(overhead.get("per_token_ms", 0.0)),
                   {int(b): float(ms) for b, ms in (none or {}).items()}, list(data.get("notes", [])),
                   CostTable.from_json(data["policy_table"]) if data.get("policy_table") else None,
                   HostWork.from_json(data["host"]) if data.get("host") else None)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, name: str | None = None) -> CostModel:
        return cls.from_json(json.loads(Path(path).read_text()), name)


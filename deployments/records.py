"""Records that cross deployment boundaries (replica -> controller -> ingress/autoscaler)."""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, Field

CostTableSource = Literal["controller", "profiled", "config", "none"]

# Keys of record_autoscaling_stats(); the autoscaling policy reads them back.
CAPACITY_KEY = "capacity_tokens_per_s"
DEMAND_KEY = "demand_tokens_per_s"


def fingerprint_key(fingerprint: dict) -> str:
    """A short stable key for a hardware/model fingerprint (canonical JSON, SHA-1)."""
    return hashlib.sha1(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:16]


class EngineLoad(BaseModel):
    """What the replica sees of its own engine."""

    ongoing_requests: int = 0
    engine_requests: int = 0
    generated_tokens_total: int = 0
    aborted_total: int = 0
    failed_total: int = 0
    tokens_per_s: float = 0.0


class ReplicaReport(BaseModel):
    """One replica's telemetry, sent to the controller every ``telemetry_interval_s``."""

    replica_id: str
    fingerprint_key: str
    served_model_name: str
    cost_table_source: CostTableSource
    start_seconds: float
    sent_at: float
    load: EngineLoad
    capacity_tokens_per_s: float
    demand_tokens_per_s: float
    dcut: dict = Field(default_factory=dict, description="dcut.vllm.api.read_stats() summary.")


class CostTableOffer(BaseModel):
    """The controller's answer to a starting replica."""

    action: Literal["use", "profile", "wait"]
    table: dict | None = None

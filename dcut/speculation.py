"""Speculation per request: a client's cap on how many drafts D-Cut may verify for its request, and what
speculation did for it.

A request carries ``"speculation"`` beside its sampling fields: ``false`` (decode plainly, in the same steps as
its speculating neighbours), ``true`` (the deployment's default), or ``{"max_width": N}`` with 0 <= N <= K. The
serving layer validates it (``parse_cap``, a 400 that names the field) and hands the cap to the engine in the
request's ``extra_args`` (``EXTRA_ARG``); the plugin keeps every request's drafts within its cap, and the batch's
drafted width within the largest cap in the batch. Verifying fewer drafts is lossless, so a capped request's greedy
output is the target's.

``RequestSpeculation`` counts, per request, the steps it was decoded in and the drafts it was given, verified and
had accepted: what the response's ``usage.speculation`` reports and what the per-request acceptance histogram
observes.

A seeded sampled request (``seed`` set, temperature > 0) that gives no ``max_width`` of its own is decoded plainly
(cap 0). Which random draws make its text depends on how many of its drafts are verified, and D-Cut decides that
from its neighbours and from what the engine has learned; with none verified, vLLM draws for it exactly as for a
request without speculation, so its text is the target's alone with that seed, in any batch, on any replica. A
``max_width`` trades that for speed: the text is still a sample of the target's distribution, not the same one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

from pydantic import BaseModel, Field

FIELD = "speculation"  # the request field (HTTP body)
EXTRA_ARG = "dcut_max_width"  # SamplingParams.extra_args key the engine reads
KEPT_RECORDS = 4096  # finished requests whose usage can still be read


def parse_cap(value: Any, k: int, default: int | None = None) -> int | None:
    """The cap a request's ``speculation`` field asks for (None: no cap beyond the deployment's ``default``).

    ``false`` -> 0, ``true`` -> the default, ``{"max_width": N}`` -> N (0 <= N <= k, above the default too: the
    default is what a request gets without asking). Anything else raises a ValueError naming the field.
    """
    if value is None or value is True:
        return default
    if value is False:
        return 0
    if isinstance(value, dict):
        unknown = set(value) - {"max_width"}
        if unknown:
            raise ValueError(f"{FIELD}: unknown key(s) {', '.join(sorted(unknown))}; expected {{\"max_width\": N}}")
        n = value.get("max_width")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= k:
            raise ValueError(f"{FIELD}.max_width: expected an integer from 0 to {k}, got {n!r}")
        return n
    raise ValueError(f"{FIELD}: expected true, false or {{\"max_width\": N}} with 0 <= N <= {k}")


def cap_of(extra_args: dict | None, k: int, default: int | None = None, seeded: bool = False) -> int:
    """The cap the engine applies to a request: its own, else 0 for a seeded sampled one (``seeded``; see above),
    else the engine's ``default``, else k."""
    raw = (extra_args or {}).get(EXTRA_ARG)
    if raw is None:
        raw = 0 if seeded else k if default is None else default
    return max(0, min(int(raw), k))


@dataclass
class SpeculationUsage:
    """What speculation did for one request (its ``usage.speculation``)."""

    steps: int = 0  # decode steps that verified drafts or could have (every step after its prefill)
    drafted_tokens: int = 0  # drafts the drafter produced for it, within its cap
    verified_tokens: int = 0  # drafts the target verified (what D-Cut's cut and the scheduler left)
    accepted_tokens: int = 0  # drafts the target accepted

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted per verified draft; None when nothing was verified."""
        return self.accepted_tokens / self.verified_tokens if self.verified_tokens else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate}


class RequestSpeculation:
    """Per-request caps and usage for one engine; finished requests stay readable (bounded)."""

    def __init__(self, k: int, default: int | None = None) -> None:
        self.k = k
        self.default = default  # the cap of a request that sets none (DCutSettings.default_max_width)
        self.caps: dict[str, int] = {}
        self.running: dict[str, SpeculationUsage] = {}
        self.finished: OrderedDict[str, SpeculationUsage] = OrderedDict()

    def caps_for(self, req_ids: list[str], cap_inputs: Callable[[str], tuple[dict | None, bool]]) -> list[int]:
        """Each request's cap; ``cap_inputs(req_id)``: its SamplingParams.extra_args and whether it is seeded and
        sampled (read once per request)."""
        out = []
        for r in req_ids:
            cap = self.caps.get(r)
            if cap is None:
                extra_args, seeded = cap_inputs(r)
                cap = self.caps[r] = cap_of(extra_args, self.k, self.default, seeded)
            out.append(cap)
        return out

    def step(self, req_ids: list[str], caps: list[int] | None, width: int, verified: list[int] | None = None,
             accepted: list[int] | None = None) -> None:
        """One engine step of ``req_ids``: a drafting pass at ``width`` (0: none), each request within its cap (None:
        K), and where the step verified drafts, how many each request had verified and accepted. One pass over the
        batch, not one per count: each pass is a Python loop over the batch on the engine's critical path."""
        running, usage = self.running, SpeculationUsage
        if not width and (verified is None or accepted is None):  # drafts nothing, verified nothing: a step, no more
            for r in req_ids:
                (running.get(r) or running.setdefault(r, usage())).steps += 1
            return
        n = len(req_ids)
        drafted = [min(width, self.k)] * n if caps is None else [min(width, cap) for cap in caps]
        if verified is None or accepted is None:
            verified = accepted = [0] * n
        for r, d, v, a in zip(req_ids, drafted, verified, accepted, strict=True):
            u = running.get(r) or running.setdefault(r, usage())  # (setdefault alone builds one each call)
            u.steps += 1
            u.drafted_tokens += d
            u.verified_tokens += v
            u.accepted_tokens += a

    def drop(self, req_ids: set[str]) -> None:
        """Requests that finished: their usage stays readable (the last ``KEPT_RECORDS``)."""
        for r in req_ids:
            self.caps.pop(r, None)
            u = self.running.pop(r, None)
            if u is not None:
                self.finished[r] = u
                self.finished.move_to_end(r)
                while len(self.finished) > KEPT_RECORDS:
                    self.finished.popitem(last=False)

    def usage(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Usage of the requests whose engine id starts with ``prefix`` (one response: n choices)."""
        found = {r: u for r, u in self.finished.items() if r.startswith(prefix)}
        found |= {r: u for r, u in self.running.items() if r.startswith(prefix)}
        return {r: u.as_dict() for r, u in found.items()}


def merged(usages: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One response's ``usage.speculation``: its requests' (choices') counts summed, the rate to 4 places."""
    total = SpeculationUsage(**{f.name: sum(int(u.get(f.name) or 0) for u in usages.values())
                                for f in fields(SpeculationUsage)})
    rate = total.acceptance_rate
    return {**asdict(total), "acceptance_rate": None if rate is None else round(rate, 4)}


ACCEPTANCE_BUCKETS = 10  # per-request acceptance rate in tenths: [0, 0.1), ..., [0.9, 1.0]


class AcceptanceHistogram(BaseModel):
    """Per-request acceptance rates (accepted / verified drafts) of the responses one replica served, by route:
    which traffic speculation helps. Requests that verified no drafts are counted apart (``unverified``)."""

    counts: dict[str, list[int]] = Field(default_factory=dict, description="route -> requests per tenth of "
                                         "acceptance rate, [0, 0.1) ... [0.9, 1.0]")
    unverified: dict[str, int] = Field(default_factory=dict, description="route -> requests with no draft verified")

    def add(self, route: str, rate: float | None) -> None:
        if rate is None:
            self.unverified[route] = self.unverified.get(route, 0) + 1
            return
        bucket = min(ACCEPTANCE_BUCKETS - 1, max(0, int(rate * ACCEPTANCE_BUCKETS)))
        self.counts.setdefault(route, [0] * ACCEPTANCE_BUCKETS)[bucket] += 1

"""Replay every policy on a case (a trace and a cost model) at each batch size; the report's figures.

Policies: no speculation (``none``), fixed widths verified in full (vLLM's fixed K), vLLM's dynamic
table (the best of those per batch size, as a user tuning it by hand would set it), the runner's
own modes (``full``, ``reference`` as the reference implementation sets it, ``continuous``, ``joint``), other engines'
rules (``dcut.replay.anchors``) and the oracle. Everything is a pure function of the inputs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tqdm import tqdm

from dcut.replay import anchors
from dcut.replay.costs import CostModel
from dcut.replay.policy import FixedWidth, Policy
from dcut.replay.simulate import (
    Cell,
    Drift,
    Pools,
    RunnerPolicy,
    SimClock,
    confidence_oracle,
    oracle,
    pooled,
    run_cell,
)
from dcut.settings import DCutSettings
from dcut.trace import Trace

STEPS = 400
WARMUP = 100
# Each cell is replayed from this many starts (``Pools.walk``) and pooled: from one start, where a policy's
# choice happens to settle decides a few percent (deep-cpu at bs 16: `joint` 4 % behind itself pinned to width 3 from
# the first start, 1.4 % over five), and a verdict on one path is a verdict on that path.
STARTS = 5
REFERENCE = DCutSettings(mode="reference", count_bonus=False, calibrate=False)  # the reference implementation's U
PRODUCT = DCutSettings(mode="joint")  # what app.config.yaml ships
PINNED = "joint-w"  # + N: ``PRODUCT`` pinned at width N (``policy_makers``), a diagnostic arm, not a baseline


@dataclass
class Case:
    """A trace replayed against a cost model at some batch sizes."""

    name: str
    trace: Trace
    cost: CostModel
    batch_sizes: list[int]
    description: str = ""
    context: float | None = None  # every step's mean context, instead of the trace's (where the costs price it)
    drift: Drift | None = None  # the machine's speed wandering over each cell's steps (None: steady)


PolicyMaker = Callable[[SimClock], Policy]


def policy_makers(case: Case, pools: Pools) -> Iterator[tuple[str, PolicyMaker, bool]]:
    """``(name, make(clock), none)`` for every policy replayed on ``case`` (``none``: no drafter in the engine)."""
    k, cost, widths = case.trace.k, case.cost.for_policies(), pools.widths
    yield "none", lambda clock: FixedWidth(0), True
    for w in widths:
        yield f"fixed-{w}", lambda clock, w=w: FixedWidth(w), False
    joint = PRODUCT.model_copy(update={"widths": [0, *widths]})  # replay can draft only the widths traced
    for name, settings in (("full", DCutSettings(mode="full")), ("reference", REFERENCE),
                           ("continuous", DCutSettings(mode="continuous")), ("joint", joint)):
        if max(widths) == k or name == "joint":
            yield name, lambda clock, n=name, s=settings: RunnerPolicy(n, s, cost, k, clock), False
    # joint pinned at each width (live: ``dcut compare``'s joint-wN arms): against fixed-N, which verifies every draft,
    # what D-Cut's cut is worth at that width; against joint, what its width choice is
    for w in widths:
        pinned = PRODUCT.model_copy(update={"widths": [w]})
        yield f"{PINNED}{w}", lambda clock, n=f"{PINNED}{w}", s=pinned: RunnerPolicy(n, s, cost, k, clock), False
    avail = [0, *widths]
    yield "vllm-adaptive", lambda clock: anchors.VLLMAdaptive(cost, k, avail), False
    yield "sglang-adaptive", lambda clock: anchors.SGLangAdaptive(cost, k, avail), False
    yield "sglang-adaptive-bs", lambda clock: _named(anchors.SGLangAdaptive(
        cost, k, avail, slots=anchors.SGLANG_BS_AWARE_SLOTS), "sglang-adaptive-bs"), False
    # TensorRT-LLM's table as a user would write it from a quick benchmark: mean acceptance per width.
    expected = {w: pools.mean_accepted(w) for w in widths}
    # (A user benchmarks each fixed width live: the true costs, as for the dynamic table.)
    yield "trtllm-schedule", lambda clock: anchors.TRTLLMSchedule.from_costs(case.cost, k, avail, expected), False


def _named(policy: Policy, name: str) -> Policy:
    policy.name = name
    return policy


def replay_case(case: Case, steps: int = STEPS, warmup: int = WARMUP, progress: bool = True,
                starts: int = STARTS) -> list[Cell]:
    """Every policy at every batch size, then ``dynamic``, the ``oracle`` and the ``oracle-conf``; each cell
    replayed from ``starts`` starts and pooled (``pooled``), each policy afresh from each."""
    pools = Pools(case.trace, case.context)
    makers = list(policy_makers(case, pools))
    cells: list[Cell] = []
    total = (len(makers) + 2) * len(case.batch_sizes) * starts
    with tqdm(total=total, desc=f"replay {case.name}", disable=not progress) as bar:
        def each(run: Callable[[int], Cell]) -> Cell:
            found = []
            for start in range(starts):
                found.append(run(start))
                bar.update()
            return pooled(found)

        for bs in case.batch_sizes:
            for _name, make, none in makers:
                cells.append(each(functools.partial(_replayed, make, none, case, pools, bs, steps, warmup)))
            cells.append(dynamic(cells, bs))
            cells.append(each(functools.partial(oracle, bs, pools, case.cost, steps, warmup, case.drift)))
            cells.append(each(functools.partial(confidence_oracle, bs, pools, case.cost, steps, warmup, case.drift)))
    return cells


def _replayed(make: PolicyMaker, none: bool, case: Case, pools: Pools, bs: int, steps: int, warmup: int,
              start: int) -> Cell:
    """One policy, made afresh, replayed from ``start``."""
    clock = SimClock()
    return run_cell(make(clock), bs, pools, case.cost, steps, warmup, clock, none=none, drift=case.drift,
                    start=start)


def dynamic(cells: list[Cell], bs: int) -> Cell:
    """vLLM's dynamic speculation with the best table a user could write: per batch size, the best of
    ``none`` and each fixed width (``num_speculative_tokens_per_batch_size``)."""
    best = max((c for c in cells if c.bs == bs and (c.policy == "none" or c.policy.startswith("fixed-"))),
               key=lambda c: c.tokens_per_s)
    return Cell("dynamic", bs, best.steps, best.tokens, best.ms, best.widths, best.verified_drafts, best.drafted,
                extra={"k": max(best.widths), **({"by_start": best.extra["by_start"]} if "by_start" in best.extra
                                                 else {})})


def summarize(case: Case, cells: list[Cell]) -> dict[str, object]:
    """The case's JSON: per policy and batch size, tokens/s, speedup over ``none``, fraction of oracle."""
    by = {(c.policy, c.bs): c for c in cells}
    rows = []
    for c in cells:
        none, best, signals = by[("none", c.bs)], by[("oracle", c.bs)], by[("oracle-conf", c.bs)]
        rows.append({
            "policy": c.policy, "bs": c.bs, "tokens_per_s": round(c.tokens_per_s, 3),
            "speedup_vs_none": round(c.tokens_per_s / none.tokens_per_s, 4),
            "fraction_of_oracle": round(c.tokens_per_s / best.tokens_per_s, 4),
            "fraction_of_confidence_oracle": round(c.tokens_per_s / signals.tokens_per_s, 4),
            "tokens_per_step": round(c.tokens / c.steps / c.bs, 4),
            "step_ms": round(c.ms / c.steps, 4),
            "widths": {str(w): n for w, n in c.widths.items()},
            "verified_per_drafted": round(c.verified_drafts / c.drafted, 4) if c.drafted else None,
            **({"predicted_tokens_per_s": round(c.predicted_tokens_per_s, 3)}
               if c.predicted_tokens_per_s is not None else {}),
            **c.extra,
        })
    return {"name": case.name, "description": case.description, "batch_sizes": case.batch_sizes,
            **({"context": case.context} if case.context is not None else {}),
            **({"drift": dataclasses.asdict(case.drift)} if case.drift else {}),
            "cost_model": {"name": case.cost.name, "fingerprint": case.cost.table.fingerprint.model_dump(),
                           "overhead": {"per_step_ms": case.cost.per_step_ms, "per_token_ms": case.cost.per_token_ms},
                           **({"host": case.cost.host.to_json()} if case.cost.host is not None else {}),
                           "notes": case.cost.notes},
            "trace": {"k": case.trace.k, "steps": case.trace.steps, "rows": int(case.trace.step_offsets[-1]),
                      "widths": case.trace.widths(), "meta": {k: v for k, v in case.trace.meta.items()
                                                              if k not in ("params",)}},
            "rows": rows}


def markdown_table(summary: dict[str, object]) -> str:
    """Policy x batch size: tokens/s, speedup over none, fraction of oracle."""
    rows = summary["rows"]
    assert isinstance(rows, list)
    sizes = summary["batch_sizes"]
    assert isinstance(sizes, list)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    cell = {(r["policy"], r["bs"]): r for r in rows}
    head = "| policy | " + " | ".join(f"bs {b}" for b in sizes) + " |\n|---|" + "---|" * len(sizes) + "\n"
    lines = []
    for p in policies:
        parts = []
        for b in sizes:
            r = cell[(p, b)]
            parts.append(f"{r['tokens_per_s']:.0f} · {r['speedup_vs_none']:.2f}× · {r['fraction_of_oracle']:.2f}")
        lines.append(f"| {p} | " + " | ".join(parts) + " |")
    return head + "\n".join(lines) + "\n\nEach cell: tokens/s · speedup over `none` · fraction of the oracle.\n"

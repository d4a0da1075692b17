"""What D-Cut's own decision costs the host each step, for replay to charge the policies that make it.

Replay prices a step from the engine's model costs and its time between steps, alike for every policy. A policy
that decides with D-Cut (the width, the keep depths, calibration, accounting) also spends host time in its hooks,
and on the critical path: the cut needs the keep depths before the scheduler takes the drafts. ``HostWork``
charges it: ``a + b * bs`` ms on a drafting step, another line on a width-0 step, fitted on measured points.

Two sources, each for the cost models it fits:

- live (``from_compare``): a ``dcut compare --breakdown`` run's D-Cut hooks, mode ``joint`` less mode ``dynamic``
  (the same hooks with nothing to decide). For the CPU cases: their engine overhead is fitted on a recording
  engine's gaps, which already hold hooks like ``dynamic``'s; what ``joint`` adds is the rest.
- warm (``from_bench``): ``dcut bench-policy --step`` (warm caches) on this CPU, ``joint``'s whole step work. For
  the GPU cost models: their engine ran no hooks of ours, and a GPU's forward leaves the host's caches warm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dcut.overhead import linear_fit

# The D-Cut hooks a compare breakdown times (``dcut.bench.breakdown``), whose sum is the hooks' host work a step.
HOOKS = ("D-Cut begin_step", "D-Cut choose_width", "D-Cut on_drafted", "D-Cut cut")

Line = tuple[float, float]  # ms per step, ms per request


@dataclass(frozen=True)
class HostWork:
    """D-Cut's host work a step: ``drafting`` and ``zero`` (width-0 steps), each ``(ms per step, ms per request)``."""

    drafting: Line
    zero: Line = (0.0, 0.0)
    source: str = ""

    def describe(self) -> str:
        (a, b), (c, d) = self.drafting, self.zero
        return (f"{a:.3f} ms + {b:.4f} ms per request a drafting step, {c:.3f} ms + {d:.4f} ms a width-0 step "
                f"(from {self.source})")

    def ms(self, bs: int, width: int) -> float:
        a, b = self.drafting if width else self.zero
        return a + b * bs

    @classmethod
    def from_points(cls, drafting: dict[int, float], zero: dict[int, float] | None = None,
                    source: str = "") -> HostWork:
        """Lines fitted on ``{bs: ms}`` points (non-negative terms: ``dcut.overhead.linear_fit``)."""
        return cls(_fit(drafting), _fit(zero or {}), source)

    def to_json(self) -> dict[str, Any]:
        return {"drafting": {"per_step_ms": self.drafting[0], "per_request_ms": self.drafting[1]},
                "zero": {"per_step_ms": self.zero[0], "per_request_ms": self.zero[1]}, "source": self.source}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HostWork:
        def line(part: dict[str, float] | None) -> Line:
            part = part or {}
            return float(part.get("per_step_ms", 0.0)), float(part.get("per_request_ms", 0.0))

        return cls(line(data.get("drafting")), line(data.get("zero")), str(data.get("source", "")))

    @classmethod
    def load(cls, path: str | Path) -> HostWork:
        return cls.from_json(json.loads(Path(path).read_text()))


def _fit(points: dict[int, float]) -> Line:
    if not points:
        return 0.0, 0.0
    bs = np.array(sorted(points), dtype=np.float64)
    ms = np.maximum(np.array([points[int(b)] for b in bs]), 0.0)
    if len(bs) == 1:
        return float(ms[0]), 0.0
    return linear_fit(bs, ms)


def from_compare(data: dict[str, Any], mode: str = "joint", baseline: str = "dynamic") -> HostWork:
    """From a ``dcut compare --breakdown`` report: per batch size, ``mode``'s D-Cut hooks less ``baseline``'s, ms a
    step (over all of ``mode``'s steps: the breakdown does not split them by width, so these are drafting steps where
    ``mode`` mostly drafted). Width-0 steps: nothing added (their hooks cost less than a drafting engine's)."""
    hooks: dict[tuple[str, int], float] = {}
    for cell in data["cells"]:
        parts = cell.get("step_ms") or {}
        if cell["mode"] in (mode, baseline) and all(h in parts for h in HOOKS):
            hooks[(cell["mode"], int(cell["bs"]))] = sum(parts[h] for h in HOOKS)
    points = {bs: ms - hooks[(baseline, bs)] for (m, bs), ms in hooks.items() if m == mode and (baseline, bs) in hooks}
    if not points:
        raise ValueError(f"the report has no breakdown of both {mode} and {baseline} (run dcut compare --breakdown)")
    machine = data.get("machine", {})
    return HostWork.from_points(points, None, f"dcut compare --breakdown on {machine.get('cpu', '?')}: {mode}'s D-Cut "
                                f"hooks less {baseline}'s, ms a step by bs {_rounded(points)}")


def from_bench(data: dict[str, Any], mode: str = "joint") -> HostWork:
    """From ``dcut bench-policy --step --json`` (warm): ``mode``'s mean step work by batch size, drafting widths
    averaged, width 0 apart."""
    rows = [r for r in data["results"] if r["mode"] == mode and not r.get("cold")]
    drafting: dict[int, list[float]] = {}
    zero: dict[int, list[float]] = {}
    for r in rows:
        (drafting if r["width"] else zero).setdefault(int(r["bs"]), []).append(r["mean_us"] / 1000.0)
    if not drafting:
        raise ValueError(f"the bench has no warm {mode} step with drafts (run dcut bench-policy --step --json)")
    means = {bs: float(np.mean(v)) for bs, v in drafting.items()}
    zeros = {bs: float(np.mean(v)) for bs, v in zero.items()}
    machine = data.get("machine", {})
    return HostWork.from_points(means, zeros, f"dcut bench-policy --step (warm) on {machine.get('cpu', '?')}: "
                                f"{mode}'s step work, ms by bs: drafting {_rounded(means)}, width 0 {_rounded(zeros)}")


def _rounded(points: dict[int, float]) -> dict[int, float]:
    return {bs: round(ms, 3) for bs, ms in sorted(points.items())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--compare", type=Path, help="a dcut compare --breakdown report (compare.json)")
    source.add_argument("--bench", type=Path, help="a dcut bench-policy --step --json output (warm)")
    parser.add_argument("--label", help="what to call the input in the source note, e.g. path@commit (default: its "
                        "path)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the host-work JSON")
    args = parser.parse_args(argv)
    path = args.compare or args.bench
    data = json.loads(path.read_text())
    host = from_compare(data) if args.compare else from_bench(data)
    host = dataclasses.replace(host, source=f"{host.source} ({args.label or path})")
    args.out.write_text(json.dumps(host.to_json(), indent=1) + "\n")
    print(json.dumps(host.to_json(), indent=1))


if __name__ == "__main__":
    main()

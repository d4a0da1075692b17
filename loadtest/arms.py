"""The arms of the load test: one app config, four ways of decoding — the mode names of ``dcut sweep`` and
``dcut compare``.

- ``none``: no speculation, no drafter (``engine.method: none``);
- ``full``: every draft verified (``engine.dcut.mode: full``: D-Cut cuts nothing, only counts);
- ``dynamic``: vLLM's own dynamic speculation, K per batch size (``engine.spec_schedule``), every draft
  of it verified (``engine.dcut.mode: full``, as ``dcut sweep``'s ``dynamic``); the schedule is the best
  fixed K per batch size measured by a committed sweep (``dynamic_fixed_k`` of
  ``docs/experiments/2026-11-29-sweep-dense/sweep.json``, through ``dcut.bench.sweep.best_k_schedule``), or given
  with ``--spec-schedule``;
- ``joint``: D-Cut as shipped (``engine.dcut.mode: joint``, the default; the config's other D-Cut settings kept).
  Called ``dcut`` before (committed reports under ``docs/experiments/2026-12-01-loadtest`` and
  ``docs/experiments/2026-11-30-routing`` keep that name).

Every arm keeps the config's engine seed, models and deployment settings.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

from dcut.commands.engine_args import parse_schedule  # the format of `dcut sweep --spec-schedule`

ARMS = ("none", "full", "dynamic", "joint")
RENAMED_ARMS = {"dcut": "joint"}  # refused, naming the new name (no alias)
APP_IMPORT_PATH = "app.builder:build_app"

Schedule = list[tuple[int, int, int]]


def app_entry(config: dict) -> dict:
    for app in config.get("applications", []):
        if app.get("import_path") == APP_IMPORT_PATH:
            return app
    raise ValueError(f"no application with import_path {APP_IMPORT_PATH} in the config")


def apply_override(args: dict, assignment: str) -> None:
    """``key.path=value`` into the app's args; the value is a YAML scalar (16 -> int, true -> bool)."""
    key, sep, value = assignment.partition("=")
    if not sep:
        raise ValueError(f"--set {assignment!r}: expected key.path=value")
    *parents, leaf = key.strip().split(".")
    node = args
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = yaml.safe_load(value)


def arm_args(args: dict, arm: str, schedule: Schedule | None = None) -> dict:
    """The app's ``args`` for one arm (a copy)."""
    if arm not in ARMS:
        raise ValueError(unknown_arm(arm))
    args = copy.deepcopy(args)
    engine = args.setdefault("engine", {})
    if arm == "none":
        engine["method"] = "none"  # AppConfig drops the drafter and D-Cut
    elif arm == "full":
        engine.setdefault("dcut", {})["mode"] = "full"
    elif arm == "dynamic":
        if not schedule:
            raise ValueError("arm dynamic needs a K schedule (--spec-schedule or a sweep's dynamic_fixed_k)")
        engine["spec_schedule"] = [list(r) for r in schedule]
        engine["num_speculative_tokens"] = max(k for _, _, k in schedule)
        engine.setdefault("dcut", {})["mode"] = "full"
    elif arm == "joint":
        engine.setdefault("dcut", {})["mode"] = "joint"
    return args


def unknown_arm(arm: str) -> str:
    """Why ``arm`` is not an arm: renamed (``RENAMED_ARMS``) or unknown."""
    if arm in RENAMED_ARMS:
        return f"arm {arm!r} was renamed to {RENAMED_ARMS[arm]!r} (the mode name of dcut sweep / dcut compare)"
    return f"unknown arm {arm!r}; choose from {', '.join(ARMS)}"


def arm_config(base: dict, arm: str, overrides: list[str], port: int | None,
               schedule: Schedule | None = None) -> dict:
    """The whole ``serve run`` config for one arm: overrides (every arm), the arm, the port."""
    config = copy.deepcopy(base)
    entry = app_entry(config)
    args = entry.setdefault("args", {})
    for assignment in overrides:
        apply_override(args, assignment)
    entry["args"] = arm_args(args, arm, schedule)
    if port is not None:
        config.setdefault("http_options", {})["port"] = port
    return config


def schedule_from_sweep(record: dict[str, Any]) -> Schedule:
    """The best fixed K per batch size of a ``dcut sweep`` record (its ``dynamic_fixed_k``), as the sweep's
    own ``dynamic`` mode builds it."""
    from dcut.bench.sweep import best_k_schedule

    by_k: dict[int, dict[int, float]] = {}
    for row in record.get("dynamic_fixed_k") or []:
        by_k.setdefault(row["k"], {})[row["bs"]] = row["tokens_per_s"]
    if not by_k:
        raise ValueError("the sweep has no dynamic_fixed_k rows (run `dcut sweep` with the dynamic mode)")
    return [tuple(r) for r in best_k_schedule(by_k, sorted({bs for rows in by_k.values() for bs in rows}))]


# Where `make sweep` writes each embedded pair's sweep (under docs/).
COMMITTED_SWEEPS = {"dense": "experiments/2026-11-29-sweep-dense", "moe": "experiments/2026-11-29-sweep-moe",
                    "deep": "experiments/2026-12-01-sweep-deep"}


def committed_sweep(config: dict, docs: Path) -> Path:
    """The committed sweep of the embedded pair ``config``'s app serves: its dynamic arm is sized on that pair."""
    from dcut.settings import EMBEDDED_MODELS

    model = Path(app_entry(config)["args"]["engine"]["model"])
    for pair, (target, _) in EMBEDDED_MODELS.items():
        if model == Path(target):
            return docs / COMMITTED_SWEEPS[pair] / "sweep.json"
    raise ValueError(f"{model} is not an embedded pair: give the dynamic arm --sweep or --spec-schedule")


def load_schedule(spec_schedule: str | None, sweep_path: Path | None) -> tuple[Schedule, str]:
    """The dynamic arm's schedule and where it came from (a sentence for the report)."""
    if spec_schedule:
        return parse_schedule(spec_schedule), "given with --spec-schedule"
    record = json.loads(Path(sweep_path).read_text())
    engine = record.get("engine", {})
    source = (f"best fixed K per batch size in `dynamic_fixed_k` of `{sweep_path}` (target `{engine.get('model')}`,"
              f" drafter `{engine.get('draft')}`, K={record.get('k')})")
    return schedule_from_sweep(record), source

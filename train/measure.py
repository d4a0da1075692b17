"""The trainer's checks of a built pair on a vLLM engine, each in a subprocess (vLLM needs a ``__main__`` guard):
greedy output with and without the drafter, acceptance per width, the cost regime, the drafter's calibration,
the reasoning pair's answers. Each is recorded under ``runs/`` for the model cards."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from train import TrainError
from train.pairs import PAIRS


def verify_json(runs: Path, target: str, k: int) -> Path:
    """Where `verify_pair` records a pair's check drafting ``k`` (the full block: the cards' main figures)."""
    return runs / (f"verify-{target}.json" if k == 15 else f"verify-{target}-k{k}.json")


def verify_subprocess(target: Path, drafter: Path, prompts: Path, num_prompts: int, max_tokens: int, k: int,
                      js: Path, *extra: str) -> dict:
    """`python -m train.verify` in a subprocess (vLLM needs a __main__ guard), its result from ``js``
    with the command that reproduces it; its output goes to ``js`` with suffix ``.log``."""
    from dcut.settings import engine_env
    from train import loop as L

    args = ["--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts), "--num-prompts",
            str(num_prompts), "--max-tokens", str(max_tokens), "-k", str(k), *extra]
    env = {**os.environ, **engine_env(kv_cache_gib=1)}
    L.log(f"verify {target.name}: " + " ".join(args))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "train.verify", *args, "--json", str(js)], env=env,
                          capture_output=True, text=True)
    log_path = js.with_suffix(".log")
    log_path.write_text(proc.stdout + proc.stderr)
    if not js.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise TrainError(f"vLLM verification of {target} failed (rc {proc.returncode}); log: {log_path}\n{tail}")
    res = json.loads(js.read_text())
    res["command"] = ("VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 python -m train.verify "
                      + " ".join(args))
    res["seconds"] = round(time.time() - t0, 1)
    return res


def verify_pair(out: Path, runs: Path, kind: str, num_prompts: int, max_tokens: int, k: int = 15) -> dict:
    """vLLM check in a subprocess (vLLM needs a __main__ guard) drafting ``k`` positions per step,
    plus (at the full block) the PyTorch replay."""
    from dcut.prompts import load_prompts
    from train import loop as L
    from train import models as M
    from train import pipeline as P
    from train import tokenizer as TK
    from train import verify as V

    tname, dname = PAIRS[kind].target, PAIRS[kind].drafter
    if not ((out / tname / ".done").exists() and (out / dname / ".done").exists()):
        raise TrainError(f"{out / tname} and {out / dname} must be trained first")
    js = verify_json(runs, tname, k)
    prompts_file = out / "heldout_prompts.jsonl"
    res = verify_subprocess(out / tname, out / dname, prompts_file, num_prompts, max_tokens, k, js)
    if k == 15:
        prompts = load_prompts(prompts_file)[:num_prompts]
        target = P.load_target(out / tname)
        drafter = M.load_drafter(out / dname, M.spec_from_hf_config(target.config))
        res["offline"] = V.offline_acceptance(target, drafter, TK.load_tokenizer(out / tname), prompts, max_tokens)
    js.write_text(json.dumps(res, indent=2) + "\n")
    L.log(f"verify {kind} (k={k}): identical={res['all_identical']} mean accepted/step="
          f"{res['mean_accepted_per_step']} per pos={res['acceptance_per_pos']}")
    return res


def _run_module(module: str, args: list[str], what: str) -> str:
    """``python -m module args`` with the engine environment (vLLM needs a ``__main__``); its stdout."""
    from dcut.settings import engine_env

    proc = subprocess.run([sys.executable, "-m", module, *args], env={**os.environ, **engine_env()},
                          capture_output=True, text=True)
    if proc.returncode:
        raise TrainError(f"{what} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def measure_regime(out: Path, runs: Path, kind: str, profile: Path, num_prompts: int, max_tokens: int) -> dict:
    """Cost figures from the pair's profile and live steps of ``none`` (no speculation), acceptance at widths 1/3/7/15
    (15 from the pair's verification); saved as ``runs/regime-<target>.json`` for the cards."""
    from dcut.cost_table import CostTable
    from dcut.machine import machine_info
    from train import regime as R

    if not profile.exists():
        raise TrainError(f"{profile} not found")
    tname = PAIRS[kind].target
    steps_json = runs / f"none-steps-{tname}.json"
    _run_module("train.regime", ["--target", str(out / tname), "--prompts", str(out / "heldout_prompts.jsonl"),
                                 "--json", str(steps_json)], "steps of none (no speculation)")
    none = {int(bs): ms for bs, ms in json.loads(steps_json.read_text()).items()}
    rows = R.cost_figures(CostTable.load(profile), none)
    acceptance = {}
    for w in R.WIDTHS:  # a pair's earlier measurement is reused (`python -m train verify` removes stale ones)
        done = verify_json(runs, tname, w)
        res = json.loads(done.read_text()) if done.exists() else verify_pair(out, runs, kind, num_prompts,
                                                                             max_tokens, k=w)
        acceptance[w] = {"acceptance_per_pos": res["acceptance_per_pos"],
                         "mean_accepted_per_step": res["mean_accepted_per_step"]}
    machine = machine_info()
    source = (f"Costs: `{profile}` (the engine's own dummy steps, `dcut profile`); live `none` step (no speculation): "
              f"`python -m train.regime` (vLLM's default compilation, prefill excluded: "
              f"(T({R.LONG} tokens) - T({R.SHORT} tokens)) / {R.LONG - R.SHORT}, median of {R.REPEATS} after a "
              f"warm-up); "
              f"acceptance: `python -m train.verify -k W`, greedy, {num_prompts} held-out prompts × "
              f"{max_tokens} tokens, bs 8; machine: {machine['cpu']} ({machine['cores']} cores).")
    record = {"rows": rows, "acceptance": acceptance, "source": source, "in_regime": R.in_regime(rows)}
    (runs / f"regime-{tname}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def measure_calibration(out: Path, runs: Path, kind: str, batch_size: int, max_tokens: int) -> dict:
    """Reliability of the drafter's confidence (`Calibrator.reliability`) with every draft verified, so
    every reached position is observed; saved as ``runs/calibration-<target>.json`` for the cards."""

    tname, dname = PAIRS[kind].target, PAIRS[kind].drafter
    args = ["generate", "--model", str(out / tname), "--draft", str(out / dname), "--mode", "full",
            "--prompts", str(out / "heldout_prompts.jsonl"), "--batch-size", str(batch_size),
            "--max-tokens", str(max_tokens), "--json"]
    result = json.loads(_run_module("dcut.cli", args, "dcut generate").strip().splitlines()[-1])
    by_width = result.get("calibration") or {}
    if not by_width:
        raise TrainError("dcut generate reported no calibration (is the drafter one D-Cut reads?)")
    record = {"command": shlex.join(["dcut", *args]), "batch_size": batch_size,
              "max_tokens": max_tokens, **by_width[max(by_width, key=int)]}
    (runs / f"calibration-{tname}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def verify_reasoning(out: Path, runs: Path, num_prompts: int, max_tokens: int) -> dict:
    """The pair in vLLM with DFlash (15 drafts), greedy until EOS: loads, output identical to the target
    alone, answers scored, acceptance; recorded once in ``runs/verify-reasoning.json``."""
    import numpy as np

    from dcut.bench.specexit import answer_of
    from train import loop as L
    from train import reasoning_pair as RP

    js = runs / "verify-reasoning.json"
    if js.exists():
        return json.loads(js.read_text())
    res = verify_subprocess(out / RP.TARGET, out / RP.DRAFTER, out / RP.HELDOUT_FILE, num_prompts, max_tokens, 15,
                            js, "--stop-at-eos")
    answers = [a for _, a in RP.heldout_problems(out)][:num_prompts]
    res["correct"] = [answer_of(t) == a for t, a in zip(res["texts"], answers, strict=True)]
    res["accuracy"] = float(np.mean(res["correct"]))
    res["mean_generated_tokens"] = float(np.mean(res["generated_tokens"]))
    js.write_text(json.dumps(res, indent=2) + "\n")
    L.log(f"verify reasoning: identical={res['all_identical']} accuracy={res['accuracy']:.3f} "
          f"mean accepted/step={res['mean_accepted_per_step']} mean generated={res['mean_generated_tokens']:.1f}")
    return res

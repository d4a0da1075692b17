"""`dcut train`: build the embedded default models offline (tokenizer, Dense/MoE targets, DFlash drafters)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dcut.settings import EMBEDDED_MODELS

HELP = "Train the embedded models (tokenizer, Dense/deep/MoE targets, DFlash drafters) on the stdlib source."


@dataclass(frozen=True)
class Refine:
    """A second distillation round on shorter sequences (`<kind>-drafter-distill --seq-len`)."""

    minutes: float
    seq_len: int
    sequences: int
    seed: int  # not the first round's: other prompts for the greedy continuations
    greedy_share: float


@dataclass(frozen=True)
class Pair:
    """One embedded target and its DFlash drafter (folders: `dcut.settings.EMBEDDED_MODELS`): shapes and
    default time budgets (minutes)."""

    name: str
    target_shape: dict
    drafter_shape: dict
    target_minutes: float
    drafter_minutes: float
    distill_minutes: float
    greedy_share: float = 0.5  # share of distillation batches drawn from the target's greedy output
    distill_sequences: int = 128  # greedy sequences of the first distillation round
    refine: Refine | None = None

    @property
    def target(self) -> str:
        return Path(EMBEDDED_MODELS[self.name][0]).name

    @property
    def drafter(self) -> str:
        return Path(EMBEDDED_MODELS[self.name][1]).name


PAIRS = {
    "dense": Pair("dense", {"kind": "dense"},
                  {"num_hidden_layers": 2, "intermediate_size": 768, "target_layer_ids": [0, 1, 2, 3]},
                  20.0, 14.0, 8.0),
    # D-Cut's regime (issue 11): the target's forward, not the engine's per-step overhead, dominates
    # a plain step; a 1-layer drafter reading five target layers costs ~0.1 of the target per token.
    "deep": Pair("deep",
                 {"kind": "dense", "hidden_size": 384, "num_hidden_layers": 16, "num_attention_heads": 6,
                  "num_key_value_heads": 2, "intermediate_size": 1024},
                 {"num_hidden_layers": 1, "intermediate_size": 1024, "target_layer_ids": [1, 5, 9, 12, 15]},
                 40.0, 8.0, 30.0, greedy_share=0.75, distill_sequences=384,
                 refine=Refine(minutes=40.0, seq_len=192, sequences=1024, seed=1, greedy_share=0.75)),
    "moe": Pair("moe", {"kind": "moe"},
                {"num_hidden_layers": 2, "intermediate_size": 768, "target_layer_ids": [0, 1, 2, 3]},
                10.0, 7.0, 0.0),
}


SEQ_LEN = 512  # tokens per training sequence
REASONING_STAGES = ("data", "target", "drafter", "head", "verify")
# The reasoning target: the dense pair's shape with this task's vocabulary (set from the data stage).
REASONING_TARGET = {"kind": "dense", "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768}
REASONING_DRAFTER = {"num_hidden_layers": 1, "intermediate_size": 768, "target_layer_ids": [0, 1, 2, 3]}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="models", help="folder for the shipped models (default: models)")
    p.add_argument("--runs", default="runs", help="folder for data caches and checkpoints (default: runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core box one thread beats two)")


def _target_args(p, prefix: str, minutes: float, lr: float) -> None:
    p.add_argument(f"--{prefix}minutes", type=float, default=minutes, help=f"time budget (default {minutes})")
    p.add_argument(f"--{prefix}steps", type=int, default=100_000, help="step cap")
    p.add_argument(f"--{prefix}lr", type=float, default=lr)


def _pair_stage(sub, name: str, help: str) -> argparse.ArgumentParser:
    """A stage that measures one pair with a vLLM engine and writes its cards."""
    p = sub.add_parser(name, help=help)
    _common(p)
    p.add_argument("pair", choices=sorted(PAIRS))
    p.add_argument("--max-tokens", type=int, default=128)
    return p


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    p = sub.add_parser("tokenizer", help="tokenize the stdlib split, train the BPE, write held-out prompts")
    _common(p)
    p.add_argument("--vocab-size", type=int, default=4096)
    for kind, pair in PAIRS.items():
        p = sub.add_parser(kind, help=f"train the {kind} target")
        _common(p)
        _target_args(p, "", pair.target_minutes, 2e-3)
        p = sub.add_parser(f"{kind}-drafter", help=f"train the DFlash drafter of the {kind} target")
        _common(p)
        _target_args(p, "", pair.drafter_minutes or 8.0, 2e-3)
        p = sub.add_parser(f"{kind}-drafter-distill", help=f"fine-tune the {kind} drafter on the target's own "
                           "greedy continuations mixed with real text")
        _common(p)
        _target_args(p, "", pair.distill_minutes or 5.0, 1e-3)
        p.add_argument("--sequences", type=int, default=pair.distill_sequences,
                       help=f"greedy sequences to generate (default {pair.distill_sequences})")
        p.add_argument("--greedy-share", type=float, default=pair.greedy_share,
                       help=f"share of batches from the greedy sequences (default {pair.greedy_share})")
        p.add_argument("--seq-len", type=int, default=SEQ_LEN,
                       help=f"tokens per sequence, a 64-token prompt then the target's greedy tokens (default "
                       f"{SEQ_LEN}); shorter puts the anchors where a served request's first tokens are")
    p = _pair_stage(sub, "verify", "load a pair in vLLM, compare greedy output with/without DFlash, "
                    "measure acceptance, write the model cards")
    p.add_argument("--num-prompts", type=int, default=16)
    p = _pair_stage(sub, "regime", "a pair's cost regime (engine-profiled costs, live plain steps) and "
                    "acceptance per position at widths 1/3/7/15, into the model cards")
    p.add_argument("--profile", required=True, help="cost_table.json from `dcut profile` of the pair")
    p.add_argument("--num-prompts", type=int, default=16)
    p = _pair_stage(sub, "calibration", "a pair's drafter confidence against acceptance per position "
                    "(full-width verification through `dcut generate`), into the model cards")
    p.add_argument("--batch-size", type=int, default=16)
    p = sub.add_parser("reasoning", help="the reasoning pair for SpecExit (issue 13): addition traces, tokenizer, "
                       "target, DFlash drafter, signal head, vLLM check and cards; finished stages are skipped")
    _common(p)
    for prefix, minutes, lr in (("target-", 16.0, 2e-3), ("drafter-", 5.0, 2e-3)):
        _target_args(p, prefix, minutes, lr)
    p.add_argument("--train-problems", type=int, default=20_000)
    p.add_argument("--num-prompts", type=int, default=16, help="held-out problems for the vLLM check")
    p.add_argument("--max-tokens", type=int, default=700)
    p.add_argument("--until", choices=REASONING_STAGES, default=REASONING_STAGES[-1],
                   help="stop after this stage (default: the last)")
    p = sub.add_parser("all", help="every stage in order, skipping finished ones, resuming checkpoints")
    _common(p)
    for kind, pair in PAIRS.items():
        _target_args(p, f"{kind}-", pair.target_minutes, 2e-3)
        _target_args(p, f"{kind}-drafter-", pair.drafter_minutes, 2e-3)
        _target_args(p, f"{kind}-distill-", pair.distill_minutes, 1e-3)
    p.add_argument("--pairs", nargs="+", choices=sorted(PAIRS), default=list(PAIRS),
                   help="pairs to build, in order (default: all)")
    p.add_argument("--sequences", type=int, help="greedy sequences of each pair's first drafter fine-tune "
                   "(default: the pair's, as `<kind>-drafter-distill`)")
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)


def _budget(minutes: float, steps: int, lr: float, *, drafter: bool, seq_len: int = SEQ_LEN):
    from dcut.train.loop import Budget

    return Budget(max_steps=steps, time_s=minutes * 60, seq_len=seq_len, batch=2, lr=lr,
                  warmup=30 if drafter else 50)


def _target_spec(kind: str):
    from dcut.train.models import TargetSpec

    return TargetSpec(**PAIRS[kind].target_shape)


def _drafter_spec(kind: str):
    from dcut.train.models import DrafterSpec

    return DrafterSpec(block_size=16, **PAIRS[kind].drafter_shape)


def _command_line() -> str:
    return "dcut train " + " ".join(shlex.quote(a) for a in sys.argv[sys.argv.index("train") + 1:]) \
        if "train" in sys.argv else "dcut train all --out models --seed 0"


def _verify_json(runs: Path, target: str, k: int) -> Path:
    """Where `verify_pair` records a pair's check drafting ``k`` (the full block: the cards' main figures)."""
    return runs / (f"verify-{target}.json" if k == 15 else f"verify-{target}-k{k}.json")


def verify_subprocess(target: Path, drafter: Path, prompts: Path, num_prompts: int, max_tokens: int, k: int,
                      js: Path, *extra: str) -> dict:
    """`python -m dcut.train.verify` in a subprocess (vLLM needs a __main__ guard), its result from ``js``
    with the command that reproduces it; its output goes to ``js`` with suffix ``.log``."""
    from dcut.cli import CommandError
    from dcut.settings import engine_env
    from dcut.train import loop as L

    args = ["--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts), "--num-prompts",
            str(num_prompts), "--max-tokens", str(max_tokens), "-k", str(k), *extra]
    env = {**os.environ, **engine_env(kv_cache_gib=1)}
    L.log(f"verify {target.name}: " + " ".join(args))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "dcut.train.verify", *args, "--json", str(js)], env=env,
                          capture_output=True, text=True)
    log_path = js.with_suffix(".log")
    log_path.write_text(proc.stdout + proc.stderr)
    if not js.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise CommandError(f"vLLM verification of {target} failed (rc {proc.returncode}); log: {log_path}\n{tail}")
    res = json.loads(js.read_text())
    res["command"] = ("VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 python -m dcut.train.verify "
                      + " ".join(args))
    res["seconds"] = round(time.time() - t0, 1)
    return res


def verify_pair(out: Path, runs: Path, kind: str, num_prompts: int, max_tokens: int, k: int = 15) -> dict:
    """vLLM check in a subprocess (vLLM needs a __main__ guard) drafting ``k`` positions per step,
    plus (at the full block) the PyTorch replay."""
    from dcut.cli import CommandError
    from dcut.prompts import load_prompts
    from dcut.train import loop as L
    from dcut.train import models as M
    from dcut.train import pipeline as P
    from dcut.train import tokenizer as TK
    from dcut.train import verify as V

    tname, dname = PAIRS[kind].target, PAIRS[kind].drafter
    if not ((out / tname / ".done").exists() and (out / dname / ".done").exists()):
        raise CommandError(f"{out / tname} and {out / dname} must be trained first")
    js = _verify_json(runs, tname, k)
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
    from dcut.cli import CommandError
    from dcut.settings import engine_env

    proc = subprocess.run([sys.executable, "-m", module, *args], env={**os.environ, **engine_env()},
                          capture_output=True, text=True)
    if proc.returncode:
        raise CommandError(f"{what} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def measure_regime(out: Path, runs: Path, kind: str, profile: Path, num_prompts: int, max_tokens: int) -> dict:
    """Cost figures from the pair's profile and live plain decoding steps, acceptance at widths 1/3/7/15
    (15 from the pair's verification); saved as ``runs/regime-<target>.json`` for the cards."""
    from dcut.cli import CommandError
    from dcut.cost_table import CostTable
    from dcut.machine import machine_info
    from dcut.train import regime as R

    if not profile.exists():
        raise CommandError(f"{profile} not found")
    tname = PAIRS[kind].target
    steps_json = runs / f"plain-steps-{tname}.json"
    _run_module("dcut.train.regime", ["--target", str(out / tname), "--prompts", str(out / "heldout_prompts.jsonl"),
                                      "--json", str(steps_json)], "plain decoding steps")
    plain = {int(bs): ms for bs, ms in json.loads(steps_json.read_text()).items()}
    rows = R.cost_figures(CostTable.load(profile), plain)
    acceptance = {}
    for w in R.WIDTHS:  # a measurement already made for this pair is reused (`dcut train verify` removes stale ones)
        done = _verify_json(runs, tname, w)
        res = json.loads(done.read_text()) if done.exists() else verify_pair(out, runs, kind, num_prompts,
                                                                             max_tokens, k=w)
        acceptance[w] = {"acceptance_per_pos": res["acceptance_per_pos"],
                         "mean_accepted_per_step": res["mean_accepted_per_step"]}
    machine = machine_info()
    source = (f"Costs: `{profile}` (the engine's own dummy steps, `dcut profile`); live plain decoding step: "
              f"`python -m dcut.train.regime` (vLLM's default compilation, prefill excluded: "
              f"(T({R.LONG} tokens) - T({R.SHORT} tokens)) / {R.LONG - R.SHORT}, median of {R.REPEATS} after a "
              f"warm-up); "
              f"acceptance: `python -m dcut.train.verify -k W`, greedy, {num_prompts} held-out prompts × "
              f"{max_tokens} tokens, bs 8; machine: {machine['cpu']} ({machine['cores']} cores).")
    record = {"rows": rows, "acceptance": acceptance, "source": source, "in_regime": R.in_regime(rows)}
    (runs / f"regime-{tname}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def measure_calibration(out: Path, runs: Path, kind: str, batch_size: int, max_tokens: int) -> dict:
    """Reliability of the drafter's confidence (`Calibrator.reliability`) with every draft verified, so
    every reached position is observed; saved as ``runs/calibration-<target>.json`` for the cards."""
    from dcut.cli import CommandError

    tname, dname = PAIRS[kind].target, PAIRS[kind].drafter
    args = ["generate", "--model", str(out / tname), "--draft", str(out / dname), "--mode", "full",
            "--prompts", str(out / "heldout_prompts.jsonl"), "--batch-size", str(batch_size),
            "--max-tokens", str(max_tokens), "--json"]
    result = json.loads(_run_module("dcut.cli", args, "dcut generate").strip().splitlines()[-1])
    by_width = result.get("calibration") or {}
    if not by_width:
        raise CommandError("dcut generate reported no calibration (is the drafter one D-Cut reads?)")
    record = {"command": shlex.join(["dcut", *args]), "batch_size": batch_size,
              "max_tokens": max_tokens, **by_width[max(by_width, key=int)]}
    (runs / f"calibration-{tname}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def train_reasoning(out: Path, runs: Path, args) -> None:
    """The reasoning pair's stages in order, each skipped when finished, up to ``args.until``."""
    from dcut.train import cards as C
    from dcut.train import models as M
    from dcut.train import pipeline as P
    from dcut.train import reasoning_pair as RP

    stages = REASONING_STAGES[:REASONING_STAGES.index(args.until) + 1]
    meta = RP.stage_data(out, runs, args.train_problems, n_heldout=500, seed=args.seed)
    if "target" in stages:
        spec = M.TargetSpec(**REASONING_TARGET, vocab_size=meta["vocab_size"])
        P.stage_target(RP.TARGET, spec, out, runs, _reasoning_budget(args.target_minutes, args.target_steps,
                                                                     args.target_lr, drafter=False), args.seed)
    if "drafter" in stages:
        P.stage_drafter(RP.DRAFTER, RP.TARGET, M.DrafterSpec(block_size=16, **REASONING_DRAFTER), out, runs,
                        _reasoning_budget(args.drafter_minutes, args.drafter_steps, args.drafter_lr, drafter=True),
                        args.seed)
    if "head" in stages:
        RP.stage_head(out, runs, meta, seed=args.seed)
        ver = verify_reasoning(out, runs, args.num_prompts, args.max_tokens) if "verify" in stages else None
        C.write_reasoning_cards(out, runs, RP.TARGET, RP.DRAFTER, ver)


def verify_reasoning(out: Path, runs: Path, num_prompts: int, max_tokens: int) -> dict:
    """The pair in vLLM with DFlash (15 drafts), greedy until EOS: loads, output identical to the target
    alone, answers scored, acceptance; recorded once in ``runs/verify-reasoning.json``."""
    import numpy as np

    from dcut.train import loop as L
    from dcut.train import reasoning as R
    from dcut.train import reasoning_pair as RP

    js = runs / "verify-reasoning.json"
    if js.exists():
        return json.loads(js.read_text())
    res = verify_subprocess(out / RP.TARGET, out / RP.DRAFTER, out / RP.HELDOUT_FILE, num_prompts, max_tokens, 15,
                            js, "--stop-at-eos")
    answers = [a for _, a in RP.heldout_problems(out)][:num_prompts]
    res["correct"] = [R.answer_of(t) == a for t, a in zip(res["texts"], answers, strict=True)]
    res["accuracy"] = float(np.mean(res["correct"]))
    res["mean_generated_tokens"] = float(np.mean(res["generated_tokens"]))
    js.write_text(json.dumps(res, indent=2) + "\n")
    L.log(f"verify reasoning: identical={res['all_identical']} accuracy={res['accuracy']:.3f} "
          f"mean accepted/step={res['mean_accepted_per_step']} mean generated={res['mean_generated_tokens']:.1f}")
    return res


def _reasoning_budget(minutes: float, steps: int, lr: float, *, drafter: bool):
    """Batches of 8 x 512 tokens (about 11 traces): the task is learnt from many short traces."""
    from dcut.train.loop import Budget

    return Budget(max_steps=steps, time_s=minutes * 60, seq_len=512, batch=8 if not drafter else 4, lr=lr,
                  warmup=30 if drafter else 50)


def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from dcut.cli import CommandError
    from dcut.train import cards as C
    from dcut.train import loop as L
    from dcut.train import pipeline as P

    torch.set_num_threads(args.threads)
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    runs.mkdir(parents=True, exist_ok=True)
    command = _command_line()
    stage = args.stage
    t0 = time.time()

    def need_tokens():
        if not (runs / "data" / "meta.json").exists():
            raise CommandError(f"no tokenized data under {runs}: run `dcut train tokenizer` first")

    if stage == "tokenizer":
        P.stage_tokenizer(out, runs, vocab_size=args.vocab_size)
    elif stage in PAIRS:
        need_tokens()
        P.stage_target(stage, _target_spec(stage), out, runs, _budget(args.minutes, args.steps, args.lr,
                                                                         drafter=False), args.seed)
    elif stage.endswith("-drafter"):
        need_tokens()
        kind = stage.split("-")[0]
        tname, dname = PAIRS[kind].target, PAIRS[kind].drafter
        if not (out / tname / ".done").exists():
            raise CommandError(f"train the {kind} target first (`dcut train {kind}`)")
        P.stage_drafter(dname, tname, _drafter_spec(kind), out, runs,
                        _budget(args.minutes, args.steps, args.lr, drafter=True), args.seed)
    elif stage.endswith("-drafter-distill"):
        kind = stage.split("-")[0]
        tname, dname = PAIRS[kind].target, PAIRS[kind].drafter
        if not (out / dname / ".done").exists():
            raise CommandError(f"train the {kind} drafter first (`dcut train {kind}-drafter`)")
        block = _drafter_spec(kind).block_size
        if args.seq_len <= P.DISTILL_PROMPT_LEN + block:
            raise CommandError(f"--seq-len must leave room for a {P.DISTILL_PROMPT_LEN}-token prompt and a "
                               f"{block}-token block")
        P.stage_drafter_distill(dname, tname, out, runs,
                                _budget(args.minutes, args.steps, args.lr, drafter=True, seq_len=args.seq_len),
                                args.seed, n_seqs=args.sequences, greedy_share=args.greedy_share)
    elif stage == "verify":
        verify_pair(out, runs, args.pair, args.num_prompts, args.max_tokens)
        C.write_cards(out, runs, (PAIRS[args.pair].target, PAIRS[args.pair].drafter), command)
    elif stage == "regime":
        measure_regime(out, runs, args.pair, Path(args.profile), args.num_prompts, args.max_tokens)
        C.write_cards(out, runs, (PAIRS[args.pair].target, PAIRS[args.pair].drafter), command)
    elif stage == "calibration":
        measure_calibration(out, runs, args.pair, args.batch_size, args.max_tokens)
        C.write_cards(out, runs, (PAIRS[args.pair].target, PAIRS[args.pair].drafter), command)
    elif stage == "reasoning":
        train_reasoning(out, runs / "reasoning", args)
    elif stage == "all":
        P.stage_tokenizer(out, runs)
        for kind in args.pairs:
            a = vars(args)
            P.stage_target(kind, _target_spec(kind), out, runs,
                           _budget(a[f"{kind}_minutes"], a[f"{kind}_steps"], a[f"{kind}_lr"], drafter=False),
                           args.seed)
            tname, dname = PAIRS[kind].target, PAIRS[kind].drafter
            P.stage_drafter(dname, tname, _drafter_spec(kind), out, runs,
                            _budget(a[f"{kind}_drafter_minutes"], a[f"{kind}_drafter_steps"],
                                    a[f"{kind}_drafter_lr"], drafter=True), args.seed)
            if a[f"{kind}_distill_minutes"] > 0:
                P.stage_drafter_distill(dname, tname, out, runs,
                                        _budget(a[f"{kind}_distill_minutes"], a[f"{kind}_distill_steps"],
                                                a[f"{kind}_distill_lr"], drafter=True), args.seed,
                                        n_seqs=args.sequences or PAIRS[kind].distill_sequences,
                                        greedy_share=PAIRS[kind].greedy_share)
                if (r := PAIRS[kind].refine) is not None:
                    budget = _budget(r.minutes, a[f"{kind}_distill_steps"], a[f"{kind}_distill_lr"], drafter=True,
                                     seq_len=r.seq_len)
                    P.stage_drafter_distill(dname, tname, out, runs, budget, r.seed, n_seqs=r.sequences,
                                            greedy_share=r.greedy_share)
            if not args.no_verify and not _verify_json(runs, tname, 15).exists():
                try:
                    verify_pair(out, runs, kind, args.num_prompts, args.max_tokens)
                except CommandError as e:
                    L.log(f"verify {kind} FAILED: {e}")
            C.write_cards(out, runs, (tname, dname), command)
        L.log(f"all: done in {(time.time() - t0) / 60:.1f} min")
    return 0

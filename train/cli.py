"""``python -m train STAGE``: build the embedded default models offline (tokenizer, Dense/deep/MoE targets,
DFlash drafters, the reasoning pair) and their model cards. Run from the repository root."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from train import PROG, TrainError, command_line
from train.measure import measure_calibration, measure_regime, verify_json, verify_pair, verify_reasoning
from train.pairs import PAIRS, REASONING_DRAFTER, REASONING_STAGES, REASONING_TARGET, SEQ_LEN

HELP = "Train the embedded models (tokenizer, Dense/deep/MoE targets, DFlash drafters) on the stdlib source."


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
    p = _pair_stage(sub, "regime", "a pair's cost regime (engine-profiled costs, live steps of none) and "
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
    from train.loop import Budget

    return Budget(max_steps=steps, time_s=minutes * 60, seq_len=seq_len, batch=2, lr=lr,
                  warmup=30 if drafter else 50)


def _target_spec(kind: str):
    from train.models import TargetSpec

    return TargetSpec(**PAIRS[kind].target_shape)


def _drafter_spec(kind: str):
    from train.models import DrafterSpec

    return DrafterSpec(block_size=16, **PAIRS[kind].drafter_shape)


def train_reasoning(out: Path, runs: Path, args) -> None:
    """The reasoning pair's stages in order, each skipped when finished, up to ``args.until``."""
    from train import cards as C
    from train import models as M
    from train import pipeline as P
    from train import reasoning_pair as RP

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


def _reasoning_budget(minutes: float, steps: int, lr: float, *, drafter: bool):
    """Batches of 8 x 512 tokens (about 11 traces): the task is learnt from many short traces."""
    from train.loop import Budget

    return Budget(max_steps=steps, time_s=minutes * 60, seq_len=512, batch=8 if not drafter else 4, lr=lr,
                  warmup=30 if drafter else 50)


def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from train import cards as C
    from train import loop as L
    from train import pipeline as P

    torch.set_num_threads(args.threads)
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    runs.mkdir(parents=True, exist_ok=True)
    command = command_line() or f"{PROG} all --out models --seed 0"
    stage = args.stage
    t0 = time.time()

    def need_tokens():
        if not (runs / "data" / "meta.json").exists():
            raise TrainError(f"no tokenized data under {runs}: run `python -m train tokenizer` first")

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
            raise TrainError(f"train the {kind} target first (`python -m train {kind}`)")
        P.stage_drafter(dname, tname, _drafter_spec(kind), out, runs,
                        _budget(args.minutes, args.steps, args.lr, drafter=True), args.seed)
    elif stage.endswith("-drafter-distill"):
        kind = stage.split("-")[0]
        tname, dname = PAIRS[kind].target, PAIRS[kind].drafter
        if not (out / dname / ".done").exists():
            raise TrainError(f"train the {kind} drafter first (`python -m train {kind}-drafter`)")
        block = _drafter_spec(kind).block_size
        if args.seq_len <= P.DISTILL_PROMPT_LEN + block:
            raise TrainError(f"--seq-len must leave room for a {P.DISTILL_PROMPT_LEN}-token prompt and a "
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
            if not args.no_verify and not verify_json(runs, tname, 15).exists():
                try:
                    verify_pair(out, runs, kind, args.num_prompts, args.max_tokens)
                except TrainError as e:
                    L.log(f"verify {kind} FAILED: {e}")
            C.write_cards(out, runs, (tname, dname), command)
        L.log(f"all: done in {(time.time() - t0) / 60:.1f} min")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=HELP)
    configure(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return int(run(args) or 0)
    except TrainError as e:
        print(f"{PROG} {args.stage}: error: {e}", file=sys.stderr)
        return 2

"""Check the device-side cut (``dcut.cut``) on a GPU with nothing but PyTorch: graph-capturable, sync-free, and cheap.

Why: issue 61 moves D-Cut's per-step decision onto the drafter's device; this is the evidence that it belongs there.
At Qwen3-8B-like shapes (a DFlash block of K = 15 drafts, a 151,936-token vocabulary, bf16 logits) and each batch
size, one step is: the drafts' log-confidences from the drafter's logits (``log_confidence``), calibration, prefix
scores, per-request caps and a keep rule, down to the kept counts. On CUDA it is

- run eagerly under ``torch.cuda.set_sync_debug_mode("error")`` (any device-to-host sync raises),
- captured in a CUDA graph, replayed (under the same mode) and compared with eager, bit for bit, on the captured
  inputs and again after new logits and a new keep rule are written into the graph's input tensors,
- timed with CUDA events: microseconds per step, eager and replayed, whole step and the cut alone.

It also checks the runner's step timer (``dcut.vllm.step_clock``, torch only) on the device: a stretch of device work
between two marks reads as that work, where a host timer around its launch reads the launch.

It prints (and with ``--out`` writes) one JSON object naming the device. Run from the repository root:

    python -m dcut.bench.gpu_cut --out docs/results/gpu-cut/h100.json

On a CPU (``--device cpu``, at a tiny shape in ``tests/unit/test_gpu_cut.py``) there is no graph and no sync mode:
the eager step runs twice and is timed by the host clock. Expected device time: well under a minute.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from dcut.cut import CalibrationTable, KeepRule, cut, log_confidence
from dcut.vllm.step_clock import timer_for


class Step:
    """One step's inputs, held in fixed tensors a captured graph reads, and the step over them."""

    def __init__(self, bs: int, k: int, vocab: int, bins: int, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.logits = torch.empty(bs * k, vocab, dtype=torch.bfloat16, device=device)
        self.refill()
        # a calibration that trusts deep positions less (its values do not matter here, its lookups do)
        self.table = CalibrationTable(a=torch.full((k, bins), 0.02, device=device),
                                      b=torch.linspace(1.0, 0.6, k, device=device)[:, None].repeat(1, bins))
        self.caps = (torch.arange(bs, device=device) * 7 + 3) % (k + 1)  # every cap from 0 to K, bs 1 at 3
        self.rule = KeepRule.new(device, budget=max(1, bs * k // 3))
        self.k = k

    def refill(self) -> None:
        """New logits written into the same tensor (what the drafter would produce next step)."""
        self.logits.normal_(generator=self.generator).mul_(4.0)

    def confidences(self) -> Tensor:
        tokens = self.logits.argmax(dim=-1)  # (the drafter's greedy tokens: vLLM computes these itself)
        return log_confidence(self.logits, tokens).view(-1, self.k)

    def __call__(self) -> Tensor:
        return cut(self.confidences(), self.rule, self.table, self.caps)


def _timed_us(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Mean microseconds per call: CUDA events around ``repeats`` calls on a GPU, the host clock on a CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats * 1e6
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / repeats * 1e3


def _no_sync(fn: Callable[[], object], device: torch.device, row: dict) -> None:
    """``fn()`` with any device-to-host sync an error (CUDA only); a sync is noted in ``row``, not raised."""
    if device.type != "cuda":
        fn()
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as e:
        row["no_sync"], row["sync_error"] = False, str(e)[:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)


def check(bs: int, k: int, vocab: int, bins: int, device: torch.device, repeats: int, warmups: int) -> dict:
    """The checks and timings at one batch size."""
    step = Step(bs, k, vocab, bins, device, seed=bs)
    row: dict = {"bs": bs, "no_sync": True}
    _no_sync(step, device, row)
    eager = step()
    log_conf = step.confidences()
    for _ in range(warmups):
        step()
    row["eager_us"] = round(_timed_us(step, repeats, device), 2)
    row["cut_eager_us"] = round(_timed_us(lambda: cut(log_conf, step.rule, step.table, step.caps), repeats, device), 2)
    if device.type != "cuda":
        row["graph_equal"] = row["graph_us"] = row["cut_graph_us"] = None
        row["eager_repeatable"] = torch.equal(eager, step())
        row["kept"] = int(eager.sum())
        return row
    side = torch.cuda.Stream()  # warm-up on a side stream before capture, as torch.cuda.graphs asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    _no_sync(graph.replay, device, row)
    equal = torch.equal(captured, eager)
    step.refill()  # new inputs, and a new plan, written in place: the graph must follow them
    step.rule.set(max(1, bs * k // 5), threshold=0.05)
    fresh = step()
    _no_sync(graph.replay, device, row)
    row["graph_equal"] = bool(equal and torch.equal(captured, fresh))
    row["kept"] = int(fresh.sum())
    row["graph_us"] = round(_timed_us(graph.replay, repeats, device), 2)
    cut_graph = torch.cuda.CUDAGraph()
    log_conf = step.confidences()
    with torch.cuda.stream(side):
        cut(log_conf, step.rule, step.table, step.caps)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(cut_graph):
        cut(log_conf, step.rule, step.table, step.caps)
    row["cut_graph_us"] = round(_timed_us(cut_graph.replay, repeats, device), 2)
    del graph, cut_graph
    return row


def clock_check(device: torch.device, n: int = 2048, repeats: int = 20) -> dict:
    """Milliseconds of ``repeats`` matmuls of ``n``: the step timer's marks around them (read after a wait, as the
    runner reads them), the host clock around their launch (what the runner timed before), and a synchronized host
    clock (the truth)."""
    a = torch.randn(n, n, device=device)
    timer = timer_for(device)

    def work() -> None:
        for _ in range(repeats):
            a @ a

    work()  # (warm-up)
    if device.type == "cuda":
        torch.cuda.synchronize()
    host = time.perf_counter()
    start = timer.mark()
    work()
    end = timer.mark()
    launched = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize()
    synced = time.perf_counter()
    return {"timer_ms": round(timer.ms(start, end), 3), "host_launch_ms": round((launched - host) * 1e3, 3),
            "synchronized_ms": round((synced - host) * 1e3, 3)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", default="1,4,16,64,256")
    parser.add_argument("--k", type=int, default=15, help="drafts per request (a DFlash block of 16)")
    parser.add_argument("--vocab", type=int, default=151_936, help="Qwen3's vocabulary")
    parser.add_argument("--bins", type=int, default=10, help="calibration bins (dcut.calibration.Calibrator)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--warmups", type=int, default=10)
    parser.add_argument("--clock-n", type=int, default=2048, help="matmul size of the step-timer check")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    started = time.perf_counter()
    rows = [check(int(bs), args.k, args.vocab, args.bins, device, args.repeats, args.warmups)
            for bs in args.batch_sizes.split(",")]
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "k": args.k, "vocab": args.vocab, "bins": args.bins, "repeats": args.repeats,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
        "clock": clock_check(device, n=args.clock_n),
        "ok": all(r["no_sync"] and r["graph_equal"] is not False for r in rows),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Measure a replay cost model on a GPU with nothing but PyTorch: verify and drafter step costs.

Why: a replay needs the step costs of a real accelerator, and vLLM is not always installable on
the GPU box at hand. This file builds a random-weight Qwen3-8B-shaped target and a DFlash-shaped
drafter in plain PyTorch and times their forward passes under CUDA graphs, as vLLM runs decode
steps. It imports only the standard library and torch (>= 2.4), so a copy of this one file runs
anywhere torch does, offline:

    python dcut/bench/gpu_costs.py --out docs/results/replay/costs/h200-qwen3-8b-measured.json

On one H200 this should take about one minute, well under the 8-minute budget: the roofline
estimate printed at start is ~40 s (224 shapes, each 16 forwards of 4-30 ms plus one graph capture,
and ~15 s of start-up); the run time actually taken goes into the notes. The output is the cost
table JSON of ``dcut.cost_table.CostTable`` plus the ``name``/``none``/``overhead``/``notes`` keys
that ``dcut.replay.costs.CostModel`` reads.

What is measured, per batch size bs:

- verify: bs requests x t tokens (t = 1..D) appended to a KV cache already holding ``--context``
  tokens per request, causal within the block, then lm_head over all bs*t rows and argmax (the
  stand-in for sampling and rejection); recorded at ``verify_tokens = bs * t``;
- draft: the drafter's one parallel pass over a block of W+1 positions per request (the anchor
  plus W masked positions, non-causal within the block, attending to its own context cache),
  then the target's lm_head over the bs*W drafted rows, for W = 0..D-1; W = 0 is one position per
  request and no lm_head: keeping the drafter's context in sync without drafting.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

DCUT_VERSION = "0.2.0"  # dcut.__version__, written out by hand: this file must not import dcut
EPS = 1e-6  # Qwen3's rms_norm_eps
ROPE_THETA = 1_000_000.0  # Qwen3's rope_theta
INIT_STD = 0.02  # random weights of a plausible scale keep activations finite
# Roofline figures of one H200 for the run-time estimate: HBM bandwidth and dense bf16 peak, each
# at an efficiency a tuned kernel reaches, plus the host cost of eager warm-ups and graph capture.
H200_BYTES_PER_S = 4.8e12 * 0.8
H200_FLOPS = 989e12 * 0.6
EAGER_LAUNCH_S = 8e-6  # per kernel launched eagerly
KERNELS_PER_LAYER = 20
CAPTURE_S = 0.03  # per graph: capture and instantiation beyond the launches
SETUP_S = 15.0  # CUDA context, random weights, caches


@dataclass(frozen=True)
class Shape:
    """A Qwen3 decoder's dimensions (defaults: Qwen3-8B)."""

    layers: int = 36
    hidden: int = 4096
    intermediate: int = 12288
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 151936

    def layer_params(self) -> int:
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim * self.hidden
        return qkv + self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate


@dataclass(frozen=True)
class Step:
    """The static per-shape inputs of a pass: bs requests of t tokens each after ctx cached tokens."""

    bs: int
    t: int
    ctx: int
    cos: Tensor  # (t, 1, head_dim): broadcasts over (bs, t, heads, head_dim)
    sin: Tensor
    mask: Tensor | None  # additive, one row per (query head of a KV group, token); None: all visible


def _weight(rows: int, cols: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    return torch.empty(rows, cols, device=device, dtype=dtype).normal_(0.0, INIT_STD)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, rotate-half layout (as Qwen3)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DecoderLayer:
    """One Qwen3 decoder layer: RMSNorm, fused QKV with per-head QK-norm and RoPE, GQA attention
    over a preallocated KV cache, fused SwiGLU MLP (vLLM fuses QKV and gate/up the same way)."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype) -> None:
        s, d = shape, shape.head_dim
        self.shape = s
        self.qkv = _weight((s.heads + 2 * s.kv_heads) * d, s.hidden, device, dtype)
        self.o = _weight(s.hidden, s.heads * d, device, dtype)
        self.gate_up = _weight(2 * s.intermediate, s.hidden, device, dtype)
        self.down = _weight(s.hidden, s.intermediate, device, dtype)
        self.input_norm = torch.ones(s.hidden, device=device, dtype=dtype)
        self.post_norm = torch.ones(s.hidden, device=device, dtype=dtype)
        self.q_norm = torch.ones(d, device=device, dtype=dtype)
        self.k_norm = torch.ones(d, device=device, dtype=dtype)

    def __call__(self, x: Tensor, cache: tuple[Tensor, Tensor], step: Step) -> Tensor:
        s, d, bs, t = self.shape, self.shape.head_dim, step.bs, step.t
        group = s.heads // s.kv_heads
        h = F.rms_norm(x, (s.hidden,), self.input_norm, EPS)
        q, k, v = F.linear(h, self.qkv).split([s.heads * d, s.kv_heads * d, s.kv_heads * d], dim=-1)
        q = _rope(F.rms_norm(q.view(bs, t, s.heads, d), (d,), self.q_norm, EPS), step.cos, step.sin)
        k = _rope(F.rms_norm(k.view(bs, t, s.kv_heads, d), (d,), self.k_norm, EPS), step.cos, step.sin)
        cache_k, cache_v = cache
        end = step.ctx + t
        cache_k[:, :, step.ctx:end] = k.transpose(1, 2)
        cache_v[:, :, step.ctx:end] = v.view(bs, t, s.kv_heads, d).transpose(1, 2)
        # GQA without copying the cache: the query heads sharing a KV head become more query rows of it.
        q = q.view(bs, t, s.kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(bs, s.kv_heads, group * t, d)
        out = F.scaled_dot_product_attention(q, cache_k[:, :, :end], cache_v[:, :, :end], attn_mask=step.mask)
        out = out.view(bs, s.kv_heads, group, t, d).permute(0, 3, 1, 2, 4).reshape(bs * t, s.heads * d)
        x = x + F.linear(out, self.o)
        gate, up = F.linear(F.rms_norm(x, (s.hidden,), self.post_norm, EPS), self.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down)


class Decoder:
    """A stack of decoder layers, a final norm and an lm_head; the target owns its embedding and
    lm_head (untied, as Qwen3-8B), the drafter borrows the target's lm_head (as DFlash)."""

    def __init__(self, shape: Shape, layers: int, device: torch.device, dtype: torch.dtype,
                 lm_head: Tensor | None = None) -> None:
        self.shape = shape
        self.layers = [DecoderLayer(shape, device, dtype) for _ in range(layers)]
        self.norm = torch.ones(shape.hidden, device=device, dtype=dtype)
        self.lm_head = _weight(shape.vocab, shape.hidden, device, dtype) if lm_head is None else lm_head

    def hidden(self, x: Tensor, caches: Sequence[tuple[Tensor, Tensor]], step: Step) -> Tensor:
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, cache, step)
        return F.rms_norm(x, (self.shape.hidden,), self.norm, EPS)

    def greedy(self, rows: Tensor) -> Tensor:
        """lm_head and argmax: argmax stands in for sampling (and, in verify, rejection)."""
        return F.linear(rows, self.lm_head).argmax(dim=-1)


def verify_step(target: Decoder, embed: Tensor, ids: Tensor, caches: Sequence[tuple[Tensor, Tensor]],
                step: Step) -> Tensor:
    """The target's verify pass: every token of every request, lm_head over all of them."""
    return target.greedy(target.hidden(F.embedding(ids.view(-1), embed), caches, step))


def draft_step(drafter: Decoder, block: Tensor, caches: Sequence[tuple[Tensor, Tensor]], step: Step) -> Tensor:
    """The drafter's pass over blocks of ``step.t = W + 1`` positions; lm_head over the W drafted ones."""
    hidden = drafter.hidden(block, caches, step)
    width = step.t - 1
    if width == 0:
        return hidden  # context sync only: no token is drafted
    rows = hidden.view(step.bs, step.t, -1)[:, 1:].reshape(step.bs * width, -1)
    return drafter.greedy(rows)


def make_step(shape: Shape, bs: int, t: int, ctx: int, causal: bool, device: torch.device,
              dtype: torch.dtype) -> Step:
    """Positions ctx..ctx+t-1 for RoPE and, when causal, the block's mask (the context is always visible)."""
    d = shape.head_dim
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(ctx, ctx + t, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    mask = None
    if causal:
        end = ctx + t
        width = -(-end // 16) * 16  # 16-aligned rows: the memory-efficient kernel takes the mask as is
        seen = torch.arange(width, device=device)[None, :] <= ctx + torch.arange(t, device=device)[:, None]
        rows = torch.zeros(t, width, device=device, dtype=dtype).masked_fill(~seen, float("-inf"))
        mask = rows.repeat(shape.heads // shape.kv_heads, 1)[None, None, :, :end]
    return Step(bs, t, ctx, angles.cos().to(dtype), angles.sin().to(dtype), mask)


def make_caches(shape: Shape, layers: int, bs: int, length: int, device: torch.device,
                dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
    """One (K, V) pair per layer, (bs, kv_heads, length, head_dim), filled as if the context were cached."""
    size = (bs, shape.kv_heads, length, shape.head_dim)
    return [(torch.empty(size, device=device, dtype=dtype).normal_(),
             torch.empty(size, device=device, dtype=dtype).normal_()) for _ in range(layers)]


def time_ms(fn: Callable[[], Tensor], device: torch.device, warmups: int, repeats: int, graphs: bool) -> float:
    """Median ms of ``repeats`` runs of ``fn``.

    CUDA: each run (a graph replay when ``graphs``) between two CUDA events, queued back to back
    so only device time is measured; a graph is captured once after eager warm-ups (lazy cuBLAS
    and kernel set-up must not happen under capture) and freed on return. CPU: eager, perf_counter.
    """
    if device.type != "cuda":
        for _ in range(warmups):
            fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000.0)
        return statistics.median(times)
    run = fn
    if graphs:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(1, warmups)):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    for _ in range(warmups):
        run()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def estimate_seconds(shape: Shape, drafter_layers: int, batch_sizes: Sequence[int], max_t: int, ctx: int,
                     warmups: int, repeats: int) -> float:
    """Expected run time on one H200: roofline per forward (weights and KV read vs bf16 matmul
    flops) times the forwards per shape, plus eager launches, graph capture and set-up."""
    kv_bytes_per_token = 2 * shape.kv_heads * shape.head_dim * 2

    def forward_s(layers: int, bs: int, t: int, lm_rows: int) -> float:
        tokens = bs * t
        params = layers * shape.layer_params()
        attention = 4 * tokens * shape.heads * shape.head_dim * (ctx + t) * layers
        flops = 2 * params * tokens + 2 * shape.vocab * shape.hidden * lm_rows + attention
        lm_bytes = 2 * shape.vocab * shape.hidden if lm_rows else 0
        read = 2 * params + lm_bytes + bs * (ctx + t) * layers * kv_bytes_per_token
        device_s = max(read / H200_BYTES_PER_S, flops / H200_FLOPS)
        eager_s = max(device_s, layers * KERNELS_PER_LAYER * EAGER_LAUNCH_S)
        return max(1, warmups) * eager_s + CAPTURE_S + eager_s + (warmups + repeats) * device_s

    total = SETUP_S
    for bs in batch_sizes:
        total += sum(forward_s(shape.layers, bs, t, bs * t) for t in range(1, max_t + 1))
        total += sum(forward_s(drafter_layers, bs, w + 1, bs * w) for w in range(max_t))
    return total


def _log(line: str) -> None:
    """Progress goes to stderr, unbuffered: stdout stays free and a slow run shows where it is."""
    print(line, file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    default = Shape()
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("gpu-costs.json"), help="cost-model JSON to write")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16, 32, 64], help="comma-separated")
    p.add_argument("--max-tokens-per-request", type=int, default=16,
                   help="D: verify t = 1..D tokens per request, draft widths W = 0..D-1, k = D-1")
    p.add_argument("--context", type=int, default=2048, help="tokens already in each request's KV cache")
    p.add_argument("--layers", type=int, default=default.layers)
    p.add_argument("--hidden", type=int, default=default.hidden)
    p.add_argument("--intermediate", type=int, default=default.intermediate)
    p.add_argument("--heads", type=int, default=default.heads)
    p.add_argument("--kv-heads", type=int, default=default.kv_heads)
    p.add_argument("--head-dim", type=int, default=default.head_dim)
    p.add_argument("--vocab", type=int, default=default.vocab)
    p.add_argument("--drafter-layers", type=int, default=5, help="an assumption: DFlash drafters have a few layers")
    p.add_argument("--warmups", type=int, default=3, help="eager runs before capture, and replays before timing")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per shape (median)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-cuda-graphs", action="store_true", help="time eager passes on CUDA too")
    args = p.parse_args(argv)
    if args.heads % args.kv_heads or args.head_dim % 2 or args.max_tokens_per_request < 1 or args.repeats < 1:
        p.error("need heads divisible by kv-heads, an even head-dim, max-tokens-per-request >= 1, repeats >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    device, dtype = torch.device(args.device), torch.bfloat16
    graphs = device.type == "cuda" and not args.no_cuda_graphs
    shape = Shape(args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim, args.vocab)
    max_t, ctx, sizes = args.max_tokens_per_request, args.context, sorted(set(args.batch_sizes))
    estimate = estimate_seconds(shape, args.drafter_layers, sizes, max_t, ctx, args.warmups, args.repeats)
    _log(f"gpu_costs: {len(sizes) * 2 * max_t} shapes on {args.device}; expected on one H200: ~{estimate:.0f} s "
        f"(roofline estimate; the budget is 8 min)")

    torch.manual_seed(0)
    hardware = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({platform.machine()})"
    points: dict[str, list[list[float]]] = {}
    draft: dict[str, dict[str, list[float]]] = {}
    none: dict[str, float] = {}  # a step of none (no speculation) per batch size
    with torch.inference_mode():
        embed = _weight(shape.vocab, shape.hidden, device, dtype)
        target = Decoder(shape, shape.layers, device, dtype)
        drafter = Decoder(shape, args.drafter_layers, device, dtype, lm_head=target.lm_head)
        for bs in sizes:
            target_caches = make_caches(shape, shape.layers, bs, ctx + max_t, device, dtype)
            drafter_caches = make_caches(shape, args.drafter_layers, bs, ctx + max_t, device, dtype)
            row = []
            for t in range(1, max_t + 1):
                step = make_step(shape, bs, t, ctx, True, device, dtype)
                ids = torch.randint(0, shape.vocab, (bs, t), device=device)
                ms = time_ms(partial(verify_step, target, embed, ids, target_caches, step),
                             device, args.warmups, args.repeats, graphs)
                row.append([bs * t, ms, args.repeats])
            cells = {}
            for width in range(max_t):
                step = make_step(shape, bs, width + 1, ctx, False, device, dtype)
                block = torch.randn(bs * (width + 1), shape.hidden, device=device, dtype=dtype)
                ms = time_ms(partial(draft_step, drafter, block, drafter_caches, step),
                             device, args.warmups, args.repeats, graphs)
                cells[str(width)] = [ms, args.repeats]
            points[str(bs)], draft[str(bs)], none[str(bs)] = row, cells, row[0][1]
            del target_caches, drafter_caches, step, ids, block
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            _log(f"bs {bs}: verify {row[0][1]:.2f}..{row[-1][1]:.2f} ms (t=1..{max_t}), draft "
                f"{cells['0'][0]:.2f}..{cells[str(max_t - 1)][0]:.2f} ms (W=0..{max_t - 1}); "
                f"{time.perf_counter() - began:.0f} s elapsed")

    total = time.perf_counter() - began
    is_default = shape == Shape()
    model = "Qwen3-8B-shaped" if is_default else (
        f"Qwen3-shaped {shape.layers}L h{shape.hidden} i{shape.intermediate} {shape.heads}q/{shape.kv_heads}kv "
        f"d{shape.head_dim} v{shape.vocab}")
    timing = (f"CUDA graphs: one captured per shape after {max(1, args.warmups)} eager runs, {args.warmups} warm-up "
              f"replays, median of {args.repeats} replays each timed with CUDA events" if graphs else
              f"eager, {args.warmups} warm-ups, median of {args.repeats} runs timed with "
              f"{'CUDA events' if device.type == 'cuda' else 'time.perf_counter'}")
    data = {
        "name": "measured-gpu",
        "fingerprint": {"hardware": hardware, "model": f"{model} (random bf16, pure PyTorch)",
                        "drafter": f"DFlash-shaped ({args.drafter_layers} layers)", "k": max_t - 1,
                        "tensor_parallel_size": 1, "dtype": "bfloat16", "vllm_version": "none (pure PyTorch)",
                        "dcut_version": DCUT_VERSION},
        "points": points,
        "offsets": {},
        "plain_offsets": {},
        "draft": draft,
        "none": none,
        "overhead": {"per_step_ms": 0.0, "per_token_ms": 0.0},
        "notes": [
            f"measured by dcut/bench/gpu_costs.py on {hardware}, torch {torch.__version__}, device {args.device}, "
            f"in {total:.1f} s (roofline estimate for one H200 was {estimate:.0f} s)",
            f"target: {model}, random weights (normal, std {INIT_STD}) in bf16, plain PyTorch ops "
            "(F.linear, F.rms_norm, F.scaled_dot_product_attention), no fused or quantised kernels, no vLLM",
            f"Qwen3 layer: RMSNorm, fused QKV, per-head QK RMSNorm, RoPE theta {ROPE_THETA:g}, GQA attention "
            "(query heads folded onto their KV head, no KV copy), fused SwiGLU MLP; untied lm_head",
            f"context: {ctx} tokens already in every request's KV cache (contiguous per request, not paged); "
            f"the cost does not vary with context length here",
            f"verify: bs requests x t tokens (t = 1..{max_t}) causal within the block, lm_head over all bs*t rows, "
            "argmax standing in for sampling and rejection; points at verify_tokens = bs*t, raw (not cummax)",
            f"drafter (assumption): DFlash-shaped, {args.drafter_layers} Qwen3 layers at the target's width with the "
            "target's lm_head; width W is one parallel pass over W+1 positions per request (anchor + W masked, "
            "non-causal within the block, attending to a drafter KV cache of the same context) and lm_head over "
            "the bs*W drafted rows; the projection of target hidden states into the drafter is left out",
            "drafter width 0 (assumption): one position per request through the drafter, no lm_head: what keeping "
            "the drafter's context in sync costs when nothing is drafted",
            f"timing: {timing}",
            "none: the verify cost at t=1 (a decode step without speculation); overhead outside the model: 0 "
            "(nothing of the engine's scheduling is measured here)",
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    _log(f"wrote {args.out} in {total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

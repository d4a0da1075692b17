"""Target model configs and a PyTorch DFlash drafter that mirrors vLLM 0.32's ``qwen3_dflash``.

What vLLM computes (``vllm/model_executor/models/qwen3_dflash.py``, ``v1/spec_decode/dflash.py``,
``v1/spec_decode/utils.py: copy_and_expand_dflash_inputs_kernel``):

* Context features: the target's hidden states *after* decoder layer ``i`` for each ``i`` in
  ``dflash_config.target_layer_ids`` (vLLM captures aux layer ``i + 1`` = the residual stream
  ``hidden + residual`` entering layer ``i + 1``, i.e. before the final norm), concatenated in
  layer order -> ``fc`` (Linear, no bias) -> ``hidden_norm`` (RMSNorm).
* Context K/V, per draft layer: ``K = rope(k_norm(k_proj(ctx)), ctx_pos)``, ``V = v_proj(ctx)``
  (no input_layernorm on the context). They are written into the draft's KV cache.
* Query block per request: input ids ``[bonus, mask x K]`` at positions ``p .. p + K`` where
  ``p`` = the position after the last verified token; the context holds positions ``< p``.
  Embeddings are the target's (shared). Each draft layer is a Qwen3 pre-norm decoder layer
  (input_layernorm, q/k/v with per-head q_norm/k_norm, RoPE, attention, o_proj,
  post_attention_layernorm, SiLU-gated MLP); attention is NON-causal (no ``layer_types`` /
  ``causal`` in config): every block token sees all context and the whole block.
* Output: final ``norm`` then the target's ``lm_head``; query slot ``k`` (1..K) drafts the
  token at position ``p + k``; slot 0 (the bonus token) is not sampled.
* Weights (safetensors, no ``model.`` prefix, no embed_tokens / lm_head so both are shared):
  ``fc.weight [H, n*H_t]``, ``hidden_norm.weight``, ``norm.weight``,
  ``layers.{i}.input_layernorm.weight``, ``layers.{i}.post_attention_layernorm.weight``,
  ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
  ``layers.{i}.mlp.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from train.tokenizer import EOS_ID, MASK_ID, PAD_ID


@dataclass
class TargetSpec:
    kind: str = "dense"  # dense | moe
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 192


@dataclass
class DrafterSpec:
    num_hidden_layers: int = 2
    intermediate_size: int = 768
    block_size: int = 16
    target_layer_ids: list[int] = field(default_factory=lambda: [0, 1, 2, 3])


def build_target(spec: TargetSpec, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=True, bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        attention_bias=False, hidden_act="silu", initializer_range=0.02,
    )
    if spec.kind == "dense":
        cfg = transformers.Qwen3Config(intermediate_size=spec.intermediate_size, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif spec.kind == "moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=spec.intermediate_size, moe_intermediate_size=spec.moe_intermediate_size,
            num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            output_router_logits=False, router_aux_loss_coef=0.01, **common,
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(spec.kind)
    model.config._attn_implementation = "sdpa"
    return model


def count_params(module: nn.Module) -> int:
    seen, n = set(), 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


# ----------------------------------------------------------------------------------------------
# DFlash drafter


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv  # [..., hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """Neox-style rotation. x [..., T, nh, hd]; cos/sin [..., T, hd]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat([-x2, x1], dim=-1)
    return x * cos.unsqueeze(-2) + rot * sin.unsqueeze(-2)


class DraftAttention(nn.Module):
    def __init__(self, h, nh, nkv, hd, eps):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, eps)
        self.k_norm = RMSNorm(hd, eps)

    def context_kv(self, ctx, cos, sin):
        B, T, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).view(B, T, self.nkv, self.hd))
        k = apply_rope(k, cos, sin)
        v = self.v_proj(ctx).view(B, T, self.nkv, self.hd)
        return k, v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.nh, self.hd))
        k = self.k_norm(self.k_proj(x).view(B, Q, self.nkv, self.hd))
        v = self.v_proj(x).view(B, Q, self.nkv, self.hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = torch.cat([ctx_k, k], dim=1)
        v = torch.cat([ctx_v, v], dim=1)
        rep = self.nh // self.nkv
        q = q.transpose(1, 2)
        k = k.transpose(1, 2).repeat_interleave(rep, dim=1)
        v = v.transpose(1, 2).repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.nh * self.hd))


class DraftMLP(nn.Module):
    def __init__(self, h, inter):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, h, nh, nkv, hd, inter, eps):
        super().__init__()
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = DraftAttention(h, nh, nkv, hd, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = DraftMLP(h, inter)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Trainable DFlash head. Embeddings and LM head come from the (frozen) target."""

    def __init__(self, tspec: TargetSpec, dspec: DrafterSpec, eps: float = 1e-6):
        super().__init__()
        self.tspec, self.dspec = tspec, dspec
        h = tspec.hidden_size
        self.fc = nn.Linear(h * len(dspec.target_layer_ids), h, bias=False)
        self.hidden_norm = RMSNorm(h, eps)
        self.layers = nn.ModuleList([
            DraftLayer(h, tspec.num_attention_heads, tspec.num_key_value_heads, tspec.head_dim,
                       dspec.intermediate_size, eps)
            for _ in range(dspec.num_hidden_layers)
        ])
        self.norm = RMSNorm(h, eps)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, aux: torch.Tensor, ctx_len: torch.Tensor | None, query_embeds: torch.Tensor,
                query_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """aux [B, T, n*H] target features at positions 0..T-1; query_embeds [B, Q, H] at
        positions query_pos [B, Q]; mask [B, 1, Q, T + Q] bool (True = may attend).
        Returns final-normed hidden states [B, Q, H] (apply the target lm_head for logits)."""
        B, T, _ = aux.shape
        theta = self.tspec.rope_theta
        ctx = self.hidden_norm(self.fc(aux))
        ctx_pos = torch.arange(T, device=aux.device).expand(B, T)
        ccos, csin = rope_cos_sin(ctx_pos, self.tspec.head_dim, theta)
        qcos, qsin = rope_cos_sin(query_pos, self.tspec.head_dim, theta)
        x = query_embeds
        for layer in self.layers:
            ck, cv = layer.self_attn.context_kv(ctx, ccos, csin)
            x = layer(x, qcos, qsin, ck, cv, mask)
        return self.norm(x)


def block_attention_mask(anchors: torch.Tensor, T: int, block: int,
                         widths: torch.Tensor | None = None) -> torch.Tensor:
    """anchors [B, nb] -> bool mask [B, 1, nb*block, T + nb*block]: block b sees context
    positions < anchors[b] and the tokens of its own block (bidirectional). With ``widths`` [B, nb],
    block b holds only its first ``1 + widths[b]`` slots (the anchor and ``widths[b]`` masks), as
    vLLM's DFlash builds it when it drafts ``widths[b]`` positions; later slots are padding no
    query attends to."""
    B, nb = anchors.shape
    Q = nb * block
    ctx_ok = torch.arange(T, device=anchors.device)[None, None, :] < anchors[:, :, None]  # [B, nb, T]
    ctx_ok = ctx_ok.repeat_interleave(block, dim=1)  # [B, Q, T]
    blk = torch.arange(Q, device=anchors.device) // block
    self_ok = (blk[:, None] == blk[None, :]).expand(B, Q, Q)
    if widths is not None:
        slot = torch.arange(Q, device=anchors.device) % block
        held = slot[None, :] <= widths.repeat_interleave(block, dim=1)  # [B, Q] key slot is in its block
        self_ok = self_ok & held[:, None, :]
    return torch.cat([ctx_ok, self_ok], dim=-1)[:, None]


def target_aux_hidden(target, input_ids: torch.Tensor, layer_ids: list[int]):
    """Run the target; return (logits, concatenated outputs of the decoder layers in layer_ids,
    before the final norm, as vLLM captures them)."""
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    layers = target.model.layers
    for i in layer_ids:
        def hook(_m, _inp, out, i=i):
            captured[i] = out[0] if isinstance(out, tuple) else out
        hooks.append(layers[i].register_forward_hook(hook))
    try:
        out = target(input_ids=input_ids, use_cache=False)
    finally:
        for hk in hooks:
            hk.remove()
    aux = torch.cat([captured[i] for i in layer_ids], dim=-1)
    return out.logits, aux


def drafter_hidden(drafter: DFlashDrafter, target, aux, input_ids, anchors, widths=None):
    """Build query blocks [anchor token, mask x (block-1)] at the anchors and return the drafter's final-normed
    hidden states [B, nb, block, H] (slot k drafts position anchor + k; what the target's lm_head and the
    SpecExit head read); ``widths`` as in `block_attention_mask`."""
    block = drafter.dspec.block_size
    B, T = input_ids.shape
    nb = anchors.shape[1]
    embed = target.get_input_embeddings()
    q_ids = torch.full((B, nb, block), MASK_ID, dtype=torch.long, device=input_ids.device)
    q_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    q_pos = anchors[:, :, None] + torch.arange(block, device=input_ids.device)
    mask = block_attention_mask(anchors, T, block, widths)
    hid = drafter(aux, None, embed(q_ids.view(B, nb * block)), q_pos.view(B, nb * block), mask)
    return hid.view(B, nb, block, -1)


def drafter_logits(drafter: DFlashDrafter, target, aux, input_ids, anchors, widths=None):
    """The drafts' logits [B, nb, block, V] (`drafter_hidden` through the target's lm_head)."""
    return target.lm_head(drafter_hidden(drafter, target, aux, input_ids, anchors, widths))


def position_weights(block: int, gamma: float) -> torch.Tensor:
    k = torch.arange(1, block, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


# ----------------------------------------------------------------------------------------------
# Saving in the format vLLM's `dflash` method loads


def drafter_config(tspec: TargetSpec, dspec: DrafterSpec) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": list(dspec.target_layer_ids)},
        "block_size": dspec.block_size,
        "target_hidden_size": tspec.hidden_size,
        "num_target_layers": tspec.num_hidden_layers,
        "hidden_size": tspec.hidden_size,
        "num_hidden_layers": dspec.num_hidden_layers,
        "num_attention_heads": tspec.num_attention_heads,
        "num_key_value_heads": tspec.num_key_value_heads,
        "head_dim": tspec.head_dim,
        "intermediate_size": dspec.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": tspec.vocab_size,
        "max_position_embeddings": tspec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": tspec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": tspec.rope_theta},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def save_drafter(drafter: DFlashDrafter, folder: Path, dtype=torch.bfloat16) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = drafter_config(drafter.tspec, drafter.dspec)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_drafter(folder: Path, tspec: TargetSpec) -> DFlashDrafter:
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    dspec = DrafterSpec(num_hidden_layers=cfg["num_hidden_layers"], intermediate_size=cfg["intermediate_size"],
                        block_size=cfg["block_size"], target_layer_ids=cfg["dflash_config"]["target_layer_ids"])
    d = DFlashDrafter(tspec, dspec)
    d.load_state_dict({k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()})
    return d


def spec_from_hf_config(cfg) -> TargetSpec:
    kind = "moe" if getattr(cfg, "num_experts", None) else "dense"
    rp = getattr(cfg, "rope_parameters", None) or {}
    return TargetSpec(
        kind=kind, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
        num_experts=getattr(cfg, "num_experts", 0) or 0,
        num_experts_per_tok=getattr(cfg, "num_experts_per_tok", 0) or 0,
        moe_intermediate_size=getattr(cfg, "moe_intermediate_size", 0) or 0,
    )


def scheduled_lr(step: int, progress: float, base: float, warmup: int = 50, floor: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine decay over the budget fraction `progress` (0..1):
    a time-based schedule that adapts to the throughput of a shared machine."""
    w = min(1.0, (step + 1) / warmup)
    t = min(1.0, max(0.0, progress))
    return base * w * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


__all__ = [n for n in dir() if not n.startswith("_")] + ["asdict"]

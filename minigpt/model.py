"""A GPT-2-style decoder with rotary position embeddings, in plain PyTorch.

Reads top to bottom: rotary embeddings, attention, MLP, block, the block checkpoint, the model and its
loss. The attention kernel is pluggable (minigpt/attention.py). Rotary embeddings make seq_len a run-time
choice rather than a model size.

Memory levers for very long contexts (ModelConfig; README "Memory levers" has the measured effect):
- checkpoint_every=k: only every k-th block's input is kept; the block is recomputed in the backward.
- checkpoint_dtype=bfloat16: that stored input is kept in bf16 (half the bytes; the residual stream is
  rounded to bf16 at those block boundaries, in the forward too, so gradients stay exact).
- offload=true: the stored inputs live in pinned CPU memory and come back for the backward.
- mlp_chunk=c: LayerNorm + MLP run over c tokens at a time and are recomputed in the backward, so the
  4·C-wide hidden activations exist for one chunk only.
- loss_chunk=c: final norm, LM head and cross-entropy run over c tokens at a time and are recomputed in
  the backward, so the N×vocab logits never exist.
- keep_attention=true (flash): checkpointed blocks keep the attention output and LSE of their forward
  (offloaded with the block input if offload=true), so the recompute skips the N² attention forward.
"""
from __future__ import annotations

import math
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from minigpt.attention import AttentionFn
from minigpt.config import ModelConfig


class Rotary(nn.Module):
    """Rotary position embedding (RoFormer): rotate each (x_i, x_{i+d/2}) pair of q and k by angle pos·θ_i."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int) -> tuple[Tensor, Tensor]:
        """cos and sin tables of shape (seq_len, 1, head_dim/2), made once per model forward."""
        pos = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
        angles = torch.outer(pos, self.inv_freq)
        return angles.cos()[:, None, :], angles.sin()[:, None, :]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, N, H, D). Rotates the two halves of the last dim: [x1, x2] -> [x1 cos - x2 sin, x1 sin + x2 cos].

    In fp32, each half rounded back to x's dtype as soon as it is made, so at long context the fp32
    temporaries stay small; autograd keeps only cos and sin for the backward.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat(((x1 * cos - x2 * sin).to(x.dtype), (x1 * sin + x2 * cos).to(x.dtype)), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, attend: AttentionFn):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.attend = attend
        self.kept_attention: KeptAttention | None = None  # set by BlockCheckpoint while it runs this block

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = self.heads(x, cos, sin)
        attend = self.kept_attention or self.attend
        y = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)  # (B, H, N, D)
        # flash and SDPA's fused kernels return y laid out as (B, N, H, D) like q, so this reshape is a view
        # (naive's y is contiguous (B, H, N, D): a copy)
        return self.c_proj(y.transpose(1, 2).reshape(B, N, C))

    def heads(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k (rotated) and v as (B, N, H, D), each in its own buffer: the attention keeps all three for its
        backward, and views would keep the whole qkv matmul output alive with them (3 KB more per token
        and layer). RoPE is applied in this layout so the caller's transposes are free strided views."""
        B, N, C = x.shape
        qkv = self.c_attn(x).view(B, N, 3, self.n_head, self.head_dim)
        q, k = apply_rotary(qkv[:, :, 0], cos, sin), apply_rotary(qkv[:, :, 1], cos, sin)
        return q, k, qkv[:, :, 2].contiguous()


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


def recomputed(fn, *args: Tensor) -> Tensor:
    """fn(*args), keeping none of its activations for the backward (recomputed there); plain fn under no_grad."""
    if torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig, attend: AttentionFn):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg, attend)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)
        self.mlp_chunk = cfg.mlp_chunk

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x), cos, sin)
        return x + self.feed_forward(x)

    def feed_forward(self, x: Tensor) -> Tensor:
        chunk = self.mlp_chunk
        if not chunk or chunk >= x.shape[1]:
            return self._norm_mlp(x)
        # Token-local work in sequence chunks, each recomputed in the backward: only one chunk's
        # 4·C-wide activations are ever alive.
        return torch.cat([recomputed(self._norm_mlp, x[:, s : s + chunk]) for s in range(0, x.shape[1], chunk)], dim=1)

    def _norm_mlp(self, x: Tensor) -> Tensor:
        return self.mlp(self.ln_2(x))


def to_host(t: Tensor) -> Tensor:
    """An asynchronous copy of t into CPU memory (pinned when t is on a GPU, so the copy overlaps compute),
    with t's memory layout."""
    host = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
    return host.copy_(t, non_blocking=True)


class KeptAttention:
    """Flash attention that keeps its output and LSE on a block's first run and reuses them on the recompute.

    The first call (the checkpointed block's no-grad forward) runs the kernel and keeps (o, lse), in CPU
    memory when offloading; the second call (the recompute in the backward) hands them to the kernel's
    backward instead of recomputing the N² attention forward.
    """

    def __init__(self, offload: bool):
        self.offload, self.kept = offload, None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
        from kernels.flash_attention import flash_attention, flash_attention_with_lse

        if self.kept is None:
            o, lse = flash_attention_with_lse(q, k, v, causal=causal)
            self.kept = (to_host(o), to_host(lse)) if self.offload else (o, lse)
            return o
        o, lse = (t.to(q.device, non_blocking=True) for t in self.kept)
        self.kept = None
        return flash_attention(q, k, v, causal=causal, precomputed=(o, lse))


class BlockCheckpoint(torch.autograd.Function):
    """Run a block keeping only its input (in `store_dtype`, on the GPU or in pinned CPU memory); recompute it in the backward.

    The forward runs on the stored (possibly rounded) input too, so the recomputed block is exactly the
    one that ran and the gradients are exact for it. Works like torch.utils.checkpoint's reentrant mode:
    the backward re-runs the block with autograd on and backpropagates through it, which also
    accumulates the block's parameter gradients (so, as there, use loss.backward(), not torch.autograd.grad).
    With keep_attention, the block's attention output and LSE are kept too and the recompute reuses them.
    """

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, block: Block, store_dtype: torch.dtype, offload: bool,
                keep_attention: bool) -> Tensor:
        stored = x.detach().to(store_dtype)
        ctx.stored = to_host(stored) if offload else stored
        ctx.block, ctx.dtype, ctx.device = block, x.dtype, x.device
        ctx.kept = KeptAttention(offload) if keep_attention else None
        ctx.save_for_backward(cos, sin)
        ctx.autocast = (torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        block.attn.kept_attention = ctx.kept
        try:
            with torch.no_grad():
                return block(stored.to(x.dtype), cos, sin)
        finally:
            block.attn.kept_attention = None

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        cos, sin = ctx.saved_tensors
        x = ctx.stored.to(ctx.device, non_blocking=True).to(ctx.dtype).requires_grad_()
        ctx.stored = None
        enabled, dtype = ctx.autocast
        ctx.block.attn.kept_attention = ctx.kept
        try:
            with torch.enable_grad(), torch.autocast(ctx.device.type, dtype=dtype, enabled=enabled):
                out = ctx.block(x, cos, sin)
        finally:
            ctx.block.attn.kept_attention = None
        torch.autograd.backward(out, grad_out)
        return x.grad, None, None, None, None, None, None


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, attend: AttentionFn):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.wte = nn.Embedding(vocab_size, cfg.n_embd)
        self.rotary = Rotary(cfg.n_embd // cfg.n_head, cfg.rope_base)
        self.blocks = nn.ModuleList(Block(cfg, attend) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input/output embeddings, as in GPT-2

        # GPT-2 init: N(0, 0.02), residual projections scaled by 1/√(2·n_layer).
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def hidden(self, idx: Tensor) -> Tensor:
        """Residual stream after the last block, (B, N, C), for token ids (B, N)."""
        x = self.wte(idx)
        cos, sin = self.rotary(idx.shape[1])
        k = self.cfg.checkpoint_every
        store_dtype = getattr(torch, self.cfg.checkpoint_dtype)
        for i, block in enumerate(self.blocks):
            if k and i % k == 0 and torch.is_grad_enabled():
                x = BlockCheckpoint.apply(x, cos, sin, block, store_dtype, self.cfg.offload, self.cfg.keep_attention)
            else:
                x = block(x, cos, sin)
        return x

    def head(self, h: Tensor) -> Tensor:
        """LM logits for residual states h (final norm + tied LM head)."""
        return self.lm_head(self.ln_f(h))

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy of `targets` given `idx` (both (B, N))."""
        return self.loss(self.hidden(idx), targets)

    def loss(self, h: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of the LM head on residual states h (B, N, C) against targets (B, N)."""
        chunk = self.cfg.loss_chunk
        if not chunk or chunk >= h.shape[1]:
            return self._loss_sum(h, targets) / targets.numel()
        # Each chunk's logits are made, reduced and dropped (and recomputed in the backward), so at
        # most one chunk of logits is alive at any time.
        total = h.new_zeros((), dtype=torch.float32)
        for s in range(0, h.shape[1], chunk):
            total = total + recomputed(self._loss_sum, h[:, s : s + chunk], targets[:, s : s + chunk])
        return total / targets.numel()

    def _loss_sum(self, h: Tensor, targets: Tensor) -> Tensor:
        """Summed cross-entropy, logits in fp32."""
        logits = self.head(h).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")

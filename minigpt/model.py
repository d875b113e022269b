"""A GPT-2-style decoder with rotary position embeddings, in plain PyTorch.

Reads top to bottom: rotary embeddings, attention, MLP, block, the model, and its loss. The
attention kernel is pluggable (minigpt/attention.py). Rotary embeddings make seq_len a run-time
choice rather than a model size; the memory levers for very long contexts live here too:

- checkpoint_every=k: every k-th block is recomputed in the backward instead of keeping its
  activations (saves ~all of that block's stored tensors, costs one more forward of it).
- loss_chunk=c: the LM head and cross-entropy run over c tokens at a time and are recomputed in the
  backward, so the N×vocab logits never exist (saves N·vocab·6 bytes, costs one more LM-head matmul).
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
    """x: (B, N, H, D). Rotates the two halves of the last dim: [x1, x2] -> [x1 cos - x2 sin, x1 sin + x2 cos]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, attend: AttentionFn):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.attend = attend

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, N, C = x.shape
        # One matmul for q, k, v; views as (B, N, H, D). RoPE is applied in this layout so the
        # transposes below are free strided views (the attention kernels accept any strides).
        q, k, v = self.c_attn(x).view(B, N, 3, self.n_head, self.head_dim).unbind(dim=2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)  # (B, H, N, D)
        return self.c_proj(y.transpose(1, 2).reshape(B, N, C))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig, attend: AttentionFn):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg, attend)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x), cos, sin)
        return x + self.mlp(self.ln_2(x))


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
        """Final normalized hidden states (B, N, C) for token ids (B, N)."""
        x = self.wte(idx)
        cos, sin = self.rotary(idx.shape[1])
        k = self.cfg.checkpoint_every
        for i, block in enumerate(self.blocks):
            if k and self.training and i % k == 0:
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return self.ln_f(x)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy of `targets` given `idx` (both (B, N))."""
        return self.loss(self.hidden(idx), targets)

    def loss(self, h: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of the LM head on hidden states h (B, N, C) against targets (B, N)."""
        chunk = self.cfg.loss_chunk
        if not chunk or chunk >= h.shape[1]:
            return _lm_loss_sum(h, targets, self.lm_head.weight) / targets.numel()
        # Chunked loss: each chunk's logits are made, reduced and dropped; checkpoint recomputes them
        # in the backward, so at most one chunk of logits is alive at any time.
        total = h.new_zeros((), dtype=torch.float32)
        for s in range(0, h.shape[1], chunk):
            total = total + checkpoint(
                _lm_loss_sum, h[:, s : s + chunk], targets[:, s : s + chunk], self.lm_head.weight, use_reentrant=False
            )
        return total / targets.numel()

    def logits(self, idx: Tensor, positions: slice | None = None) -> Tensor:
        """LM logits (B, n, vocab), optionally only at `positions`, in fp32."""
        h = self.hidden(idx)
        if positions is not None:
            h = h[:, positions]
        return self.lm_head(h).float()


def _lm_loss_sum(h: Tensor, targets: Tensor, weight: Tensor) -> Tensor:
    """Summed cross-entropy of the LM head on hidden states h; logits in fp32."""
    logits = F.linear(h, weight).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")

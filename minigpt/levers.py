"""Memory levers for very long contexts: trade compute (and PCIe traffic) for GPU memory.

The model (minigpt/model.py) calls three things from here; each is off by default (ModelConfig) and, when off,
costs nothing:

- `chunked(fn, x, chunk)` (model.mlp_chunk): a token-local function over `chunk` tokens at a time, each chunk
  recomputed in the backward, so its wide activations exist for one chunk only (the 4·C-wide MLP hidden).
- `chunked_sum(fn, h, targets, chunk)` (model.loss_chunk): the same for the LM head + loss, whose N×vocab
  logits then never exist at once.
- `BlockRecompute` (model.recompute_every, recompute_dtype, offload, keep_attention): a block keeps only its
  input (optionally in bf16, optionally in pinned CPU memory) and is recomputed in the backward; with
  keep_attention the recompute reuses the forward's attention output and LSE instead of rerunning the N²
  attention forward. The attention override is passed into the block explicitly.

"Recompute" here is activation recomputation; saved training state is a checkpoint (minigpt/checkpoint.py).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from minigpt.attention import AttentionBackend
from minigpt.config import ModelConfig


def recomputed(fn: Callable[..., Tensor], *args: Tensor) -> Tensor:
    """fn(*args), keeping none of its activations for the backward (recomputed there); plain fn under no_grad."""
    if torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def chunked(fn: Callable[[Tensor], Tensor], x: Tensor, chunk: int) -> Tensor:
    """fn over x (B, N, C) in sequence chunks of `chunk` tokens, each recomputed in the backward; 0 = one piece."""
    if not chunk or chunk >= x.shape[1]:
        return fn(x)
    return torch.cat([recomputed(fn, x[:, s : s + chunk]) for s in range(0, x.shape[1], chunk)], dim=1)


def chunked_sum(fn: Callable[[Tensor, Tensor], Tensor], h: Tensor, targets: Tensor, chunk: int) -> Tensor:
    """sum of fn(h, targets) over sequence chunks, each recomputed in the backward; 0 = one piece."""
    if not chunk or chunk >= h.shape[1]:
        return fn(h, targets)
    total = h.new_zeros((), dtype=torch.float32)
    for s in range(0, h.shape[1], chunk):
        total = total + recomputed(fn, h[:, s : s + chunk], targets[:, s : s + chunk])
    return total


def to_host(t: Tensor) -> Tensor:
    """An asynchronous copy of t into CPU memory (pinned when t is on a GPU, so the copy overlaps compute),
    with t's memory layout."""
    host = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
    return host.copy_(t, non_blocking=True)


class KeptAttention:
    """An attention that keeps its output and LSE on a block's first run and reuses them on the recompute.

    The first call (the recomputed block's no-grad forward) runs the backend's forward_with_lse and keeps
    (o, lse), in CPU memory when offloading; the second call (the recompute in the backward) hands them to the
    backend's attend_saved, which sets up the backward without running the N² attention forward again.
    """

    def __init__(self, backend: AttentionBackend, offload: bool):
        self.backend, self.offload, self.kept = backend, offload, None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
        if self.kept is None:
            o, lse = self.backend.forward_with_lse(q, k, v, causal=causal)
            self.kept = (to_host(o), to_host(lse)) if self.offload else (o, lse)
            return o
        o, lse = (t.to(q.device, non_blocking=True) for t in self.kept)
        self.kept = None
        return self.backend.attend_saved(q, k, v, o, lse, causal=causal)


class _RecomputeFunction(torch.autograd.Function):
    """Run `block` keeping only its input (in `store_dtype`, on the GPU or in pinned CPU memory); recompute it in
    the backward.

    The forward runs on the stored (possibly rounded) input too, so the recomputed block is exactly the one
    that ran and the gradients are exact for it. Like torch.utils.checkpoint's reentrant mode, the backward
    re-runs the block with autograd on and backpropagates through it, which also accumulates the block's
    parameter gradients (so, as there, use loss.backward(), not torch.autograd.grad).
    """

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, block: nn.Module, store_dtype: torch.dtype, offload: bool,
                attend: KeptAttention | None) -> Tensor:
        stored = x.detach().to(store_dtype)
        ctx.stored = to_host(stored) if offload else stored
        ctx.block, ctx.attend, ctx.dtype, ctx.device = block, attend, x.dtype, x.device
        ctx.save_for_backward(cos, sin)
        ctx.autocast = (torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        with torch.no_grad():
            return block(stored.to(x.dtype), cos, sin, attend=attend)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        cos, sin = ctx.saved_tensors
        x = ctx.stored.to(ctx.device, non_blocking=True).to(ctx.dtype).requires_grad_()
        ctx.stored = None
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(ctx.device.type, dtype=dtype, enabled=enabled):
            out = ctx.block(x, cos, sin, attend=ctx.attend)
        torch.autograd.backward(out, grad_out)
        return x.grad, None, None, None, None, None, None


class BlockRecompute:
    """Which blocks are recomputed in the backward, and how (model.recompute_every, recompute_dtype, offload,
    keep_attention)."""

    def __init__(self, cfg: ModelConfig, attention: AttentionBackend):
        self.every, self.offload, self.keep_attention = cfg.recompute_every, cfg.offload, cfg.keep_attention
        self.store_dtype = getattr(torch, cfg.recompute_dtype)
        self.attention = attention

    def applies(self, index: int) -> bool:
        """Block `index` is recomputed (only when gradients are being recorded)."""
        return bool(self.every) and index % self.every == 0 and torch.is_grad_enabled()

    def __call__(self, block: nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        attend = KeptAttention(self.attention, self.offload) if self.keep_attention else None
        return _RecomputeFunction.apply(x, cos, sin, block, self.store_dtype, self.offload, attend)

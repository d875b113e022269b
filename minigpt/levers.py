"""Memory levers for very long contexts: trade compute (and PCIe traffic) for GPU memory.

The model (minigpt/model.py) calls three things from here; each is off by default (ModelConfig) and, when off,
costs nothing:

- `chunked(fn, x, chunk, params)` (model.mlp_chunk): a token-local function over `chunk` tokens at a time, each
  chunk recomputed in the backward, so its wide activations exist for one chunk only (the 4·C-wide MLP hidden);
  the input's gradient is written chunk by chunk into one buffer.
- `chunked_sum(fn, h, targets, chunk, params)` (model.loss_chunk): the same for the LM head + loss, whose N×vocab
  logits then never exist at once.
- `BlockRecompute` (model.recompute_every, recompute_dtype, offload, keep_attention): a block keeps only its
  input (optionally in bf16, optionally in pinned CPU memory) and is recomputed in the backward; with
  keep_attention the recompute reuses the forward's attention output and LSE instead of rerunning the N²
  attention forward. The attention override is passed into the block explicitly.

"Recompute" here is activation recomputation; saved training state is a checkpoint (minigpt/checkpoint.py).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch import Tensor

from minigpt.attention import AttentionBackend
from minigpt.config import ModelConfig


class _Chunked(torch.autograd.Function):
    """fn over sequence chunks of x, keeping only x; the backward recomputes one chunk at a time.

    Gradients are written chunk by chunk into one buffer for x and one per parameter, and returned: so a
    parameter gets one gradient per step from this node (DDP's hooks fire once, as without chunking), and no
    full-size zero gradient is made per chunk, as slicing's backward does under torch.utils.checkpoint (for a
    768-wide fp32 x that was 3 KB per token, once per chunk). `total=True` sums fn's (scalar) chunk results.
    """

    @staticmethod
    def forward(ctx, x: Tensor, fn: Callable[..., Tensor], chunk: int, total: bool, extra: Tensor | None,
                *params: Tensor) -> Tensor:
        ctx.fn, ctx.chunk, ctx.total = fn, chunk, total
        ctx.autocast = (torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        ctx.save_for_backward(x, extra, *params)
        out = None
        with torch.no_grad():
            for s in range(0, x.shape[1], chunk):
                y = fn(*_chunk_args(x, extra, s, chunk))
                if total:
                    out = y.float() if out is None else out + y
                    continue
                if out is None:  # the output's dtype and width are the first chunk's
                    out = y.new_empty((x.shape[0], x.shape[1], *y.shape[2:]))
                out[:, s : s + chunk] = y
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, extra, *params = ctx.saved_tensors
        trainable = [p for p in params if p.requires_grad]
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dparams: list[Tensor | None] = [None] * len(trainable)
        enabled, dtype = ctx.autocast
        for s in range(0, x.shape[1], ctx.chunk):
            xc, *rest = _chunk_args(x.detach(), extra, s, ctx.chunk)
            xc.requires_grad_(dx is not None)
            with torch.enable_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
                y = ctx.fn(xc, *rest)
            wrt = ([xc] if dx is not None else []) + trainable
            grads = torch.autograd.grad(y, wrt, grad_out if ctx.total else grad_out[:, s : s + ctx.chunk],
                                        allow_unused=True)
            if dx is not None:
                dx[:, s : s + ctx.chunk] = grads[0]
                grads = grads[1:]
            for i, g in enumerate(grads):
                if g is not None:
                    dparams[i] = g if dparams[i] is None else dparams[i].add_(g)
        found = iter(dparams)
        return (dx, None, None, None, None, *(next(found) if p.requires_grad else None for p in params))


def _chunk_args(x: Tensor, extra: Tensor | None, s: int, chunk: int) -> tuple[Tensor, ...]:
    return (x[:, s : s + chunk],) if extra is None else (x[:, s : s + chunk], extra[:, s : s + chunk])


def chunked(fn: Callable[[Tensor], Tensor], x: Tensor, chunk: int, params: Iterable[Tensor]) -> Tensor:
    """fn over x (B, N, C) in sequence chunks of `chunk` tokens, each recomputed in the backward; 0 = one piece.
    `params` are the parameters fn uses (their gradients are computed per chunk and summed)."""
    if not chunk or chunk >= x.shape[1]:
        return fn(x)
    if not torch.is_grad_enabled():
        return torch.cat([fn(x[:, s : s + chunk]) for s in range(0, x.shape[1], chunk)], dim=1)
    return _Chunked.apply(x, fn, chunk, False, None, *params)


def chunked_sum(fn: Callable[[Tensor, Tensor], Tensor], h: Tensor, targets: Tensor, chunk: int,
                params: Iterable[Tensor]) -> Tensor:
    """sum of fn(h, targets) over sequence chunks, each recomputed in the backward; 0 = one piece."""
    if not chunk or chunk >= h.shape[1]:
        return fn(h, targets)
    if not torch.is_grad_enabled():
        return sum(fn(h[:, s : s + chunk], targets[:, s : s + chunk]).float() for s in range(0, h.shape[1], chunk))
    return _Chunked.apply(h, fn, chunk, True, targets, *params)


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
        # the backward needs out's graph, not its values (its last op, the residual add, saves nothing):
        # free them now rather than after the block's backward (3 KB per token for an fp32 768-wide stream)
        if out._base is None and type(out.grad_fn).__name__ == "AddBackward0":
            out.untyped_storage().resize_(0)
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

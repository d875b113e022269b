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

import threading
import weakref
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


class HostMemory:
    """Bytes of host memory held by offloaded tensors (`to_host`): now, and the peak since `reset_peak`. Counted
    when a copy is made and when its tensor is freed, so a run can report what offloading took of the host's RAM.
    Thread-safe: the backward frees copies on autograd's thread."""

    _lock = threading.Lock()
    live = 0
    peak = 0

    @classmethod
    def add(cls, host: Tensor) -> None:
        n = host.untyped_storage().nbytes()
        with cls._lock:
            cls.live += n
            cls.peak = max(cls.peak, cls.live)
        weakref.finalize(host, cls._release, n)

    @classmethod
    def _release(cls, n: int) -> None:
        with cls._lock:
            cls.live -= n

    @classmethod
    def reset_peak(cls) -> None:
        with cls._lock:
            cls.peak = cls.live

    @classmethod
    def peak_gib(cls) -> float:
        return cls.peak / float(1 << 30)


def to_host(t: Tensor) -> Tensor:
    """An asynchronous copy of t into CPU memory (pinned when t is on a GPU, so the copy overlaps compute),
    with t's memory layout."""
    host = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
    HostMemory.add(host)
    return host.copy_(t, non_blocking=True)


class KeptAttention:
    """An attention that keeps its output and LSE on a block's first run and reuses them on the recompute.

    The first call (the recomputed block's no-grad forward) runs the backend's forward_with_lse and keeps
    (o, lse), in CPU memory when offloading; the second call (the recompute in the backward) hands them to the
    backend's attend_saved, which sets up the backward without running the N² attention forward again.
    """

    def __init__(self, backend: AttentionBackend, offload: bool):
        self.backend, self.offload, self.kept = backend, offload, None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, *, window: int | None = None,
                 document_ids: Tensor | None = None) -> Tensor:
        masks = dict(window=window, document_ids=document_ids)
        if self.kept is None:
            o, lse = self.backend.forward_with_lse(q, k, v, causal=causal, **masks)
            self.kept = (to_host(o), to_host(lse)) if self.offload else (o, lse)
            return o
        o, lse = (t.to(q.device, non_blocking=True) for t in self.kept)
        self.kept = None
        return self.backend.attend_saved(q, k, v, o, lse, causal=causal, **masks)


def _spans(n: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) token ranges of `chunk` tokens (one range when chunk is 0)."""
    step = chunk or n
    return [(s, min(s + step, n)) for s in range(0, n, step)]


class _RecomputeFunction(torch.autograd.Function):
    """Run `block` keeping only its input (in `store_dtype`, on the GPU or in pinned CPU memory); recompute it in
    the backward, piece by piece, so that the block's backward holds little more than attention's own tensors.

    Autograd over the whole recomputed block would keep, next to attention's q, k, v, o and their gradients, the
    fp32 block input, its LayerNorm, the fp32 stream after attention, and one more fp32 gradient for every
    residual add (≈ 22 KB per token for gpt2-small). Here the block runs as its pieces (`_BlockPieces`), and
    the backward walks them in the order that frees memory soonest, each token-local piece `chunk` tokens at a
    time (model.mlp_chunk):

    1. q, k, v of the stored input, without autograd; attention on them with autograd (with kept attention its
       forward is not run again).
    2. Per chunk, backward of `Block.after_attention` (x1 = x + c_proj(o), out = x1 + mlp(ln_2(x1))): the
       gradient of the block's input along the residual (written into the incoming gradient's buffer, which is
       ours) and of o (dO).
    3. Attention's backward: dq, dk, dv; then q, k, v, o and dO are dropped.
    4. Per chunk, backward of `Block.qkv` (ln_1, qkv projection, RoPE), added into the input's gradient.

    The forward runs the same pieces on the same chunks of the stored (possibly rounded) input, so the
    recomputed block is exactly the one that ran and its gradients are exact. The parameters' gradients are
    summed over the chunks and returned (one gradient per parameter and step, as DDP's hooks expect).
    """

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, document_ids: Tensor | None, block: nn.Module,
                store_dtype: torch.dtype, offload: bool, attend: KeptAttention | None, chunk: int,
                *params: Tensor) -> Tensor:
        stored = x.detach().to(store_dtype)
        pieces = _BlockPieces(block, cos, sin, chunk, x.dtype, x.device, attend, document_ids)
        with torch.no_grad():
            q, k, v = pieces.heads(stored)
            out = pieces.mlp_out(stored, pieces.attend(q, k, v))
        ctx.stored = to_host(stored) if offload else stored
        ctx.pieces, ctx.params = pieces, params
        ctx.autocast = (torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        pieces, stored, params = ctx.pieces, ctx.stored, ctx.params
        ctx.stored = ctx.pieces = None
        grads: dict[int, Tensor] = {}
        enabled, dtype = ctx.autocast
        with torch.autocast(pieces.device.type, dtype=dtype, enabled=enabled):
            with torch.no_grad():
                q, k, v = pieces.heads(stored)
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            with torch.enable_grad():
                o = pieces.attend(q, k, v)  # (B, H, N, D) with autograd back to the q, k, v leaves
            g = _own(grad_out)  # the gradient of the block's output, then of its input: one buffer throughout
            do = pieces.mlp_backward(stored, o.detach(), g, grads)
            dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
            del q, k, v, o, do
            pieces.heads_backward(stored, (dq, dk, dv), g, grads)
        return (g, None, None, None, None, None, None, None, None,
                *(grads.get(id(p)) if p.requires_grad else None for p in params))


class _BlockPieces:
    """A transformer block (minigpt/model.py's Block) run as its pieces: `Block.qkv`, attention and
    `Block.after_attention`, the token-local ones over `chunk` tokens at a time. Inputs are the stored (B, N, C)
    block input and, after attention, its output (B, H, N, D); the attention is within the block's window and the
    batch's documents (`document_ids`, None without a document mask)."""

    def __init__(self, block: nn.Module, cos: Tensor, sin: Tensor, chunk: int, dtype: torch.dtype,
                 device: torch.device, attend: KeptAttention | None, document_ids: Tensor | None = None):
        self.block, self.cos, self.sin, self.chunk = block, cos, sin, chunk
        self.dtype, self.device, self.attend_fn, self.document_ids = dtype, device, attend, document_ids

    def x(self, stored: Tensor, s: int, e: int) -> Tensor:
        """Tokens s:e of the block input in the compute dtype (from host memory when offloaded)."""
        return stored[:, s:e].to(self.device, non_blocking=True).to(self.dtype).detach()

    def _qkv(self, x: Tensor, s: int, e: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.block.qkv(x, self.cos[s:e], self.sin[s:e])

    def heads(self, stored: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v (B, N, heads, D) of the block input, chunk by chunk (call without autograd). k and v are the two
        halves of one buffer, so ring attention can send them as one message without copying them."""
        qkv: list[Tensor] = []
        for s, e in _spans(stored.shape[1], self.chunk):
            parts = self._qkv(self.x(stored, s, e), s, e)
            if not qkv:
                q_shape, kv_shape = ((p.shape[0], stored.shape[1], *p.shape[2:]) for p in parts[:2])
                kv = parts[1].new_empty((2, *kv_shape))
                qkv = [parts[0].new_empty(q_shape), kv[0], kv[1]]
            for buf, p in zip(qkv, parts):
                buf[:, s:e] = p
        return qkv[0], qkv[1], qkv[2]

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attention over (B, N, heads, D) q, k, v (kept attention if given); the output is (B, H, N, D)."""
        if self.attend_fn is None:
            return self.block.attn.attend_heads(q, k, v, self.document_ids)
        return self.attend_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                              window=self.block.attn.window, document_ids=self.document_ids)

    def mlp_out(self, stored: Tensor, o: Tensor) -> Tensor:
        """The block's output (`Block.after_attention`) chunk by chunk (without autograd)."""
        out = None
        for s, e in _spans(stored.shape[1], self.chunk):
            y = self.block.after_attention(self.x(stored, s, e), o[:, :, s:e])
            if out is None:
                out = y.new_empty((y.shape[0], stored.shape[1], *y.shape[2:]))
            out[:, s:e] = y
        return out

    def mlp_backward(self, stored: Tensor, o: Tensor, g: Tensor, grads: dict[int, Tensor]) -> Tensor:
        """Backpropagate g (the output's gradient) through the rest of the block, chunk by chunk: g becomes the
        gradient along the residual, in place; returns dO in o's layout."""
        do = torch.empty_like(o)  # o's memory layout
        params = [p for p in (self.block.attn.c_proj.weight, *self.block.mlp_params) if p.requires_grad]
        for s, e in _spans(stored.shape[1], self.chunk):
            x = self.x(stored, s, e).requires_grad_()
            oc = o[:, :, s:e].detach().requires_grad_()
            with torch.enable_grad():
                y = self.block.after_attention(x, oc)
            dx, doc, *dparams = torch.autograd.grad(y, (x, oc, *params), g[:, s:e])
            g[:, s:e] = dx
            do[:, :, s:e] = doc
            _accumulate(grads, params, dparams)
        return do

    def heads_backward(self, stored: Tensor, dqkv: tuple[Tensor, Tensor, Tensor], g: Tensor,
                       grads: dict[int, Tensor]) -> None:
        """Add the gradient through ln_1 and the q, k, v projection (dq, dk, dv as (B, N, H, D)) into g."""
        params = [p for p in (*self.block.ln_1.parameters(), self.block.attn.c_attn.weight) if p.requires_grad]
        for s, e in _spans(stored.shape[1], self.chunk):
            x = self.x(stored, s, e).requires_grad_()
            with torch.enable_grad():
                qkv = self._qkv(x, s, e)
            dx, *dparams = torch.autograd.grad(qkv, (x, *params), tuple(d[:, s:e] for d in dqkv))
            g[:, s:e] += dx
            _accumulate(grads, params, dparams)


def _own(grad: Tensor) -> Tensor:
    """The incoming gradient as a buffer this backward may overwrite. Autograd hands a node its own gradient
    buffer, except that an add passes one tensor to both its inputs; the model adds a block's output only to
    what was computed from it (the next block's residual), whose backward has run by then. A broadcast or
    strided gradient (e.g. from a sum) is copied. A gradient passed in by hand to a recomputed block's output
    (`model.hidden(x).backward(g)`) is overwritten: pass a copy if you need it afterwards."""
    return grad if grad._base is None and grad.is_contiguous() else grad.contiguous().clone()


def _accumulate(grads: dict[int, Tensor], params: list[Tensor], new: list[Tensor]) -> None:
    for p, d in zip(params, new):
        grads[id(p)] = d if id(p) not in grads else grads[id(p)].add_(d)


class BlockRecompute:
    """Which blocks are recomputed in the backward, and how (model.recompute_every, recompute_dtype, offload,
    keep_attention)."""

    def __init__(self, cfg: ModelConfig, attention: AttentionBackend):
        self.every, self.offload, self.keep_attention = cfg.recompute_every, cfg.offload, cfg.keep_attention
        self.store_dtype = getattr(torch, cfg.recompute_dtype)
        self.chunk = cfg.mlp_chunk  # the recompute runs a block's token-local pieces this many tokens at a time
        self.attention = attention

    def applies(self, index: int) -> bool:
        """Block `index` is recomputed (only when gradients are being recorded)."""
        return bool(self.every) and index % self.every == 0 and torch.is_grad_enabled()

    def __call__(self, block: nn.Module, x: Tensor, cos: Tensor, sin: Tensor,
                 document_ids: Tensor | None = None) -> Tensor:
        attend = KeptAttention(self.attention, self.offload) if self.keep_attention else None
        return _RecomputeFunction.apply(x, cos, sin, document_ids, block, self.store_dtype, self.offload, attend,
                                        self.chunk, *block.parameters())

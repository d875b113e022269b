"""Attention backends, chosen by name: `get_attention(name)(q, k, v, causal=True) -> o`.

q, k, v: (batch, heads, seq, head_dim), any strides with a contiguous last dimension. Output has
q's shape and dtype. The three backends compute the same function and differ in memory and speed:

- naive: the textbook softmax(q kᵀ / √d) v, materializing the B·H·N·N scores (memory grows as N²).
- sdpa:  torch.nn.functional.scaled_dot_product_attention, optionally pinned to one of PyTorch's kernels.
- flash: minigpt's own Triton FlashAttention (kernels/flash_attention.py), O(N) memory.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class AttentionFn(Protocol):
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor: ...


ATTENTION_BACKENDS: dict[str, Callable[..., Tensor]] = {}


def register(name: str) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    def wrap(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        ATTENTION_BACKENDS[name] = fn
        return fn
    return wrap


def get_attention(name: str, **options) -> AttentionFn:
    """The attention function registered under `name`, with backend options bound (e.g. sdpa's `backend`)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention={name}: unknown backend; choose one of {', '.join(ATTENTION_BACKENDS)}")
    fn = ATTENTION_BACKENDS[name]
    return functools.partial(fn, **options) if options else fn


@register("naive")
def naive_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    """softmax(q kᵀ/√d) v with the full score matrix in memory; softmax in fp32 for accuracy."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        future = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)


_SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


@register("sdpa")
def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, backend: str = "auto") -> Tensor:
    """PyTorch's fused attention; `backend` pins one kernel (flash | efficient | cudnn | math) or lets PyTorch pick."""
    if backend == "auto":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if backend not in _SDPA_BACKENDS:
        raise ValueError(f"attention.sdpa_backend={backend}: choose one of auto, {', '.join(_SDPA_BACKENDS)}")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, _SDPA_BACKENDS[backend])):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@register("flash")
def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
    """minigpt's Triton FlashAttention (imported lazily so CPU-only users never load Triton)."""
    from kernels import flash_attention as flash

    return flash(q, k, v, causal=causal)

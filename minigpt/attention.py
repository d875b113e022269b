"""Attention backends, chosen by name from a registry: `get_attention(name, **options)(q, k, v, causal=True) -> o`.

q, k, v: (batch, heads, seq, head_dim), any strides with a contiguous last dimension. The output has q's
shape and dtype. The backends compute the same function and differ in memory and speed:

- naive: the textbook softmax(q kᵀ / √d) v, materializing the B·H·N·N scores (memory grows as N²).
- sdpa:  torch.nn.functional.scaled_dot_product_attention, optionally pinned to one of PyTorch's kernels.
- flash: minigpt's own Triton FlashAttention (kernels/, installed as `minigpt_kernels`), O(N) memory; needs Triton
  (Linux), imported at first use, so the package imports and the other backends run without it.

Each backend is one object: its name, its options, `unsupported(device, dtype, head_dim)` (config validation
calls it, so a run that cannot work is refused before it starts) and, where it has them, a forward that also
returns the row log-sum-exp and an attention whose forward was already run (kept attention uses both), and an
attention straight from the qkv projection with RoPE inside (`attend_projection`: flash folds RoPE's backward
into its own).
Adding a backend is one class here with `@register`; config, model, sweep and benchmark take it by name.
"""
from __future__ import annotations

import math
import os
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

BACKENDS: dict[str, type[AttentionBackend]] = {}


def register(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    BACKENDS[cls.name] = cls
    return cls


def attention_names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def get_attention(name: str, **options) -> AttentionBackend:
    """The backend registered under `name`, built with its options (e.g. sdpa's `sdpa_backend`)."""
    if name not in BACKENDS:
        raise ValueError(f"attention={name}: unknown backend; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name](**options)


class AttentionBackend:
    """One way to compute causal or full attention. Subclasses set `name` and implement `__call__`."""

    name: ClassVar[str]
    returns_lse: ClassVar[bool] = False  # has forward_with_lse and attend_saved (needed by keep_attention)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
        raise NotImplementedError

    def unsupported(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """Why this backend cannot run on (device, compute dtype, head_dim), or None if it can."""
        return None

    def options(self) -> dict[str, object]:
        """The options this backend was built with (recorded in the run summary)."""
        return {}

    def forward_with_lse(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> tuple[Tensor, Tensor]:
        """Forward only, no autograd: (o, row log-sum-exp)."""
        raise NotImplementedError(f"attention={self.name} does not return its log-sum-exp")

    def attend_saved(self, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool = True) -> Tensor:
        """`o` (from forward_with_lse on these inputs) made differentiable without running the forward again."""
        raise NotImplementedError(f"attention={self.name} cannot reuse a saved forward")

    def attend_projection(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
        """Causal attention straight from the qkv projection (B, N, 3, H, D), q and k rotated by cos, sin inside,
        as (B, H, N, D); or None where this backend has no such path for these inputs (the model then rotates q
        and k itself and calls the backend)."""
        return None


@register
class NaiveAttention(AttentionBackend):
    """softmax(q kᵀ/√d) v with the full score matrix in memory; softmax in fp32 for accuracy."""

    name = "naive"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
        n_q, n_k = q.shape[-2], k.shape[-2]
        scores = torch.matmul(q, k.transpose(-2, -1)).float() * (1.0 / math.sqrt(q.shape[-1]))
        if causal:
            future = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)


# sdpa_backend option -> torch.nn.attention.SDPBackend member
SDPA_KERNELS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                "math": "MATH"}
SDPA_BACKEND_CHOICES = ("auto", *SDPA_KERNELS)


@register
class SdpaAttention(AttentionBackend):
    """PyTorch's fused attention; `sdpa_backend` pins one kernel (flash | efficient | cudnn | math) or lets PyTorch pick."""

    name = "sdpa"

    def __init__(self, sdpa_backend: str = "auto"):
        if sdpa_backend not in SDPA_BACKEND_CHOICES:
            raise ValueError(f"attention.sdpa_backend={sdpa_backend}: choose one of {', '.join(SDPA_BACKEND_CHOICES)}")
        self.sdpa_backend = sdpa_backend

    def options(self) -> dict[str, object]:
        return {"sdpa_backend": self.sdpa_backend}

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
        if self.sdpa_backend == "auto":
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, SDPA_KERNELS[self.sdpa_backend])):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def unsupported(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """A pinned kernel is tried once on a tiny input of this device, dtype and head_dim: PyTorch's own rules
        (GPU generation, dtype, head_dim, build options) decide, not a copy of them here."""
        if self.sdpa_backend == "auto":
            return None
        q = torch.zeros(1, 1, 8, head_dim, device=device, dtype=dtype)
        try:
            self(q, q, q, causal=True)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return (f"PyTorch cannot run its {self.sdpa_backend} kernel on {device.type} with {str(dtype)[6:]} at "
                    f"head_dim {head_dim} ({first[:120]}); use attention.sdpa_backend=auto or another of "
                    f"{', '.join(SDPA_KERNELS)}")
        return None


@register
class FlashAttention(AttentionBackend):
    """minigpt's Triton FlashAttention (its kernels compile on first use, so CPU-only users never compile Triton code)."""

    name = "flash"
    returns_lse = True

    def __init__(self, deterministic: bool = False):
        self.deterministic = bool(deterministic)  # always the seven-matmul backward (bitwise reproducible)

    def options(self) -> dict[str, object]:
        return {"deterministic": self.deterministic}

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> Tensor:
        from minigpt_kernels.flash_attention import flash_attention

        return flash_attention(q, k, v, causal=causal, deterministic=self.deterministic)

    def unsupported(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        try:
            from minigpt_kernels.flash_attention import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
        except ImportError as e:
            if (e.name or "").partition(".")[0] != "triton":
                raise  # a broken install of our own, not a missing Triton
            return ("needs Triton, which is not installed (Linux: pip install triton); without it use attention=sdpa "
                    "or naive")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return ("needs a CUDA GPU (a Triton kernel); on CPU use attention=sdpa or naive "
                    "(or set TRITON_INTERPRET=1 to run the kernel in Triton's slow interpreter)")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            return (f"head_dim {head_dim} (model.n_embd / model.n_head) is not supported by the kernel; "
                    f"it needs one of {', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
        if dtype not in SUPPORTED_DTYPES:
            return f"dtype {str(dtype)[6:]} is not supported; use bfloat16, float16 or float32"
        return None

    def forward_with_lse(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> tuple[Tensor, Tensor]:
        from minigpt_kernels.flash_attention import flash_attention_with_lse

        return flash_attention_with_lse(q, k, v, causal=causal)

    def attend_saved(self, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool = True) -> Tensor:
        from minigpt_kernels.flash_attention import flash_attention

        return flash_attention(q, k, v, causal=causal, precomputed=(o, lse), deterministic=self.deterministic)

    def attend_projection(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
        """Eager GPU calls: RoPE's backward folded into the kernel's (minigpt_kernels.flash_attention_qkv)."""
        from minigpt_kernels.flash_attention_qkv import flash_attention_qkv, qkv_attention_fits

        if not qkv_attention_fits(qkv, cos, sin):
            return None
        return flash_attention_qkv(qkv, cos, sin, deterministic=self.deterministic)


AttentionFn = Callable[..., Tensor]  # what the model calls: attend(q, k, v, causal=True) -> o

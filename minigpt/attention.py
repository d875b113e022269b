"""Attention backends, chosen by name from a registry:
`get_attention(name, **options)(q, k, v, causal=True, *, window=None, document_ids=None) -> o`.

q: (batch, heads, seq, head_dim); k, v: (batch, kv_heads, seq, head_dim), heads a multiple of kv_heads (GQA: query
head h reads key/value head h // (heads // kv_heads)); any strides with a contiguous last dimension. The output
has q's shape and dtype. Masks, combined with causal: `window` (an int >= 1: causal, query i sees keys
i − window < j <= i; non-causal, |i − j| < window) and `document_ids` ((batch, seq) int, non-decreasing: query i
sees key j only where their ids are equal). Every query sees itself, so no row is empty. The backends compute the
same function and differ in memory and speed:

- naive: the textbook softmax(q kᵀ / √d) v, materializing the B·H·N·N scores (memory grows as N²); masks as an
  explicit boolean matrix: the reference the others are tested against.
- sdpa:  torch.nn.functional.scaled_dot_product_attention, optionally pinned to one of PyTorch's kernels; masks as
  an explicit boolean attn_mask (B·N² bytes).
- flash: minigpt's own Triton FlashAttention (kernels/, installed as `minigpt_kernels`), O(N) memory, masks and GQA
  in the kernel (the tiles a mask empties are skipped); needs Triton (Linux), imported at first use, so the package
  imports and the other backends run without it.
- flex:  PyTorch's FlexAttention (torch.nn.attention.flex_attention), compiled; the masks as a mask_mod and a
  block mask that skips empty tiles. Trains on CUDA only (PyTorch has no backward for it on CPU).

Each backend is one object: its name, its options, `unsupported(device, dtype, head_dim, gqa=, masks=)` (config
validation calls it, so a run that cannot work is refused before it starts) and, where it has them, a forward that
also returns the row log-sum-exp and an attention whose forward was already run (kept attention uses both), and an
attention straight from the qkv projection with RoPE inside (`attend_projection`: flash folds RoPE's backward
into its own).
Adding a backend is one class here with `@register`; config, model, sweep and benchmark take it by name.
"""
from __future__ import annotations

import functools
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


def get_provider(provider: str) -> AttentionBackend:
    """A benchmark's provider by name: a registered backend ("flash", "sdpa", ...) or sdpa pinned to one of PyTorch's
    fused kernels as "sdpa-<kernel>" (sdpa-flash, sdpa-cudnn, sdpa-efficient)."""
    backend, _, kernel = provider.partition("-")
    return get_attention(backend, sdpa_backend=kernel) if kernel else get_attention(backend)


class AttentionBackend:
    """One way to compute attention (causal or full, optionally windowed, within documents, GQA). Subclasses set
    `name` and implement `__call__`."""

    name: ClassVar[str]
    returns_lse: ClassVar[bool] = False  # has forward_with_lse and attend_saved (needed by keep_attention)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, *, window: int | None = None,
                 document_ids: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def unsupported(self, device: torch.device, dtype: torch.dtype, head_dim: int, *, gqa: bool = False,
                    masks: bool = False) -> str | None:
        """Why this backend cannot run on (device, compute dtype, head_dim), with fewer key/value heads than query
        heads (`gqa`) and a window or document mask (`masks`), or None if it can."""
        return None

    def options(self) -> dict[str, object]:
        """The options this backend was built with (recorded in the run summary)."""
        return {}

    def forward_with_lse(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, *, window: int | None = None,
                         document_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Forward only, no autograd: (o, row log-sum-exp)."""
        raise NotImplementedError(f"attention={self.name} does not return its log-sum-exp")

    def attend_saved(self, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool = True, *,
                     window: int | None = None, document_ids: Tensor | None = None) -> Tensor:
        """`o` (from forward_with_lse on these inputs) made differentiable without running the forward again."""
        raise NotImplementedError(f"attention={self.name} cannot reuse a saved forward")

    def attend_projection(self, qkv: Tensor, cos: Tensor, sin: Tensor, *, n_kv_head: int, window: int | None = None,
                          document_ids: Tensor | None = None) -> Tensor | None:
        """Causal attention straight from the qkv projection (B, N, H + 2·n_kv_head, D) (q heads, then k, then v),
        q and k rotated by cos, sin inside, as (B, H, N, D); or None where this backend has no such path for these
        inputs (the model then rotates q and k itself and calls the backend)."""
        return None


def visible(n: int, causal: bool, window: int | None, document_ids: Tensor | None,
            device: torch.device) -> Tensor | None:
    """Which keys each query sees, as a boolean matrix for an explicit mask: (N, N), or (B, 1, N, N) with document
    ids (broadcast over the heads); None when it sees all of them."""
    if not causal and window is None and document_ids is None:
        return None
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    seen = j <= i if causal else torch.ones(n, n, dtype=torch.bool, device=device)
    if window is not None:
        seen = seen & ((i - j < window) if causal else ((i - j).abs() < window))
    if document_ids is not None:
        same = document_ids[:, :, None] == document_ids[:, None, :]  # (B, N, N)
        seen = (seen & same)[:, None]
    return seen


def expand_kv(q: Tensor, t: Tensor) -> Tensor:
    """k or v with its heads repeated to q's (GQA: query head h reads key/value head h // group)."""
    group = q.shape[1] // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


@register
class NaiveAttention(AttentionBackend):
    """softmax(q kᵀ/√d) v with the full score matrix in memory; softmax in fp32 for accuracy; GQA by repeating k and
    v's heads, masks as an explicit boolean matrix (the reference the other backends are tested against)."""

    name = "naive"

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, *, window: int | None = None,
                 document_ids: Tensor | None = None) -> Tensor:
        k, v = expand_kv(q, k), expand_kv(q, v)
        n_q, n_k = q.shape[-2], k.shape[-2]
        scores = torch.matmul(q, k.transpose(-2, -1)).float() * (1.0 / math.sqrt(q.shape[-1]))  # (B, nh, T, T)
        if window is not None or document_ids is not None:
            scores = scores.masked_fill(~visible(n_q, causal, window, document_ids, q.device), float("-inf"))
        elif causal:
            future = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)


# sdpa_backend option -> torch.nn.attention.SDPBackend member
SDPA_KERNELS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                "math": "MATH"}
SDPA_BACKEND_CHOICES = ("auto", *SDPA_KERNELS)
SDPA_NO_MASK = ("flash", "cudnn")  # pinned kernels that take no attn_mask (so no window or document mask)


@register
class SdpaAttention(AttentionBackend):
    """PyTorch's fused attention; `sdpa_backend` pins one kernel (flash | efficient | cudnn | math) or lets PyTorch
    pick. GQA via enable_gqa; a window or document mask goes in as an explicit boolean attn_mask."""

    name = "sdpa"

    def __init__(self, sdpa_backend: str = "auto"):
        if sdpa_backend not in SDPA_BACKEND_CHOICES:
            raise ValueError(f"attention.sdpa_backend={sdpa_backend}: choose one of {', '.join(SDPA_BACKEND_CHOICES)}")
        self.sdpa_backend = sdpa_backend

    def options(self) -> dict[str, object]:
        return {"sdpa_backend": self.sdpa_backend}

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, *, window: int | None = None,
                 document_ids: Tensor | None = None) -> Tensor:
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        if window is None and document_ids is None:
            masks = {"is_causal": causal}
        else:
            masks = {"attn_mask": visible(q.shape[-2], causal, window, document_ids, q.device)}
        if self.sdpa_backend == "auto":
            return F.scaled_dot_product_attention(q, k, v, **masks, **gqa)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, SDPA_KERNELS[self.sdpa_backend])):
            return F.scaled_dot_product_attention(q, k, v, **masks, **gqa)

    def unsupported(self, device: torch.device, dtype: torch.dtype, head_dim: int, *, gqa: bool = False,
                    masks: bool = False) -> str | None:
        """A pinned kernel that takes no attn_mask is refused with masks; otherwise it is tried once on a tiny input
        of this device, dtype, head_dim, GQA and masks: PyTorch's own rules (GPU generation, dtype, head_dim, build
        options) decide, not a copy of them here."""
        if masks and self.sdpa_backend in SDPA_NO_MASK:
            return (f"attention.sdpa_backend={self.sdpa_backend} takes no attention mask, which model.window and "
                    f"data.document_mask need; use attention.sdpa_backend=auto, efficient or math, or attention=flash")
        if self.sdpa_backend == "auto":
            return None
        q = torch.zeros(1, 2 if gqa else 1, 8, head_dim, device=device, dtype=dtype)
        kv = q[:, :1]
        try:
            self(q, kv, kv, causal=True, window=4 if masks else None)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            what = " and ".join(name for name, used in (("GQA", gqa), ("a mask", masks)) if used)
            what = f" with {what}" if what else ""
            return (f"PyTorch cannot run its {self.sdpa_backend} kernel on {device.type} with {str(dtype)[6:]} at "
                    f"head_dim {head_dim}{what} ({first[:120]}); use attention.sdpa_backend=auto or another of "
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

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, *, window: int | None = None,
                 document_ids: Tensor | None = None) -> Tensor:
        from minigpt_kernels.flash_attention import flash_attention

        return flash_attention(q, k, v, causal=causal, window=window, document_ids=document_ids,
                               deterministic=self.deterministic)

    def unsupported(self, device: torch.device, dtype: torch.dtype, head_dim: int, *, gqa: bool = False,
                    masks: bool = False) -> str | None:
        """(GQA, windows and document ids are the kernel's own.)"""
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

    def forward_with_lse(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, *, window: int | None = None,
                         document_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        from minigpt_kernels.flash_attention import flash_attention_with_lse

        return flash_attention_with_lse(q, k, v, causal=causal, window=window, document_ids=document_ids)

    def attend_saved(self, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool = True, *,
                     window: int | None = None, document_ids: Tensor | None = None) -> Tensor:
        from minigpt_kernels.flash_attention import flash_attention

        return flash_attention(q, k, v, causal=causal, window=window, document_ids=document_ids, precomputed=(o, lse),
                               deterministic=self.deterministic)

    def attend_projection(self, qkv: Tensor, cos: Tensor, sin: Tensor, *, n_kv_head: int, window: int | None = None,
                          document_ids: Tensor | None = None) -> Tensor | None:
        """Eager GPU calls: RoPE's backward folded into the kernel's (minigpt_kernels.flash_attention_qkv), with GQA
        and the masks."""
        from minigpt_kernels.flash_attention_qkv import flash_attention_qkv, qkv_attention_fits

        if not qkv_attention_fits(qkv, cos, sin, n_kv_head=n_kv_head):
            return None
        return flash_attention_qkv(qkv, cos, sin, n_kv_head=n_kv_head, window=window, document_ids=document_ids,
                                   deterministic=self.deterministic)


@functools.cache
def compiled_flex() -> Callable[..., Tensor]:
    """torch.compile(flex_attention), made once: uncompiled, FlexAttention materializes the scores."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_mask_mod(causal: bool, window: int | None, document_ids: Tensor | None) -> Callable[..., Tensor]:
    """FlexAttention's mask_mod for these masks: whether query q_idx of row b sees key kv_idx."""
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        seen = kv_idx <= q_idx if causal else kv_idx >= 0
        if window is not None:
            seen = seen & ((q_idx - kv_idx < window) if causal else ((q_idx - kv_idx).abs() < window))
        if document_ids is not None:
            seen = seen & (document_ids[b, q_idx] == document_ids[b, kv_idx])
        return seen

    return mask_mod


@register
class FlexAttention(AttentionBackend):
    """PyTorch's FlexAttention, compiled once: the masks as a mask_mod, whose block mask lets the kernel skip the
    tiles it empties; GQA via enable_gqa. A block mask is made per call with document ids (they change with each
    batch; the layers of one forward share it), else once per (N, causal, window)."""

    name = "flex"

    def __init__(self):
        self.block_masks: dict[tuple, object] = {}  # (N, causal, window, device) -> BlockMask, without documents
        self.document_masks: dict[tuple, object] = {}  # the same, for the document ids of the last call
        self.document_ids: Tensor | None = None  # kept, so the identity test below cannot meet a reused id

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, *, window: int | None = None,
                 document_ids: Tensor | None = None) -> Tensor:
        block_mask = self.block_mask(q.shape[-2], causal, window, document_ids, q.device)
        return compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])

    def block_mask(self, n: int, causal: bool, window: int | None, document_ids: Tensor | None,
                   device: torch.device) -> object | None:
        """The BlockMask of these masks (None: full attention), from the cache where it was made before."""
        from torch.nn.attention.flex_attention import create_block_mask

        if not causal and window is None and document_ids is None:
            return None
        if document_ids is not None and document_ids is not self.document_ids:
            self.document_ids, self.document_masks = document_ids, {}
        cache = self.block_masks if document_ids is None else self.document_masks
        key = (n, causal, window, device)
        if key not in cache:
            rows = None if document_ids is None else document_ids.shape[0]
            cache[key] = create_block_mask(flex_mask_mod(causal, window, document_ids), rows, None, n, n,
                                           device=device)
        return cache[key]

    def unsupported(self, device: torch.device, dtype: torch.dtype, head_dim: int, *, gqa: bool = False,
                    masks: bool = False) -> str | None:
        if device.type != "cuda":
            return ("PyTorch's FlexAttention has no backward on CPU, so it cannot train here; on CPU use "
                    "attention=sdpa or naive")
        return None


AttentionFn = Callable[..., Tensor]  # what the model calls: attend(q, k, v, causal=True, *, window, document_ids) -> o

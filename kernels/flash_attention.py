"""FlashAttention for PyTorch: the functions callers use (`flash_attention`, `flash_attention_with_lse`), their input
checks, the custom ops torch.compile traces (with fakes) and the autograd.Function. The kernels are in
triton_kernels.py and gluon/, which runs where (and why) in dispatch.py, the launchers in launch.py.

This module also re-exports the names older callers reach through it (launchers, TileConfig, tile_config, INTERPRET,
...): `importlib.import_module("minigpt_kernels.flash_attention").launch_forward` keeps working.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from minigpt_kernels.device import INTERPRET
from minigpt_kernels.dispatch import (  # noqa: F401 (re-exported)
    PATH_ENV, PATHS, VIA_DS_MAX_BYTES, Plan, TileConfig, ds_head_elements, fused_backward_config, plan, tile_config)
from minigpt_kernels.launch import (  # noqa: F401 (re-exported)
    FUSED_DQ_ACC_BYTES, check_doc_ids, empty_in_layout_of, launch_backward, launch_backward_delta, launch_backward_dkdv,
    launch_backward_dq, launch_backward_fused, launch_backward_via_ds, launch_forward, specialized_ready,
    via_ds_chosen)
from minigpt_kernels.triton_kernels import LOG2E  # noqa: F401 (re-exported)

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    """flash_attention's contract (README, DESIGN.md): ValueError naming what an input breaks."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"flash_attention: {name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if not (k.shape == v.shape and q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:]):
        raise ValueError(f"flash_attention: q, k, v must have the same shape but for the heads (GQA), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise ValueError(f"flash_attention: q's heads ({q.shape[1]}) must be a multiple of k and v's ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"flash_attention: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k, v on different devices ({q.device}, {k.device}, {v.device})")
    check_kind(q.dtype, q.shape[-1], q.shape[2], q.device)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"flash_attention: {name}'s last dimension must be contiguous (stride 1), got strides {t.stride()}")


def check_kind(dtype: torch.dtype, head_dim: int, seq: int, device: torch.device) -> None:
    """check_inputs' part that holds for all of q, k, v at once (flash_attention_qkv's inputs are one tensor): a dtype
    and head_dim the kernels take, seq >= 1, on a GPU (or under Triton's interpreter)."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"flash_attention: dtype {dtype} not supported; use float16, bfloat16 or float32")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"flash_attention: head_dim {head_dim} not supported; use one of {SUPPORTED_HEAD_DIMS}")
    if seq < 1:
        raise ValueError("flash_attention: seq must be >= 1")
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(f"flash_attention: needs CUDA tensors (got {device}); set TRITON_INTERPRET=1 to run on CPU")


def check_masks(q: Tensor, window: int | None, document_ids: Tensor | None, seq: int | None = None) -> None:
    """The masks of flash_attention for q (B, H, seq, D), or any tensor of q's batch and device with the length
    given as `seq`: ValueError naming what breaks. No look at the ids' values here (that would sync with the GPU
    and break a compiled graph): MINIGPT_CHECK_MASKS=1 has the launchers check they do not decrease."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"flash_attention: window must be an int >= 1 (or None), got {window!r}")
    if document_ids is not None:
        check_doc_ids("document_ids", document_ids, q, q.shape[2] if seq is None else seq)


# ------------------------------------------------------------------------------------------------
# PyTorch integration: custom ops (opaque to torch.compile, no graph break) + autograd.Function
# ------------------------------------------------------------------------------------------------
def _masks(window: int | None, document_ids: Tensor | None) -> dict:
    """flash_attention's masks as the launchers take them (the same document ids for queries and keys)."""
    return dict(window=window, q_doc_ids=document_ids, k_doc_ids=document_ids)


@torch.library.custom_op("minigpt::flash_attn_fwd", mutates_args=())
def _flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: float, window: int | None = None,
                    document_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return launch_forward(q, k, v, causal, sm_scale, **_masks(window, document_ids))


@_flash_attn_fwd.register_fake
def _(q, k, v, causal, sm_scale, window=None, document_ids=None):  # the outputs' shapes and layouts, for torch.compile
    B, H, N, D = q.shape
    return empty_in_layout_of(q), q.new_empty((B, H, N), dtype=torch.float32)


@torch.library.custom_op("minigpt::flash_attn_bwd", mutates_args=())
def _flash_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
                    sm_scale: float, deterministic: bool, window: int | None = None,
                    document_ids: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    return launch_backward(do, q, k, v, o, lse, causal, sm_scale, deterministic=deterministic,
                           **_masks(window, document_ids))


@_flash_attn_bwd.register_fake
def _(do, q, k, v, o, lse, causal, sm_scale, deterministic, window=None, document_ids=None):
    return empty_in_layout_of(q), empty_in_layout_of(k), empty_in_layout_of(v)


def traced(t: Tensor) -> bool:
    """Whether to reach the kernels through the custom ops above: when torch.compile traces the call (Dynamo, or
    AOTAutograd's fake/functional tensors; any other tensor subclass takes them too), which treats them as opaque.
    Plain eager calls launch the kernels directly: the custom-op dispatch costs more host time than the launches
    (kernels/NOTES.md U)."""
    return torch.compiler.is_compiling() or type(t) is not Tensor


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: float, window: int | None,
                document_ids: Tensor | None, precomputed: tuple[Tensor, Tensor] | None, deterministic: bool) -> Tensor:
        if precomputed is not None:  # the caller ran this forward already (e.g. before a checkpoint recompute)
            o, lse = precomputed
        elif traced(q):
            o, lse = torch.ops.minigpt.flash_attn_fwd(q, k, v, causal, sm_scale, window, document_ids)
        else:
            o, lse = launch_forward(q, k, v, causal, sm_scale, **_masks(window, document_ids))
        ctx.save_for_backward(q, k, v, o, lse, document_ids)
        ctx.causal, ctx.sm_scale, ctx.deterministic, ctx.window = causal, sm_scale, deterministic, window
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, o, lse, document_ids = ctx.saved_tensors
        if traced(do) or torch.is_grad_enabled():  # create_graph: the op's missing formula says so, loudly
            dq, dk, dv = torch.ops.minigpt.flash_attn_bwd(do, q, k, v, o, lse, ctx.causal, ctx.sm_scale,
                                                          ctx.deterministic, ctx.window, document_ids)
        else:
            dq, dk, dv = launch_backward(do, q, k, v, o, lse, ctx.causal, ctx.sm_scale,
                                         deterministic=ctx.deterministic, **_masks(ctx.window, document_ids))
        return dq, dk, dv, None, None, None, None, None, None


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, softmax_scale: float | None = None, *,
                    window: int | None = None, document_ids: Tensor | None = None,
                    precomputed: tuple[Tensor, Tensor] | None = None, deterministic: bool = False) -> Tensor:
    """softmax(softmax_scale · q kᵀ [+ masks]) v without materializing the scores; differentiable.

    q: (batch, q_heads, seq, head_dim), k, v: (batch, kv_heads, seq, head_dim) CUDA tensors of one dtype (fp16,
    bf16; fp32 runs with TF32 dots), q_heads a multiple of kv_heads (GQA/MQA: query head h reads K/V head
    h // (q_heads // kv_heads); dk, dv sum over each group), any strides whose last dimension is contiguous;
    head_dim in {16, 32, 64, 128, 256}; any seq >= 1.
    Masks, combined: `causal` (query i sees keys j <= i); `window` (an int >= 1: causal, keys i − window < j <= i;
    non-causal, |i − j| < window); `document_ids` ((batch, seq) int32/int64 on q's device, non-decreasing along seq:
    packed documents; query i sees key j only where their ids are equal; MINIGPT_CHECK_MASKS=1 checks the order).
    The tiles the masks empty are skipped, found on the device (no host sync: torch.compile traces no graph break).
    softmax_scale defaults to 1/sqrt(head_dim). Returns a tensor of q's shape and dtype, laid out in memory
    like q: (B, N, H, D) rows for head-transposed views such as the model's, else contiguous.
    `precomputed=(o, lse)` from `flash_attention_with_lse` on the same inputs skips the forward kernel and
    only sets up the backward (activation checkpointing uses it to avoid recomputing the N² attention).
    `deterministic=True` (or torch.use_deterministic_algorithms) keeps the bitwise-reproducible seven-matmul
    backward where the five-matmul one would run (launch_backward).
    Unsupported inputs raise ValueError naming the problem.
    """
    check_inputs(q, k, v)
    check_masks(q, window, document_ids)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return FlashAttention.apply(q, k, v, causal, sm_scale, window, document_ids, precomputed, deterministic)


def flash_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, softmax_scale: float | None = None,
                             *, window: int | None = None,
                             document_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Forward only (no autograd): the output and the row log-sum-exp (base 2, fp32, (batch, q_heads, seq)); a
    row that sees no key has lse −inf (none does under flash_attention's masks: each query sees itself).
    Inputs and masks: flash_attention's."""
    check_inputs(q, k, v)
    check_masks(q, window, document_ids)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if traced(q) or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        # no gradient: the op says so if asked
        return torch.ops.minigpt.flash_attn_fwd(q, k, v, causal, sm_scale, window, document_ids)
    return launch_forward(q, k, v, causal, sm_scale, **_masks(window, document_ids))

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
    FUSED_DQ_ACC_BYTES, empty_in_layout_of, launch_backward, launch_backward_delta, launch_backward_dkdv,
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
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"flash_attention: q, k, v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"flash_attention: q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"flash_attention: dtype {q.dtype} not supported; use float16, bfloat16 or float32")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"flash_attention: head_dim {q.shape[-1]} not supported; use one of {SUPPORTED_HEAD_DIMS}")
    if q.shape[2] < 1:
        raise ValueError("flash_attention: seq must be >= 1")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k, v on different devices ({q.device}, {k.device}, {v.device})")
    if q.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"flash_attention: needs CUDA tensors (got {q.device}); set TRITON_INTERPRET=1 to run on CPU")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"flash_attention: {name}'s last dimension must be contiguous (stride 1), got strides {t.stride()}")


# ------------------------------------------------------------------------------------------------
# PyTorch integration: custom ops (opaque to torch.compile, no graph break) + autograd.Function
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("minigpt::flash_attn_fwd", mutates_args=())
def _flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: float) -> tuple[Tensor, Tensor]:
    return launch_forward(q, k, v, causal, sm_scale)


@_flash_attn_fwd.register_fake
def _(q, k, v, causal, sm_scale):  # shapes and memory layouts of the outputs, for torch.compile
    B, H, N, D = q.shape
    return empty_in_layout_of(q), q.new_empty((B, H, N), dtype=torch.float32)


@torch.library.custom_op("minigpt::flash_attn_bwd", mutates_args=())
def _flash_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
                    sm_scale: float, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return launch_backward(do, q, k, v, o, lse, causal, sm_scale, deterministic=deterministic)


@_flash_attn_bwd.register_fake
def _(do, q, k, v, o, lse, causal, sm_scale, deterministic):
    return empty_in_layout_of(q), empty_in_layout_of(k), empty_in_layout_of(v)


def traced(t: Tensor) -> bool:
    """Whether to reach the kernels through the custom ops above: when torch.compile traces the call (Dynamo, or
    AOTAutograd's fake/functional tensors; any other tensor subclass takes them too), which treats them as opaque.
    Plain eager calls launch the kernels directly: the custom-op dispatch costs more host time than the launches
    (kernels/NOTES.md U)."""
    return torch.compiler.is_compiling() or type(t) is not Tensor


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: float,
                precomputed: tuple[Tensor, Tensor] | None, deterministic: bool) -> Tensor:
        if precomputed is not None:  # the caller ran this forward already (e.g. before a checkpoint recompute)
            o, lse = precomputed
        elif traced(q):
            o, lse = torch.ops.minigpt.flash_attn_fwd(q, k, v, causal, sm_scale)
        else:
            o, lse = launch_forward(q, k, v, causal, sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale, ctx.deterministic = causal, sm_scale, deterministic
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        if traced(do) or torch.is_grad_enabled():  # create_graph: the op's missing formula says so, loudly
            dq, dk, dv = torch.ops.minigpt.flash_attn_bwd(do, q, k, v, o, lse, ctx.causal, ctx.sm_scale,
                                                          ctx.deterministic)
        else:
            dq, dk, dv = launch_backward(do, q, k, v, o, lse, ctx.causal, ctx.sm_scale,
                                         deterministic=ctx.deterministic)
        return dq, dk, dv, None, None, None, None


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, softmax_scale: float | None = None,
                    precomputed: tuple[Tensor, Tensor] | None = None, deterministic: bool = False) -> Tensor:
    """softmax(softmax_scale · q kᵀ [+ causal mask]) v without materializing the scores; differentiable.

    q, k, v: (batch, heads, seq, head_dim) CUDA tensors of one dtype (fp16, bf16; fp32 runs with TF32 dots),
    any strides whose last dimension is contiguous; head_dim in {16, 32, 64, 128, 256}; any seq >= 1.
    softmax_scale defaults to 1/sqrt(head_dim). Returns a tensor of q's shape and dtype, laid out in memory
    like q: (B, N, H, D) rows for head-transposed views such as the model's, else contiguous.
    `precomputed=(o, lse)` from `flash_attention_with_lse` on the same inputs skips the forward kernel and
    only sets up the backward (activation checkpointing uses it to avoid recomputing the N² attention).
    `deterministic=True` (or torch.use_deterministic_algorithms) keeps the bitwise-reproducible seven-matmul
    backward where the five-matmul one would run (launch_backward).
    Unsupported inputs raise ValueError naming the problem.
    """
    check_inputs(q, k, v)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return FlashAttention.apply(q, k, v, causal, sm_scale, precomputed, deterministic)


def flash_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                             softmax_scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Forward only (no autograd): the output and the row log-sum-exp (base 2, fp32, (batch, heads, seq))."""
    check_inputs(q, k, v)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if traced(q) or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return torch.ops.minigpt.flash_attn_fwd(q, k, v, causal, sm_scale)  # no gradient: the op says so if asked
    return launch_forward(q, k, v, causal, sm_scale)

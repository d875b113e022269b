"""Causal attention straight from the qkv projection, RoPE included: the model's flash path on a GPU.

    qkv (B, N, 3, H, D)  ->  o = attention(rot(q), rot(k), v)      o: (B, H, N, D), laid out like q

The same function as qkv_rotary followed by flash_attention, with the two backwards folded into one:
- the attention's backward writes dV and dK straight into the projection's gradient dqkv (strided views of it),
  where the pair would write dq, dk, dv into buffers of their own for the rotary backward to copy;
- the rotary backward then rotates dK back in place and dQ back into dqkv, reading dQ from the five-matmul
  backward's fp32 accumulator where that one ran over every head at once (up to FUSED_DQ_ACC_BYTES of accumulator;
  longer inputs go head group by head group and their dQ is rounded into dqkv first), so its cast into a bf16 dq
  (and one rounding) is skipped too.
That is 10 bytes per element of one of q, k, v instead of 18 (8K tokens × batch 4 × 768: about 200 MB less traffic
per layer and one launch fewer; kernels/NOTES.md X). No other attention can do it: it needs the kernel's own
accumulator and output strides. The forward is qkv_rotary's kernel, then the attention's.

It runs outside Dynamo only: with the model's regional compilation (compile=true) the attention call sits between
the compiled regions, so this path runs there too; a whole-model trace takes the model's PyTorch RoPE and the flash
custom ops instead.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from minigpt_kernels.flash_attention import check_inputs, traced
from minigpt_kernels.launch import launch_backward, launch_forward
from minigpt_kernels.rotary import check_layout, qkv_rotary_forward, rotary_fits, rotate_back_into


class FlashAttentionQKV(torch.autograd.Function):
    """flash_attention_qkv's autograd: the forward keeps q, k (rotated) and v as views of the rotary kernel's own
    buffers (so the projection's output need not outlive the forward), o and the LSE; the backward writes dqkv, and
    gives cos and sin no gradient."""

    @staticmethod
    def forward(ctx, qkv: Tensor, cos: Tensor, sin: Tensor, sm_scale: float, deterministic: bool) -> Tensor:
        q, k, v = (t.transpose(1, 2) for t in qkv_rotary_forward(qkv, cos, sin))  # (B, H, N, D) views
        o, lse = launch_forward(q, k, v, True, sm_scale)
        ctx.save_for_backward(q, k, v, o, lse, cos, sin)
        ctx.sm_scale, ctx.deterministic, ctx.qkv_shape = sm_scale, deterministic, qkv.shape
        return o

    @staticmethod
    @once_differentiable  # no gradient of the gradient: asking for one raises
    def backward(ctx, do: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, o, lse, cos, sin = ctx.saved_tensors
        dqkv = torch.empty(ctx.qkv_shape, dtype=q.dtype, device=q.device)
        parts = tuple(dqkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, D) views of dqkv's q, k, v parts
        # dv and dk land in dqkv; dq too, unless the five-matmul backward ran over every head at once and returned
        # its fp32 accumulator instead
        dq, dk, _ = launch_backward(do, q, k, v, o, lse, True, ctx.sm_scale, deterministic=ctx.deterministic,
                                    out=parts, fp32_dq=True)
        rotate_back_into(dqkv, dq.transpose(1, 2), dk.transpose(1, 2), cos, sin)
        return dqkv, None, None, None, None


def qkv_attention_fits(qkv: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether flash_attention_qkv takes these inputs: qkv_rotary's GPU layout (cos, sin needing no gradient), and a
    call outside Dynamo (a whole-model trace takes the model's PyTorch RoPE and the flash custom ops instead)."""
    return not traced(qkv) and rotary_fits(qkv, cos, sin)


def flash_attention_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, deterministic: bool = False) -> Tensor:
    """Causal softmax(q kᵀ/√D) v of q = rot(qkv[:, :, 0]), k = rot(qkv[:, :, 1]), v = qkv[:, :, 2]; differentiable.
    qkv: (B, N, 3, H, D) with contiguous (3, H, D) on a GPU (or under Triton's interpreter), D a power of two the
    kernel takes; cos, sin: fp32 (N, D/2) tables (or (N, 1, D/2), as minigpt.model.Rotary makes them). Returns o
    (B, H, N, D) in q's (B, N, H, D) memory order, as flash_attention does for the model's views.
    deterministic: as for flash_attention."""
    check_layout(qkv, cos, sin, "flash_attention_qkv")
    check_inputs(*(qkv[:, :, i].transpose(1, 2) for i in range(3)))
    N, D = qkv.shape[1], qkv.shape[4]
    cos, sin = cos.reshape(N, D // 2), sin.reshape(N, D // 2)
    return FlashAttentionQKV.apply(qkv, cos, sin, 1.0 / math.sqrt(D), deterministic)

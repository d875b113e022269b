"""Causal attention straight from the qkv projection, RoPE included: the model's flash path on a GPU.

    qkv (B, N, Hq + 2·Hkv, D)  ->  o = attention(rot(q), rot(k), v)      o: (B, Hq, N, D), laid out like q
    q = qkv[:, :, :Hq], k = qkv[:, :, Hq:Hq+Hkv], v = qkv[:, :, Hq+Hkv:]  (query head h reads K/V head h // (Hq/Hkv))

Grouped-query attention (Hkv < Hq, Hq a multiple of Hkv) and multi-head attention (Hkv = Hq; the model's
(B, N, 3, H, D) projection is taken as (B, N, 3H, D), a view), with flash_attention's masks (a sliding window,
document ids) on top of the causal one.

The same function as qkv_rotary followed by flash_attention, with the two backwards folded into one:
- the attention's backward writes dV and dK straight into the projection's gradient dqkv (strided views of its
  k and v heads; with GQA the dK/dV kernel sums each K/V head's group of query heads itself, so dK and dV are
  (B, Hkv, N, D) from the start: no K/V or dK/dV of Hq heads exists anywhere), where the pair would write dq, dk,
  dv into buffers of their own for the rotary backward to copy;
- the rotary backward then rotates dK back in place and dQ back into dqkv, reading dQ from the five-matmul
  backward's fp32 accumulator where that one ran over every head at once (multi-head without masks only; up to
  FUSED_DQ_ACC_BYTES of accumulator; longer inputs go head group by head group and their dQ is rounded into dqkv
  first), so its cast into a bf16 dq (and one rounding) is skipped too.
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

from minigpt_kernels.flash_attention import check_kind, check_masks, traced
from minigpt_kernels.launch import launch_backward, launch_forward
from minigpt_kernels.rotary import check_layout, qkv_rotary_forward, rotary_fits, rotate_back_into


def _heads(packed: Tensor, n_head: int, n_kv_head: int) -> tuple[Tensor, Tensor, Tensor]:
    """q (B, Hq, N, D), k and v (B, Hkv, N, D): head-transposed views of the packed (B, N, Hq + 2·Hkv, D)."""
    return tuple(t.transpose(1, 2) for t in packed.split((n_head, n_kv_head, n_kv_head), dim=2))


class FlashAttentionQKV(torch.autograd.Function):
    """flash_attention_qkv's autograd: the forward keeps q, k (rotated) and v as views of the rotary kernel's own
    buffers (so the projection's output need not outlive the forward), o and the LSE; the backward writes dqkv, and
    gives cos, sin and the masks no gradient."""

    @staticmethod
    def forward(ctx, packed: Tensor, cos: Tensor, sin: Tensor, n_kv_head: int, sm_scale: float,
                window: int | None, document_ids: Tensor | None, deterministic: bool) -> Tensor:
        # q (B, Hq, N, D), k, v (B, Hkv, N, D): views of the (B, N, heads, D) buffers
        q, k, v = (t.transpose(1, 2) for t in qkv_rotary_forward(packed, cos, sin, n_kv_head))
        masks = dict(window=window, q_doc_ids=document_ids, k_doc_ids=document_ids)
        o, lse = launch_forward(q, k, v, True, sm_scale, **masks)
        ctx.save_for_backward(q, k, v, o, lse, cos, sin, document_ids)
        ctx.sm_scale, ctx.deterministic, ctx.window, ctx.packed_shape = sm_scale, deterministic, window, packed.shape
        return o

    @staticmethod
    @once_differentiable  # no gradient of the gradient: asking for one raises
    def backward(ctx, do: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, o, lse, cos, sin, document_ids = ctx.saved_tensors
        dqkv = torch.empty(ctx.packed_shape, dtype=q.dtype, device=q.device)
        parts = _heads(dqkv, q.shape[1], k.shape[1])  # dqkv's q, k, v heads as (B, H, N, D) views
        # dv and dk land in dqkv (Hkv heads each, summed over their groups by the dK/dV kernel); dq too, unless the
        # five-matmul backward ran over every head at once and returned its fp32 accumulator instead
        dq, dk, _ = launch_backward(do, q, k, v, o, lse, True, ctx.sm_scale, deterministic=ctx.deterministic,
                                    out=parts, fp32_dq=True, window=ctx.window, q_doc_ids=document_ids,
                                    k_doc_ids=document_ids)
        # dqkv's q heads = rot⁻¹(dQ) (from the accumulator, or in place), its k heads = rot⁻¹(dK) in place
        rotate_back_into(dqkv, dq.transpose(1, 2), dk.transpose(1, 2), cos, sin)
        return dqkv, None, None, None, None, None, None, None


def qkv_attention_fits(qkv: Tensor, cos: Tensor, sin: Tensor, n_kv_head: int | None = None) -> bool:
    """Whether flash_attention_qkv takes these inputs: qkv_rotary's GPU layout with n_kv_head K/V heads (cos, sin
    needing no gradient), and a call outside Dynamo (a whole-model trace takes the model's PyTorch RoPE and the
    flash custom ops instead)."""
    return not traced(qkv) and rotary_fits(qkv, cos, sin, n_kv_head)


def flash_attention_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, *, n_kv_head: int | None = None,
                        window: int | None = None, document_ids: Tensor | None = None,
                        deterministic: bool = False) -> Tensor:
    """Causal softmax(q kᵀ/√D [+ masks]) v of q = rot(qkv[:, :, :Hq]), k = rot(qkv[:, :, Hq:Hq+Hkv]),
    v = qkv[:, :, Hq+Hkv:]; differentiable (with respect to qkv).

    qkv: (B, N, Hq + 2·Hkv, D) with each token's (Hq + 2·Hkv, D) contiguous (any token and batch strides, e.g. a
    view of the linear layer's (B, N, (Hq + 2·Hkv)·D) output), on a GPU (or under Triton's interpreter); Hkv =
    n_kv_head (None: heads / 3, multi-head), Hq a multiple of it (query head h reads K/V head h // (Hq / Hkv)); D a
    head_dim flash_attention takes. The model's multi-head (B, N, 3, H, D) with contiguous (3, H, D) is taken too
    (as the (B, N, 3H, D) view; n_kv_head None or H); its gradient comes back in that shape.
    cos, sin: fp32 (N, D/2) tables (or (N, 1, D/2), as minigpt.model.Rotary makes them), needing no gradient.
    window, document_ids, deterministic: as for flash_attention (the causal mask always applies).
    Returns o (B, Hq, N, D) in q's (B, N, Hq, D) memory order, as flash_attention does for the model's views.
    Inputs it does not take raise ValueError naming the problem."""
    packed, _, n_kv_head = check_layout(qkv, cos, sin, "flash_attention_qkv", n_kv_head)
    _, N, _, D = packed.shape
    check_kind(packed.dtype, D, N, packed.device)  # check_inputs' shapes and strides hold by check_layout's
    check_masks(packed, window, document_ids, seq=N)
    cos, sin = cos.reshape(N, D // 2), sin.reshape(N, D // 2)
    return FlashAttentionQKV.apply(packed, cos, sin, n_kv_head, 1.0 / math.sqrt(D), window, document_ids,
                                   deterministic)

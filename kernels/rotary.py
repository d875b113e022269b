"""The attention's inputs from the qkv projection in one pass: q and k rotated (RoPE), v split off.

    qkv (B, N, 3, H, D)  ->  q = rot(qkv[:, :, 0]), k = rot(qkv[:, :, 1]), v = qkv[:, :, 2]     each (B, N, H, D)
    rot([x1, x2]) = [x1 cos - x2 sin, x1 sin + x2 cos]          (x1, x2: the two halves of a head's D values)

Why a kernel: eager PyTorch spends about a dozen elementwise passes on this (fp32 casts, the four products,
the concatenation; in the backward a zero-filled qkv-sized gradient per slice, then their sum), which at 8K tokens ×
batch 4 in gpt2-small took 2.47 ms per layer (forward and backward) against 3.4 ms for the attention itself (H200, kernels/NOTES.md U).
Here the forward reads qkv once and writes q, k, v once; the backward reads their gradients once and writes the
qkv gradient once. The rotation is orthogonal, so its backward is the rotation by the opposite angle:
    dx1 = g1 cos + g2 sin,   dx2 = g2 cos - g1 sin.
(With YaRN the model's tables carry its temperature, cos² + sin² = t; these formulas are still the transpose of the
forward's, so the gradient stays exact: tests/test_rope_scaling.py.)
Both compute in fp32 and round once to the input dtype, as minigpt.model.apply_rotary does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from minigpt_kernels.device import INTERPRET

BLOCK_TOKENS = 32  # tokens per program (each program rotates one head of them)


@triton.jit
def _qkv_rotary_kernel(PACKED, Q, K, V, COS, SIN, N, H, n_blocks,
                       stride_pb, stride_pn, stride_pp, stride_ph,  # PACKED (B, N, 3, H, D): part p, token n, head h
                       stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,  # Q, K, V (B, N, H, D)
                       stride_vb, stride_vn, stride_vh, stride_cn,
                       BACKWARD: tl.constexpr, WITH_V: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """One head of BLOCK tokens. Forward: q, k rotated and v copied from the qkv projection PACKED into Q, K, V.
    BACKWARD: their gradients Q, K, V rotated back (k's and q's) and copied (v's) into the projection's gradient
    PACKED; without WITH_V, v's part is left as it is (already written there). Q or K may be PACKED's own part
    (rotated in place: each element is loaded before it is stored, by the same program)."""
    pid = tl.program_id(0)  # one grid axis: no per-axis limit on heads · batch or on tokens
    bh = (pid // n_blocks).to(tl.int64)
    b, h = bh // H, bh % H
    n = (pid % n_blocks) * BLOCK + tl.arange(0, BLOCK)
    rows = n.to(tl.int64)[:, None]
    d = tl.arange(0, HALF)[None, :]
    ok = (n < N)[:, None]
    angle = rows * stride_cn + d  # cos, sin: (N, HALF) tables at the tokens' positions
    c = tl.load(COS + angle, mask=ok, other=0.0)
    s = tl.load(SIN + angle, mask=ok, other=0.0)
    packed = PACKED + b * stride_pb + rows * stride_pn + h * stride_ph + d
    q = Q + b * stride_qb + rows * stride_qn + h * stride_qh + d
    k = K + b * stride_kb + rows * stride_kn + h * stride_kh + d
    v = V + b * stride_vb + rows * stride_vn + h * stride_vh + d
    for part in tl.static_range(2):  # q, then k: [x1, x2] -> rot or rot⁻¹, in fp32, rounded once
        one = q if part == 0 else k
        src, dst = (one, packed + part * stride_pp) if BACKWARD else (packed + part * stride_pp, one)
        x1 = tl.load(src, mask=ok).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok).to(tl.float32)
        if BACKWARD:  # rot⁻¹: the rotation by −angle
            y1, y2 = x1 * c + x2 * s, x2 * c - x1 * s
        else:
            y1, y2 = x1 * c - x2 * s, x1 * s + x2 * c
        tl.store(dst, y1.to(dst.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, y2.to(dst.dtype.element_ty), mask=ok)
    if WITH_V:
        src, dst = (v, packed + 2 * stride_pp) if BACKWARD else (packed + 2 * stride_pp, v)
        for half in tl.static_range(2):  # v as it is
            tl.store(dst + half * HALF, tl.load(src + half * HALF, mask=ok), mask=ok)


def _launch(packed: Tensor, q: Tensor, k: Tensor, v: Tensor | None, cos: Tensor, sin: Tensor, backward: bool) -> None:
    """q, k, v: (B, N, H, D) views, any strides with a contiguous last dimension; v None: left out (backward only)."""
    B, N, _, H, D = packed.shape
    n_blocks = triton.cdiv(N, BLOCK_TOKENS)
    with_v = v is not None
    v = v if with_v else k  # a stand-in the kernel does not touch
    _qkv_rotary_kernel[(n_blocks * B * H,)](packed, q, k, v, cos, sin, N, H, n_blocks, *packed.stride()[:4],
                             *(st for t in (q, k, v) for st in t.stride()[:3]),
                             cos.stride(0), BACKWARD=backward, WITH_V=with_v, HALF=D // 2, BLOCK=BLOCK_TOKENS,
                             num_warps=4)


def qkv_rotary_forward(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """qkv_rotary without autograd: q, k rotated and v, each a new (B, N, H, D) buffer; cos, sin (N, D/2)."""
    B, N, _, H, D = qkv.shape
    q, k, v = (torch.empty((B, N, H, D), dtype=qkv.dtype, device=qkv.device) for _ in range(3))
    _launch(qkv, q, k, v, cos, sin, backward=False)
    return q, k, v


class QKVRotary(torch.autograd.Function):
    """q, k (rotated) and v, each in a (B, N, H, D) buffer of its own, from qkv (B, N, 3, H, D)."""

    @staticmethod
    def forward(ctx, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = qkv_rotary_forward(qkv, cos, sin)
        ctx.save_for_backward(cos, sin)
        ctx.shape = qkv.shape
        return q, k, v

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor):
        cos, sin = ctx.saved_tensors
        dq, dk, dv = (g if g.stride(-1) == 1 else g.contiguous() for g in (dq, dk, dv))
        dqkv = torch.empty(ctx.shape, dtype=dq.dtype, device=dq.device)
        _launch(dqkv, dq, dk, dv, cos, sin, backward=True)
        return dqkv, None, None


def rotate_back_into(dqkv: Tensor, dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor) -> None:
    """dqkv[:, :, 0] = rot⁻¹(dq) and dqkv[:, :, 1] = rot⁻¹(dk), in fp32 and rounded once; dqkv[:, :, 2] untouched.
    The backward of qkv_rotary for an attention that wrote dv into dqkv itself (minigpt_kernels.flash_attention_qkv):
    dqkv (B, N, 3, H, D) as qkv_rotary takes it; dq, dk (B, N, H, D) views of any dtype and strides with a
    contiguous last dimension, e.g. an fp32 accumulator, or dqkv's own parts (rotated in place); cos, sin (N, D/2)."""
    _launch(dqkv, dq, dk, None, cos, sin, backward=True)


def _layout_fits(qkv: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """The projection (B, N, 3, H, D) with (3, H, D) contiguous and D a power of two; cos and sin fp32 (N, D/2)
    tables (size-1 dimensions between allowed, as (N, 1, D/2)) on its device, rows contiguous and laid out alike, and
    needing no gradient (the kernel's backward gives none for them)."""
    B, N, three, H, D = qkv.shape
    if not (three == 3 and D >= 4 and (D & (D - 1)) == 0 and qkv.stride(4) == 1 and qkv.stride(3) == D
            and qkv.stride(2) == H * D):
        return False
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or sin.shape != cos.shape or cos.dim() < 2:
        return False
    if cos.shape[0] != N or cos.shape[-1] != D // 2 or cos.numel() != N * D // 2:  # not a transposed table
        return False
    if cos.requires_grad or sin.requires_grad:
        return False
    cos, sin = cos.reshape(N, D // 2), sin.reshape(N, D // 2)
    return cos.stride(1) == 1 and sin.stride() == cos.stride() and cos.device == qkv.device


def rotary_fits(qkv: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether the model should take qkv_rotary for these inputs: a GPU tensor of the layout it reads. Anything else
    (CPU runs; a float64 model's tables) takes the model's PyTorch code. On CPU the kernel runs only under Triton's
    interpreter, for the tests, which call it directly."""
    return qkv.is_cuda and _layout_fits(qkv, cos, sin)


def check_layout(qkv: Tensor, cos: Tensor, sin: Tensor, caller: str) -> None:
    """ValueError unless qkv_rotary's kernel takes these inputs (see qkv_rotary)."""
    if not (_layout_fits(qkv, cos, sin) and (qkv.is_cuda or INTERPRET)):
        raise ValueError(f"{caller}: qkv (B, N, 3, H, D) with contiguous (3, H, D), D a power of two, on a GPU, and "
                         f"fp32 (N, D/2) cos/sin tables with contiguous rows and no grad expected, got qkv {tuple(qkv.shape)} "
                         f"strides {qkv.stride()} on {qkv.device}, cos {tuple(cos.shape)} {cos.dtype}")


def qkv_rotary(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k rotated by the tokens' angles (cos, sin: (N, D/2) fp32, or (N, 1, D/2) as minigpt.model.Rotary makes them)
    and v, each a (B, N, H, D) contiguous buffer, from the qkv projection (B, N, 3, H, D) with contiguous (3, H, D),
    D a power of two, on a GPU (or under Triton's interpreter); differentiable."""
    check_layout(qkv, cos, sin, "qkv_rotary")
    N, D = qkv.shape[1], qkv.shape[4]
    return QKVRotary.apply(qkv, cos.reshape(N, D // 2), sin.reshape(N, D // 2))

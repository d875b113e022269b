"""The attention's inputs from the qkv projection in one pass: q and k rotated (RoPE), v split off.

    qkv (B, N, Hq + 2·Hkv, D)  ->  q = rot(qkv[:, :, :Hq]), k = rot(qkv[:, :, Hq:Hq+Hkv]), v = qkv[:, :, Hq+Hkv:]
                                   q (B, N, Hq, D), k and v (B, N, Hkv, D), each a buffer of its own
    rot([x1, x2]) = [x1 cos - x2 sin, x1 sin + x2 cos]          (x1, x2: the two halves of a head's D values)

The projection's heads are q's Hq, then k's Hkv, then v's Hkv (grouped-query attention: Hq a multiple of Hkv, query
head h reads K/V head h // (Hq / Hkv)); Hkv = Hq is multi-head attention, whose projection the model lays out as
(B, N, 3, H, D): that layout is taken too, viewed as (B, N, 3H, D) (the same memory, heads q, k, v in order).

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

from minigpt_kernels.device import INTERPRET, cdiv
from minigpt_kernels.relaunch import launch_kernel

BLOCK_TOKENS = 32  # tokens per program (each program rotates one query head of them, and its K/V head if it leads)


@triton.jit
def _rotate_half_pairs(src, dst, c, s, ok, HALF: tl.constexpr, BACKWARD: tl.constexpr):
    """dst = rot(src) (forward) or rot⁻¹(src) (BACKWARD) for one head of BLOCK tokens: src, dst point at each token's
    first half x1 (its second half x2 is HALF further); c, s the tokens' cos, sin. In fp32, rounded once to dst's
    dtype. src may be dst (in place: both halves are loaded before either is stored)."""
    x1 = tl.load(src, mask=ok).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok).to(tl.float32)
    if BACKWARD:  # rot⁻¹: the rotation by −angle (the transpose of the forward's matrix)
        y1, y2 = x1 * c + x2 * s, x2 * c - x1 * s
    else:  # rot: [x1 cos − x2 sin, x1 sin + x2 cos]
        y1, y2 = x1 * c - x2 * s, x1 * s + x2 * c
    tl.store(dst, y1.to(dst.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, y2.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _qkv_rotary_kernel(PACKED, Q, K, V, COS, SIN, N, H_Q, n_blocks,
                       stride_pb, stride_pn, stride_ph,  # PACKED (B, N, Hq + 2·Hkv, D): token n, packed head h
                       stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,  # Q (B, N, Hq, D), K, V
                       stride_vb, stride_vn, stride_vh, stride_cn,                          # (B, N, Hkv, D)
                       BACKWARD: tl.constexpr, WITH_V: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr,
                       BLOCK: tl.constexpr):
    """One query head h of BLOCK tokens, and the K/V head hk = h // GROUP where h leads its group (h % GROUP == 0),
    so that each of the Hq + 2·Hkv packed heads has exactly one program. Forward: q (and k) rotated and v copied from
    the qkv projection PACKED into Q, K, V. BACKWARD: their gradients Q, K, V rotated back (q's, k's) and copied
    (v's) into the projection's gradient PACKED; without WITH_V, v's part is left as it is (already written there).
    Q or K may be PACKED's own part (rotated in place: each element is loaded before it is stored, by the same
    program). GROUP 1 (multi-head attention): every program does q, k and v of its head."""
    pid = tl.program_id(0)  # one grid axis: no per-axis limit on heads · batch or on tokens
    bh = (pid // n_blocks).to(tl.int64)
    b, h = bh // H_Q, bh % H_Q  # batch row, query head
    hk = h // GROUP  # its K/V head
    n = (pid % n_blocks) * BLOCK + tl.arange(0, BLOCK)
    rows = n.to(tl.int64)[:, None]
    d = tl.arange(0, HALF)[None, :]
    ok = (n < N)[:, None]
    angle = rows * stride_cn + d  # cos, sin: (N, HALF) tables at the tokens' positions
    c = tl.load(COS + angle, mask=ok, other=0.0)
    s = tl.load(SIN + angle, mask=ok, other=0.0)
    # the packed heads of token n: q's h at h, k's hk at Hq + hk, v's hk at Hq + Hkv + hk (Hkv = Hq / GROUP)
    packed = PACKED + b * stride_pb + rows * stride_pn + d
    packed_q = packed + h * stride_ph
    packed_k = packed + (H_Q + hk) * stride_ph
    packed_v = packed + (H_Q + H_Q // GROUP + hk) * stride_ph
    q = Q + b * stride_qb + rows * stride_qn + h * stride_qh + d
    k = K + b * stride_kb + rows * stride_kn + hk * stride_kh + d
    v = V + b * stride_vb + rows * stride_vn + hk * stride_vh + d
    # q: rot (forward: packed -> Q) or rot⁻¹ (backward: dQ -> packed)
    # (one name per head kind: dQ may be an fp32 accumulator while dK is 16-bit, and Triton keeps a name's type)
    q_src, q_dst = (q, packed_q) if BACKWARD else (packed_q, q)
    _rotate_half_pairs(q_src, q_dst, c, s, ok, HALF, BACKWARD)
    if h % GROUP == 0:  # the group's first query head also does its K/V head (GROUP 1: always, folded)
        k_src, k_dst = (k, packed_k) if BACKWARD else (packed_k, k)  # k: as q
        _rotate_half_pairs(k_src, k_dst, c, s, ok, HALF, BACKWARD)
        if WITH_V:  # v as it is, one half at a time
            v_src, v_dst = (v, packed_v) if BACKWARD else (packed_v, v)
            for half in tl.static_range(2):
                tl.store(v_dst + half * HALF, tl.load(v_src + half * HALF, mask=ok), mask=ok)


def _launch(packed: Tensor, q: Tensor, k: Tensor, v: Tensor | None, cos: Tensor, sin: Tensor, backward: bool) -> None:
    """packed (B, N, Hq + 2·Hkv, D); q (B, N, Hq, D), k, v (B, N, Hkv, D) views, any strides with a contiguous last
    dimension; v None: left out (backward only). One program per query head and block of tokens."""
    B, N, _, D = packed.shape
    n_head, n_kv_head = q.shape[2], k.shape[2]
    n_blocks = cdiv(N, BLOCK_TOKENS)
    with_v = v is not None
    v = v if with_v else k  # a stand-in the kernel does not touch
    launch_kernel(
        _qkv_rotary_kernel, (n_blocks * B * n_head,),
        packed, q, k, v, cos, sin, N, n_head, n_blocks, *packed.stride()[:3],
        *(st for t in (q, k, v) for st in t.stride()[:3]), cos.stride(0),
        BACKWARD=backward, WITH_V=with_v, GROUP=n_head // n_kv_head, HALF=D // 2, BLOCK=BLOCK_TOKENS, num_warps=4)


def qkv_rotary_forward(packed: Tensor, cos: Tensor, sin: Tensor, n_kv_head: int) -> tuple[Tensor, Tensor, Tensor]:
    """qkv_rotary without autograd or checks: packed (B, N, Hq + 2·Hkv, D), cos, sin (N, D/2); returns q rotated
    (B, N, Hq, D), k rotated and v (B, N, Hkv, D), each a new buffer."""
    B, N, heads, D = packed.shape
    n_head = heads - 2 * n_kv_head
    q = torch.empty((B, N, n_head, D), dtype=packed.dtype, device=packed.device)
    k, v = (torch.empty((B, N, n_kv_head, D), dtype=packed.dtype, device=packed.device) for _ in range(2))
    _launch(packed, q, k, v, cos, sin, backward=False)
    return q, k, v


class QKVRotary(torch.autograd.Function):
    """q, k (rotated) and v, each in a buffer of its own, from packed qkv (B, N, Hq + 2·Hkv, D)."""

    @staticmethod
    def forward(ctx, packed: Tensor, cos: Tensor, sin: Tensor, n_kv_head: int) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = qkv_rotary_forward(packed, cos, sin, n_kv_head)
        ctx.save_for_backward(cos, sin)
        ctx.shape = packed.shape
        return q, k, v

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor):
        cos, sin = ctx.saved_tensors
        dq, dk, dv = (g if g.stride(-1) == 1 else g.contiguous() for g in (dq, dk, dv))
        dqkv = torch.empty(ctx.shape, dtype=dq.dtype, device=dq.device)
        _launch(dqkv, dq, dk, dv, cos, sin, backward=True)
        return dqkv, None, None, None


def rotate_back_into(dqkv: Tensor, dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor) -> None:
    """dqkv's q heads = rot⁻¹(dq) and its k heads = rot⁻¹(dk), in fp32 and rounded once; its v heads untouched.
    The backward of qkv_rotary for an attention that wrote dv into dqkv itself (minigpt_kernels.flash_attention_qkv):
    dqkv (B, N, Hq + 2·Hkv, D) as qkv_rotary reads it; dq (B, N, Hq, D), dk (B, N, Hkv, D) views of any dtype and
    strides with a contiguous last dimension, e.g. an fp32 accumulator, or dqkv's own parts (rotated in place);
    cos, sin (N, D/2)."""
    _launch(dqkv, dq, dk, None, cos, sin, backward=True)


def _packed_heads(qkv: Tensor, n_kv_head: int | None) -> tuple[Tensor, int, int] | str:
    """(qkv as (B, N, Hq + 2·Hkv, D), Hq, Hkv), or what about qkv's shape or n_kv_head does not fit. The model's
    (B, N, 3, H, D) is viewed as (B, N, 3H, D) where its (3, H) are one run of heads (no copy)."""
    if n_kv_head is not None and (isinstance(n_kv_head, bool) or not isinstance(n_kv_head, int) or n_kv_head < 1):
        return f"n_kv_head must be an int >= 1 (or None), got {n_kv_head!r}"
    if qkv.dim() == 5:  # (B, N, 3, H, D): multi-head attention
        B, N, three, H, D = qkv.shape
        if three != 3:
            return f"a 5-D qkv must be (B, N, 3, H, D), got {tuple(qkv.shape)}"
        if n_kv_head not in (None, H):
            return f"a (B, N, 3, H, D) qkv has H = {H} K/V heads (multi-head), got n_kv_head={n_kv_head}"
        if not (qkv.stride(4) == 1 and (H == 1 or qkv.stride(3) == D) and qkv.stride(2) == H * D):
            return f"a (B, N, 3, H, D) qkv needs contiguous (3, H, D), got strides {qkv.stride()}"
        qkv, n_kv_head = qkv.view(B, N, 3 * H, D), H  # the same memory: heads q's H, k's H, v's H
    elif qkv.dim() != 4:
        return f"qkv must be (B, N, Hq + 2·Hkv, D) (or the model's (B, N, 3, H, D)), got shape {tuple(qkv.shape)}"
    heads = qkv.shape[2]
    if n_kv_head is None:
        if heads % 3:
            return (f"qkv has {heads} heads, not 3·H: pass n_kv_head (Hkv) for a (B, N, Hq + 2·Hkv, D) projection "
                    f"with fewer K/V heads than query heads")
        n_kv_head = heads // 3
    n_head = heads - 2 * n_kv_head
    if n_head < 1:
        return f"qkv has {heads} heads: Hq + 2·Hkv with n_kv_head = {n_kv_head} leaves Hq = {n_head} query heads"
    if n_head % n_kv_head:
        return (f"qkv's {heads} heads with n_kv_head = {n_kv_head} leave Hq = {n_head} query heads, not a multiple of "
                f"Hkv = {n_kv_head}")
    return qkv, n_head, n_kv_head


def _layout_problem(qkv: Tensor, cos: Tensor, sin: Tensor, n_kv_head: int | None) -> tuple[Tensor, int, int] | str:
    """(qkv as (B, N, Hq + 2·Hkv, D), Hq, Hkv) where the kernel takes these inputs, else what it does not take:
    the projection's heads of a token contiguous ((Hq + 2·Hkv, D) rows, any row stride) and D a power of two >= 4;
    cos and sin fp32 (N, D/2) tables (size-1 dimensions between allowed, as (N, 1, D/2)) on its device, rows
    contiguous and laid out alike, and needing no gradient (the kernel's backward gives none for them)."""
    heads = _packed_heads(qkv, n_kv_head)
    if isinstance(heads, str):
        return heads
    packed = heads[0]
    B, N, _, D = packed.shape
    if not (D >= 4 and (D & (D - 1)) == 0):
        return f"head_dim {D} is not a power of two >= 4"
    if not (packed.stride(3) == 1 and packed.stride(2) == D):
        return (f"qkv's heads of a token must be contiguous ((Hq + 2·Hkv, D) rows), got shape {tuple(qkv.shape)} "
                f"strides {qkv.stride()}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        return f"cos, sin must be fp32 tables, got {cos.dtype}, {sin.dtype}"
    if sin.shape != cos.shape or cos.dim() < 2 or cos.shape[0] != N or cos.shape[-1] != D // 2 \
            or cos.numel() != N * D // 2:  # not a transposed table
        return (f"cos, sin must be (N, D/2) = ({N}, {D // 2}) tables (or (N, 1, D/2)), got {tuple(cos.shape)}, "
                f"{tuple(sin.shape)}")
    if cos.requires_grad or sin.requires_grad:
        return "cos, sin must need no grad (the kernel gives them none)"
    cos2, sin2 = cos.reshape(N, D // 2), sin.reshape(N, D // 2)
    if not (cos2.stride(1) == 1 and sin2.stride() == cos2.stride()):
        return f"cos, sin need contiguous rows laid out alike, got strides {cos.stride()}, {sin.stride()}"
    if cos.device != qkv.device or sin.device != qkv.device:
        return f"cos, sin must be on qkv's device {qkv.device}, got {cos.device}, {sin.device}"
    return heads


def _layout_fits(qkv: Tensor, cos: Tensor, sin: Tensor, n_kv_head: int | None = None) -> bool:
    """Whether the kernel takes these inputs, wherever they are (see _layout_problem)."""
    return not isinstance(_layout_problem(qkv, cos, sin, n_kv_head), str)


def rotary_fits(qkv: Tensor, cos: Tensor, sin: Tensor, n_kv_head: int | None = None) -> bool:
    """Whether the model should take qkv_rotary for these inputs: a GPU tensor of the layout it reads. Anything else
    (CPU runs; a float64 model's tables) takes the model's PyTorch code. On CPU the kernel runs only under Triton's
    interpreter, for the tests, which call it directly."""
    return qkv.is_cuda and _layout_fits(qkv, cos, sin, n_kv_head)


def check_layout(qkv: Tensor, cos: Tensor, sin: Tensor, caller: str,
                 n_kv_head: int | None = None) -> tuple[Tensor, int, int]:
    """ValueError naming what the kernel does not take (see qkv_rotary); else (qkv as (B, N, Hq + 2·Hkv, D), a view,
    Hq, Hkv)."""
    got = _layout_problem(qkv, cos, sin, n_kv_head)
    if isinstance(got, str):
        raise ValueError(f"{caller}: {got}")
    if not (qkv.is_cuda or INTERPRET):
        raise ValueError(f"{caller}: qkv must be on a GPU (got {qkv.device}); set TRITON_INTERPRET=1 to run on CPU")
    return got


def qkv_rotary(qkv: Tensor, cos: Tensor, sin: Tensor, *, n_kv_head: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """q, k rotated by the tokens' angles (cos, sin: (N, D/2) fp32, or (N, 1, D/2) as minigpt.model.Rotary makes them)
    and v, from the qkv projection (B, N, Hq + 2·Hkv, D) with each token's heads contiguous (q's Hq, then k's Hkv,
    then v's Hkv; n_kv_head None: Hq = Hkv = heads / 3), or the model's (B, N, 3, H, D) with contiguous (3, H, D);
    D a power of two, on a GPU (or under Triton's interpreter); differentiable. Returns q (B, N, Hq, D), k and v
    (B, N, Hkv, D), each a contiguous buffer. Inputs it does not take raise ValueError naming the problem."""
    packed, _, n_kv_head = check_layout(qkv, cos, sin, "qkv_rotary", n_kv_head)
    N, D = packed.shape[1], packed.shape[3]
    return QKVRotary.apply(packed, cos.reshape(N, D // 2), sin.reshape(N, D // 2), n_kv_head)

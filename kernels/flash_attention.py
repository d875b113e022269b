"""FlashAttention in Triton: tiled forward with online softmax, FlashAttention-2 backward.

    o = softmax(scale · q kᵀ + causal mask) v          q, k, v, o: (batch, heads, seq, head_dim)

The N×N score matrix never exists in memory. The forward walks over key tiles keeping, per query row,
a running max m and running sum l of exp(scores − m), and rescales its accumulator whenever m grows;
it saves the row log-sum-exp (LSE) so the backward can rebuild any tile of probabilities
P = exp(S − LSE) without a second softmax pass. All exponentials are base 2 with log2(e) folded into
the scale (exp(x) = exp2(x · log2 e)), which is one multiply cheaper per score.

Backward (FlashAttention-2): one kernel owns a query tile and walks the key tiles to accumulate dQ; it also
computes delta = rowsum(dO ∘ O) for its rows and leaves it for the other, which owns a key tile and walks the
query tiles to accumulate dK and dV. No atomics: every output tile has one writer, so results are deterministic.
(On an H100/H200 at head_dim 64 from 4K tokens and 128 from 2K the backward is instead the five-matmul one of
flash_backward_specialized.py, which adds dQ with fp32 reduce-adds; deterministic=True, the flash backend's
attention.deterministic or torch.use_deterministic_algorithms keep this one. At head_dim 128 up to 1K tokens the
dK/dV kernel also writes its dS tiles to memory and dQ = dS K becomes one matmul per tile, launch_backward_via_ds:
O(N²) memory, worth it only where N² is small.)

Tiles stream through TMA descriptors on Hopper (hardware bulk copies; rows past the end read as 0) when
the inputs are 16-byte aligned, through masked pointer loads otherwise. On an H100/H200, causal sequences from 1K
tokens (fp16/bf16, head_dim 64 or 128) take the warp-specialized forward of flash_forward_pingpong.py instead
(FlashAttention-3's producer warp and consumer warpgroups in ping-pong, written in Gluon; persistent below 16K tokens
at head_dim 64 and at every length at 128), and the warp-specialized backward kernels of
flash_backward_specialized.py (the five-matmul dK/dV/dQ kernel at head_dim 64 from 4K tokens, persistent below 16K, and
at head_dim 128 from 2K, persistent below 8K; the dQ kernel at head_dim 128 from 4K where deterministic results are asked for); they compute the same outputs as the Triton kernels here
(the five-matmul dQ up to its summation order, which varies between runs).

Causal masking: tiles entirely above the diagonal are never visited; only tiles on the diagonal pay for
the mask. Sequence tails (seq not a multiple of the tile) are handled with masked loads and stores.
Offsets that can exceed 2³¹ (batch/head bases; tile starts on inputs where seq × row stride passes 2³¹,
e.g. a million tokens in the model's qkv layout) are int64; offsets inside a tile stay int32.

Queries and keys of different lengths (Nq query rows against Nk key rows) are supported for non-causal attention
through the launchers (ring attention uses them; `flash_attention` itself takes q, k, v of one shape). For the
same user, the launchers can also fold new keys into a partial result instead of starting afresh: the forward
continues from an fp32 (o, lse) state, which it reads as its initial online-softmax state and overwrites with
the attention over both key sets, and the backward kernels add their dQ or dK/dV into fp32 buffers. Both only
touch a program's prologue and epilogue (constexpr flags): the inner loops are those of the plain kernels.

Precision: fp16/bf16 inputs use tensor-core dots with fp32 accumulation and an fp32 softmax; fp32 inputs
are accepted and run the same kernels with TF32 dots (about 1e-3 relative error; exact fp32 under
Triton's CPU interpreter).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# ------------------------------------------------------------------------------------------------
# Tile sources: what the inner loops stream over (keys/values in the forward, queries/grads in the backward)
# ------------------------------------------------------------------------------------------------
@triton.jit
def _tile_source(base, N, stride_n, offs_n, offs_d, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """One head's (N, HEAD_DIM) rows as a TMA descriptor (bulk asynchronous tile copies on Hopper, rows past
    N read as 0, addressing done in hardware) or as a tile of pointers to rows 0..BLOCK that the loop advances."""
    if TMA:
        return tl.make_tensor_descriptor(base, shape=[N, HEAD_DIM], strides=[stride_n, 1],
                                         block_shape=[BLOCK, HEAD_DIM])
    else:
        return base + offs_n[:, None] * stride_n + offs_d[None, :]


@triton.jit
def _tile_start(src, lo, stride_n, INT64_OFFSETS: tl.constexpr, TMA: tl.constexpr):
    """Point a pointer tile at row lo (a descriptor is addressed by row at each load instead)."""
    if TMA:
        return src
    elif INT64_OFFSETS:  # lo·stride passes 2³¹ on very long inputs
        return src + tl.cast(lo, tl.int64) * stride_n
    else:
        return src + lo * stride_n


@triton.jit
def _load_tile(src, row, rows_ok, MASKED: tl.constexpr, TMA: tl.constexpr):
    """The tile of rows starting at `row` (where a pointer tile already points); rows past the end read as 0."""
    if TMA:
        return src.load([row, 0])
    elif MASKED:
        return tl.load(src, mask=rows_ok[:, None], other=0.0)
    else:
        return tl.load(src)


@triton.jit
def _triangle_tile(i, j):
    """Where tile (query tile i, key tile j ≤ i) of a causal head lies in its dS buffer: (0,0), (1,0), (1,1), …"""
    return i * (i + 1) // 2 + j


@triton.jit
def _next_tile(src, BLOCK: tl.constexpr, stride_n, TMA: tl.constexpr):
    if TMA:
        return src
    else:
        return src + BLOCK * stride_n


@triton.jit
def _row_source(base, N, BLOCK: tl.constexpr, TMA: tl.constexpr):
    """One head's N per-row fp32 values (LSE, delta) as a TMA descriptor of BLOCK-row pieces, or as a pointer."""
    if TMA:
        return tl.make_tensor_descriptor(base, shape=[N], strides=[1], block_shape=[BLOCK])
    else:
        return base


@triton.jit
def _load_rows(src, row, rows, rows_ok, other, TMA: tl.constexpr):
    """The values of rows row..row+BLOCK. A TMA copy is one instruction for the whole block where masked pointer
    loads cost every thread an address, a predicate and an asynchronous copy per value it holds (a quarter of the
    dK/dV loop's instructions). Rows past the end read as 0 through TMA, as `other` through pointers."""
    if TMA:
        return src.load([row])
    else:
        return tl.load(src + rows, mask=rows_ok, other=other)


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, start_m, lo, hi, N_K, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               INT64_OFFSETS: tl.constexpr, TMA: tl.constexpr):
    """Fold key tiles [lo, hi) into the running (acc, l, m) of one query tile.

    MASKED tiles (the causal diagonal, or the ragged last tile) apply the causal/bounds mask; the rest
    are known to be fully visible and skip it. k_src/v_src are TMA descriptors (TMA) or pointer tiles over the
    N_K keys.
    """
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    k_src = _tile_start(k_src, lo, stride_kn, INT64_OFFSETS, TMA)
    v_src = _tile_start(v_src, lo, stride_vn, INT64_OFFSETS, TMA)
    for start_n in range(lo, hi, BLOCK_N):
        in_bounds = (start_n + offs_n) < N_K
        k = _load_tile(k_src, start_n, in_bounds, MASKED, TMA)
        v = _load_tile(v_src, start_n, in_bounds, MASKED, TMA)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            visible = in_bounds[None, :]
            if CAUSAL:
                visible = visible & (offs_m[:, None] >= (start_n + offs_n)[None, :])
            qk = tl.where(visible, qk, float("-inf"))
        # scores in base-2 units are s = qk · scale·log2(e);  m_new = max(m_old, rowmax(s))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        # p = exp2(s − m_new), one fused multiply-add per score
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        # α = exp2(m_old − m_new) rescales what was accumulated under the old max
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        # acc = α·acc + p v, the add done by the tensor core's accumulator
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
        k_src = _next_tile(k_src, BLOCK_N, stride_kn, TMA)
        v_src = _next_tile(v_src, BLOCK_N, stride_vn, TMA)
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE,
                stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on, stride_lse,
                H, N_Q, N_K, qk_scale,
                CAUSAL: tl.constexpr, CONTINUE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, INT64_OFFSETS: tl.constexpr, TMA: tl.constexpr):
    """One query tile of N_Q rows against N_K keys (N_Q == N_K when CAUSAL). LSE rows are stride_lse apart.
    CONTINUE: (O, LSE) hold an fp32 partial result over other keys, continued here and overwritten."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # longest rows first: the last query tiles see the most keys
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    q_ptrs = Q + b * stride_qb + h * stride_qh + start_m.to(tl.int64) * stride_qn \
        + offs_m[:, None] * stride_qn + offs_d[None, :]
    row_ok = (start_m + offs_m) < N_Q
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    k_src = _tile_source(K + b * stride_kb + h * stride_kh, N_K, stride_kn, offs_n, offs_d, BLOCK_N, HEAD_DIM, TMA)
    v_src = _tile_source(V + b * stride_vb + h * stride_vh, N_K, stride_vn, offs_n, offs_d, BLOCK_N, HEAD_DIM, TMA)

    if CONTINUE:
        # the state of a softmax over earlier keys, (o, lse) = (Σ 2^s v / Σ 2^s, log2 Σ 2^s), as a running
        # (m, l, acc): m = lse, l = Σ 2^(s − m) = 1, acc = o·l = o. The loop's rescaling then folds the new keys in.
        m_i = tl.load(LSE + bh.to(tl.int64) * stride_lse + start_m + offs_m, mask=row_ok, other=float("-inf"))
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        # a row with lse = −inf holds nothing yet: acc = 0 whatever its o says. Its first tile has a visible key
        # (key 0 in a causal launch; any key of a non-causal one), so m becomes finite there and α = exp2(−inf) = 0
        # wipes l = 1: no exp2(−inf − (−inf)) is ever taken.
        o_ptrs = O + b * stride_ob + h * stride_oh + start_m.to(tl.int64) * stride_on \
            + offs_m[:, None] * stride_on + offs_d[None, :]
        acc = tl.load(o_ptrs, mask=row_ok[:, None] & (m_i > float("-inf"))[:, None], other=0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max (base-2 units)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running row sum of exp2(s − m)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running unnormalized output

    if CAUSAL:  # key tiles wholly before the query tile are fully visible; the rest, to the diagonal, get the mask
        full_hi = (start_m // BLOCK_N) * BLOCK_N  # = start_m unless key tiles are wider than query tiles
        diag_hi = tl.minimum(start_m + BLOCK_M, N_K)
    else:  # all keys visible; only the ragged last tile is masked
        full_hi = (N_K // BLOCK_N) * BLOCK_N
        diag_hi = N_K
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, start_m, 0, full_hi, N_K,
                               qk_scale, False, CAUSAL, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, start_m, full_hi, diag_hi, N_K,
                               qk_scale, True, CAUSAL, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA)

    # o = acc / l;  LSE = m + log2(l) (base 2), what the backward needs to rebuild P = exp2(s − LSE)
    o = acc / l_i[:, None]
    lse_ptrs = LSE + bh.to(tl.int64) * stride_lse + start_m + offs_m
    tl.store(lse_ptrs, m_i + tl.math.log2(l_i), mask=row_ok)
    o_ptrs = O + b * stride_ob + h * stride_oh + start_m.to(tl.int64) * stride_on \
        + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None])


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_delta_kernel(O, DO, DELTA, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don,
                      H, N, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta_i = Σ_d dO_id · O_id  (= Σ_j P_ij dP_ij, the softmax backward's row term)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = (start_m + offs_m) < N
    rows = start_m.to(tl.int64) + offs_m
    o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_don + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh.to(tl.int64) * N + rows, delta, mask=row_ok)


@triton.jit
def _bwd_dkdv_tiles(dk, dv, k, v, q_src, do_src, lse_src, delta_src, ds_head, stride_qn, stride_don,
                    start_n, lo, hi, N_Q, qk_scale,
                    MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INT64_OFFSETS: tl.constexpr,
                    TMA: tl.constexpr, ROW_TMA: tl.constexpr, STORE_DS: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi) of the N_Q queries. Works on transposed tiles
    (keys × queries). STORE_DS: also write each bf16/fp16 dS tile into this head's triangle of tiles (ds_head), for
    _bwd_dq_from_ds_kernel."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    q_src = _tile_start(q_src, lo, stride_qn, INT64_OFFSETS, TMA)
    do_src = _tile_start(do_src, lo, stride_don, INT64_OFFSETS, TMA)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < N_Q
        q = _load_tile(q_src, start_m, row_ok, True, TMA)
        do = _load_tile(do_src, start_m, row_ok, True, TMA)
        # rows past the end: through pointers LSE = +inf, so their probabilities are exactly 0; through TMA
        # LSE = 0 and P = 1 there, but their Q and dO rows are 0 too, so they add exactly 0 to dV (P dO) and dK
        # (dS = P ∘ (V dOᵀ − delta) = 0, delta = 0)
        lse = _load_rows(lse_src, start_m, rows, row_ok, float("inf"), ROW_TMA)
        # Pᵀ = exp2(K Qᵀ · scale·log2e − LSE)
        pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
        if MASKED:
            pT = tl.where(rows[None, :] >= offs_n[:, None], pT, 0.0)
        # dV += Pᵀ dO
        dv = tl.dot(pT.to(do.dtype), do, dv)
        # dPᵀ = V dOᵀ;  dSᵀ = Pᵀ ∘ (dPᵀ − delta)
        delta = _load_rows(delta_src, start_m, rows, row_ok, 0.0, ROW_TMA)
        dsT = pT * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dsT = dsT.to(q.dtype)
        # dK += dSᵀ Q  (the softmax scale is applied once at the end)
        dk = tl.dot(dsT, q, dk)
        if STORE_DS:  # dSᵀ is [key][query] here; the buffer keeps each tile [query][key], as dQ = dS K reads it
            tile = ds_head + _triangle_tile(start_m // BLOCK_M, start_n // BLOCK_N) * (BLOCK_M * BLOCK_N)
            tl.store(tile + offs_m[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None], dsT)
        q_src = _next_tile(q_src, BLOCK_M, stride_qn, TMA)
        do_src = _next_tile(do_src, BLOCK_M, stride_don, TMA)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DS,
                     stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                     stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_lse, stride_delta,
                     H, N_Q, N_K, qk_scale, sm_scale,
                     CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, INT64_OFFSETS: tl.constexpr, TMA: tl.constexpr, ROW_TMA: tl.constexpr,
                     STORE_DS: tl.constexpr):
    """dK, dV of one tile of the N_K keys over the N_Q queries (N_Q == N_K when CAUSAL). ACCUMULATE: add them to
    what DK, DV hold (fp32) instead of overwriting it. ROW_TMA: LSE and delta rows are read through TMA.
    STORE_DS (causal, BLOCK_M == BLOCK_N): also leave the dS tiles in DS (launch_backward_via_ds)."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = (start_n + offs_n) < N_K
    rows_n = start_n.to(tl.int64) + offs_n
    k = tl.load(K + b * stride_kb + h * stride_kh + rows_n[:, None] * stride_kn + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    v = tl.load(V + b * stride_vb + h * stride_vh + rows_n[:, None] * stride_vn + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    q_src = _tile_source(Q + b * stride_qb + h * stride_qh, N_Q, stride_qn, offs_m, offs_d, BLOCK_M, HEAD_DIM, TMA)
    do_src = _tile_source(DO + b * stride_dob + h * stride_doh, N_Q, stride_don, offs_m, offs_d, BLOCK_M, HEAD_DIM,
                          TMA)
    lse_src = _row_source(LSE + bh.to(tl.int64) * stride_lse, N_Q, BLOCK_M, ROW_TMA)
    delta_src = _row_source(DELTA + bh.to(tl.int64) * stride_delta, N_Q, BLOCK_M, ROW_TMA)
    n_tiles = tl.cdiv(N_Q, BLOCK_M)
    ds_head = DS + bh.to(tl.int64) * (_triangle_tile(n_tiles, 0) * (BLOCK_M * BLOCK_N))  # this head's triangle

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:  # queries before this key tile cannot see it; the diagonal tiles get the mask
        diag_hi = tl.minimum(start_n + BLOCK_N, N_Q)
        dk, dv = _bwd_dkdv_tiles(dk, dv, k, v, q_src, do_src, lse_src, delta_src, ds_head, stride_qn, stride_don,
                                 start_n, start_n, diag_hi, N_Q, qk_scale, True, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA,
                                 ROW_TMA, STORE_DS)
        dk, dv = _bwd_dkdv_tiles(dk, dv, k, v, q_src, do_src, lse_src, delta_src, ds_head, stride_qn, stride_don,
                                 start_n, diag_hi, N_Q, N_Q, qk_scale, False, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA,
                                 ROW_TMA, STORE_DS)
    else:
        dk, dv = _bwd_dkdv_tiles(dk, dv, k, v, q_src, do_src, lse_src, delta_src, ds_head, stride_qn, stride_don,
                                 start_n, 0, N_Q, N_Q, qk_scale, False, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA,
                                 ROW_TMA, False)

    dk *= sm_scale  # dS was taken w.r.t. the scaled scores
    dk_ptrs = DK + b * stride_dkb + h * stride_dkh + rows_n[:, None] * stride_dkn + offs_d[None, :]
    dv_ptrs = DV + b * stride_dvb + h * stride_dvh + rows_n[:, None] * stride_dvn + offs_d[None, :]
    if ACCUMULATE:  # dK = dK_before + this launch's share (scaled above, alone); this program is the tile's only writer
        dk += tl.load(dk_ptrs, mask=col_ok[:, None], other=0.0)
        dv += tl.load(dv_ptrs, mask=col_ok[:, None], other=0.0)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_m, lo, hi, N_K, qk_scale,
                  MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INT64_OFFSETS: tl.constexpr,
                  TMA: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles [lo, hi) of the N_K keys."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    k_src = _tile_start(k_src, lo, stride_kn, INT64_OFFSETS, TMA)
    v_src = _tile_start(v_src, lo, stride_vn, INT64_OFFSETS, TMA)
    for start_n in range(lo, hi, BLOCK_N):
        # keys past the end load as zeros: they add exactly 0 to dQ (dQ += dS K), so no score mask is needed
        col_ok = (start_n + offs_n) < N_K
        k = _load_tile(k_src, start_n, col_ok, True, TMA)
        v = _load_tile(v_src, start_n, col_ok, True, TMA)
        # P = exp2(Q Kᵀ · scale·log2e − LSE)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(offs_m[:, None] >= (start_n + offs_n)[None, :], p, 0.0)
        # dP = dO Vᵀ;  dS = P ∘ (dP − delta);  dQ += dS K
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
        k_src = _next_tile(k_src, BLOCK_N, stride_kn, TMA)
        v_src = _next_tile(v_src, BLOCK_N, stride_vn, TMA)
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, O,
                   stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                   stride_dqb, stride_dqh, stride_dqn, stride_ob, stride_oh, stride_on, stride_lse, stride_delta,
                   H, N_Q, N_K, qk_scale, sm_scale,
                   CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, INT64_OFFSETS: tl.constexpr, TMA: tl.constexpr, DELTA_FROM_O: tl.constexpr):
    """dQ of one tile of the N_Q queries over the N_K keys (N_Q == N_K when CAUSAL). ACCUMULATE: add it to what DQ
    holds (fp32) instead of overwriting it. DELTA_FROM_O: compute the tile's delta rows from O and dO (loaded here
    anyway) and write them to DELTA for the dK/dV kernel, instead of reading them: no separate delta pass."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # longest rows first
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = (start_m + offs_m) < N_Q
    rows = start_m.to(tl.int64) + offs_m
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_don + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * stride_lse + rows, mask=row_ok, other=float("inf"))
    if DELTA_FROM_O:  # delta_i = Σ_d dO_id · O_id, as _bwd_delta_kernel computes it
        o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        tl.store(DELTA + bh.to(tl.int64) * stride_delta + rows, delta, mask=row_ok)
    else:
        delta = tl.load(DELTA + bh.to(tl.int64) * stride_delta + rows, mask=row_ok, other=0.0)
    k_src = _tile_source(K + b * stride_kb + h * stride_kh, N_K, stride_kn, offs_n, offs_d, BLOCK_N, HEAD_DIM, TMA)
    v_src = _tile_source(V + b * stride_vb + h * stride_vh, N_K, stride_vn, offs_n, offs_d, BLOCK_N, HEAD_DIM, TMA)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        dq = _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_m, 0, start_m, N_K,
                           qk_scale, False, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA)
        dq = _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_m, start_m,
                           tl.minimum(start_m + BLOCK_M, N_K), N_K, qk_scale, True, BLOCK_M, BLOCK_N, INT64_OFFSETS,
                           TMA)
    else:
        dq = _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_m, 0, N_K, N_K,
                           qk_scale, False, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA)
    dq *= sm_scale
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqn + offs_d[None, :]
    if ACCUMULATE:  # dQ = dQ_before + this launch's share (scaled above, alone); this program is the tile's only writer
        dq += tl.load(dq_ptrs, mask=row_ok[:, None], other=0.0)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _bwd_dq_from_ds_kernel(DS, K, DQ, stride_kb, stride_kh, stride_kn, stride_dqb, stride_dqh, stride_dqn, H, N,
                           sm_scale, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """dQ of one causal query tile from the dS tiles the dK/dV kernel left (STORE_DS): dQ_i = scale · Σ_{j≤i} dS_ij K_j,
    one matmul per tile instead of the three (QKᵀ, dO Vᵀ, dS K) of _bwd_dq_kernel."""
    i = tl.num_programs(0) - 1 - tl.program_id(0)  # longest rows first
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    offs_m = tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    n_tiles = tl.cdiv(N, BLOCK)
    # this row of tiles, (i, 0) … (i, i), lies contiguous in the head's triangle
    ds_ptrs = DS + bh.to(tl.int64) * (_triangle_tile(n_tiles, 0) * (BLOCK * BLOCK)) \
        + _triangle_tile(i, 0) * (BLOCK * BLOCK) + offs_m[:, None] * BLOCK + offs_n[None, :]
    k_ptrs = K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    dq = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    for j in range(0, i + 1):
        # keys past the end load as zeros: whatever their dS holds (finite), they add exactly 0
        k = tl.load(k_ptrs, mask=(j * BLOCK + offs_n)[:, None] < N, other=0.0)
        dq = tl.dot(tl.load(ds_ptrs), k, dq)  # dQ_i += dS_ij K_j
        ds_ptrs += BLOCK * BLOCK
        k_ptrs += BLOCK * stride_kn
    rows = i.to(tl.int64) * BLOCK + offs_m
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqn + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows[:, None] < N)


# ------------------------------------------------------------------------------------------------
# Launch configuration: tile sizes, warps and pipeline depth per kernel, head_dim and causality
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False  # stream tiles through TMA descriptors (Hopper+, aligned inputs; else pointer loads)
    maxnreg: int | None = None  # cap on registers per thread, so more programs share an SM (GPU only)
    # the warp-specialized Gluon kernels (sm_90; num_warps is then per consumer warpgroup, maxnreg unused): the
    # forward of flash_forward_pingpong.py with block_m/64 consumers of 64 query rows; the dK/dV/dQ and dQ kernels of
    # flash_backward_specialized.py with two consumers: dK/dV/dQ block_n = 128 keys per program, block_m the streamed
    # query tile; dQ block_m = 128 rows per program, block_n the streamed key tile
    specialized: bool = False
    # the persistent variant of the forward or the dK/dV/dQ kernel: one program per SM walking a host-made list of
    # query tiles or key blocks (kernels/persistent_schedule.py)
    persistent: bool = False


# 2-byte inputs (bf16, fp16; the same tensor-core rate and tile bytes), causal. Chosen from
# `scripts/bench_attention.py --explore-only --explore-seq 8192` on an H200 (bf16 causal, D=64/128, N=8K, each shape
# with and without TMA; results/explore_NVIDIA_H200.json holds every candidate's time). D=16/32 reuse D=64's
# choice; D=256 uses smaller tiles to fit shared memory (pointer loads, not tuned). The forward at D=128 takes
# 128×64 tiles with 8 warps: best in that exploration (1.086 vs 1.120 ms for 64×64) and in the H100 re-check
# (1.083 vs 1.141 ms, results/explore_NVIDIA_H100_80GB_HBM3_*.json). The dK/dV kernel takes 64×64 tiles with 4
# warps (NOTES.md J, K): at D<=64 capped at 168 registers per thread, so three programs share an SM instead of two
# (with LSE/delta read through TMA: 1K 0.480 vs 0.561 ms for 32×128, 16K 3.94 vs 4.65, 32K 15.8 vs 17.8, 128K with 12
# heads 91.9 vs 105.0); at D=128 two independent programs per SM instead of one of 8 warps (4K 1.055 vs 1.206 ms,
# 16K 3.64 vs 3.84, 32K 14.5 vs 15.9 for 64×128). Key: (kernel, head_dim).
# dQ needs block_m % block_n == 0, dK/dV block_n % block_m == 0; the forward takes either (powers of two).
_GPU_CONFIGS: dict[tuple[str, int], TileConfig] = {
    **{("fwd", d): TileConfig(64, 64, 4, 3, tma=True) for d in (16, 32, 64)},
    ("fwd", 128): TileConfig(128, 64, 8, 3, tma=True),
    ("fwd", 256): TileConfig(64, 32, 4, 2),
    **{("dkdv", d): TileConfig(64, 64, 4, 3, tma=True, maxnreg=168) for d in (16, 32, 64)},
    ("dkdv", 128): TileConfig(64, 64, 4, 2, tma=True),
    ("dkdv", 256): TileConfig(16, 64, 4, 2),
    **{("dq", d): TileConfig(128, 64, 8, 3, tma=True) for d in (16, 32, 64)},
    ("dq", 128): TileConfig(128, 64, 8, 4, tma=True),
    ("dq", 256): TileConfig(64, 16, 4, 2),
}
# Non-causal attention where its own exploration (`--explore-only --shortlist --full`, H100, N=8K:
# results/explore_NVIDIA_H100_80GB_HBM3_bfloat16_full.json) found a different best: the forward at D<=64 wants
# 128-row query tiles (2.35 vs 2.45 ms), as the causal forward does at D=128. The rest use the causal choice, and
# fp16 uses bf16's (its shortlist re-check put the same shapes within noise of the top).
_GPU_CONFIGS_FULL: dict[tuple[str, int], TileConfig] = {
    **{("fwd", d): TileConfig(128, 64, 8, 3, tma=True) for d in (16, 32, 64)},
}
# fp32 inputs (TF32 dots): tiles hold twice the bytes, so half the tile area and two stages fit shared memory.
_GPU_CONFIGS_FP32: dict[tuple[str, int], TileConfig] = {
    **{("fwd", d): TileConfig(64, 32, 4, 2, tma=True) for d in (16, 32, 64, 128)},
    ("fwd", 256): TileConfig(32, 16, 4, 1),
    **{("dkdv", d): TileConfig(32, 64, 4, 2, tma=True) for d in (16, 32, 64, 128)},
    ("dkdv", 256): TileConfig(16, 32, 4, 1),
    **{("dq", d): TileConfig(64, 32, 4, 2, tma=True) for d in (16, 32, 64, 128)},
    ("dq", 256): TileConfig(32, 16, 4, 1),
}
# Causal 2-byte inputs, by sequence length (H200, bf16, 16K tokens per batch; kernels/NOTES.md sections C and J):
# (kernel, head_dim) -> (seq bound, config). The forward at D=128 takes 64×64 tiles with 4 warps up to 8K tokens
# (ms, same process, three H200s: 4K 0.654–0.692 vs 0.688–0.749, 8K 1.14–1.16 vs 1.17–1.33; 128×64 wins at 16K:
# 2.07–2.26 vs 2.17–2.32). At D<=64 the forward takes 128-key tiles over 64 query rows with 4 warps (2 stages, 157
# registers: three programs per SM) from 8K tokens: the loop's per-tile work (rescale, bookkeeping, barriers) is
# spread over twice the scores (ms, one process, NOTES.md L: 8K 1.355 vs 1.391 for 64×64 and 1.368 for 128×64/8
# warps, 16K a tie, 128K with 12 heads 57.9 vs 58.5; 1K–4K ties or behind).
_GPU_CONFIGS_UP_TO_SEQ: dict[tuple[str, int], tuple[int, TileConfig]] = {
    ("fwd", 128): (8192, TileConfig(64, 64, 4, 3, tma=True)),
}
_GPU_CONFIGS_FROM_SEQ: dict[tuple[str, int], tuple[int, TileConfig]] = {
    **{("fwd", d): (8192, TileConfig(64, 128, 4, 2, tma=True)) for d in (16, 32, 64)},
}
# Causal 2-byte inputs on an H100/H200 (sm_90), by sequence length: the warp-specialized Gluon kernels where they are
# faster (specialized_ready decides whether the inputs fit them; anything else takes the tables above). Each key lists
# (from this many tokens, config), shortest first; the last entry that applies wins.
# - Forward (flash_forward_pingpong.py): ms, one process, H200, bf16, 16K tokens (NOTES.md O, S).
#   - Persistent, head_dim 64, 2 consumers (128 query rows), 128-key tiles, 3 stages, at 1K tokens: 0.241 vs the
#     Triton forward's 0.260 (2K 0.377 vs 0.402, 4K 0.661 vs 0.719). 3 consumers from 2K since P is packed by hand
#     (NOTES.md Z, AA; before, 0.386 and 0.679 at 2K and 4K): 2 / 3 consumers, 32 heads, 2K 0.384 / 0.373, 4K 0.679
#     / 0.657, 12 heads 2K 0.149 / 0.141, 4K 0.256 / 0.241, but 1K 0.242 / 0.253; at 8K 1.208 vs 1.226 for 2
#     consumers and 1.257 for the plain ping-pong kernel before the packing, 1.141 against 1.213 with it.
#   - Persistent at 3 consumers also from 16K, now that P is packed by hand and both loops compile to 583–585
#     instructions per tile (NOTES.md S, Z; before, its loop was 36 longer and the plain kernel won from 16K):
#     persistent vs plain, model strides, 12 heads unless named, b2dd292: 16K (2 × 12) 1.597 vs 1.691, 16K (32
#     heads) 2.145 vs 2.199, 32K 3.124 vs 3.215, 64K 12.38 vs 12.57. The plain (one program per query tile) ping-pong
#     kernel from 128K: 49.35 vs 49.57.
#   - Persistent, head_dim 128, 2 consumers, 3 stages (225 KB of shared memory), from 1K: 1K 0.176 vs 0.217 (Triton),
#     2K 0.268 vs 0.339, 4K 0.450 vs 0.570 for the plain ping-pong kernel, 8K 0.914 vs 1.005, 16K 1.700 vs 1.827,
#     128K (12 heads) 82.45 vs 82.53.
# - dK/dV/dQ at D=64, the five-matmul backward (flash_backward_specialized.py; NOTES.md Q, T): 128 keys per program,
#   64-query tiles, 3 stages, the whole backward in ms (delta, zeroed fp32 dQ accumulator, the kernel, the cast)
#   against the seven-matmul one (dQ, then dK/dV), H200, one process. Persistent (one program per SM over a
#   host-made list of key blocks) from 4K tokens: 4K 1.761 vs 1.876 (plain five-matmul 1.875, cuDNN 1.811), 8K (2 ×
#   32 heads) 3.114 vs 3.511 (plain 3.308, cuDNN 3.253), 8K with 4 × 12 heads 2.354 vs 2.413 (plain 2.509); 2K: the
#   seven-matmul one stays (1.016 vs 1.130). The plain kernel from 16K: 16K (32 heads) 5.91 vs 6.02 persistent and
#   6.63 seven-matmul, 32K (12 heads) 8.60 vs 8.76 and 9.76, 128K (12 heads) 135.9 vs 148.7 seven-matmul. Not
#   deterministic (dQ is summed by reduce-adds in arrival order), so deterministic mode
#   (torch.use_deterministic_algorithms) keeps the seven-matmul backward.
# - dK/dV/dQ at D=128 (_dkdvdq_kernel without its dQ warpgroup, each consumer computes half of dQ's columns, one
#   tile behind its dK/dV; NOTES.md V, W), from 2K tokens: persistent with 3 stages (one K/V buffer) below 8K, plain
#   with 2 from 8K. The whole backward in ms (do_bench, 16K tokens, 16 heads, 4527005): persistent s3 / plain s2 /
#   seven-matmul / cuDNN 2K 0.920 / 0.956 / 1.033 / 0.882, 4K 1.514 / 1.602 / 1.704 / 1.426, 8K 2.787 / 2.806 / 3.206
#   / 2.810, 16K 5.224 / 5.102 / 5.982 / 5.313; 1K 0.702 / 0.672 / 0.649 / 0.543 (the seven-matmul one stays).
# - dQ at D=128: 128 rows per program, 64-key tiles, 3 stages: 16K 2.294 vs 2.594, 32K 8.82 vs 10.07; 4K 0.662 vs
#   0.738 in one run, 0.712 vs 0.704 in another (2K 0.438 vs 0.448: a tie, left to Triton). At D=64 the Triton dQ
#   kernel (128 rows over 8 warps) stays ahead at every length (16K: 2.82 vs 2.69).
_SPECIALIZED_FROM_SEQ: dict[tuple[str, int], list[tuple[int, TileConfig]]] = {
    ("fwd", 64): [(1024, TileConfig(128, 128, 4, 3, tma=True, specialized=True, persistent=True)),
                  (2048, TileConfig(192, 128, 4, 3, tma=True, specialized=True, persistent=True)),
                  (131072, TileConfig(192, 128, 4, 3, tma=True, specialized=True))],
    ("fwd", 128): [(1024, TileConfig(128, 128, 4, 3, tma=True, specialized=True, persistent=True))],
    ("dkdvdq", 64): [(4096, TileConfig(64, 128, 4, 3, tma=True, specialized=True, persistent=True)),
                     (16384, TileConfig(64, 128, 4, 3, tma=True, specialized=True))],
    ("dkdvdq", 128): [(2048, TileConfig(64, 128, 4, 3, tma=True, specialized=True, persistent=True)),
                      (8192, TileConfig(64, 128, 4, 2, tma=True, specialized=True))],
    ("dq", 128): [(4096, TileConfig(128, 64, 4, 3, tma=True, specialized=True))],
}


# Causal 2-byte inputs at head_dim 128 up to this many tokens take the backward that keeps dS in memory
# (launch_backward_via_ds; NOTES.md AB): whole backward ms, H200, bf16, 16K tokens, 16 heads, one process (0ab498f),
# against the seven-matmul one: 1K 0.574 vs 0.651, 512 0.407 vs 0.484; at 2K the five-matmul kernel stays (0.898
# vs 0.944), and at head_dim 64 the seven-matmul one (1K: 0.669 vs 0.719). Its buffer holds B·H·T(T+1)/2 tiles of
# 64 × 64 (T = ⌈N/64⌉; ~B·H·N²/2 elements), so it runs only where that is at most VIA_DS_MAX_BYTES; and only on
# sm_90, where it was measured.
_VIA_DS_UP_TO_SEQ: dict[int, int] = {128: 1024}
VIA_DS_MAX_BYTES = 1 << 30


def via_ds_chosen(q: Tensor, causal: bool) -> bool:
    """Whether the table sends this backward to launch_backward_via_ds: a causal 2-byte input on an sm_90 GPU, of a
    head_dim and length the table lists, whose dS buffer fits VIA_DS_MAX_BYTES."""
    B, H, N, D = q.shape
    if INTERPRET or not (causal and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)) \
            or N > _VIA_DS_UP_TO_SEQ.get(D, 0) or _capability(q.device) != (9, 0):
        return False
    tile = tile_config("dkdv", D, True, q.dtype, N).block_m
    return B * H * ds_head_elements(N, tile) * q.element_size() <= VIA_DS_MAX_BYTES


def _specialized_entry(kernel: str, head_dim: int, seq_len: int) -> TileConfig | None:
    """The warp-specialized kernel's configuration for this length, None below the table's first length."""
    chosen = None
    for from_seq, cfg in _SPECIALIZED_FROM_SEQ.get((kernel, head_dim), []):
        if seq_len >= from_seq:
            chosen = cfg
    return chosen


# Small tiles under the CPU interpreter: fast there, and several tiles per test sequence so the
# diagonal / full / ragged-tail paths all run. TMA on, as on the GPU (the interpreter emulates descriptors);
# tests run the pointer path with explicit configs.
_INTERPRET_CONFIGS = {"fwd": TileConfig(32, 16, 4, 1, tma=True), "dkdv": TileConfig(16, 32, 4, 1, tma=True),
                      "dq": TileConfig(32, 16, 4, 1, tma=True)}


def tile_config(kernel: str, head_dim: int, causal: bool = True, dtype: torch.dtype = torch.bfloat16,
                seq_len: int | None = None, specialized: bool = False) -> TileConfig:
    """The launch configuration of one kernel ('fwd', 'dkdv' or 'dq') for this head_dim, causality and dtype, and,
    when seq_len is given, for that sequence length (causal 2-byte inputs have short- and long-sequence tiles).
    specialized: the inputs fit the warp-specialized Gluon kernels (specialized_ready), which causal sequences then
    take where the table (_SPECIALIZED_FROM_SEQ) has an entry for this kernel, head_dim and length."""
    if INTERPRET:
        return _INTERPRET_CONFIGS[kernel]
    if dtype == torch.float32:
        return _GPU_CONFIGS_FP32[(kernel, head_dim)]
    if not causal and (kernel, head_dim) in _GPU_CONFIGS_FULL:
        return _GPU_CONFIGS_FULL[(kernel, head_dim)]
    gluon = _specialized_entry(kernel, head_dim, seq_len) if specialized and causal and seq_len is not None else None
    if gluon is not None:
        return gluon
    if causal and seq_len is not None:
        up_to = _GPU_CONFIGS_UP_TO_SEQ.get((kernel, head_dim))
        if up_to is not None and seq_len <= up_to[0]:
            return up_to[1]
        from_seq = _GPU_CONFIGS_FROM_SEQ.get((kernel, head_dim))
        if from_seq is not None and seq_len >= from_seq[0]:
            return from_seq[1]
    return _GPU_CONFIGS[(kernel, head_dim)]


def fused_backward_config(head_dim: int, causal: bool, dtype: torch.dtype, seq_len: int,
                          specialized: bool) -> TileConfig | None:
    """The five-matmul backward's configuration (the dK/dV/dQ kernel of flash_backward_specialized.py) where the table
    sends these launches to it: causal 2-byte inputs that fit the warp-specialized kernels (specialized), long
    enough. None elsewhere: the seven-matmul backward runs."""
    if INTERPRET or not (specialized and causal and dtype in (torch.float16, torch.bfloat16)):
        return None
    return _specialized_entry("dkdvdq", head_dim, seq_len)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------
def _check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
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


def _strides3(t: Tensor) -> tuple[int, int, int]:
    return t.stride()[:3]


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability, asked once per device (torch's query costs a few µs per launch)."""
    return torch.cuda.get_device_capability(device)


def _hopper_or_newer(t: Tensor) -> bool:
    return INTERPRET or (t.is_cuda and _capability(t.device)[0] >= 9)


def _tma_ready(*tensors: Tensor) -> bool:
    """TMA needs 16-byte aligned bases and strides (but the last, contiguous dimension's): (B, H, N, D) tiles whose
    head bases and rows are aligned, (B, H, N) LSE/delta whose head rows are. Views that break this take the pointer
    path."""
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or any(stride * size % 16 for stride in t.stride()[:-1]):
            return False
    return True


def _tma_scratch(size: int, alignment: int, stream: int | None) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _use_tma(cfg: TileConfig, *tensors: Tensor) -> bool:
    """Whether this launch streams these tensors through TMA. Device-side descriptors need Triton's scratch
    allocator; it is per thread (a ContextVar) and autograd runs the backward on its own thread, so it is set on
    every launch."""
    if not (cfg.tma and _hopper_or_newer(tensors[0]) and _tma_ready(*tensors)):
        return False
    if not INTERPRET:
        triton.set_allocator(_tma_scratch)
    return True


_GLUON_MODULES: dict[str, object] = {}  # imported on first use (only on an sm_90 GPU)


def _gluon_module(name: str):
    """minigpt_kernels.<name> (a Gluon kernel file), or None where its Gluon API (triton 3.6, Hopper) does not import."""
    if name not in _GLUON_MODULES:
        try:
            _GLUON_MODULES[name] = importlib.import_module(f"minigpt_kernels.{name}")
        except (ImportError, AttributeError):  # another triton's Gluon
            _GLUON_MODULES[name] = None
    return _GLUON_MODULES[name]


def specialized_ready(q: Tensor, k: Tensor, v: Tensor, causal: bool, accumulate: bool = False,
                      out: tuple[Tensor, Tensor] | None = None, module: str = "flash_forward_pingpong",
                      also: tuple[Tensor, ...] = ()) -> bool:
    """Whether the warp-specialized Gluon kernels of `module` can take these inputs: an sm_90 GPU (wgmma) with their
    Gluon API, causal, fp16/bf16, head_dim 64 or 128, as many queries as keys, TMA-aligned q/k/v (and `also`, e.g. do),
    a fresh result (no `accumulate`) and, for the forward's out=(o, lse), o in q's dtype and contiguous LSE rows."""
    return (not INTERPRET and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128)
            and causal and not accumulate and q.shape == k.shape == v.shape
            and (out is None or (out[0].dtype == q.dtype and out[1].is_contiguous()))
            and _capability(q.device) == (9, 0) and _tma_ready(q, k, v, *also)
            and all(t.stride(-1) == 1 for t in (q, k, v, *also))
            and _gluon_module(module) is not None)


_NOT_SPECIALIZED = ("flash_attention: the warp-specialized {} takes causal fp16/bf16 inputs with head_dim 64 or 128, "
                    "TMA-aligned, on an sm_90 GPU, without accumulate (see specialized_ready)")


def _reg_cap(cfg: TileConfig) -> dict[str, int]:
    return {} if cfg.maxnreg is None or INTERPRET else {"maxnreg": cfg.maxnreg}


def _needs_int64(n: int, *tensors: Tensor) -> bool:
    """Whether a row offset (seq position × row stride) can pass 2³¹: then the kernels use int64 tile offsets.

    Only then: int64 offsets cost 10-15% on an H200 at benchmark sizes (they hide alignment from the compiler).
    """
    return any(n * t.stride(2) >= 2**31 for t in tensors)


def _in_layout_of(t: Tensor, flat: Tensor, heads: int) -> Tensor:
    """flat (B·heads·N·D elements) viewed as (B, heads, N, D) in t's memory order (see _empty_in_layout_of), so that
    copying it into a head slice of a tensor laid out like t walks both in the same order."""
    B, _, N, D = t.shape
    if t.stride(1) < t.stride(2):
        return flat.view(B, N, heads, D).transpose(1, 2)
    return flat.view(B, heads, N, D)


def _empty_in_layout_of(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An uninitialized (B, H, N, D) tensor (of t's dtype unless given) laid out in memory like t: as (B, N, H, D)
    rows when t is a head-transposed view of a (B, N, ...) buffer (the model's q/k/v), so that the model's
    transpose + reshape back to (B, N, H·D) is a free view; plain (B, H, N, D) otherwise."""
    B, H, N, D = t.shape
    dtype = t.dtype if dtype is None else dtype
    if t.stride(1) < t.stride(2):  # heads vary faster than positions: rows of (H, D)
        return torch.empty((B, N, H, D), dtype=dtype, device=t.device).transpose(1, 2)
    return torch.empty((B, H, N, D), dtype=dtype, device=t.device)


def _check_lengths(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    """The launchers take Nq query rows against Nk key rows; a causal mask is the diagonal of a square, so causal
    launches need Nq == Nk. (flash_attention's own check, _check_inputs, keeps one shape for q, k, v.)"""
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or k.shape[2] < 1:
        raise ValueError(f"flash_attention: q (B, H, Nq, D) and k, v (B, H, Nk, D) with Nk >= 1 expected, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"flash_attention: causal attention needs as many queries as keys, got Nq={q.shape[2]}, "
                         f"Nk={k.shape[2]} (different lengths only without the causal mask)")


def _row_stride(t: Tensor) -> int | None:
    """The distance between the (batch, head) rows of a (B, H, N) tensor that the kernels address as
    t + (b·H + h)·stride + n (LSE, delta): a contiguous tensor or a slice of one along N. None if t is not such."""
    B, H, N = t.shape
    stride = t.stride(1) if H > 1 else t.stride(0)
    if (N > 1 and t.stride(2) != 1) or (B > 1 and H > 1 and t.stride(0) != H * stride):
        return None
    return stride


def _rows_in(t: Tensor) -> tuple[Tensor, int]:
    """A (B, H, N) kernel input and its row stride; copied to contiguous memory only if its rows do not fit."""
    stride = _row_stride(t)
    if stride is None:
        t = t.contiguous()
        stride = _row_stride(t)
    return t, stride


def _rows_for_tma(t: Tensor, stride: int) -> tuple[Tensor, int]:
    """(rows, stride) of a (B, H, N) fp32 input whose (b, h) rows must each start 16-byte aligned (a 1-D TMA
    descriptor's base): t itself when they do, else a copy into rows padded to a multiple of 4 (B·H·N·4 bytes)."""
    if _tma_ready(t) and (stride * t.element_size()) % 16 == 0:
        return t, stride
    B, H, N = t.shape
    padded = torch.empty((B, H, (N + 3) // 4 * 4), dtype=torch.float32, device=t.device)
    padded[:, :, :N].copy_(t)
    return padded, padded.stride(1)


def _check_out(name: str, t: Tensor, shape: torch.Size | tuple[int, ...], accumulate: bool) -> None:
    """An output buffer given by the caller: its shape, a contiguous last dimension, fp32 when accumulated into."""
    if t.shape != shape or t.stride(-1) != 1 or (accumulate and t.dtype != torch.float32):
        raise ValueError(f"flash_attention: out {name} must be {tuple(shape)}{', fp32,' if accumulate else ''} with a "
                         f"contiguous last dimension, got {tuple(t.shape)} {t.dtype} with strides {t.stride()}")


def _grad_outputs(out: tuple[Tensor, ...] | None, accumulate: bool, names: tuple[str, ...],
                  likes: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The backward launchers' output buffers: new ones laid out like their inputs, or the caller's `out`, checked
    (accumulating needs one to add into)."""
    if out is None:
        if accumulate:
            raise ValueError("flash_attention: accumulate=True adds into `out`; none given")
        return tuple(_empty_in_layout_of(t) for t in likes)
    for name, t, like in zip(names, out, likes):
        _check_out(name, t, like.shape, accumulate)
    return tuple(out)


def launch_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: float, cfg: TileConfig | None = None,
                   out: tuple[Tensor, Tensor] | None = None, accumulate: bool = False) -> tuple[Tensor, Tensor]:
    """Run the forward kernel: (o, lse) of the Nq rows of q against the Nk keys of k, v (Nq == Nk when causal).
    `cfg` overrides the tile table (the benchmark's tile exploration).

    out=(o, lse): write the result there instead of into new tensors: o (B, H, Nq, D), any dtype, any strides with
    a contiguous last dimension; lse (B, H, Nq) fp32, a contiguous tensor or a slice of one along Nq.
    accumulate=True: out holds, in fp32, the attention of these rows over other keys (o normalized, lse base 2; a
    row with lse = -inf holds nothing yet, whatever its o) and is overwritten with the attention over both key
    sets. Ring attention folds each arriving block into its running output this way, without a merge pass."""
    _check_lengths(q, k, v, causal)
    B, H, N_Q, D = q.shape
    N_K = k.shape[2]
    ready = specialized_ready(q, k, v, causal, accumulate, out)
    if cfg is not None and cfg.specialized and not ready:
        raise ValueError(_NOT_SPECIALIZED.format("forward"))
    cfg = cfg or tile_config("fwd", D, causal, q.dtype, N_Q, specialized=ready)
    if out is None:
        if accumulate:
            raise ValueError("flash_attention: accumulate=True continues the state in `out`; none given")
        o, lse = _empty_in_layout_of(q), torch.empty((B, H, N_Q), dtype=torch.float32, device=q.device)
    else:
        o, lse = out
        _check_out("o", o, q.shape, accumulate)
        if lse.shape != (B, H, N_Q) or lse.dtype != torch.float32 or _row_stride(lse) is None:
            raise ValueError(f"flash_attention: out lse must be ({B}, {H}, {N_Q}) fp32 with contiguous rows, got "
                             f"{tuple(lse.shape)} {lse.dtype} with strides {lse.stride()}")
    if cfg.specialized:
        triton.set_allocator(_tma_scratch)  # its TMA descriptors are made on the device, like _use_tma's
        kernels = _gluon_module("flash_forward_pingpong")
        launch = kernels.launch_forward_persistent if cfg.persistent else kernels.launch_forward_pingpong
        launch(q, k, v, o, lse, sm_scale * LOG2E, cfg.block_m // 64, cfg.block_n, cfg.num_stages)
        return o, lse
    grid = (triton.cdiv(N_Q, cfg.block_m), B * H)
    _fwd_kernel[grid](q, k, v, o, lse, *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(o), _row_stride(lse),
                      H, N_Q, N_K, sm_scale * LOG2E, CAUSAL=causal, CONTINUE=accumulate, HEAD_DIM=D,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, INT64_OFFSETS=_needs_int64(max(N_Q, N_K), q, k, v),
                      TMA=_use_tma(cfg, k, v), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                      **_reg_cap(cfg))
    return o, lse


def launch_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, sm_scale: float,
                    dkdv_cfg: TileConfig | None = None, dq_cfg: TileConfig | None = None,
                    deterministic: bool = False, out: tuple[Tensor, Tensor, Tensor] | None = None,
                    fp32_dq: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The backward: (dq, dk, dv). Where the table says so (long causal sequences at head_dim 64 or 128 on an
    H100/H200), the five-matmul backward (launch_backward_fused), unless deterministic results are asked for (deterministic=True or
    torch.use_deterministic_algorithms): its dQ is summed in a varying order. Short causal sequences at head_dim 128
    on an H100/H200 (fp16/bf16, up to 1K tokens, its dS buffer at most VIA_DS_MAX_BYTES, no cfg given): the backward
    that keeps dS in memory (launch_backward_via_ds; deterministic, so also in deterministic mode). Otherwise the
    deterministic seven-matmul backward: the dQ kernel, then the dK/dV kernel (the cfgs override their tiles). The
    dQ kernel also computes delta = rowsum(dO ∘ O) for its rows (it loads dO anyway) and leaves it for the dK/dV
    kernel, which saves a pass over O and dO: 1–3% of the backward at 1K–4K and at 128K tokens (NOTES.md L).
    out=(dq, dk, dv): write the gradients there (q's, k's, v's shapes, contiguous last dimensions) and return them;
    fp32_dq: where the five-matmul backward runs, return its fp32 dQ accumulator in out's dq's stead (see
    launch_backward_fused)."""
    if do.stride(-1) != 1:
        do = do.contiguous()
    B, H, N = lse.shape
    if out is not None:
        _grad_outputs(out, False, ("dq", "dk", "dv"), (q, k, v))  # checked here, before either path runs
    if dkdv_cfg is None and dq_cfg is None and not (deterministic or torch.are_deterministic_algorithms_enabled()):
        # the table's choice for this length, if the inputs fit the warp-specialized kernels (checked only then)
        cfg = fused_backward_config(q.shape[-1], causal, q.dtype, N, True)
        if cfg is not None and specialized_ready(q, k, v, causal, module="flash_backward_specialized", also=(do,)):
            return launch_backward_fused(do, q, k, v, o, lse, sm_scale, cfg, out=out, fp32_dq=fp32_dq)
    if dkdv_cfg is None and dq_cfg is None and via_ds_chosen(q, causal):  # deterministic too
        return launch_backward_via_ds(do, q, k, v, o, lse, sm_scale, out=out)
    # rows start 16-byte aligned whatever N, as TMA reads them
    delta = torch.empty((B, H, (N + 3) // 4 * 4), dtype=torch.float32, device=lse.device)[:, :, :N]
    dq = launch_backward_dq(do, q, k, v, lse, delta, causal, sm_scale, dq_cfg, o=o,
                            out=None if out is None else out[0])
    dk, dv = launch_backward_dkdv(do, q, k, v, lse, delta, causal, sm_scale, dkdv_cfg,
                                  out=None if out is None else out[1:])
    return dq, dk, dv


# The five-matmul backward's fp32 dQ accumulator takes at most this many bytes, or one head's (B·N·D·4) where that is
# more: inputs with more heads · tokens run it head group by head group (from 128K tokens one head alone fills an
# H200), so its memory stays bounded by the larger of the two.
FUSED_DQ_ACC_BYTES = 256 << 20


def launch_backward_fused(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, sm_scale: float,
                          cfg: TileConfig | None = None, out: tuple[Tensor, Tensor, Tensor] | None = None,
                          fp32_dq: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The causal five-matmul backward (kernels/NOTES.md Q): (dq, dk, dv) in the memory layouts of q, k, v. A delta
    kernel, then the dK/dV/dQ kernel of flash_backward_specialized.py, which adds dQ into a zeroed fp32 accumulator
    (a TMA reduce-add per query tile and block of 128 keys), then one cast into dq. No kernel recomputes QKᵀ and dO·Vᵀ
    for dQ; dQ's summation order follows the programs' timing, so it can differ in the last bits between runs.
    Needs inputs that fit the warp-specialized kernels (specialized_ready); at head_dim 128 the kernel splits dQ's
    columns between its consumers. out=(dq, dk, dv): write the gradients there.
    fp32_dq: return the fp32 accumulator (q's shape and memory order) as dq, without the cast, when it holds
    every head at once (a caller that transforms dQ anyway, e.g. rotates it back, then rounds it only once);
    otherwise dq as usual."""
    if do.stride(-1) != 1:
        do = do.contiguous()
    B, H, N, D = q.shape
    if not specialized_ready(q, k, v, True, module="flash_backward_specialized", also=(do,)):
        raise ValueError("flash_attention: the warp-specialized dK/dV/dQ kernel takes causal fp16/bf16 inputs with "
                         "head_dim 64 or 128, TMA-aligned, on an sm_90 GPU (see specialized_ready)")
    if cfg is not None and not (cfg.specialized and cfg.block_m == 64 and cfg.block_n == 128 and cfg.num_stages >= 2):
        raise ValueError(f"flash_attention: the dK/dV/dQ kernel runs 128 keys per program over 64-query tiles with at "
                         f"least 2 stages (TileConfig(64, 128, 4, stages, specialized=True)), got {cfg}")
    c = cfg or _specialized_entry("dkdvdq", D, N) or _SPECIALIZED_FROM_SEQ[("dkdvdq", D)][0][1]
    kernels = _gluon_module("flash_backward_specialized")
    dq, dk, dv = _grad_outputs(out, False, ("dq", "dk", "dv"), (q, k, v))
    group = max(1, min(H, FUSED_DQ_ACC_BYTES // (B * N * D * 4)))  # heads per launch
    keep_acc = fp32_dq and group == H
    acc = torch.empty(B * group * N * D, dtype=torch.float32, device=q.device)
    triton.set_allocator(_tma_scratch)
    launch = kernels.launch_dkdv_dq_persistent if c.persistent else kernels.launch_dkdv_dq
    for h0 in range(0, H, group):
        hs = slice(h0, min(H, h0 + group))
        dq_acc = _in_layout_of(q, acc[:B * (hs.stop - h0) * N * D], hs.stop - h0).zero_()
        do_h, delta = launch_backward_delta(do[:, hs], o[:, hs], lse[:, hs])
        (lse_h, stride_lse), (delta, stride_delta) = _rows_in(lse[:, hs]), _rows_in(delta)
        (lse_h, stride_lse), (delta, stride_delta) = _rows_for_tma(lse_h, stride_lse), _rows_for_tma(delta, stride_delta)
        launch(do_h, q[:, hs], k[:, hs], v[:, hs], lse_h, stride_lse, delta, stride_delta, dk[:, hs], dv[:, hs], dq_acc,
               sm_scale, sm_scale * LOG2E, c.block_m, c.num_stages)
        if keep_acc:
            return dq_acc, dk, dv
        dq[:, hs].copy_(dq_acc)
    return dq, dk, dv


# The backward's kernels are also launched one by one, with delta from a kernel of its own: ring attention runs a
# block's dQ and dK/dV kernels at different times, to overlap different transfers, and has them add into its fp32
# accumulators (`accumulate`).
# lse and delta are those of the whole softmax row (the final o, lse), whatever part of its keys a launch sees.
def launch_backward_delta(do: Tensor, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """(do with a contiguous last dimension, delta = rowsum(dO ∘ O) as (B, H, N) fp32)."""
    B, H, N, D = o.shape
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = torch.empty_like(lse, memory_format=torch.contiguous_format)
    _bwd_delta_kernel[(triton.cdiv(N, 128), B * H)](o, do, delta, *_strides3(o), *_strides3(do), H, N,
                                                    HEAD_DIM=D, BLOCK_M=128, num_warps=4)
    return do, delta


def launch_backward_dkdv(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, causal: bool,
                         sm_scale: float, cfg: TileConfig | None = None, out: tuple[Tensor, Tensor] | None = None,
                         accumulate: bool = False, ds: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(dk, dv) of the Nk keys over the Nq queries (Nq == Nk when causal), in the memory layouts of k and v, or
    written into out=(dk, dv) (k's shape, contiguous last dimension); accumulate=True adds them to what out holds
    (fp32): ring attention's travelling dK/dV accumulator. ds (causal, square tiles): a flat buffer of
    B·H·ds_head_elements(N, tile) elements in q's dtype that receives every dS tile (launch_backward_via_ds)."""
    _check_lengths(q, k, v, causal)
    B, H, N_Q, D = q.shape
    N_K = k.shape[2]
    dk, dv = _grad_outputs(out, accumulate, ("dk", "dv"), (k, v))
    (lse, stride_lse), (delta, stride_delta) = _rows_in(lse), _rows_in(delta)
    if cfg is not None and cfg.specialized:
        raise ValueError("flash_attention: the warp-specialized dK/dV kernel computes dQ too: launch_backward_fused "
                         "runs it")
    c = cfg or tile_config("dkdv", D, causal, q.dtype, N_Q)
    if ds is not None and not (causal and c.block_m == c.block_n and ds.dtype == q.dtype and ds.is_contiguous()
                               and ds.numel() == B * H * ds_head_elements(N_Q, c.block_m)
                               and ds_head_elements(N_Q, c.block_m) < 2**31):  # offsets inside a head are int32
        raise ValueError(f"flash_attention: ds takes causal launches with square tiles, a contiguous {q.dtype} buffer "
                         f"of B·H·ds_head_elements(N, tile) elements, under 2³¹ per head; got {c} and {ds.numel()} "
                         f"{ds.dtype}")
    _bwd_dkdv_kernel[(triton.cdiv(N_K, c.block_n), B * H)](
        q, k, v, do, lse, delta, dk, dv,
        dk if ds is None else ds,  # DS: any pointer when nothing is stored
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(do),
        *_strides3(dk), *_strides3(dv), stride_lse, stride_delta, H, N_Q, N_K, sm_scale * LOG2E, sm_scale,
        CAUSAL=causal, ACCUMULATE=accumulate, HEAD_DIM=D, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        INT64_OFFSETS=_needs_int64(max(N_Q, N_K), q, k, v, do), TMA=_use_tma(c, q, do),
        ROW_TMA=_use_tma(c, lse, delta), STORE_DS=ds is not None,
        num_warps=c.num_warps, num_stages=c.num_stages, **_reg_cap(c))
    return dk, dv


@contextlib.contextmanager
def _unfilled():
    """torch.empty without the NaN fill that deterministic mode (torch.use_deterministic_algorithms) adds, for a buffer
    the kernels write in full before reading it."""
    was = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = was


def ds_head_elements(n: int, tile: int) -> int:
    """The dS buffer's elements per causal head of n tokens: its tile × tile blocks on or below the diagonal."""
    t = triton.cdiv(n, tile)
    return t * (t + 1) // 2 * tile * tile


def launch_backward_via_ds(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, sm_scale: float,
                           cfg: TileConfig | None = None, dq_cfg: TileConfig | None = None,
                           out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The causal backward with dS kept in memory: (dq, dk, dv). The delta kernel; the dK/dV kernel, which also
    writes each dS tile (q's dtype, as its own dK matmul rounds it) into a buffer of the lower triangle of tiles;
    then dQ = scale · dS K from that buffer, one matmul per tile where the seven-matmul backward's dQ kernel does
    three. Five matmuls, no atomics, deterministic; dK, dV are the dK/dV kernel's own, and dQ came out bitwise the
    seven-matmul backward's in every shape measured on an H200 (NOTES.md AB; not guaranteed: other tiles, other
    delta source). The buffer holds B·H·ds_head_elements(N, tile) elements (~B·H·N²/2; at 1K tokens and head_dim
    128, 4.25× q's size), so the table takes this path only for short sequences (via_ds_chosen).
    cfg: the dK/dV kernel's tiles (square); dq_cfg: the dQ kernel's warps and stages (its tiles are cfg's)."""
    _check_lengths(q, k, v, True)
    B, H, N, D = q.shape
    c = cfg or tile_config("dkdv", D, True, q.dtype, N)
    dc = dq_cfg or TileConfig(c.block_m, c.block_n, 4, 3)  # 4 warps, 3 stages: best of 2–4 stages, 4 or 8 warps
    if c.block_m != c.block_n or (dc.block_m, dc.block_n) != (c.block_m, c.block_n):
        raise ValueError(f"flash_attention: the dS path takes square tiles, the same for both kernels; got {c}, {dc}")
    dq, dk, dv = _grad_outputs(out, False, ("dq", "dk", "dv"), (q, k, v))
    do, delta = launch_backward_delta(do, o, lse)
    with _unfilled():  # every element is written before it is read: no NaN fill in deterministic mode
        ds = torch.empty(B * H * ds_head_elements(N, c.block_m), dtype=q.dtype, device=q.device)
    launch_backward_dkdv(do, q, k, v, lse, delta, True, sm_scale, c, out=(dk, dv), ds=ds)
    _bwd_dq_from_ds_kernel[(triton.cdiv(N, c.block_m), B * H)](
        ds, k, dq, *_strides3(k), *_strides3(dq), H, N, sm_scale, HEAD_DIM=D, BLOCK=c.block_m,
        num_warps=dc.num_warps, num_stages=dc.num_stages)
    return dq, dk, dv


def launch_backward_dq(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, causal: bool,
                       sm_scale: float, cfg: TileConfig | None = None, out: Tensor | None = None,
                       accumulate: bool = False, o: Tensor | None = None) -> Tensor:
    """dq of the Nq queries over the Nk keys (Nq == Nk when causal), in the memory layout of q, or written into
    `out` (q's shape, contiguous last dimension); accumulate=True adds it to what out holds (fp32).
    o given (the forward's output): delta is computed here from o and do and written into `delta` (then an output,
    (B, H, Nq) fp32) instead of read from it."""
    _check_lengths(q, k, v, causal)
    B, H, N_Q, D = q.shape
    N_K = k.shape[2]
    (dq,) = _grad_outputs(None if out is None else (out,), accumulate, ("dq",), (q,))
    if o is not None and (o.shape != q.shape or o.stride(-1) != 1):
        raise ValueError(f"flash_attention: o must have q's shape {tuple(q.shape)} and a contiguous last dimension, "
                         f"got {tuple(o.shape)} with strides {o.stride()}")
    if o is not None and (delta.shape != (B, H, N_Q) or delta.dtype != torch.float32 or _row_stride(delta) is None):
        # written here: it must not be a copy made for reading
        raise ValueError(f"flash_attention: delta to compute must be ({B}, {H}, {N_Q}) fp32 with contiguous rows, got "
                         f"{tuple(delta.shape)} {delta.dtype} with strides {delta.stride()}")
    (lse, stride_lse), (delta, stride_delta) = _rows_in(lse), _rows_in(delta)
    # the warp-specialized dQ kernel computes delta from o (it has no path that reads it)
    wanted = cfg.specialized if cfg is not None else _specialized_entry("dq", D, N_Q) is not None  # else not checked
    ready = o is not None and wanted and specialized_ready(q, k, v, causal, accumulate,
                                                           module="flash_backward_specialized", also=(do,))
    if cfg is not None and cfg.specialized and (not ready or cfg.block_m != 128):
        raise ValueError(_NOT_SPECIALIZED.format("dQ kernel") + ", with o given; its block_m is 128")
    c = cfg or tile_config("dq", D, causal, q.dtype, N_Q, specialized=ready)
    if c.specialized:
        triton.set_allocator(_tma_scratch)
        _gluon_module("flash_backward_specialized").launch_dq(
            do, q, k, v, o, lse, stride_lse, delta, stride_delta, dq, sm_scale, sm_scale * LOG2E, c.block_n,
            c.num_stages)
        return dq
    _bwd_dq_kernel[(triton.cdiv(N_Q, c.block_m), B * H)](
        q, k, v, do, lse, delta, dq, o, *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(do),
        *_strides3(dq), *(_strides3(o) if o is not None else (0, 0, 0)), stride_lse, stride_delta,
        H, N_Q, N_K, sm_scale * LOG2E, sm_scale,
        CAUSAL=causal, ACCUMULATE=accumulate, HEAD_DIM=D, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        INT64_OFFSETS=_needs_int64(max(N_Q, N_K), q, k, v, do), TMA=_use_tma(c, k, v), DELTA_FROM_O=o is not None,
        num_warps=c.num_warps, num_stages=c.num_stages, **_reg_cap(c))
    return dq


# ------------------------------------------------------------------------------------------------
# PyTorch integration: custom ops (opaque to torch.compile, no graph break) + autograd.Function
# ------------------------------------------------------------------------------------------------
@torch.library.custom_op("minigpt::flash_attn_fwd", mutates_args=())
def _flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: float) -> tuple[Tensor, Tensor]:
    return launch_forward(q, k, v, causal, sm_scale)


@_flash_attn_fwd.register_fake
def _(q, k, v, causal, sm_scale):  # shapes and memory layouts of the outputs, for torch.compile
    B, H, N, D = q.shape
    return _empty_in_layout_of(q), q.new_empty((B, H, N), dtype=torch.float32)


@torch.library.custom_op("minigpt::flash_attn_bwd", mutates_args=())
def _flash_attn_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
                    sm_scale: float, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return launch_backward(do, q, k, v, o, lse, causal, sm_scale, deterministic=deterministic)


@_flash_attn_bwd.register_fake
def _(do, q, k, v, o, lse, causal, sm_scale, deterministic):
    return _empty_in_layout_of(q), _empty_in_layout_of(k), _empty_in_layout_of(v)


def _traced(t: Tensor) -> bool:
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
        elif _traced(q):
            o, lse = torch.ops.minigpt.flash_attn_fwd(q, k, v, causal, sm_scale)
        else:
            o, lse = launch_forward(q, k, v, causal, sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale, ctx.deterministic = causal, sm_scale, deterministic
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        if _traced(do) or torch.is_grad_enabled():  # create_graph: the op's missing formula says so, loudly
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
    _check_inputs(q, k, v)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return FlashAttention.apply(q, k, v, causal, sm_scale, precomputed, deterministic)


def flash_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                             softmax_scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Forward only (no autograd): the output and the row log-sum-exp (base 2, fp32, (batch, heads, seq))."""
    _check_inputs(q, k, v)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if _traced(q) or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return torch.ops.minigpt.flash_attn_fwd(q, k, v, causal, sm_scale)  # no gradient: the op says so if asked
    return launch_forward(q, k, v, causal, sm_scale)

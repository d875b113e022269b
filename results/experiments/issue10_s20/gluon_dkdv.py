"""Experiment D, re-cut: the dK/dV kernel in Gluon (triton.experimental.gluon, triton 3.6) with asynchronous wgmma,
LSE and delta rows read through 1-D TMA descriptors (one bulk copy per query tile each, in the same ring stage and
on the same mbarrier as that tile's Q and dO) instead of masked per-thread pointer loads (kernels/NOTES.md D, K).

Per key tile (BLOCK_N keys, one program), over the query tiles it meets (BLOCK_M queries each), on transposed tiles
(keys × queries):
    Sᵀ = K Qᵀ,  Pᵀ = exp2(Sᵀ·scale·log2e − LSE),  dV += Pᵀ dO,  dPᵀ = V dOᵀ,  dSᵀ = Pᵀ ∘ (dPᵀ − delta),  dK += dSᵀ Q
and dK ·= scale at the end. K and V are loaded once by TMA; Q, dO, LSE, delta stream through a STAGES-deep ring.
Each step issues Sᵀ and dPᵀ together, waits for Sᵀ only, computes Pᵀ while dPᵀ runs, issues dV, waits for dPᵀ,
computes dSᵀ while dV runs and issues dK; that dV and dK are retired by the next step's first wait. The in-flight dK,
dV cross the loop's back-edge only as accumulators of later wgmmas (and their bf16 A operands Pᵀ, dSᵀ are carried
untouched), which is what ptxas needs to leave the wgmmas asynchronous (NOTES "What ptxas needs ...").

That schedule holds Sᵀ, dPᵀ, dK, dV and the bf16 Pᵀ, dSᵀ at once: ~190 registers at 64×64 tiles, D=64 (two programs
per SM), and under maxnreg 168 ptxas serializes every wgmma (C7512, insufficient registers). LEAN (a variant, not
D's schedule) retires the previous dV/dK while Sᵀ runs, before issuing dPᵀ, and retires dV with dPᵀ: 160 registers,
still asynchronous, three programs per SM without a cap; the cost is that dSᵀ no longer overlaps dV's matmul.

Standalone (no import of the repo's kernel module): `_empty_in_layout_of` and `_row_stride` are copies.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

LOG2E = 1.4426950408889634


@gluon.constexpr_function
def _mma_layout(rows, cols, num_warps):
    """Accumulator layout of a (rows, cols) wgmma result: warps stacked along rows, the widest n."""
    n = 256
    while n > cols or cols % n:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _dkdv_tiles(t0, t1, num_tiles, lo, s, phase, dk, dv, pT16, dsT16,
                k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ready,
                q_desc, do_desc, lse_desc, delta_desc, start_n, qk_scale,
                MASKED: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr, LEAN: gl.constexpr):
    """Steps t0..t1 of the query-tile sequence (tile t starts at query lo + t·BLOCK_M; ring stage s, mbarrier phase
    `phase` at t0). dK/dV of the last step are left in flight. MASKED: diagonal tiles (query i sees key j iff i >= j)."""
    dtype: gl.constexpr = q_smem.dtype
    num_warps: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_M, num_warps)   # Sᵀ, dPᵀ: keys × queries
    d_layout: gl.constexpr = _mma_layout(BLOCK_N, HEAD_DIM, num_warps)  # dK, dV: keys × head_dim
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # one value per query (a column of Sᵀ): LSE, delta
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # one value per key
    # bytes landing on a stage's mbarrier: Q and dO tiles, LSE and delta rows. TMA counts the whole box, rows past N
    # (zero-filled) included.
    STAGE_BYTES: gl.constexpr = 2 * BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8 + 2 * BLOCK_M * 4
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    cols = gl.arange(0, BLOCK_M, layout=col_layout)
    keys = start_n + gl.arange(0, BLOCK_N, layout=row_layout)

    # The compiler puts a CTA barrier before each TMA copy and the mbarrier expect (they all write the stage's
    # mbarrier), and one before delta's read from shared memory (delta's copy wrote that buffer). This one, outside
    # the loop, clears the prologue's pending copies, which would otherwise cost one more inside it, at its top.
    gl.thread_barrier()
    for t in range(t0, t1):
        mbarrier.wait(ready.index(s), phase)  # tile t's Q, dO, LSE, delta have landed in stage s
        q_s = q_smem.index(s)
        do_s = do_smem.index(s)
        sT = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)  # Sᵀ = K Qᵀ
        if LEAN:
            # retire the previous step's dV, dK while Sᵀ runs, so that Pᵀ/dSᵀ's registers are free before dPᵀ's
            # accumulator is needed; then issue dPᵀ = V dOᵀ and wait for Sᵀ only
            dv, dk, dsT16 = warpgroup_mma_wait(1, deps=(dv, dk, dsT16))
            dpT = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            sT = warpgroup_mma_wait(1, deps=(sT,))
        else:
            # dPᵀ = V dOᵀ issued with Sᵀ; retire the previous step's dV, dK and this step's Sᵀ (dPᵀ may run on)
            dpT = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            sT, dv, dk, pT16, dsT16 = warpgroup_mma_wait(1, deps=(sT, dv, dk, pT16, dsT16))
        # stage s-1 is free: fetch tile t + STAGES - 1 into it (its LSE/delta were read by the previous step; the
        # compiler puts a CTA barrier before the copy for that)
        nt = t + STAGES - 1
        ns = s - 1
        if ns < 0:
            ns = STAGES - 1
        pred = nt < num_tiles
        row = lo + nt * BLOCK_M
        bar = ready.index(ns)
        mbarrier.expect(bar, STAGE_BYTES, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [row, 0], bar, q_smem.index(ns), pred=pred)
        tma.async_copy_global_to_shared(do_desc, [row, 0], bar, do_smem.index(ns), pred=pred)
        tma.async_copy_global_to_shared(lse_desc, [row], bar, lse_smem.index(ns), pred=pred)
        tma.async_copy_global_to_shared(delta_desc, [row], bar, delta_smem.index(ns), pred=pred)
        # Pᵀ = exp2(K Qᵀ · scale·log2e − LSE)   (while the tensor cores compute dPᵀ).
        # Rows past N: TMA fills LSE with 0 (not +inf), so Pᵀ = exp2(0) = 1 there; but their Q and dO rows read as 0
        # through TMA too, so they add exactly 0 to dV (Pᵀ dO) and to dK (dSᵀ = Pᵀ ∘ (V dOᵀ − delta) = 1 ∘ (0 − 0)).
        lse = lse_smem.index(s).load(col_layout)
        pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse, 0))
        if MASKED:  # diagonal tiles only: query i sees key j iff i >= j
            rows = lo + t * BLOCK_M + cols
            pT = gl.where(gl.expand_dims(rows, 0) >= gl.expand_dims(keys, 1), pT, 0.0)
        pT16 = gl.convert_layout(pT.to(dtype), a_layout)
        # dV += Pᵀ dO
        dv = warpgroup_mma(pT16, do_s, dv, is_async=True)
        if LEAN:  # wait for dV too: Pᵀ's bf16 registers are free before dSᵀ is built
            dpT, dv, pT16 = warpgroup_mma_wait(0, deps=(dpT, dv, pT16))
            dv = warpgroup_mma_init(dv)  # (the loop carries it as an accumulator)
        else:
            dpT = warpgroup_mma_wait(1, deps=(dpT,))
        # dSᵀ = Pᵀ ∘ (dPᵀ − delta)   (while dV's matmul runs, unless LEAN)
        delta = delta_smem.index(s).load(col_layout)
        dsT = pT * (dpT - gl.expand_dims(delta, 0))
        dsT16 = gl.convert_layout(dsT.to(dtype), a_layout)
        # dK += dSᵀ Q  (the softmax scale is applied once at the end)
        dk = warpgroup_mma(dsT16, q_s, dk, is_async=True)
        # next ring stage; the mbarrier phase flips each time the ring wraps
        s += 1
        if s == STAGES:
            s = 0
            phase ^= 1
    return s, phase, dk, dv, pT16, dsT16


@gluon.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                 stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                 stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                 stride_lse, stride_delta, H, N, qk_scale, sm_scale,
                 CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, LEAN: gl.constexpr):
    """dK, dV of one tile of BLOCK_N keys of one (batch, head) over its N queries. LSE, DELTA: (B·H) rows of N fp32
    values, row stride a multiple of 4 (16-byte aligned rows, for TMA)."""
    dtype: gl.constexpr = Q.dtype.element_ty
    num_warps: gl.constexpr = gl.num_warps()
    start_n = gl.program_id(0) * BLOCK_N
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)

    d_layout: gl.constexpr = _mma_layout(BLOCK_N, HEAD_DIM, num_warps)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    kv_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    qd_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    # 1-D fp32 rows: no swizzle (what Triton picks for its 1-D LSE/delta descriptors)
    row_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)

    # TMA descriptors over this head's rows (rows past N read as 0)
    k_desc = tma.make_tensor_descriptor(K + b * stride_kb + h * stride_kh, shape=[N, HEAD_DIM],
                                        strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_smem)
    v_desc = tma.make_tensor_descriptor(V + b * stride_vb + h * stride_vh, shape=[N, HEAD_DIM],
                                        strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_smem)
    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[N, HEAD_DIM],
                                        strides=[stride_qn, 1], block_shape=[BLOCK_M, HEAD_DIM], layout=qd_smem)
    do_desc = tma.make_tensor_descriptor(DO + b * stride_dob + h * stride_doh, shape=[N, HEAD_DIM],
                                         strides=[stride_don, 1], block_shape=[BLOCK_M, HEAD_DIM], layout=qd_smem)
    lse_desc = tma.make_tensor_descriptor(LSE + bh.to(gl.int64) * stride_lse, shape=[N], strides=[1],
                                          block_shape=[BLOCK_M], layout=row_smem)
    delta_desc = tma.make_tensor_descriptor(DELTA + bh.to(gl.int64) * stride_delta, shape=[N], strides=[1],
                                            block_shape=[BLOCK_M], layout=row_smem)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_smem)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_smem)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_smem)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_smem)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    # query tiles this key tile meets: causal from its own start (earlier queries cannot see it), else all
    if CAUSAL:
        lo = start_n
    else:
        lo = 0
    num_tiles = gl.cdiv(N - lo, BLOCK_M)
    STAGE_BYTES: gl.constexpr = 2 * BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8 + 2 * BLOCK_M * 4

    mbarrier.expect(kv_bar, 2 * BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8)
    tma.async_copy_global_to_shared(k_desc, [start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [start_n, 0], kv_bar, v_smem)
    for i in gl.static_range(STAGES - 1):  # prologue: the first STAGES-1 query tiles
        pred = i < num_tiles
        row = lo + i * BLOCK_M
        bar = ready.index(i)
        mbarrier.expect(bar, STAGE_BYTES, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [row, 0], bar, q_smem.index(i), pred=pred)
        tma.async_copy_global_to_shared(do_desc, [row, 0], bar, do_smem.index(i), pred=pred)
        tma.async_copy_global_to_shared(lse_desc, [row], bar, lse_smem.index(i), pred=pred)
        tma.async_copy_global_to_shared(delta_desc, [row], bar, delta_smem.index(i), pred=pred)
    mbarrier.wait(kv_bar, 0)

    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=d_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=d_layout))
    pT16 = gl.zeros([BLOCK_N, BLOCK_M], dtype, layout=a_layout)   # A operands of the dV/dK wgmmas in flight
    dsT16 = gl.zeros([BLOCK_N, BLOCK_M], dtype, layout=a_layout)
    s = gl.to_tensor(0)
    phase = gl.to_tensor(0)
    if CAUSAL:  # the first cdiv(BLOCK_N, BLOCK_M) query tiles cross the diagonal and get the mask; the rest see all keys
        n_diag = gl.minimum(num_tiles, (BLOCK_N + BLOCK_M - 1) // BLOCK_M)
        s, phase, dk, dv, pT16, dsT16 = _dkdv_tiles(
            0, n_diag, num_tiles, lo, s, phase, dk, dv, pT16, dsT16, k_smem, v_smem, q_smem, do_smem, lse_smem,
            delta_smem, ready, q_desc, do_desc, lse_desc, delta_desc, start_n, qk_scale,
            True, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, LEAN)
        s, phase, dk, dv, pT16, dsT16 = _dkdv_tiles(
            n_diag, num_tiles, num_tiles, lo, s, phase, dk, dv, pT16, dsT16, k_smem, v_smem, q_smem, do_smem,
            lse_smem, delta_smem, ready, q_desc, do_desc, lse_desc, delta_desc, start_n, qk_scale,
            False, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, LEAN)
    else:
        s, phase, dk, dv, pT16, dsT16 = _dkdv_tiles(
            0, num_tiles, num_tiles, lo, s, phase, dk, dv, pT16, dsT16, k_smem, v_smem, q_smem, do_smem, lse_smem,
            delta_smem, ready, q_desc, do_desc, lse_desc, delta_desc, start_n, qk_scale,
            False, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, LEAN)

    dk, dv, pT16, dsT16 = warpgroup_mma_wait(0, deps=(dk, dv, pT16, dsT16))
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    dk = dk * sm_scale  # dS was taken w.r.t. the scaled scores
    out_rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, d_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, d_layout))
    rows64 = gl.expand_dims(out_rows.to(gl.int64), 1)
    mask = gl.expand_dims(out_rows < N, 1)
    gl.store(DK + b * stride_dkb + h * stride_dkh + rows64 * stride_dkn + gl.expand_dims(out_cols, 0),
             dk.to(DK.dtype.element_ty), mask=mask)
    gl.store(DV + b * stride_dvb + h * stride_dvh + rows64 * stride_dvn + gl.expand_dims(out_cols, 0),
             dv.to(DV.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------
def _s3(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _alloc(size, alignment, stream):
    """Triton's scratch allocator for device-side TMA descriptors (128 bytes per descriptor and program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _empty_in_layout_of(t, dtype=None):
    """Copy of kernels/flash_attention.py's: an uninitialized (B, H, N, D) tensor laid out in memory like t, as
    (B, N, H, D) rows when t is a head-transposed view of a (B, N, ...) buffer, plain (B, H, N, D) otherwise."""
    B, H, N, D = t.shape
    dtype = t.dtype if dtype is None else dtype
    if t.stride(1) < t.stride(2):  # heads vary faster than positions: rows of (H, D)
        return torch.empty((B, N, H, D), dtype=dtype, device=t.device).transpose(1, 2)
    return torch.empty((B, H, N, D), dtype=dtype, device=t.device)


def _row_stride(t):
    """Copy of kernels/flash_attention.py's: the distance between the (b, h) rows of a (B, H, N) tensor addressed as
    t + (b·H + h)·stride + n, or None if t is not laid out so."""
    B, H, N = t.shape
    stride = t.stride(1) if H > 1 else t.stride(0)
    if (N > 1 and t.stride(2) != 1) or (B > 1 and H > 1 and t.stride(0) != H * stride):
        return None
    return stride


def _rows_for_tma(t):
    """(rows, row stride) of a (B, H, N) fp32 tensor such that every (b, h) row starts 16-byte aligned, as a 1-D TMA
    descriptor's base must. Used as is when it already does (N a multiple of 4, contiguous); otherwise copied into
    a (B, H, N rounded up to 4) buffer (a B·H·N·4-byte copy; the padding is never read: the descriptors have N rows)."""
    stride = _row_stride(t)
    if stride is not None and stride % 4 == 0 and t.data_ptr() % 16 == 0:
        return t, stride
    B, H, N = t.shape
    n_pad = (N + 3) // 4 * 4
    buf = torch.empty((B, H, n_pad), dtype=torch.float32, device=t.device)
    buf[:, :, :N].copy_(t)
    return buf, n_pad


def gluon_dkdv(do, q, k, v, lse, delta, causal, sm_scale, block_m=64, block_n=64, warps=4, stages=2, maxnreg=None,
               lean=False):
    """(dk, dv) in the memory layouts of k and v. q, k, v, do: bf16/fp16 (B, H, N, D), last dim contiguous, 16-byte
    aligned bases and row strides (TMA); lse, delta: (B, H, N) fp32."""
    B, H, N, D = q.shape
    assert k.shape == v.shape == do.shape == q.shape and D in (64, 128), "q, k, v, do: one (B, H, N, D), D 64/128"
    for name, t in (("q", q), ("k", k), ("v", v), ("do", do)):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(t.stride(i) * t.element_size() % 16 for i in range(3)):
            raise ValueError(f"gluon_dkdv: {name} must have a contiguous last dim and 16-byte aligned strides "
                             f"(TMA); strides {t.stride()}")
    dk, dv = _empty_in_layout_of(k), _empty_in_layout_of(v)
    lse, stride_lse = _rows_for_tma(lse)
    delta, stride_delta = _rows_for_tma(delta)
    triton.set_allocator(_alloc)  # per thread (a ContextVar): set on every launch
    _dkdv_kernel[(triton.cdiv(N, block_n), B * H)](
        q, k, v, do, lse, delta, dk, dv, *_s3(q), *_s3(k), *_s3(v), *_s3(do), *_s3(dk), *_s3(dv),
        stride_lse, stride_delta, H, N, sm_scale * LOG2E, sm_scale,
        causal, D, block_m, block_n, stages, lean, num_warps=warps, **({"maxnreg": maxnreg} if maxnreg else {}))
    return dk, dv

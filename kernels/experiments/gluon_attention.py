"""Issue 10 experiments D and E (kernels/NOTES.md): dK/dV, dQ and forward kernels in Gluon with asynchronous wgmma.
Kept in the history only; `gluon_attention_bench.py` beside it ran them on an H200 (fa_head = kernels/flash_attention.py
of that commit)."""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)


@gluon.constexpr_function
def _mma_layout(rows, cols, num_warps):
    """Accumulator layout of a (rows, cols) wgmma result: warps stacked along rows, the widest n."""
    n = 256
    while n > cols or cols % n:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _smem_layout(rows, cols, bits):
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16 if bits == 16 else gl.float16)


@gluon.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                 stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                 stride_dkb, stride_dkh, stride_dkn,
                 H, N, qk_scale, sm_scale,
                 CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    start_n = gl.program_id(0) * BLOCK_N
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)

    # register layouts: Sᵀ/dPᵀ tiles (keys × queries) and dK/dV accumulators (keys × head_dim)
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_M, num_warps)
    d_layout: gl.constexpr = _mma_layout(BLOCK_N, HEAD_DIM, num_warps)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # one value per query (a column of Sᵀ)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # one value per key
    kv_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    qd_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)

    # TMA descriptors over this head's rows
    k_desc = tma.make_tensor_descriptor(K + b * stride_kb + h * stride_kh, shape=[N, HEAD_DIM],
                                        strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_smem)
    v_desc = tma.make_tensor_descriptor(V + b * stride_vb + h * stride_vh, shape=[N, HEAD_DIM],
                                        strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_smem)
    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[N, HEAD_DIM],
                                        strides=[stride_qn, 1], block_shape=[BLOCK_M, HEAD_DIM], layout=qd_smem)
    do_desc = tma.make_tensor_descriptor(DO + b * stride_dob + h * stride_doh, shape=[N, HEAD_DIM],
                                         strides=[stride_don, 1], block_shape=[BLOCK_M, HEAD_DIM], layout=qd_smem)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_smem)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_smem)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_smem)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_smem)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    # query tiles this key tile meets: causal from its own start, else all
    if CAUSAL:
        lo = start_n
    else:
        lo = 0
    num_tiles = gl.cdiv(N - lo, BLOCK_M)
    tile_bytes: gl.constexpr = 2 * BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8

    mbarrier.expect(kv_bar, 2 * BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8)
    tma.async_copy_global_to_shared(k_desc, [start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [start_n, 0], kv_bar, v_smem)
    for i in gl.static_range(STAGES - 1):  # prologue: the first STAGES-1 query tiles
        pred = i < num_tiles
        mbarrier.expect(ready.index(i), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [lo + i * BLOCK_M, 0], ready.index(i), q_smem.index(i), pred=pred)
        tma.async_copy_global_to_shared(do_desc, [lo + i * BLOCK_M, 0], ready.index(i), do_smem.index(i), pred=pred)
    mbarrier.wait(kv_bar, 0)

    keys = start_n + gl.arange(0, BLOCK_N, layout=row_layout)
    cols = gl.arange(0, BLOCK_M, layout=col_layout)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=d_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=d_layout))
    pT16 = gl.zeros([BLOCK_N, BLOCK_M], dtype, layout=a_layout)   # operands of the matmuls still in flight
    dsT16 = gl.zeros([BLOCK_N, BLOCK_M], dtype, layout=a_layout)
    lse_base = LSE + bh.to(gl.int64) * N
    delta_base = DELTA + bh.to(gl.int64) * N

    for t in range(num_tiles):
        s = t % STAGES
        start_m = lo + t * BLOCK_M
        rows = start_m + cols
        row_ok = rows < N
        # rows past the end get LSE = +inf, so their probabilities are exactly 0
        lse = gl.load(lse_base + rows, mask=row_ok, other=float("inf"))
        delta = gl.load(delta_base + rows, mask=row_ok, other=0.0)
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        q_s = q_smem.index(s)
        do_s = do_smem.index(s)
        # Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, both issued now
        sT = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        # retire the previous tile's dV, dK and this tile's Sᵀ (dPᵀ may still run)
        sT, dv, dk, pT16, dsT16 = warpgroup_mma_wait(1, deps=(sT, dv, dk, pT16, dsT16))
        # the previous tile's stage is free: fetch tile t + STAGES - 1 into it
        nt = t + STAGES - 1
        ns = nt % STAGES
        pred = nt < num_tiles
        mbarrier.expect(ready.index(ns), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [lo + nt * BLOCK_M, 0], ready.index(ns), q_smem.index(ns), pred=pred)
        tma.async_copy_global_to_shared(do_desc, [lo + nt * BLOCK_M, 0], ready.index(ns), do_smem.index(ns),
                                        pred=pred)
        # Pᵀ = exp2(K Qᵀ · scale·log2e − LSE)   (while the tensor cores compute dPᵀ)
        pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse, 0))
        if CAUSAL:
            if start_m < start_n + BLOCK_N:  # diagonal tiles: query i sees key j only if i >= j
                pT = gl.where(gl.expand_dims(rows, 0) >= gl.expand_dims(keys, 1), pT, 0.0)
        pT16 = gl.convert_layout(pT.to(dtype), a_layout)
        # dV += Pᵀ dO
        dv = warpgroup_mma(pT16, do_s, dv, is_async=True)
        dpT = warpgroup_mma_wait(1, deps=(dpT,))
        # dSᵀ = Pᵀ ∘ (dPᵀ − delta)   (while dV's matmul runs)
        dsT = pT * (dpT - gl.expand_dims(delta, 0))
        dsT16 = gl.convert_layout(dsT.to(dtype), a_layout)
        # dK += dSᵀ Q  (the softmax scale is applied once at the end)
        dk = warpgroup_mma(dsT16, q_s, dk, is_async=True)

    dk, dv, pT16, dsT16 = warpgroup_mma_wait(0, deps=(dk, dv, pT16, dsT16))
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    dk = dk * sm_scale  # dS was taken w.r.t. the scaled scores
    out_rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, d_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, d_layout))
    offs = b * stride_dkb + h * stride_dkh + gl.expand_dims(out_rows.to(gl.int64), 1) * stride_dkn \
        + gl.expand_dims(out_cols, 0)
    mask = gl.expand_dims(out_rows < N, 1)
    gl.store(DK + offs, dk.to(dtype), mask=mask)
    gl.store(DV + offs, dv.to(dtype), mask=mask)


@gluon.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
               stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
               stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
               stride_dqb, stride_dqh, stride_dqn,
               H, N, qk_scale, sm_scale,
               CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    pid_m = gl.program_id(0)
    if CAUSAL:  # longest rows first
        pid_m = gl.num_programs(0) - 1 - pid_m
    start_m = pid_m * BLOCK_M
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)

    s_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)    # S, dP: queries × keys
    d_layout: gl.constexpr = _mma_layout(BLOCK_M, HEAD_DIM, num_warps)   # dQ
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    qd_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)

    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[N, HEAD_DIM],
                                        strides=[stride_qn, 1], block_shape=[BLOCK_M, HEAD_DIM], layout=qd_smem)
    do_desc = tma.make_tensor_descriptor(DO + b * stride_dob + h * stride_doh, shape=[N, HEAD_DIM],
                                         strides=[stride_don, 1], block_shape=[BLOCK_M, HEAD_DIM], layout=qd_smem)
    k_desc = tma.make_tensor_descriptor(K + b * stride_kb + h * stride_kh, shape=[N, HEAD_DIM],
                                        strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_smem)
    v_desc = tma.make_tensor_descriptor(V + b * stride_vb + h * stride_vh, shape=[N, HEAD_DIM],
                                        strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_smem)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], qd_smem)
    do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], qd_smem)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_smem)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_smem)
    qd_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(qd_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    if CAUSAL:
        hi = gl.minimum(start_m + BLOCK_M, N)
    else:
        hi = N
    num_tiles = gl.cdiv(hi, BLOCK_N)
    tile_bytes: gl.constexpr = 2 * BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8

    mbarrier.expect(qd_bar, 2 * BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8)
    tma.async_copy_global_to_shared(q_desc, [start_m, 0], qd_bar, q_smem)
    tma.async_copy_global_to_shared(do_desc, [start_m, 0], qd_bar, do_smem)
    for i in gl.static_range(STAGES - 1):
        pred = i < num_tiles
        mbarrier.expect(ready.index(i), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [i * BLOCK_N, 0], ready.index(i), k_smem.index(i), pred=pred)
        tma.async_copy_global_to_shared(v_desc, [i * BLOCK_N, 0], ready.index(i), v_smem.index(i), pred=pred)

    rows = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
    row_ok = rows < N
    lse = gl.load(LSE + bh.to(gl.int64) * N + rows, mask=row_ok, other=float("inf"))
    delta = gl.load(DELTA + bh.to(gl.int64) * N + rows, mask=row_ok, other=0.0)
    cols = gl.arange(0, BLOCK_N, layout=col_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    dq = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=d_layout))
    ds16 = gl.zeros([BLOCK_M, BLOCK_N], dtype, layout=a_layout)
    mbarrier.wait(qd_bar, 0)

    for t in range(num_tiles):
        s = t % STAGES
        start_n = t * BLOCK_N
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        k_s = k_smem.index(s)
        v_s = v_smem.index(s)
        # S = Q Kᵀ and dP = dO Vᵀ, both issued now
        st = warpgroup_mma(q_smem, k_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_smem, v_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        st, dq, ds16 = warpgroup_mma_wait(1, deps=(st, dq, ds16))
        nt = t + STAGES - 1
        ns = nt % STAGES
        pred = nt < num_tiles
        mbarrier.expect(ready.index(ns), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [nt * BLOCK_N, 0], ready.index(ns), k_smem.index(ns), pred=pred)
        tma.async_copy_global_to_shared(v_desc, [nt * BLOCK_N, 0], ready.index(ns), v_smem.index(ns), pred=pred)
        # P = exp2(Q Kᵀ · scale·log2e − LSE)   (while dP is computed)
        p = gl.exp2(st * qk_scale - gl.expand_dims(lse, 1))
        keys = start_n + cols
        if CAUSAL:
            if start_n + BLOCK_N > start_m:
                p = gl.where(gl.expand_dims(rows, 1) >= gl.expand_dims(keys, 0), p, 0.0)
        # keys past the end load as zeros, so they add nothing to dQ; their P must not be NaN: scores are 0 there
        dp = warpgroup_mma_wait(0, deps=(dp,))
        # dS = P ∘ (dP − delta);  dQ += dS K
        ds16 = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), a_layout)
        dq = warpgroup_mma(ds16, k_s, dq, is_async=True)

    dq, ds16 = warpgroup_mma_wait(0, deps=(dq, ds16))
    mbarrier.invalidate(qd_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    dq = dq * sm_scale
    out_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, d_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, d_layout))
    offs = b * stride_dqb + h * stride_dqh + gl.expand_dims(out_rows.to(gl.int64), 1) * stride_dqn \
        + gl.expand_dims(out_cols, 0)
    gl.store(DQ + offs, dq.to(dtype), mask=gl.expand_dims(out_rows < N, 1))


LOG2E = 1.4426950408889634


def _s3(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _alloc(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def gluon_dkdv(do, q, k, v, lse, delta, causal, sm_scale, block_m=64, block_n=64, warps=4, stages=2, maxnreg=None):
    from fa_head import _empty_in_layout_of
    B, H, N, D = q.shape
    dk, dv = _empty_in_layout_of(k), _empty_in_layout_of(v)
    triton.set_allocator(_alloc)
    _dkdv_kernel[(triton.cdiv(N, block_n), B * H)](
        q, k, v, do, lse, delta, dk, dv, *_s3(q), *_s3(k), *_s3(v), *_s3(do), *_s3(dk), H, N,
        sm_scale * LOG2E, sm_scale, causal, D, block_m, block_n, stages, num_warps=warps,
        **({'maxnreg': maxnreg} if maxnreg else {}))
    return dk, dv


def gluon_dq(do, q, k, v, lse, delta, causal, sm_scale, block_m=128, block_n=64, warps=8, stages=2):
    from fa_head import _empty_in_layout_of
    B, H, N, D = q.shape
    dq = _empty_in_layout_of(q)
    triton.set_allocator(_alloc)
    _dq_kernel[(triton.cdiv(N, block_m), B * H)](
        q, k, v, do, lse, delta, dq, *_s3(q), *_s3(k), *_s3(v), *_s3(do), *_s3(dq), H, N,
        sm_scale * LOG2E, sm_scale, causal, D, block_m, block_n, stages, num_warps=warps)
    return dq


@gluon.jit
def _fwd_kernel(Q, K, V, O, LSE,
                stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                H, N, qk_scale,
                CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Forward with the next tile's scores in flight during this tile's softmax: step j issues S_{j+1} = Q K_{j+1}ᵀ,
    then does the online softmax of S_j and issues acc += P_j V_j; the tensor cores never wait for the exponentials."""
    dtype: gl.constexpr = Q.dtype.element_ty
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    start_m = pid_m * BLOCK_M
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)

    s_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    o_layout: gl.constexpr = _mma_layout(BLOCK_M, HEAD_DIM, num_warps)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[N, HEAD_DIM],
                                        strides=[stride_qn, 1], block_shape=[BLOCK_M, HEAD_DIM], layout=q_sl)
    k_desc = tma.make_tensor_descriptor(K + b * stride_kb + h * stride_kh, shape=[N, HEAD_DIM],
                                        strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_sl)
    v_desc = tma.make_tensor_descriptor(V + b * stride_vb + h * stride_vh, shape=[N, HEAD_DIM],
                                        strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_sl)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_sl)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    if CAUSAL:
        hi = gl.minimum(start_m + BLOCK_M, N)
        full_tiles = start_m // BLOCK_N  # tiles left of the diagonal block: no mask
    else:
        hi = N
        full_tiles = N // BLOCK_N
    num_tiles = gl.cdiv(hi, BLOCK_N)
    tile_bytes: gl.constexpr = 2 * BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
    mbarrier.expect(q_bar, BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8)
    tma.async_copy_global_to_shared(q_desc, [start_m, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES - 1):
        pred = i < num_tiles
        mbarrier.expect(ready.index(i), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [i * BLOCK_N, 0], ready.index(i), k_smem.index(i), pred=pred)
        tma.async_copy_global_to_shared(v_desc, [i * BLOCK_N, 0], ready.index(i), v_smem.index(i), pred=pred)

    rows = start_m + gl.arange(0, BLOCK_M, layout=row_s)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    zero_o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    acc = zero_o
    pv = warpgroup_mma_init(zero_o)  # P_j V_j, added into acc at the next step (never rescaled in place:
    alpha_o = gl.full([BLOCK_M], 1.0, gl.float32, layout=row_o)  # ptxas serializes wgmma whose accumulator is
    p16 = gl.zeros([BLOCK_M, BLOCK_N], dtype, layout=p_layout)     # rewritten by other instructions mid-flight)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    # S_0 in flight before the loop
    mbarrier.wait(ready.index(0), 0)
    s_next = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)

    for j in range(num_tiles):
        st = j % STAGES
        # retire S_j (and the previous P V); S_j is the only matmul left in flight
        s_cur, pv, p16 = warpgroup_mma_wait(0, deps=(s_next, pv, p16))
        # acc_{j-1} = α_{j-1}·acc_{j-2} + P_{j-1} V_{j-1}
        acc = acc * gl.expand_dims(alpha_o, 1) + pv
        # the stage of tile j-1 is free (its P V is done): fetch tile j + STAGES - 1 into it
        nt = j + STAGES - 1
        ns = nt % STAGES
        pred = nt < num_tiles
        mbarrier.expect(ready.index(ns), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [nt * BLOCK_N, 0], ready.index(ns), k_smem.index(ns), pred=pred)
        tma.async_copy_global_to_shared(v_desc, [nt * BLOCK_N, 0], ready.index(ns), v_smem.index(ns), pred=pred)
        # issue S_{j+1} now, so the tensor cores work while this tile's softmax runs
        # (unconditionally: a wgmma under an `if` is made synchronous; past the last tile it reads a stale stage
        # and its result is never used)
        n1 = (j + 1) % STAGES
        mbarrier.wait(ready.index(n1), ((j + 1) // STAGES) & 1, pred=j + 1 < num_tiles)
        s_next = warpgroup_mma(q_smem, k_smem.index(n1).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        # online softmax of S_j (base 2):  m_new = max(m, rowmax(s));  p = exp2(s − m_new);  α = exp2(m − m_new)
        if j >= full_tiles:
            keys = j * BLOCK_N + cols
            visible = gl.expand_dims(keys, 0) < N
            if CAUSAL:
                visible = visible & (gl.expand_dims(rows, 1) >= gl.expand_dims(keys, 0))
            s_cur = gl.where(visible, s_cur, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s_cur, 1) * qk_scale)
        p = gl.exp2(s_cur * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        # P_j V_j into its own accumulator; acc takes it (rescaled by α_j) at the next step
        alpha_o = gl.convert_layout(alpha, row_o)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        pv = warpgroup_mma(p16, v_smem.index(st), zero_o, use_acc=False, is_async=True)

    s_next, pv, p16 = warpgroup_mma_wait(0, deps=(s_next, pv, p16))
    acc = acc * gl.expand_dims(alpha_o, 1) + pv
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    # o = acc / l;  LSE = m + log2(l)
    o = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    gl.store(LSE + bh.to(gl.int64) * N + rows, m_i + gl.log2(l_i), mask=rows < N)
    out_rows = start_m + gl.arange(0, BLOCK_M, layout=row_o)
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    offs = b * stride_ob + h * stride_oh + gl.expand_dims(out_rows.to(gl.int64), 1) * stride_on \
        + gl.expand_dims(out_cols, 0)
    gl.store(O + offs, o.to(dtype), mask=gl.expand_dims(out_rows < N, 1))


def gluon_fwd(q, k, v, causal, sm_scale, block_m=128, block_n=64, warps=8, stages=2):
    from fa_head import _empty_in_layout_of
    B, H, N, D = q.shape
    o = _empty_in_layout_of(q)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    triton.set_allocator(_alloc)
    _fwd_kernel[(triton.cdiv(N, block_m), B * H)](
        q, k, v, o, lse, *_s3(q), *_s3(k), *_s3(v), *_s3(o), H, N, sm_scale * LOG2E,
        causal, D, block_m, block_n, stages, num_warps=warps)
    return o, lse

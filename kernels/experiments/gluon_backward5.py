"""Issue 10 experiments F, F-WS and F-L (kernels/NOTES.md), kept in the history only. F: a 5-matmul backward in Gluon. The dK/dV kernel of experiment D also computes
dQᵀ_i += Kᵀ dSᵀ for every query tile it meets and adds it into an fp32 accumulator with a TMA bulk reduce-add;
no dQ kernel. dSᵀ goes to shared memory once and feeds both the dK and the dQ matmul. F-WS (`_bwd5ws_kernel`): the
same with dQ in a warpgroup of its own (gl.warp_specialize). F-L (`_bwd5l_kernel`): F with a 1-warp TMA loader
partition. DQ_MODE 1/2 are timing diagnostics (wrong dQ). Benches: bench_gluon_backward5.py (F, with experiment D's
kernel from commit ccf0b22 as gluon_bwd), bench_gluon_ws.py, bench_gluon_loader.py."""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
from triton._C.libtriton import ir


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """cp.reduce.async.bulk.tensor .add: global[coord] += shared tile (Gluon 3.6 has the op, not the wrapper)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.constexpr_function
def _mma_layout(rows, cols, num_warps):
    n = 256
    while n > cols or cols % n:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _dq_layout(rows, cols, num_warps):
    """dQᵀ (head_dim × queries): one warpgroup per 64 rows, further warpgroups split the queries."""
    wg = num_warps // 4
    n = 256
    while n > cols // wg or (cols // wg) % n:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, wg], instr_shape=[16, n, 16])


@gluon.jit
def _bwd5_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQA,
                 stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                 stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                 H, N, N_PAD, qk_scale, sm_scale,
                 CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, DQ_MODE: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    start_n = gl.program_id(0) * BLOCK_N
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)

    s_layout: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_M, num_warps)     # Sᵀ, dPᵀ: keys × queries
    d_layout: gl.constexpr = _mma_layout(BLOCK_N, HEAD_DIM, num_warps)    # dK, dV: keys × head_dim
    q_layout: gl.constexpr = _dq_layout(HEAD_DIM, BLOCK_M, num_warps)    # dQᵀ: head_dim × queries
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    kv_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    qd_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    ds_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    dqa_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_M], gl.float32)

    k_desc = tma.make_tensor_descriptor(K + b * stride_kb + h * stride_kh, shape=[N, HEAD_DIM],
                                        strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_smem)
    v_desc = tma.make_tensor_descriptor(V + b * stride_vb + h * stride_vh, shape=[N, HEAD_DIM],
                                        strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_smem)
    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[N, HEAD_DIM],
                                        strides=[stride_qn, 1], block_shape=[BLOCK_M, HEAD_DIM], layout=qd_smem)
    do_desc = tma.make_tensor_descriptor(DO + b * stride_dob + h * stride_doh, shape=[N, HEAD_DIM],
                                         strides=[stride_don, 1], block_shape=[BLOCK_M, HEAD_DIM], layout=qd_smem)
    # dQᵀ accumulator of this head: (head_dim, N) fp32, rows N_PAD apart
    dqa_desc = tma.make_tensor_descriptor(DQA + bh.to(gl.int64) * HEAD_DIM * N_PAD, shape=[HEAD_DIM, N],
                                          strides=[N_PAD, 1], block_shape=[HEAD_DIM, BLOCK_M], layout=dqa_sl)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_smem)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_smem)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_smem)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_smem)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_sl)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, HEAD_DIM, BLOCK_M], dqa_sl)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    if CAUSAL:
        lo = start_n
    else:
        lo = 0
    num_tiles = gl.cdiv(N - lo, BLOCK_M)
    tile_bytes: gl.constexpr = 2 * BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8

    mbarrier.expect(kv_bar, 2 * BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8)
    tma.async_copy_global_to_shared(k_desc, [start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [start_n, 0], kv_bar, v_smem)
    for i in gl.static_range(STAGES - 1):
        pred = i < num_tiles
        mbarrier.expect(ready.index(i), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [lo + i * BLOCK_M, 0], ready.index(i), q_smem.index(i), pred=pred)
        tma.async_copy_global_to_shared(do_desc, [lo + i * BLOCK_M, 0], ready.index(i), do_smem.index(i), pred=pred)
    mbarrier.wait(kv_bar, 0)

    keys = start_n + gl.arange(0, BLOCK_N, layout=row_layout)
    cols = gl.arange(0, BLOCK_M, layout=col_layout)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    zero_q = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, layout=q_layout)
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=d_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=d_layout))
    pT16 = gl.zeros([BLOCK_N, BLOCK_M], dtype, layout=a_layout)
    lse_base = LSE + bh.to(gl.int64) * N
    delta_base = DELTA + bh.to(gl.int64) * N

    for t in range(num_tiles):
        s = t % STAGES
        start_m = lo + t * BLOCK_M
        rows = start_m + cols
        row_ok = rows < N
        lse = gl.load(lse_base + rows, mask=row_ok, other=float("inf"))
        delta = gl.load(delta_base + rows, mask=row_ok, other=0.0)
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        q_s = q_smem.index(s)
        do_s = do_smem.index(s)
        # Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, both issued now
        sT = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        # retire the previous tile's dK and this tile's Sᵀ (dPᵀ may still run)
        sT, dk, dv, pT16 = warpgroup_mma_wait(1, deps=(sT, dk, dv, pT16))
        nt = t + STAGES - 1
        ns = nt % STAGES
        pred = nt < num_tiles
        mbarrier.expect(ready.index(ns), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [lo + nt * BLOCK_M, 0], ready.index(ns), q_smem.index(ns), pred=pred)
        tma.async_copy_global_to_shared(do_desc, [lo + nt * BLOCK_M, 0], ready.index(ns), do_smem.index(ns),
                                        pred=pred)
        # Pᵀ = exp2(K Qᵀ · scale·log2e − LSE)
        pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse, 0))
        if CAUSAL:
            if start_m < start_n + BLOCK_N:
                pT = gl.where(gl.expand_dims(rows, 0) >= gl.expand_dims(keys, 1), pT, 0.0)
        pT16 = gl.convert_layout(pT.to(dtype), a_layout)
        # dV += Pᵀ dO
        dv = warpgroup_mma(pT16, do_s, dv, is_async=True)
        dpT = warpgroup_mma_wait(1, deps=(dpT,))
        # dSᵀ = Pᵀ ∘ (dPᵀ − delta), once into shared memory for both matmuls below
        dsT = pT * (dpT - gl.expand_dims(delta, 0))
        ds_smem.store(dsT.to(dtype))
        fence_async_shared()
        # dQᵀ = Kᵀ dSᵀ, then dK += dSᵀ Q  (softmax scale applied once at the end). dQᵀ is waited for within the
        # step: ptxas serializes every wgmma of the loop if a result is read by other instructions one step later
        if DQ_MODE < 2:
            dqT = warpgroup_mma(k_smem.permute((1, 0)), ds_smem, zero_q, use_acc=False, is_async=True)
        dk = warpgroup_mma(ds_smem, q_s, dk, is_async=True)
        if DQ_MODE < 2:
            dqT = warpgroup_mma_wait(1, deps=(dqT,))  # (dV is done too; dK may still run)
            # dQ_acc[:, this tile] += dQᵀ, by the TMA unit while we go on (the staging buffer is free once the
            # reduce before last has read it)
            buf = dq_smem.index(t % 2)
            tma.store_wait(1)
            buf.store(dqT)
            fence_async_shared()
            if DQ_MODE == 0:
                tma_reduce_add(dqa_desc, [0, start_m], buf)

    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    tma.store_wait(0)
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    dk = dk * sm_scale
    out_rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, d_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, d_layout))
    rows64 = gl.expand_dims(out_rows.to(gl.int64), 1)
    mask = gl.expand_dims(out_rows < N, 1)
    gl.store(DK + b * stride_dkb + h * stride_dkh + rows64 * stride_dkn + gl.expand_dims(out_cols, 0),
             dk.to(dtype), mask=mask)
    gl.store(DV + b * stride_dvb + h * stride_dvh + rows64 * stride_dvn + gl.expand_dims(out_cols, 0),
             dv.to(dtype), mask=mask)


LOG2E = 1.4426950408889634


def _s3(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _alloc(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def gluon_bwd5(do, q, k, v, lse, delta, causal, sm_scale, block_m=64, block_n=64, warps=4, stages=2, dq_mode=0):
    """dq, dk, dv from one kernel (plus the fp32 → dtype cast of dQ). do/lse/delta as launch_backward_delta gives."""
    from minigpt_kernels.flash_attention import _empty_in_layout_of
    B, H, N, D = q.shape
    dk, dv = _empty_in_layout_of(k), _empty_in_layout_of(v)
    n_pad = (N + 3) // 4 * 4
    dqa = torch.zeros((B, H, D, n_pad), dtype=torch.float32, device=q.device)
    triton.set_allocator(_alloc)
    _bwd5_kernel[(triton.cdiv(N, block_n), B * H)](
        q, k, v, do, lse, delta, dk, dv, dqa, *_s3(q), *_s3(k), *_s3(v), *_s3(do), *_s3(dk), *_s3(dv),
        H, N, n_pad, sm_scale * LOG2E, sm_scale, causal, D, block_m, block_n, stages, dq_mode, num_warps=warps)
    dq = _empty_in_layout_of(q)
    dq.copy_(dqa[..., :N].transpose(-1, -2) * sm_scale)
    return dq, dk, dv


# ---- F-WS: the same backward with dQ in its own warpgroup (gl.warp_specialize) ----
@gluon.jit
def _ws_main(q_desc, do_desc, q_smem, do_smem, k_smem, v_smem, ds_smem, ready, ds_ready, ds_free,
             LSE, DELTA, bh, N, start_n, lo, num_tiles, qk_scale,
             CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, num_warps: gl.constexpr):
    """dK, dV of one key tile: Sᵀ, dPᵀ, dV += Pᵀ dO, dSᵀ into shared memory (handed to the dQ warpgroup), dK += dSᵀ Q."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_M, num_warps)
    d_layout: gl.constexpr = _mma_layout(BLOCK_N, HEAD_DIM, num_warps)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    tile_bytes: gl.constexpr = 2 * BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8

    keys = start_n + gl.arange(0, BLOCK_N, layout=row_layout)
    cols = gl.arange(0, BLOCK_M, layout=col_layout)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=d_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=d_layout))
    pT16 = gl.zeros([BLOCK_N, BLOCK_M], dtype, layout=a_layout)
    lse_base = LSE + bh.to(gl.int64) * N
    delta_base = DELTA + bh.to(gl.int64) * N
    for t in range(num_tiles):
        s = t % STAGES
        b = t % 2
        start_m = lo + t * BLOCK_M
        rows = start_m + cols
        row_ok = rows < N
        lse = gl.load(lse_base + rows, mask=row_ok, other=float("inf"))
        delta = gl.load(delta_base + rows, mask=row_ok, other=0.0)
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        q_s = q_smem.index(s)
        do_s = do_smem.index(s)
        sT = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        sT, dk, dv, pT16 = warpgroup_mma_wait(1, deps=(sT, dk, dv, pT16))
        nt = t + STAGES - 1
        ns = nt % STAGES
        pred = nt < num_tiles
        mbarrier.expect(ready.index(ns), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [lo + nt * BLOCK_M, 0], ready.index(ns), q_smem.index(ns), pred=pred)
        tma.async_copy_global_to_shared(do_desc, [lo + nt * BLOCK_M, 0], ready.index(ns), do_smem.index(ns),
                                        pred=pred)
        pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse, 0))
        if CAUSAL:
            if start_m < start_n + BLOCK_N:
                pT = gl.where(gl.expand_dims(rows, 0) >= gl.expand_dims(keys, 1), pT, 0.0)
        pT16 = gl.convert_layout(pT.to(dtype), a_layout)
        dv = warpgroup_mma(pT16, do_s, dv, is_async=True)
        dpT = warpgroup_mma_wait(1, deps=(dpT,))
        dsT = pT * (dpT - gl.expand_dims(delta, 0))
        # dSᵀ into buffer b once the dQ warpgroup has read what was there two tiles ago
        mbarrier.wait(ds_free.index(b), ((t // 2) & 1) ^ 1)
        ds_smem.index(b).store(dsT.to(dtype))
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(b), count=1)
        dk = warpgroup_mma(ds_smem.index(b), q_s, dk, is_async=True)
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    return dk, dv


@gluon.jit
def _ws_dq(k_smem, ds_smem, dq_smem, kv_bar, ds_ready, ds_free, dqa_desc, lo, num_tiles,
           HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """dQᵀ = Kᵀ dSᵀ for each query tile, added into the fp32 accumulator by a TMA reduce."""
    q_layout: gl.constexpr = _mma_layout(HEAD_DIM, BLOCK_M, 4)
    zero_q = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, layout=q_layout)
    mbarrier.wait(kv_bar, 0)
    for t in range(num_tiles):
        b = t % 2
        mbarrier.wait(ds_ready.index(b), (t // 2) & 1)
        dqT = warpgroup_mma(k_smem.permute((1, 0)), ds_smem.index(b), zero_q, use_acc=False, is_async=True)
        dqT = warpgroup_mma_wait(0, deps=(dqT,))
        mbarrier.arrive(ds_free.index(b), count=1)
        buf = dq_smem.index(b)
        tma.store_wait(1)
        buf.store(dqT)
        fence_async_shared()
        tma_reduce_add(dqa_desc, [0, lo + t * BLOCK_M], buf)
    tma.store_wait(0)


@gluon.jit
def _bwd5ws_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQA,
                   stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                   stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                   H, N, N_PAD, qk_scale, sm_scale,
                   CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, DQ_REGS: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    start_n = gl.program_id(0) * BLOCK_N
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    d_layout: gl.constexpr = _mma_layout(BLOCK_N, HEAD_DIM, num_warps)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    qd_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    ds_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    dqa_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_M], gl.float32)
    k_desc = tma.make_tensor_descriptor(K + b * stride_kb + h * stride_kh, shape=[N, HEAD_DIM],
                                        strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_sl)
    v_desc = tma.make_tensor_descriptor(V + b * stride_vb + h * stride_vh, shape=[N, HEAD_DIM],
                                        strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_sl)
    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[N, HEAD_DIM],
                                        strides=[stride_qn, 1], block_shape=[BLOCK_M, HEAD_DIM], layout=qd_sl)
    do_desc = tma.make_tensor_descriptor(DO + b * stride_dob + h * stride_doh, shape=[N, HEAD_DIM],
                                         strides=[stride_don, 1], block_shape=[BLOCK_M, HEAD_DIM], layout=qd_sl)
    dqa_desc = tma.make_tensor_descriptor(DQA + bh.to(gl.int64) * HEAD_DIM * N_PAD, shape=[HEAD_DIM, N],
                                          strides=[N_PAD, 1], block_shape=[HEAD_DIM, BLOCK_M], layout=dqa_sl)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_sl)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_sl)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_sl)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_sl)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_sl)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, HEAD_DIM, BLOCK_M], dqa_sl)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=1)
        mbarrier.init(ds_free.index(i), count=1)
    fence_async_shared()

    if CAUSAL:
        lo = start_n
    else:
        lo = 0
    num_tiles = gl.cdiv(N - lo, BLOCK_M)
    tile_bytes: gl.constexpr = 2 * BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8
    mbarrier.expect(kv_bar, 2 * BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8)
    tma.async_copy_global_to_shared(k_desc, [start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [start_n, 0], kv_bar, v_smem)
    for i in gl.static_range(STAGES - 1):
        pred = i < num_tiles
        mbarrier.expect(ready.index(i), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(q_desc, [lo + i * BLOCK_M, 0], ready.index(i), q_smem.index(i), pred=pred)
        tma.async_copy_global_to_shared(do_desc, [lo + i * BLOCK_M, 0], ready.index(i), do_smem.index(i), pred=pred)
    mbarrier.wait(kv_bar, 0)

    dk, dv = gl.warp_specialize([
        (_ws_main, (q_desc, do_desc, q_smem, do_smem, k_smem, v_smem, ds_smem, ready, ds_ready, ds_free,
                    LSE, DELTA, bh, N, start_n, lo, num_tiles, qk_scale,
                    CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, num_warps)),
        (_ws_dq, (k_smem, ds_smem, dq_smem, kv_bar, ds_ready, ds_free, dqa_desc, lo, num_tiles,
                  HEAD_DIM, BLOCK_M, BLOCK_N)),
    ], [4], [DQ_REGS])

    dk = dk * sm_scale
    out_rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, d_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, d_layout))
    rows64 = gl.expand_dims(out_rows.to(gl.int64), 1)
    mask = gl.expand_dims(out_rows < N, 1)
    gl.store(DK + b * stride_dkb + h * stride_dkh + rows64 * stride_dkn + gl.expand_dims(out_cols, 0),
             dk.to(dtype), mask=mask)
    gl.store(DV + b * stride_dvb + h * stride_dvh + rows64 * stride_dvn + gl.expand_dims(out_cols, 0),
             dv.to(dtype), mask=mask)


def gluon_bwd5ws(do, q, k, v, lse, delta, causal, sm_scale, block_m=32, block_n=64, stages=2, maxnreg=128,
                 dq_regs=96):
    from minigpt_kernels.flash_attention import _empty_in_layout_of
    B, H, N, D = q.shape
    dk, dv = _empty_in_layout_of(k), _empty_in_layout_of(v)
    n_pad = (N + 3) // 4 * 4
    dqa = torch.zeros((B, H, D, n_pad), dtype=torch.float32, device=q.device)
    triton.set_allocator(_alloc)
    _bwd5ws_kernel[(triton.cdiv(N, block_n), B * H)](
        q, k, v, do, lse, delta, dk, dv, dqa, *_s3(q), *_s3(k), *_s3(v), *_s3(do), *_s3(dk), *_s3(dv),
        H, N, n_pad, sm_scale * LOG2E, sm_scale, causal, D, block_m, block_n, stages, dq_regs, num_warps=4,
        maxnreg=maxnreg)
    dq = _empty_in_layout_of(q)
    dq.copy_(dqa[..., :N].transpose(-1, -2) * sm_scale)
    return dq, dk, dv


# ---- F-L: F with a 1-warp loader partition (no CTA barrier on Q/dO refills); dQ stays in the main loop ----
@gluon.jit
def _fl_load(q_desc, do_desc, q_smem, do_smem, ready, empty, lo, num_tiles,
             BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    tile_bytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
    for t in range(num_tiles):
        s = t % STAGES
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), tile_bytes)
        tma.async_copy_global_to_shared(q_desc, [lo + t * BLOCK_M, 0], ready.index(s), q_smem.index(s))
        tma.async_copy_global_to_shared(do_desc, [lo + t * BLOCK_M, 0], ready.index(s), do_smem.index(s))


@gluon.jit
def _fl_main(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, ready, empty, dqa_desc,
             LSE, DELTA, bh, N, start_n, lo, num_tiles, qk_scale,
             CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_M, num_warps)
    d_layout: gl.constexpr = _mma_layout(BLOCK_N, HEAD_DIM, num_warps)
    q_layout: gl.constexpr = _dq_layout(HEAD_DIM, BLOCK_M, num_warps)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    keys = start_n + gl.arange(0, BLOCK_N, layout=row_layout)
    cols = gl.arange(0, BLOCK_M, layout=col_layout)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    zero_q = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, layout=q_layout)
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=d_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=d_layout))
    pT16 = gl.zeros([BLOCK_N, BLOCK_M], dtype, layout=a_layout)
    lse_base = LSE + bh.to(gl.int64) * N
    delta_base = DELTA + bh.to(gl.int64) * N
    for t in range(num_tiles):
        s = t % STAGES
        start_m = lo + t * BLOCK_M
        rows = start_m + cols
        row_ok = rows < N
        lse = gl.load(lse_base + rows, mask=row_ok, other=float("inf"))
        delta = gl.load(delta_base + rows, mask=row_ok, other=0.0)
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        q_s = q_smem.index(s)
        do_s = do_smem.index(s)
        sT = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        sT, dk, dv, pT16 = warpgroup_mma_wait(1, deps=(sT, dk, dv, pT16))
        # the previous tile's dK (the last reader of its Q) is retired: its stage goes back to the loader
        mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1, pred=t > 0)
        pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse, 0))
        if CAUSAL:
            if start_m < start_n + BLOCK_N:
                pT = gl.where(gl.expand_dims(rows, 0) >= gl.expand_dims(keys, 1), pT, 0.0)
        pT16 = gl.convert_layout(pT.to(dtype), a_layout)
        dv = warpgroup_mma(pT16, do_s, dv, is_async=True)
        dpT = warpgroup_mma_wait(1, deps=(dpT,))
        dsT = pT * (dpT - gl.expand_dims(delta, 0))
        ds_smem.store(dsT.to(dtype))
        fence_async_shared()
        dqT = warpgroup_mma(k_smem.permute((1, 0)), ds_smem, zero_q, use_acc=False, is_async=True)
        dk = warpgroup_mma(ds_smem, q_s, dk, is_async=True)
        dqT = warpgroup_mma_wait(1, deps=(dqT,))
        buf = dq_smem.index(t % 2)
        tma.store_wait(1)
        buf.store(dqT)
        fence_async_shared()
        tma_reduce_add(dqa_desc, [0, start_m], buf)
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    tma.store_wait(0)
    return dk, dv


@gluon.jit
def _bwd5l_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQA,
                  stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                  stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                  H, N, N_PAD, qk_scale, sm_scale,
                  CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    start_n = gl.program_id(0) * BLOCK_N
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    d_layout: gl.constexpr = _mma_layout(BLOCK_N, HEAD_DIM, num_warps)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    qd_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    ds_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    dqa_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_M], gl.float32)
    k_desc = tma.make_tensor_descriptor(K + b * stride_kb + h * stride_kh, shape=[N, HEAD_DIM],
                                        strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_sl)
    v_desc = tma.make_tensor_descriptor(V + b * stride_vb + h * stride_vh, shape=[N, HEAD_DIM],
                                        strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_sl)
    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[N, HEAD_DIM],
                                        strides=[stride_qn, 1], block_shape=[BLOCK_M, HEAD_DIM], layout=qd_sl)
    do_desc = tma.make_tensor_descriptor(DO + b * stride_dob + h * stride_doh, shape=[N, HEAD_DIM],
                                         strides=[stride_don, 1], block_shape=[BLOCK_M, HEAD_DIM], layout=qd_sl)
    dqa_desc = tma.make_tensor_descriptor(DQA + bh.to(gl.int64) * HEAD_DIM * N_PAD, shape=[HEAD_DIM, N],
                                          strides=[N_PAD, 1], block_shape=[HEAD_DIM, BLOCK_M], layout=dqa_sl)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_sl)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_sl)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_sl)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_sl)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_sl)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, HEAD_DIM, BLOCK_M], dqa_sl)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    if CAUSAL:
        lo = start_n
    else:
        lo = 0
    num_tiles = gl.cdiv(N - lo, BLOCK_M)
    mbarrier.expect(kv_bar, 2 * BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8)
    tma.async_copy_global_to_shared(k_desc, [start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [start_n, 0], kv_bar, v_smem)
    mbarrier.wait(kv_bar, 0)
    dk, dv = gl.warp_specialize([
        (_fl_main, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, ready, empty, dqa_desc,
                    LSE, DELTA, bh, N, start_n, lo, num_tiles, qk_scale,
                    CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, num_warps)),
        (_fl_load, (q_desc, do_desc, q_smem, do_smem, ready, empty, lo, num_tiles, BLOCK_M, STAGES)),
    ], [1], [24])
    dk = dk * sm_scale
    out_rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, d_layout))
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, d_layout))
    rows64 = gl.expand_dims(out_rows.to(gl.int64), 1)
    mask = gl.expand_dims(out_rows < N, 1)
    gl.store(DK + b * stride_dkb + h * stride_dkh + rows64 * stride_dkn + gl.expand_dims(out_cols, 0),
             dk.to(dtype), mask=mask)
    gl.store(DV + b * stride_dvb + h * stride_dvh + rows64 * stride_dvn + gl.expand_dims(out_cols, 0),
             dv.to(dtype), mask=mask)


def gluon_bwd5l(do, q, k, v, lse, delta, causal, sm_scale, block_m=64, block_n=128, warps=8, stages=2, maxnreg=None):
    from minigpt_kernels.flash_attention import _empty_in_layout_of
    B, H, N, D = q.shape
    dk, dv = _empty_in_layout_of(k), _empty_in_layout_of(v)
    n_pad = (N + 3) // 4 * 4
    dqa = torch.zeros((B, H, D, n_pad), dtype=torch.float32, device=q.device)
    triton.set_allocator(_alloc)
    _bwd5l_kernel[(triton.cdiv(N, block_n), B * H)](
        q, k, v, do, lse, delta, dk, dv, dqa, *_s3(q), *_s3(k), *_s3(v), *_s3(do), *_s3(dk), *_s3(dv),
        H, N, n_pad, sm_scale * LOG2E, sm_scale, causal, D, block_m, block_n, stages, num_warps=warps,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    dq = _empty_in_layout_of(q)
    dq.copy_(dqa[..., :N].transpose(-1, -2) * sm_scale)
    return dq, dk, dv

"""Issue 10, session 23: a 5-matmul causal backward on P's warp-specialized dK/dV kernel (NOTES next step 1).

The two consumers of flash_backward_specialized's dK/dV kernel also hand dSᵀ_t (64 keys × 64 queries each) to shared
memory; a third warpgroup computes dQ_t = dS_t K (M = 64 queries, K = 128 keys: both consumers' keys) and adds it into
a zeroed fp32 (B, H, N, D) accumulator with a TMA reduce-add (cp.reduce.async.bulk.tensor.add). No dQ kernel.
"""
from __future__ import annotations

import torch
import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from minigpt_kernels.flash_attention import _strides3
from minigpt_kernels.flash_backward_specialized import CONSUMERS, TILE, _dkdv_producer
from minigpt_kernels.flash_forward_pingpong import _head_rows, _mma_layout


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """cp.reduce.async.bulk.tensor .add: global[coord] += shared tile (Gluon 3.6 has the op, not the wrapper)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _pT_dsT(sT, dpT, lse_smem, delta_smem, keys, rows, masked, qk_scale, dtype: gl.constexpr):
    col_layout: gl.constexpr = gl.SliceLayout(0, sT.type.layout)
    pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse_smem.load(col_layout), 0))
    if masked:
        pT = gl.where(gl.expand_dims(rows, 0) >= gl.expand_dims(keys, 1), pT, 0.0)
    dsT = pT * (dpT - gl.expand_dims(delta_smem.load(col_layout), 0))
    return pT.to(dtype), dsT.to(dtype)


@gluon.jit
def _hand_over(ds_smem, ds_ready, ds_free, dsT16, t, ME: gl.constexpr):
    """dSᵀ_t of this consumer into buffer t % DS_BUFS for the dQ warpgroup, once it has read what was there."""
    DS_BUFS: gl.constexpr = ds_ready.shape[0]
    u = t % DS_BUFS
    mbarrier.wait(ds_free.index(u), ((t // DS_BUFS) & 1) ^ 1)
    ds_smem.index(u * CONSUMERS + ME).store(dsT16)
    fence_async_shared()
    mbarrier.arrive(ds_ready.index(u), count=1)


@gluon.jit
def _consumer5(shared, ME: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, ready, empty, ds_smem, ds_ready, ds_free,
     DK, DV, b, h, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
     N, start_n, num_tiles, qk_scale, sm_scale) = shared
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, 4)
    d_layout: gl.constexpr = _mma_layout(HEAD_DIM, 4)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    MASKED_TILES: gl.constexpr = (TILE * (ME + 1) + BLOCK_M - 1) // BLOCK_M
    key0 = start_n + ME * TILE
    keys = key0 + gl.arange(0, TILE, layout=gl.SliceLayout(1, s_layout))
    cols = start_n + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([TILE, BLOCK_M], gl.float32, layout=s_layout)
    dk = gl.zeros([TILE, HEAD_DIM], gl.float32, layout=d_layout)
    dv = gl.zeros([TILE, HEAD_DIM], gl.float32, layout=d_layout)
    k = k_smem.index(ME)
    v = v_smem.index(ME)
    mbarrier.wait(kv_ready.index(ME), 0)

    mbarrier.wait(ready.index(0), 0)
    sT = warpgroup_mma(k, q_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dpT = warpgroup_mma(v, do_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    sT, dpT = warpgroup_mma_wait(0, deps=(sT, dpT))
    pT16, dsT16 = _pT_dsT(sT, dpT, lse_smem.index(0), delta_smem.index(0), keys, cols, 0 < MASKED_TILES, qk_scale,
                          dtype)
    _hand_over(ds_smem, ds_ready, ds_free, dsT16, 0, ME)
    pT16 = gl.convert_layout(pT16, a_layout)
    dsT16 = gl.convert_layout(dsT16, a_layout)

    for t in range(1, num_tiles):
        stage = t % STAGES
        prev = (t - 1) % STAGES
        mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
        sT = warpgroup_mma(k, q_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v, do_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dv = warpgroup_mma(pT16, do_smem.index(prev), dv, is_async=True)
        dk = warpgroup_mma(dsT16, q_smem.index(prev), dk, is_async=True)
        sT, dpT = warpgroup_mma_wait(2, deps=(sT, dpT))
        pT16_t, dsT16_t = _pT_dsT(sT, dpT, lse_smem.index(stage), delta_smem.index(stage), keys, cols + t * BLOCK_M,
                                  t < MASKED_TILES, qk_scale, dtype)
        _hand_over(ds_smem, ds_ready, ds_free, dsT16_t, t, ME)
        dv, dk, pT16, dsT16 = warpgroup_mma_wait(0, deps=(dv, dk, pT16, dsT16))
        mbarrier.arrive(empty.index(prev), count=1)
        pT16 = gl.convert_layout(pT16_t, a_layout)
        dsT16 = gl.convert_layout(dsT16_t, a_layout)

    last = (num_tiles - 1) % STAGES
    dv = warpgroup_mma(pT16, do_smem.index(last), dv, is_async=True)
    dk = warpgroup_mma(dsT16, q_smem.index(last), dk, is_async=True)
    dv, dk, pT16, dsT16 = warpgroup_mma_wait(0, deps=(dv, dk, pT16, dsT16))

    dk = dk * sm_scale
    out_keys = key0 + gl.arange(0, TILE, layout=gl.SliceLayout(1, d_layout))
    out_cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, d_layout)), 0)
    rows64 = gl.expand_dims(out_keys.to(gl.int64), 1)
    mask = gl.expand_dims(out_keys < N, 1)
    gl.store(DK + b * stride_dkb + h * stride_dkh + rows64 * stride_dkn + out_cols, dk.to(DK.dtype.element_ty),
             mask=mask)
    gl.store(DV + b * stride_dvb + h * stride_dvh + rows64 * stride_dvn + out_cols, dv.to(DV.dtype.element_ty),
             mask=mask)


@gluon.jit
def _store_reduce(acc, dq_smem, dq_desc, row, t, sm_scale):
    """dQ tile (rows row ...) · scale into staging buffer t % DQ_BUFS, then TMA reduce-add into the accumulator."""
    DQ_BUFS: gl.constexpr = dq_smem.shape[0]
    buf = dq_smem.index(t % DQ_BUFS)
    tma.store_wait(DQ_BUFS - 1)  # the reduce issued from this buffer DQ_BUFS tiles ago has read it
    buf.store(acc * sm_scale)
    fence_async_shared()
    tma_reduce_add(dq_desc, [row, 0], buf)


@gluon.jit
def _dq_partial(dqs, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, REDUCE: gl.constexpr, PIPE: gl.constexpr):
    """dQ_t = scale · dS_t K over the program's 128 keys, added into the fp32 accumulator (TMA reduce-add).
    PIPE: tile t−1's store and reduce are issued while tile t's matmul runs."""
    (k_smem, ds_smem, dq_smem, kv_ready, ds_ready, ds_free, dq_desc, start_n, num_tiles, sm_scale) = dqs
    DS_BUFS: gl.constexpr = ds_ready.shape[0]
    q_layout: gl.constexpr = _mma_layout(HEAD_DIM, 4)
    zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=q_layout)
    prev = zero
    for c in gl.static_range(CONSUMERS):
        mbarrier.wait(kv_ready.index(c), 0)
    for t in range(num_tiles):
        u = t % DS_BUFS
        mbarrier.wait(ds_ready.index(u), (t // DS_BUFS) & 1)
        acc = warpgroup_mma(ds_smem.index(u * CONSUMERS).permute((1, 0)), k_smem.index(0), zero, use_acc=False,
                            is_async=True)
        acc = warpgroup_mma(ds_smem.index(u * CONSUMERS + 1).permute((1, 0)), k_smem.index(1), acc, is_async=True)
        if PIPE:
            if t > 0:
                if REDUCE:
                    _store_reduce(prev, dq_smem, dq_desc, start_n + (t - 1) * BLOCK_M, t - 1, sm_scale)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(ds_free.index(u), count=1)
        if PIPE:
            prev = acc
        else:
            if REDUCE:
                _store_reduce(acc, dq_smem, dq_desc, start_n + t * BLOCK_M, t, sm_scale)
    if PIPE:
        if REDUCE:
            if num_tiles > 0:
                _store_reduce(prev, dq_smem, dq_desc, start_n + (num_tiles - 1) * BLOCK_M, num_tiles - 1, sm_scale)
    tma.store_wait(0)


@gluon.jit
def _dkdvdq_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQA,
                   stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                   stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                   stride_dqb, stride_dqh, stride_dqn,
                   stride_lse, stride_delta, H, N, qk_scale, sm_scale,
                   HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, DQ_REGS: gl.constexpr,
                   REDUCE: gl.constexpr, PIPE: gl.constexpr, DS_BUFS: gl.constexpr, DQ_BUFS: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    start_n = gl.program_id(0) * (CONSUMERS * TILE)
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, HEAD_DIM], dtype)
    qd_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, BLOCK_M], dtype)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.float32)
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    k_desc = _head_rows(K, b, h, stride_kb, stride_kh, stride_kn, N, TILE, HEAD_DIM, kv_layout)
    v_desc = _head_rows(V, b, h, stride_vb, stride_vh, stride_vn, N, TILE, HEAD_DIM, kv_layout)
    q_desc = _head_rows(Q, b, h, stride_qb, stride_qh, stride_qn, N, BLOCK_M, HEAD_DIM, qd_layout)
    do_desc = _head_rows(DO, b, h, stride_dob, stride_doh, stride_don, N, BLOCK_M, HEAD_DIM, qd_layout)
    dq_desc = _head_rows(DQA, b, h, stride_dqb, stride_dqh, stride_dqn, N, BLOCK_M, HEAD_DIM, dq_layout)
    lse_desc = tma.make_tensor_descriptor(LSE + bh.to(gl.int64) * stride_lse, shape=[N], strides=[1],
                                          block_shape=[BLOCK_M], layout=row_layout)
    delta_desc = tma.make_tensor_descriptor(DELTA + bh.to(gl.int64) * stride_delta, shape=[N], strides=[1],
                                            block_shape=[BLOCK_M], layout=row_layout)
    k_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, TILE, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, TILE, HEAD_DIM], kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [DS_BUFS * CONSUMERS, TILE, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS, BLOCK_M, HEAD_DIM], dq_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [DS_BUFS, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [DS_BUFS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(kv_ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    for i in gl.static_range(DS_BUFS):
        mbarrier.init(ds_ready.index(i), count=CONSUMERS)
        mbarrier.init(ds_free.index(i), count=1)
    fence_async_shared()
    num_tiles = gl.cdiv(N - start_n, BLOCK_M)

    shared = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, ready, empty, ds_smem, ds_ready, ds_free,
              DK, DV, b, h, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
              N, start_n, num_tiles, qk_scale, sm_scale)
    loads = (k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
             delta_smem, kv_ready, ready, empty, start_n, num_tiles)
    dqs = (k_smem, ds_smem, dq_smem, kv_ready, ds_ready, ds_free, dq_desc, start_n, num_tiles, sm_scale)
    gl.warp_specialize([(_consumer5, (shared, gl.constexpr(0), HEAD_DIM, BLOCK_M, STAGES)),
                        (_consumer5, (shared, gl.constexpr(1), HEAD_DIM, BLOCK_M, STAGES)),
                        (_dkdv_producer, (loads, HEAD_DIM, BLOCK_M, STAGES)),
                        (_dq_partial, (dqs, HEAD_DIM, BLOCK_M, REDUCE, PIPE))],
                       [4, 1, 4], [CONSUMER_REGS, PRODUCER_REGS, DQ_REGS])


def launch_dkdvdq(do, q, k, v, lse, stride_lse, delta, stride_delta, dk, dv, dqa, sm_scale, qk_scale, block_m=64,
                  stages=3, cregs=208, dqregs=88, reduce=True, pipe=False, ds_bufs=2, dq_bufs=2):
    B, H, N, D = q.shape
    grid = (-(-N // (CONSUMERS.value * TILE.value)), B * H)
    _dkdvdq_kernel[grid](q, k, v, do, lse, delta, dk, dv, dqa, *_strides3(q), *_strides3(k), *_strides3(v),
                         *_strides3(do), *_strides3(dk), *_strides3(dv), *_strides3(dqa), stride_lse, stride_delta, H,
                         N, qk_scale, sm_scale, HEAD_DIM=D, BLOCK_M=block_m, STAGES=stages, CONSUMER_REGS=cregs,
                         PRODUCER_REGS=24, DQ_REGS=dqregs, REDUCE=reduce, PIPE=pipe, DS_BUFS=ds_bufs,
                         DQ_BUFS=dq_bufs, num_warps=4)


def backward5(do, q, k, v, o, lse, sm_scale, cregs=208, dqregs=88, reduce=True, stages=3, **kw):
    """(dq, dk, dv): delta kernel, zeroed fp32 dQ accumulator, the fused kernel, one cast."""
    import importlib
    fa = importlib.import_module("minigpt_kernels.flash_attention")
    B, H, N, D = q.shape
    do, delta = fa.launch_backward_delta(do, o, lse)
    (lse, sl), (delta, sd) = fa._rows_in(lse), fa._rows_in(delta)
    (lse, sl), (delta, sd) = fa._rows_for_tma(lse, sl), fa._rows_for_tma(delta, sd)
    dk, dv = fa._empty_in_layout_of(k), fa._empty_in_layout_of(v)
    dqa = torch.zeros((B, H, N, D), dtype=torch.float32, device=q.device)
    triton.set_allocator(fa._tma_scratch)
    launch_dkdvdq(do, q, k, v, lse, sl, delta, sd, dk, dv, dqa, sm_scale, sm_scale * fa.LOG2E, stages=stages,
                  cregs=cregs, dqregs=dqregs, reduce=reduce, **kw)
    dq = fa._empty_in_layout_of(q)
    dq.copy_(dqa)
    return dq, dk, dv

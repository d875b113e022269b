"""Experiment (not wired in): the five-matmul dK/dV/dQ kernel at head_dim 128 (kernels/NOTES.md next step 2).
Differences from kernels/flash_backward_specialized.py's _dkdvdq_kernel:
- consumers run each tile serially (Sᵀ, dPᵀ; Pᵀ, dSᵀ; dV, dK): no dV/dK in flight across the next tile's softmax, so
  dK, dV (64 keys × 128 = 128 registers) + Sᵀ, dPᵀ (64) fit;
- the dQ warpgroup computes dQ_t in two 64-column halves (dS K[:, half]), each staged (64×64 fp32) and reduce-added on
  its own, so its accumulator is 32 registers as at head_dim 64.
"""
from minigpt_kernels.flash_backward_specialized import (
    CONSUMERS, TILE, _pT_dsT, _hand_over, _write_dkdv, _tma_reduce_add, _dkdvdq_producer)
from minigpt_kernels.flash_forward_pingpong import _head_rows, _mma_layout
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)


@gluon.jit
def _step_serial(k, v, q_smem, do_smem, lse_smem, delta_smem, ready, empty, ds_smem, ds_ready, ds_free, t,
                 ME: gl.constexpr, STAGES: gl.constexpr, zero_s, dv, dk, keys, cols, masked, qk_scale,
                 a_layout: gl.constexpr):
    stage = t % STAGES
    mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
    sT = warpgroup_mma(k, q_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dpT = warpgroup_mma(v, do_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    sT, dpT = warpgroup_mma_wait(0, deps=(sT, dpT))
    pT16, dsT16 = _pT_dsT(sT, dpT, lse_smem.index(stage), delta_smem.index(stage), keys, cols, masked, qk_scale,
                          q_smem.dtype)
    _hand_over(ds_smem, ds_ready, ds_free, dsT16, t, ME)
    pT16 = gl.convert_layout(pT16, a_layout)
    dsT16 = gl.convert_layout(dsT16, a_layout)
    dv = warpgroup_mma(pT16, do_smem.index(stage), dv, is_async=True)
    dk = warpgroup_mma(dsT16, q_smem.index(stage), dk, is_async=True)
    dv, dk, pT16, dsT16 = warpgroup_mma_wait(0, deps=(dv, dk, pT16, dsT16))
    mbarrier.arrive(empty.index(stage), count=1)
    return dv, dk


@gluon.jit
def _consumer128(shared, ME: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, ready, empty, ds_smem, ds_ready, ds_free,
     DK, DV, b, h, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
     N, start_n, num_tiles, qk_scale, sm_scale) = shared
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
    for t in range(num_tiles):
        dv, dk = _step_serial(k, v, q_smem, do_smem, lse_smem, delta_smem, ready, empty, ds_smem, ds_ready, ds_free,
                              t, ME, STAGES, zero_s, dv, dk, keys, cols + t * BLOCK_M, t < MASKED_TILES, qk_scale,
                              a_layout)
    _write_dkdv(dk, dv, DK, DV, b, h, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, N, key0,
                sm_scale, HEAD_DIM)


@gluon.jit
def _reducer128(dqs, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    (k_smem, ds_smem, dq_smem, kv_ready, ds_ready, ds_free, dq_desc, start_n, num_tiles, sm_scale) = dqs
    HALF: gl.constexpr = HEAD_DIM // 2
    dq_layout: gl.constexpr = _mma_layout(HALF, 4)
    zero = gl.zeros([BLOCK_M, HALF], gl.float32, layout=dq_layout)
    for c in gl.static_range(CONSUMERS):
        mbarrier.wait(kv_ready.index(c), 0)
    for t in range(num_tiles):
        u = t % 2
        mbarrier.wait(ds_ready.index(u), (t // 2) & 1)
        for half in gl.static_range(2):
            dq = warpgroup_mma(ds_smem.index(u * CONSUMERS).permute((1, 0)),
                               k_smem.index(0).slice(half * HALF, HALF, dim=1), zero, use_acc=False, is_async=True)
            dq = warpgroup_mma(ds_smem.index(u * CONSUMERS + 1).permute((1, 0)),
                               k_smem.index(1).slice(half * HALF, HALF, dim=1), dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq,))
            if half == 1:
                mbarrier.arrive(ds_free.index(u), count=1)
            staging = dq_smem.index(half)
            tma.store_wait(1)  # the reduce issued from this buffer one tile ago has read it
            staging.store(dq * sm_scale)
            fence_async_shared()
            _tma_reduce_add(dq_desc, [start_n + t * BLOCK_M, half * HALF], staging)
    tma.store_wait(0)


@gluon.jit
def _dkdvdq128_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC,
                      stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                      stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                      stride_accb, stride_acch, stride_accn, stride_lse, stride_delta, H, N, qk_scale, sm_scale,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, REDUCER_REGS: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    HALF: gl.constexpr = HEAD_DIM // 2
    start_n = gl.program_id(0) * (CONSUMERS * TILE)
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, HEAD_DIM], dtype)
    qd_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, BLOCK_M], dtype)
    acc_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], gl.float32)
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    k_desc = _head_rows(K, b, h, stride_kb, stride_kh, stride_kn, N, TILE, HEAD_DIM, kv_layout)
    v_desc = _head_rows(V, b, h, stride_vb, stride_vh, stride_vn, N, TILE, HEAD_DIM, kv_layout)
    q_desc = _head_rows(Q, b, h, stride_qb, stride_qh, stride_qn, N, BLOCK_M, HEAD_DIM, qd_layout)
    do_desc = _head_rows(DO, b, h, stride_dob, stride_doh, stride_don, N, BLOCK_M, HEAD_DIM, qd_layout)
    dq_desc = tma.make_tensor_descriptor(DQ_ACC + b * stride_accb + h * stride_acch, shape=[N, HEAD_DIM],
                                         strides=[stride_accn, 1], block_shape=[BLOCK_M, HALF], layout=acc_layout)
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
    ds_smem = gl.allocate_shared_memory(dtype, [2 * CONSUMERS, TILE, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HALF], acc_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(kv_ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
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
    gl.warp_specialize([(_consumer128, (shared, gl.constexpr(0), HEAD_DIM, BLOCK_M, STAGES)),
                        (_consumer128, (shared, gl.constexpr(1), HEAD_DIM, BLOCK_M, STAGES)),
                        (_dkdvdq_producer, (loads, HEAD_DIM, BLOCK_M, STAGES)),
                        (_reducer128, (dqs, HEAD_DIM, BLOCK_M))],
                       [4, 1, 4], [CONSUMER_REGS, PRODUCER_REGS, REDUCER_REGS])


# ------------------------------------------------------------------------------------------------
# Variant B (FlashAttention-3's split): no dQ warpgroup. After both consumers stored dSᵀ_t, consumer c computes dQ_t's
# columns [64c, 64c + 64) = dS_t K[:, those columns] (32 registers) and reduce-adds them itself.
# ------------------------------------------------------------------------------------------------
@gluon.jit
def _step_b(k, v, k0, k1, q_smem, do_smem, lse_smem, delta_smem, ready, empty, ds_smem, ds_ready, ds_free, dq_smem,
            dq_desc, t, row, ME: gl.constexpr, STAGES: gl.constexpr, zero_s, zero_q, dv, dk, keys, cols, masked,
            qk_scale, sm_scale, a_layout: gl.constexpr):
    stage = t % STAGES
    u = t % 2
    mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
    sT = warpgroup_mma(k, q_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dpT = warpgroup_mma(v, do_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    sT, dpT = warpgroup_mma_wait(0, deps=(sT, dpT))
    pT16, dsT16 = _pT_dsT(sT, dpT, lse_smem.index(stage), delta_smem.index(stage), keys, cols, masked, qk_scale,
                          q_smem.dtype)
    mbarrier.wait(ds_free.index(u), ((t // 2) & 1) ^ 1)  # both consumers read what buffer u held (tile t − 2)
    ds_smem.index(u * CONSUMERS + ME).store(dsT16)
    fence_async_shared()
    mbarrier.arrive(ds_ready.index(u), count=1)
    pT16 = gl.convert_layout(pT16, a_layout)
    dsT16 = gl.convert_layout(dsT16, a_layout)
    dv = warpgroup_mma(pT16, do_smem.index(stage), dv, is_async=True)
    dk = warpgroup_mma(dsT16, q_smem.index(stage), dk, is_async=True)
    mbarrier.wait(ds_ready.index(u), (t // 2) & 1)  # both halves of dSᵀ_t stored
    dq = warpgroup_mma(ds_smem.index(u * CONSUMERS).permute((1, 0)), k0, zero_q, use_acc=False, is_async=True)
    dq = warpgroup_mma(ds_smem.index(u * CONSUMERS + 1).permute((1, 0)), k1, dq, is_async=True)
    dv, dk, dq, pT16, dsT16 = warpgroup_mma_wait(0, deps=(dv, dk, dq, pT16, dsT16))
    mbarrier.arrive(ds_free.index(u), count=1)
    mbarrier.arrive(empty.index(stage), count=1)
    staging = dq_smem.index(ME)
    tma.store_wait(0)  # the reduce issued from it a tile ago has read it
    staging.store(dq * sm_scale)
    fence_async_shared()
    _tma_reduce_add(dq_desc, [row, ME * (k0.shape[1])], staging)
    return dv, dk


@gluon.jit
def _consumer_b(shared, ME: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, ready, empty, ds_smem, ds_ready, ds_free,
     dq_smem, dq_desc, DK, DV, b, h, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
     N, start_n, num_tiles, qk_scale, sm_scale) = shared
    HALF: gl.constexpr = HEAD_DIM // 2
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, 4)
    d_layout: gl.constexpr = _mma_layout(HEAD_DIM, 4)
    q_layout: gl.constexpr = _mma_layout(HALF, 4)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    MASKED_TILES: gl.constexpr = (TILE * (ME + 1) + BLOCK_M - 1) // BLOCK_M
    key0 = start_n + ME * TILE
    keys = key0 + gl.arange(0, TILE, layout=gl.SliceLayout(1, s_layout))
    cols = start_n + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([TILE, BLOCK_M], gl.float32, layout=s_layout)
    zero_q = gl.zeros([BLOCK_M, HALF], gl.float32, layout=q_layout)
    dk = gl.zeros([TILE, HEAD_DIM], gl.float32, layout=d_layout)
    dv = gl.zeros([TILE, HEAD_DIM], gl.float32, layout=d_layout)
    k = k_smem.index(ME)
    v = v_smem.index(ME)
    k0 = k_smem.index(0).slice(ME * HALF, HALF, dim=1)  # this consumer's dQ columns of both consumers' keys
    k1 = k_smem.index(1).slice(ME * HALF, HALF, dim=1)
    for c in gl.static_range(CONSUMERS):
        mbarrier.wait(kv_ready.index(c), 0)
    for t in range(num_tiles):
        dv, dk = _step_b(k, v, k0, k1, q_smem, do_smem, lse_smem, delta_smem, ready, empty, ds_smem, ds_ready,
                         ds_free, dq_smem, dq_desc, t, start_n + t * BLOCK_M, ME, STAGES, zero_s, zero_q, dv, dk,
                         keys, cols + t * BLOCK_M, t < MASKED_TILES, qk_scale, sm_scale, a_layout)
    tma.store_wait(0)
    _write_dkdv(dk, dv, DK, DV, b, h, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, N, key0,
                sm_scale, HEAD_DIM)


@gluon.jit
def _dkdvdq128b_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC,
                       stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                       stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                       stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                       stride_accb, stride_acch, stride_accn, stride_lse, stride_delta, H, N, qk_scale, sm_scale,
                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    HALF: gl.constexpr = HEAD_DIM // 2
    start_n = gl.program_id(0) * (CONSUMERS * TILE)
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, HEAD_DIM], dtype)
    qd_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, BLOCK_M], dtype)
    acc_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], gl.float32)
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    k_desc = _head_rows(K, b, h, stride_kb, stride_kh, stride_kn, N, TILE, HEAD_DIM, kv_layout)
    v_desc = _head_rows(V, b, h, stride_vb, stride_vh, stride_vn, N, TILE, HEAD_DIM, kv_layout)
    q_desc = _head_rows(Q, b, h, stride_qb, stride_qh, stride_qn, N, BLOCK_M, HEAD_DIM, qd_layout)
    do_desc = _head_rows(DO, b, h, stride_dob, stride_doh, stride_don, N, BLOCK_M, HEAD_DIM, qd_layout)
    dq_desc = tma.make_tensor_descriptor(DQ_ACC + b * stride_accb + h * stride_acch, shape=[N, HEAD_DIM],
                                         strides=[stride_accn, 1], block_shape=[BLOCK_M, HALF], layout=acc_layout)
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
    ds_smem = gl.allocate_shared_memory(dtype, [2 * CONSUMERS, TILE, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS, BLOCK_M, HALF], acc_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(kv_ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=CONSUMERS)
        mbarrier.init(ds_free.index(i), count=CONSUMERS)
    fence_async_shared()
    num_tiles = gl.cdiv(N - start_n, BLOCK_M)
    shared = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, ready, empty, ds_smem, ds_ready, ds_free,
              dq_smem, dq_desc, DK, DV, b, h, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
              N, start_n, num_tiles, qk_scale, sm_scale)
    loads = (k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
             delta_smem, kv_ready, ready, empty, start_n, num_tiles)
    gl.warp_specialize([(_consumer_b, (shared, gl.constexpr(0), HEAD_DIM, BLOCK_M, STAGES)),
                        (_consumer_b, (shared, gl.constexpr(1), HEAD_DIM, BLOCK_M, STAGES)),
                        (_dkdvdq_producer, (loads, HEAD_DIM, BLOCK_M, STAGES))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

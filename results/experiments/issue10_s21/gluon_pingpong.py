"""Issue 10, session 21, experiment O: FlashAttention-3's forward structure in Gluon (triton 3.6, Hopper), causal.

One program owns 128 query rows (or 192 with three consumers). Its warps split by role (`gl.warp_specialize`):
- a producer warp streams K_j, V_j through a TMA ring (k_ready/v_ready: the copy landed; kv_empty: every consumer
  is done with the stage);
- NUM_CONSUMERS consumer warpgroups own 64 query rows each and take turns at the tensor cores (ping-pong, ordered
  by mbarriers: `turn[c]` completes when consumer c may issue). At its turn a consumer issues S_j = Q K_jᵀ and
  O += P_{j-1} V_{j-1} together, hands the turn on, and computes the softmax of S_j while the next consumer's
  matmuls run. Every wgmma is retired within its step (ptxas serializes the loop otherwise, NOTES.md F).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

LOG2E = 1.4426950408889634
BLOCK_R = gl.constexpr(64)  # query rows per consumer warpgroup (the wgmma's M)


@gluon.constexpr_function
def _mma_layout(rows, cols, num_warps):
    n = 256
    while n > cols or cols % n:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _softmax_step(s, m_i, l_i, rows, cols, key0, full_tiles, j, qk_scale, CAUSAL: gl.constexpr):
    """Online softmax of one score tile (base 2): (p, α, m_new, l_new). Causal only, for now."""
    if j >= full_tiles:  # the diagonal tile: keys after the row are masked (and so are keys past N)
        keys = key0 + cols
        s = gl.where(gl.expand_dims(rows, 1) >= gl.expand_dims(keys, 0), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new



@gluon.jit
def _pv_and_next_scores(j, p16, acc, m_i, l_i, q_s, k_smem, v_smem, k_ready, v_ready, kv_empty, turn, zero_s, rows, cols,
                        full_tiles, qk_scale, ME: gl.constexpr, NEXT: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """One consumer step: at its turn, issue S_j = Q K_jᵀ and O += P_{j-1} V_{j-1}; then the softmax of S_j while
    P_{j-1} V_{j-1} runs. Returns (acc, m, l, P_j as the next step's operand)."""
    st = j % STAGES
    pst = (j - 1) % STAGES
    mbarrier.wait(turn.index(ME), j & 1)
    mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
    s = warpgroup_mma(q_s, k_smem.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(pst), ((j - 1) // STAGES) & 1)
    acc = warpgroup_mma(p16, v_smem.index(pst), acc, is_async=True)
    mbarrier.arrive(turn.index(NEXT), count=1)
    s = warpgroup_mma_wait(1, deps=(s,))
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, rows, cols, j * BLOCK_N, full_tiles, j, qk_scale, CAUSAL)
    p_next = gl.convert_layout(p.to(p16.dtype), p_layout)
    acc, p16, p_next = warpgroup_mma_wait(0, deps=(acc, p16, p_next))
    mbarrier.arrive(kv_empty.index(pst), count=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return acc, m_i, l_i, p_next

@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn,
              O, LSE, b, h, bh, stride_ob, stride_oh, stride_on, N, start_m, num_tiles, qk_scale,
              ME: gl.constexpr, NUM_CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_R, BLOCK_N, 4)
    o_layout: gl.constexpr = _mma_layout(BLOCK_R, HEAD_DIM, 4)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    NEXT: gl.constexpr = (ME + 1) % NUM_CONSUMERS
    row0 = start_m + ME * BLOCK_R
    rows = row0 + gl.arange(0, BLOCK_R, layout=row_s)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    full_tiles = row0 // BLOCK_N  # key tiles wholly before this consumer's first row: no mask
    zero_s = gl.zeros([BLOCK_R, BLOCK_N], gl.float32, layout=s_layout)
    m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_R], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_R, HEAD_DIM], gl.float32, layout=o_layout)
    q_s = q_smem.index(ME)
    mbarrier.wait(q_bar.index(ME), 0)
    if ME == NUM_CONSUMERS - 1:  # the last consumer opens the first turn: consumer 0 goes first
        mbarrier.arrive(turn.index(0), count=1)

    # tile 0: S_0 alone
    mbarrier.wait(turn.index(ME), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_s, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.arrive(turn.index(NEXT), count=1)
    s = warpgroup_mma_wait(0, deps=(s,))
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, rows, cols, 0, full_tiles, 0, qk_scale, CAUSAL)
    p16 = gl.convert_layout(p.to(dtype), p_layout)

    if OVERLAP:  # two P operands in turn (unrolled by two), so P_j can be packed while P_{j-1} V_{j-1} runs
        pa = p16
        pb = p16
        n_steps = num_tiles - 1
        for t in range(0, n_steps // 2):
            j = 1 + 2 * t
            acc, m_i, l_i, pb = _pv_and_next_scores(j, pa, acc, m_i, l_i, q_s, k_smem, v_smem, k_ready, v_ready,
                                                    kv_empty, turn, zero_s, rows, cols, full_tiles, qk_scale, ME, NEXT,
                                                    BLOCK_N, STAGES, CAUSAL, o_layout, p_layout)
            acc, m_i, l_i, pa = _pv_and_next_scores(j + 1, pb, acc, m_i, l_i, q_s, k_smem, v_smem, k_ready, v_ready,
                                                    kv_empty, turn, zero_s, rows, cols, full_tiles, qk_scale, ME, NEXT,
                                                    BLOCK_N, STAGES, CAUSAL, o_layout, p_layout)
        if n_steps % 2 == 1:
            acc, m_i, l_i, pb = _pv_and_next_scores(num_tiles - 1, pa, acc, m_i, l_i, q_s, k_smem, v_smem, k_ready,
                                                    v_ready, kv_empty, turn, zero_s, rows, cols, full_tiles, qk_scale,
                                                    ME, NEXT, BLOCK_N, STAGES, CAUSAL, o_layout, p_layout)
            p16 = pb
        else:
            p16 = pa
    # tile j: S_j and P_{j-1} V_{j-1} at this consumer's turn, then the softmax of S_j while the others' run
    for j in range(1, num_tiles if not OVERLAP else 1):
        st = j % STAGES
        pst = (j - 1) % STAGES
        mbarrier.wait(turn.index(ME), j & 1)
        mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
        s = warpgroup_mma(q_s, k_smem.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(pst), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p16, v_smem.index(pst), acc, is_async=True)
        mbarrier.arrive(turn.index(NEXT), count=1)
        s = warpgroup_mma_wait(1, deps=(s,))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, rows, cols, j * BLOCK_N, full_tiles, j, qk_scale, CAUSAL)
        acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
        mbarrier.arrive(kv_empty.index(pst), count=1)  # K_{j-1} and V_{j-1} read by this consumer
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p16 = gl.convert_layout(p.to(dtype), p_layout)

    # the last P V
    lst = (num_tiles - 1) % STAGES
    mbarrier.wait(turn.index(ME), num_tiles & 1)
    mbarrier.wait(v_ready.index(lst), ((num_tiles - 1) // STAGES) & 1)
    acc = warpgroup_mma(p16, v_smem.index(lst), acc, is_async=True)
    mbarrier.arrive(turn.index(NEXT), count=1)
    acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))

    o = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    gl.store(LSE + bh.to(gl.int64) * N + rows, m_i + gl.log2(l_i), mask=rows < N)
    out_rows = row0 + gl.arange(0, BLOCK_R, layout=row_o)
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    offs = b * stride_ob + h * stride_oh + gl.expand_dims(out_rows.to(gl.int64), 1) * stride_on \
        + gl.expand_dims(out_cols, 0)
    gl.store(O + offs, o.to(dtype), mask=gl.expand_dims(out_rows < N, 1))


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, start_m, num_tiles,
              NUM_CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    q_bytes: gl.constexpr = BLOCK_R * HEAD_DIM * dtype.primitive_bitwidth // 8
    kv_bytes: gl.constexpr = BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.expect(q_bar.index(c), q_bytes)
        tma.async_copy_global_to_shared(q_desc, [start_m + c * BLOCK_R, 0], q_bar.index(c), q_smem.index(c))
    for j in range(num_tiles):
        st = j % STAGES
        mbarrier.wait(kv_empty.index(st), ((j // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        mbarrier.expect(k_ready.index(st), kv_bytes)
        tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], k_ready.index(st), k_smem.index(st))
        mbarrier.expect(v_ready.index(st), kv_bytes)
        tma.async_copy_global_to_shared(v_desc, [j * BLOCK_N, 0], v_ready.index(st), v_smem.index(st))


@gluon.jit
def _pingpong_fwd_kernel(Q, K, V, O, LSE,
                         stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                         stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                         H, N, qk_scale,
                         CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                         PRODUCER_REGS: gl.constexpr, OVERLAP: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    BLOCK_M: gl.constexpr = NUM_CONSUMERS * BLOCK_R
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # longest rows first
    start_m = pid_m * BLOCK_M
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, HEAD_DIM], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[N, HEAD_DIM],
                                        strides=[stride_qn, 1], block_shape=[BLOCK_R, HEAD_DIM], layout=q_sl)
    k_desc = tma.make_tensor_descriptor(K + b * stride_kb + h * stride_kh, shape=[N, HEAD_DIM],
                                        strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_sl)
    v_desc = tma.make_tensor_descriptor(V + b * stride_vb + h * stride_vh, shape=[N, HEAD_DIM],
                                        strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM], layout=kv_sl)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BLOCK_R, HEAD_DIM], q_sl)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_sl)
    q_bar = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=NUM_CONSUMERS)
    fence_async_shared()
    if CAUSAL:
        num_tiles = gl.cdiv(gl.minimum(start_m + BLOCK_M, N), BLOCK_N)
    else:
        num_tiles = gl.cdiv(N, BLOCK_N)

    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, O, LSE, b, h, bh, stride_ob,
                         stride_oh, stride_on, N, start_m, num_tiles, qk_scale, gl.constexpr(0), NUM_CONSUMERS, HEAD_DIM,
                         BLOCK_N, STAGES, CAUSAL, OVERLAP)),
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, O, LSE, b, h, bh, stride_ob,
                         stride_oh, stride_on, N, start_m, num_tiles, qk_scale, gl.constexpr(1), NUM_CONSUMERS, HEAD_DIM,
                         BLOCK_N, STAGES, CAUSAL, OVERLAP)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, start_m,
                         num_tiles, NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, O, LSE, b, h, bh, stride_ob,
                         stride_oh, stride_on, N, start_m, num_tiles, qk_scale, gl.constexpr(0), NUM_CONSUMERS, HEAD_DIM,
                         BLOCK_N, STAGES, CAUSAL, OVERLAP)),
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, O, LSE, b, h, bh, stride_ob,
                         stride_oh, stride_on, N, start_m, num_tiles, qk_scale, gl.constexpr(1), NUM_CONSUMERS, HEAD_DIM,
                         BLOCK_N, STAGES, CAUSAL, OVERLAP)),
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, O, LSE, b, h, bh, stride_ob,
                         stride_oh, stride_on, N, start_m, num_tiles, qk_scale, gl.constexpr(2), NUM_CONSUMERS, HEAD_DIM,
                         BLOCK_N, STAGES, CAUSAL, OVERLAP)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, start_m,
                         num_tiles, NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


def _s3(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _alloc(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def pingpong_fwd(q, k, v, sm_scale, consumers=2, block_n=128, stages=2, consumer_regs=232, producer_regs=24,
                 maxnreg=None, overlap=False):
    """(o, lse) of causal attention, lse in base 2 like the Triton kernel's."""
    B, H, N, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    triton.set_allocator(_alloc)
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    _pingpong_fwd_kernel[(triton.cdiv(N, consumers * BLOCK_R.value), B * H)](
        q, k, v, o, lse, *_s3(q), *_s3(k), *_s3(v), *_s3(o), H, N, sm_scale * LOG2E,
        True, D, consumers, block_n, stages, consumer_regs, producer_regs, overlap, num_warps=4, **extra)
    return o, lse

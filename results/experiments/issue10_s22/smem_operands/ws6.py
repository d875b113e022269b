# Session 22, variant of gluon_backward_ws.py (..): the dK/dV consumer with Pᵀ and dSᵀ through shared memory (SS wgmma). Measured slower (kernels/NOTES.md P).
"""Session 22 experiment (issue 10), kept as it ran: the causal FlashAttention backward's dK/dV and dQ kernels on Hopper with the ping-pong forward's structure, in Gluon:
warp-specialized, with consumer warpgroups taking turns at the tensor cores (flash_forward_pingpong.py).

Per key, over the queries i that see it (transposed tiles, keys × queries):

    Sᵀ = K Qᵀ,  Pᵀ = exp2(Sᵀ·scale·log2e − LSE),  dV += Pᵀ dO,  dPᵀ = V dOᵀ,  dSᵀ = Pᵀ ∘ (dPᵀ − delta),  dK += dSᵀ Q

and dK ·= scale at the end (the same outputs as flash_attention.py's dK/dV kernel; delta = rowsum(dO ∘ O)).

Why a second dK/dV kernel: the Triton one runs three independent 64-key programs per SM (two at head_dim 128), each
waiting on its own matmuls and each refilling its query ring behind a CTA-wide barrier. Here one program owns
64·NUM_CONSUMERS keys and splits its warps by role (`gl.warp_specialize`):

- one producer warp loads each consumer's K and V rows once, then streams the query tiles Q_t, dO_t and their LSE and
  delta rows through a ring of STAGES shared-memory buffers with TMA (ready[s]: the copies landed; empty[s]: every
  consumer is done with the buffer);
- NUM_CONSUMERS consumer warpgroups own 64 keys each and take turns at the tensor cores (turn[c]). At its turn a
  consumer issues Sᵀ_t and dPᵀ_t for query tile t together with dV += Pᵀ_{t−1} dO_{t−1} and dK += dSᵀ_{t−1} Q_{t−1},
  and hands the turn on; it computes Pᵀ_t and dSᵀ_t while the next consumer's matmuls run.

Every matmul is retired within its step (a wgmma result still in flight at the loop's back-edge makes ptxas
serialize them all: kernels/NOTES.md F). Scope as the ping-pong forward's: causal, fp16/bf16, head_dim 64 or 128, one
length for queries and keys, TMA-aligned inputs, LSE/delta rows whose starts are 16-byte aligned, sm_90.
"""
from __future__ import annotations

from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from minigpt_kernels.flash_forward_pingpong import CONSUMER_REGS, PRODUCER_REGS, ROWS_PER_CONSUMER, _mma_layout

KEYS_PER_CONSUMER = gl.constexpr(64)  # keys per consumer warpgroup: the M of one wgmma


@gluon.jit
def _softmax_grad(sT, dpT, lse_smem, delta_smem, keys, rows, masked, qk_scale, dtype: gl.constexpr,
                  a_layout: gl.constexpr):
    """Pᵀ and dSᵀ of one tile from its scores Sᵀ and dPᵀ = V dOᵀ, as A operands (registers) of the dV and dK matmuls.
    Rows past N read LSE = 0 and delta = 0 (TMA zero fill), so Pᵀ = 1 there; their Q and dO rows are 0 too, so they
    add exactly 0 to dV (Pᵀ dO) and dK (dSᵀ = Pᵀ ∘ (V dOᵀ − delta) = 0)."""
    col_layout: gl.constexpr = gl.SliceLayout(0, sT.type.layout)
    # Pᵀ = exp2(K Qᵀ · scale·log2e − LSE)
    pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse_smem.load(col_layout), 0))
    if masked:  # a tile that crosses this consumer's diagonal: query i sees key j iff i >= j
        pT = gl.where(gl.expand_dims(rows, 0) >= gl.expand_dims(keys, 1), pT, 0.0)
    # dSᵀ = Pᵀ ∘ (dPᵀ − delta)
    dsT = pT * (dpT - gl.expand_dims(delta_smem.load(col_layout), 0))
    return gl.convert_layout(pT.to(dtype), a_layout), gl.convert_layout(dsT.to(dtype), a_layout)


@gluon.jit
def _dkdv_consumer(shared, ME: gl.constexpr, NUM_CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr,
                   BLOCK_M: gl.constexpr, STAGES: gl.constexpr, TURNS: gl.constexpr, OVERLAP: gl.constexpr):
    """Variant: Pᵀ and dSᵀ go through shared memory (double-buffered per consumer), the dV/dK matmuls read them
    from there (SS wgmma), so no register A operand is in flight. Free-running consumers, overlap always."""
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, ready, empty, turn, ps_smem,
     DK, DV, b, h, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
     N, start_n, num_tiles, qk_scale, sm_scale) = shared
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, 4)
    d_layout: gl.constexpr = _mma_layout(HEAD_DIM, 4)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    MASKED_TILES: gl.constexpr = (KEYS_PER_CONSUMER * (ME + 1) + BLOCK_M - 1) // BLOCK_M
    key0 = start_n + ME * KEYS_PER_CONSUMER
    keys = key0 + gl.arange(0, KEYS_PER_CONSUMER, layout=gl.SliceLayout(1, s_layout))
    cols = start_n + gl.arange(0, BLOCK_M, layout=col_layout)
    zero_s = gl.zeros([KEYS_PER_CONSUMER, BLOCK_M], gl.float32, layout=s_layout)
    dk = gl.zeros([KEYS_PER_CONSUMER, HEAD_DIM], gl.float32, layout=d_layout)
    dv = gl.zeros([KEYS_PER_CONSUMER, HEAD_DIM], gl.float32, layout=d_layout)
    k = k_smem.index(ME)
    v = v_smem.index(ME)
    mbarrier.wait(kv_ready.index(ME), 0)

    mbarrier.wait(ready.index(0), 0)
    sT = warpgroup_mma(k, q_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dpT = warpgroup_mma(v, do_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    sT, dpT = warpgroup_mma_wait(0, deps=(sT, dpT))
    pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse_smem.index(0).load(col_layout), 0))
    if 0 < MASKED_TILES:
        pT = gl.where(gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1), pT, 0.0)
    dsT = pT * (dpT - gl.expand_dims(delta_smem.index(0).load(col_layout), 0))
    ps_smem.index(4 * ME + 0).store(pT.to(dtype))
    ps_smem.index(4 * ME + 1).store(dsT.to(dtype))

    for t in range(1, num_tiles):
        stage = t % STAGES
        prev = (t - 1) % STAGES
        old = 4 * ME + 2 * ((t - 1) % 2)
        new = 4 * ME + 2 * (t % 2)
        mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
        sT = warpgroup_mma(k, q_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v, do_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        fence_async_shared()  # (placed here: right after the stores, ptxas 3.6 crashes)
        dv = warpgroup_mma(ps_smem.index(old), do_smem.index(prev), dv, is_async=True)
        dk = warpgroup_mma(ps_smem.index(old + 1), q_smem.index(prev), dk, is_async=True)
        sT, dpT = warpgroup_mma_wait(2, deps=(sT, dpT))
        pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse_smem.index(stage).load(col_layout), 0))
        if t < MASKED_TILES:
            pT = gl.where(gl.expand_dims(cols + t * BLOCK_M, 0) >= gl.expand_dims(keys, 1), pT, 0.0)
        dsT = pT * (dpT - gl.expand_dims(delta_smem.index(stage).load(col_layout), 0))
        ps_smem.index(new).store(pT.to(dtype))
        ps_smem.index(new + 1).store(dsT.to(dtype))
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(empty.index(prev), count=1)

    last = (num_tiles - 1) % STAGES
    lastb = 4 * ME + 2 * ((num_tiles - 1) % 2)
    fence_async_shared()
    dv = warpgroup_mma(ps_smem.index(lastb), do_smem.index(last), dv, is_async=True)
    dk = warpgroup_mma(ps_smem.index(lastb + 1), q_smem.index(last), dk, is_async=True)
    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))

    dk = dk * sm_scale
    out_keys = key0 + gl.arange(0, KEYS_PER_CONSUMER, layout=gl.SliceLayout(1, d_layout))
    out_cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, d_layout)), 0)
    rows64 = gl.expand_dims(out_keys.to(gl.int64), 1)
    mask = gl.expand_dims(out_keys < N, 1)
    gl.store(DK + b * stride_dkb + h * stride_dkh + rows64 * stride_dkn + out_cols, dk.to(DK.dtype.element_ty),
             mask=mask)
    gl.store(DV + b * stride_dvb + h * stride_dvh + rows64 * stride_dvn + out_cols, dv.to(DV.dtype.element_ty),
             mask=mask)


@gluon.jit
def _dkdv_producer(loads, NUM_CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                   STAGES: gl.constexpr):
    """The producer warp: each consumer's K and V rows once, then query tile t (Q, dO, LSE, delta) into buffer
    t % STAGES as soon as every consumer has released what it held (tile t − STAGES). Rows past N read as 0 (TMA)."""
    (k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
     kv_ready, ready, empty, start_n, num_tiles) = loads
    dtype: gl.constexpr = q_smem.dtype
    kv_bytes: gl.constexpr = 2 * KEYS_PER_CONSUMER * HEAD_DIM * dtype.primitive_bitwidth // 8
    # TMA counts a whole box, rows past N (zero-filled) included
    tile_bytes: gl.constexpr = 2 * BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8 + 2 * BLOCK_M * 4
    for c in gl.static_range(NUM_CONSUMERS):
        key0 = start_n + c * KEYS_PER_CONSUMER
        mbarrier.expect(kv_ready.index(c), kv_bytes)
        tma.async_copy_global_to_shared(k_desc, [key0, 0], kv_ready.index(c), k_smem.index(c))
        tma.async_copy_global_to_shared(v_desc, [key0, 0], kv_ready.index(c), v_smem.index(c))
    for t in range(num_tiles):
        stage = t % STAGES
        row = start_n + t * BLOCK_M
        # round r = t // STAGES of this buffer waits for round r − 1's release; a fresh barrier passes parity 1
        mbarrier.wait(empty.index(stage), ((t // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, tile_bytes)
        tma.async_copy_global_to_shared(q_desc, [row, 0], bar, q_smem.index(stage))
        tma.async_copy_global_to_shared(do_desc, [row, 0], bar, do_smem.index(stage))
        tma.async_copy_global_to_shared(lse_desc, [row], bar, lse_smem.index(stage))
        tma.async_copy_global_to_shared(delta_desc, [row], bar, delta_smem.index(stage))


@gluon.jit
def _pingpong_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                          stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                          stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                          stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                          stride_lse, stride_delta, H, N, qk_scale, sm_scale,
                          HEAD_DIM: gl.constexpr, NUM_CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr,
                          STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                          TURNS: gl.constexpr = True, OVERLAP: gl.constexpr = False):
    """dK, dV of one block of 64·NUM_CONSUMERS keys of one (batch, head), causal: over the queries from the block's
    first key on. Program 0 holds the first keys (most queries), so the longest programs start first."""
    dtype: gl.constexpr = Q.dtype.element_ty
    BLOCK_N: gl.constexpr = NUM_CONSUMERS * KEYS_PER_CONSUMER
    start_n = gl.program_id(0) * BLOCK_N
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS_PER_CONSUMER, HEAD_DIM], dtype)
    qd_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    k_desc = tma.make_tensor_descriptor(K + b * stride_kb + h * stride_kh, shape=[N, HEAD_DIM], strides=[stride_kn, 1],
                                        block_shape=[KEYS_PER_CONSUMER, HEAD_DIM], layout=kv_layout)
    v_desc = tma.make_tensor_descriptor(V + b * stride_vb + h * stride_vh, shape=[N, HEAD_DIM], strides=[stride_vn, 1],
                                        block_shape=[KEYS_PER_CONSUMER, HEAD_DIM], layout=kv_layout)
    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[N, HEAD_DIM], strides=[stride_qn, 1],
                                        block_shape=[BLOCK_M, HEAD_DIM], layout=qd_layout)
    do_desc = tma.make_tensor_descriptor(DO + b * stride_dob + h * stride_doh, shape=[N, HEAD_DIM],
                                         strides=[stride_don, 1], block_shape=[BLOCK_M, HEAD_DIM], layout=qd_layout)
    lse_desc = tma.make_tensor_descriptor(LSE + bh.to(gl.int64) * stride_lse, shape=[N], strides=[1],
                                          block_shape=[BLOCK_M], layout=row_layout)
    delta_desc = tma.make_tensor_descriptor(DELTA + bh.to(gl.int64) * stride_delta, shape=[N], strides=[1],
                                            block_shape=[BLOCK_M], layout=row_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, KEYS_PER_CONSUMER, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, KEYS_PER_CONSUMER, HEAD_DIM], kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    ps_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS_PER_CONSUMER, BLOCK_M], dtype)
    ps_smem = gl.allocate_shared_memory(dtype, [4 * NUM_CONSUMERS, KEYS_PER_CONSUMER, BLOCK_M], ps_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NUM_CONSUMERS)
    fence_async_shared()
    num_tiles = gl.cdiv(N - start_n, BLOCK_M)  # query tiles from the block's first key to the end

    shared = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, ready, empty, turn, ps_smem,
              DK, DV, b, h, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
              N, start_n, num_tiles, qk_scale, sm_scale)
    loads = (k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
             delta_smem, kv_ready, ready, empty, start_n, num_tiles)
    # the partition list is a literal for the compiler: one entry per consumer (the first is the default partition)
    # and the producer
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([(_dkdv_consumer, (shared, gl.constexpr(0), NUM_CONSUMERS, HEAD_DIM, BLOCK_M, STAGES, TURNS, OVERLAP)),
                            (_dkdv_consumer, (shared, gl.constexpr(1), NUM_CONSUMERS, HEAD_DIM, BLOCK_M, STAGES, TURNS, OVERLAP)),
                            (_dkdv_producer, (loads, NUM_CONSUMERS, HEAD_DIM, BLOCK_M, STAGES))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_dkdv_consumer, (shared, gl.constexpr(0), NUM_CONSUMERS, HEAD_DIM, BLOCK_M, STAGES, TURNS, OVERLAP)),
                            (_dkdv_consumer, (shared, gl.constexpr(1), NUM_CONSUMERS, HEAD_DIM, BLOCK_M, STAGES, TURNS, OVERLAP)),
                            (_dkdv_consumer, (shared, gl.constexpr(2), NUM_CONSUMERS, HEAD_DIM, BLOCK_M, STAGES, TURNS, OVERLAP)),
                            (_dkdv_producer, (loads, NUM_CONSUMERS, HEAD_DIM, BLOCK_M, STAGES))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


def launch_dkdv_pingpong(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, stride_lse: int, delta: Tensor,
                         stride_delta: int, dk: Tensor, dv: Tensor, sm_scale: float, qk_scale: float, consumers: int,
                         block_m: int, stages: int, turns: bool = True, overlap: bool = False,
                         consumer_regs: int | None = None) -> None:
    """Write the causal dK, dV of q, k, v, do (B, H, N, D) into dk, dv (k's shape, contiguous last dimension).
    lse, delta: fp32 rows t + (b·H + h)·stride with 16-byte aligned starts (1-D TMA). qk_scale = sm_scale · log2(e).
    The caller checks the scope and has set Triton's scratch allocator for the device-side TMA descriptors."""
    B, H, N, D = q.shape
    grid = (-(-N // (consumers * KEYS_PER_CONSUMER.value)), B * H)
    _pingpong_dkdv_kernel[grid](
        q, k, v, do, lse, delta, dk, dv, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        stride_lse, stride_delta, H, N, qk_scale, sm_scale,
        HEAD_DIM=D, NUM_CONSUMERS=consumers, BLOCK_M=block_m, STAGES=stages,
        CONSUMER_REGS=consumer_regs or CONSUMER_REGS[consumers], PRODUCER_REGS=PRODUCER_REGS, TURNS=turns,
        OVERLAP=overlap, num_warps=4)


# ------------------------------------------------------------------------------------------------
# dQ: one program owns 64·NUM_CONSUMERS query rows, the producer streams K_j, V_j (the forward's structure)
# ------------------------------------------------------------------------------------------------
@gluon.jit
def _dq_consumer(shared, ME: gl.constexpr, NUM_CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, TURNS: gl.constexpr, OVERLAP: gl.constexpr):
    """Consumer warpgroup ME: dQ of query rows start_m + 64·ME ... + 63 over key tiles 0 .. num_tiles−1, and the rows'
    delta = rowsum(dO ∘ O), written for the dK/dV kernel."""
    (q_smem, do_smem, k_smem, v_smem, qdo_ready, kv_ready, kv_empty, turn,
     O, DO, LSE, DELTA, DQ, b, h, bh, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don,
     stride_dqb, stride_dqh, stride_dqn, stride_lse, stride_delta, N, start_m, num_tiles, qk_scale, sm_scale) = shared
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, 4)   # S, dP: 64 rows × BLOCK_N keys
    d_layout: gl.constexpr = _mma_layout(HEAD_DIM, 4)  # dQ: 64 rows × HEAD_DIM
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)  # dS in registers
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # O, dO rows for delta
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    NEXT: gl.constexpr = (ME + 1) % NUM_CONSUMERS
    row0 = start_m + ME * ROWS_PER_CONSUMER
    rows = row0 + gl.arange(0, ROWS_PER_CONSUMER, layout=row_s)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    full_tiles = row0 // BLOCK_N  # key tiles wholly at or before this consumer's first row need no mask

    # delta_i = Σ_d dO_id · O_id (for this kernel and the dK/dV kernel after it); LSE (+inf past N: P = 0 there)
    io_rows = row0 + gl.arange(0, ROWS_PER_CONSUMER, layout=gl.SliceLayout(1, io_layout))
    io_cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout)), 0)
    io_mask = gl.expand_dims(io_rows < N, 1)
    io_rows64 = gl.expand_dims(io_rows.to(gl.int64), 1)
    o = gl.load(O + b * stride_ob + h * stride_oh + io_rows64 * stride_on + io_cols, mask=io_mask, other=0.0)
    do = gl.load(DO + b * stride_dob + h * stride_doh + io_rows64 * stride_don + io_cols, mask=io_mask, other=0.0)
    delta = gl.convert_layout(gl.sum(o.to(gl.float32) * do.to(gl.float32), 1), row_s)
    gl.store(DELTA + bh.to(gl.int64) * stride_delta + rows, delta, mask=rows < N)
    lse = gl.load(LSE + bh.to(gl.int64) * stride_lse + rows, mask=rows < N, other=float("inf"))

    zero_s = gl.zeros([ROWS_PER_CONSUMER, BLOCK_N], gl.float32, layout=s_layout)
    dq = gl.zeros([ROWS_PER_CONSUMER, HEAD_DIM], gl.float32, layout=d_layout)
    q = q_smem.index(ME)
    do_s = do_smem.index(ME)
    mbarrier.wait(qdo_ready.index(ME), 0)
    if TURNS and ME == NUM_CONSUMERS - 1:  # the last consumer opens the first turn, so consumer 0 goes first
        mbarrier.arrive(turn.index(0), count=1)

    # tile 0: S_0 = Q K_0ᵀ and dP_0 = dO V_0ᵀ alone (no dQ yet)
    if TURNS:
        mbarrier.wait(turn.index(ME), 0)
    mbarrier.wait(kv_ready.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dp = warpgroup_mma(do_s, v_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if TURNS:
        mbarrier.arrive(turn.index(NEXT), count=1)
    s, dp = warpgroup_mma_wait(0, deps=(s, dp))
    ds16 = _ds(s, dp, lse, delta, rows, cols, 0 >= full_tiles, qk_scale, dtype, a_layout)

    # tile j: issue S_j, dP_j and the previous tile's dQ += dS_{j−1} K_{j−1}; then dS_j
    for j in range(1, num_tiles):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        if TURNS:
            mbarrier.wait(turn.index(ME), j & 1)
        mbarrier.wait(kv_ready.index(stage), (j // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_s, v_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dq = warpgroup_mma(ds16, k_smem.index(prev), dq, is_async=True)
        if TURNS:
            mbarrier.arrive(turn.index(NEXT), count=1)
        if OVERLAP:  # dS_j while this consumer's dQ matmul of tile j−1 still runs
            s, dp = warpgroup_mma_wait(1, deps=(s, dp))
            ds16n = _ds(s, dp, lse, delta, rows, cols + j * BLOCK_N, j >= full_tiles, qk_scale, dtype, a_layout)
            dq, ds16 = warpgroup_mma_wait(0, deps=(dq, ds16))
            mbarrier.arrive(kv_empty.index(prev), count=1)  # K_{j−1}, V_{j−1} no longer read by this consumer
            ds16 = ds16n
        else:
            s, dp, dq, ds16 = warpgroup_mma_wait(0, deps=(s, dp, dq, ds16))
            mbarrier.arrive(kv_empty.index(prev), count=1)
            ds16 = _ds(s, dp, lse, delta, rows, cols + j * BLOCK_N, j >= full_tiles, qk_scale, dtype, a_layout)

    last = (num_tiles - 1) % STAGES
    if TURNS:
        mbarrier.wait(turn.index(ME), num_tiles & 1)
    dq = warpgroup_mma(ds16, k_smem.index(last), dq, is_async=True)
    if TURNS:
        mbarrier.arrive(turn.index(NEXT), count=1)
    dq, ds16 = warpgroup_mma_wait(0, deps=(dq, ds16))

    dq = dq * sm_scale  # dS was taken w.r.t. the scaled scores
    out_rows = row0 + gl.arange(0, ROWS_PER_CONSUMER, layout=gl.SliceLayout(1, d_layout))
    out_cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, d_layout)), 0)
    gl.store(DQ + b * stride_dqb + h * stride_dqh + gl.expand_dims(out_rows.to(gl.int64), 1) * stride_dqn + out_cols,
             dq.to(DQ.dtype.element_ty), mask=gl.expand_dims(out_rows < N, 1))


@gluon.jit
def _ds(s, dp, lse, delta, rows, cols, masked, qk_scale, dtype: gl.constexpr, a_layout: gl.constexpr):
    """dS of one tile from its scores S and dP = dO Vᵀ, as the A operand (registers) of the dQ matmul."""
    # P = exp2(Q Kᵀ · scale·log2e − LSE)
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse, 1))
    if masked:  # the diagonal tile: keys after the row get probability 0
        p = gl.where(gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0), p, 0.0)
    # dS = P ∘ (dP − delta)
    return gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), a_layout)


@gluon.jit
def _dq_producer(loads, NUM_CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr):
    """The producer warp: each consumer's Q and dO rows once, then K_j, V_j into buffer j % STAGES as soon as every
    consumer has released what it held (tile j − STAGES). Rows past N read as 0 (TMA)."""
    (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qdo_ready, kv_ready, kv_empty,
     start_m, num_tiles) = loads
    dtype: gl.constexpr = q_smem.dtype
    qdo_bytes: gl.constexpr = 2 * ROWS_PER_CONSUMER * HEAD_DIM * dtype.primitive_bitwidth // 8
    kv_bytes: gl.constexpr = 2 * BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
    for c in gl.static_range(NUM_CONSUMERS):
        row0 = start_m + c * ROWS_PER_CONSUMER
        mbarrier.expect(qdo_ready.index(c), qdo_bytes)
        tma.async_copy_global_to_shared(q_desc, [row0, 0], qdo_ready.index(c), q_smem.index(c))
        tma.async_copy_global_to_shared(do_desc, [row0, 0], qdo_ready.index(c), do_smem.index(c))
    for j in range(num_tiles):
        stage = j % STAGES
        mbarrier.wait(kv_empty.index(stage), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(kv_ready.index(stage), kv_bytes)
        tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], kv_ready.index(stage), k_smem.index(stage))
        tma.async_copy_global_to_shared(v_desc, [j * BLOCK_N, 0], kv_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _pingpong_dq_kernel(Q, K, V, DO, O, LSE, DELTA, DQ,
                        stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                        stride_ob, stride_oh, stride_on, stride_dqb, stride_dqh, stride_dqn,
                        stride_lse, stride_delta, H, N, qk_scale, sm_scale,
                        HEAD_DIM: gl.constexpr, NUM_CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                        TURNS: gl.constexpr = True, OVERLAP: gl.constexpr = False):
    """dQ (and delta) of one tile of 64·NUM_CONSUMERS query rows of one (batch, head), causal; the last query tiles
    (most keys) first."""
    dtype: gl.constexpr = Q.dtype.element_ty
    BLOCK_M: gl.constexpr = NUM_CONSUMERS * ROWS_PER_CONSUMER
    start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS_PER_CONSUMER, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_desc = tma.make_tensor_descriptor(Q + b * stride_qb + h * stride_qh, shape=[N, HEAD_DIM], strides=[stride_qn, 1],
                                        block_shape=[ROWS_PER_CONSUMER, HEAD_DIM], layout=q_layout)
    do_desc = tma.make_tensor_descriptor(DO + b * stride_dob + h * stride_doh, shape=[N, HEAD_DIM],
                                         strides=[stride_don, 1], block_shape=[ROWS_PER_CONSUMER, HEAD_DIM],
                                         layout=q_layout)
    k_desc = tma.make_tensor_descriptor(K + b * stride_kb + h * stride_kh, shape=[N, HEAD_DIM], strides=[stride_kn, 1],
                                        block_shape=[BLOCK_N, HEAD_DIM], layout=kv_layout)
    v_desc = tma.make_tensor_descriptor(V + b * stride_vb + h * stride_vh, shape=[N, HEAD_DIM], strides=[stride_vn, 1],
                                        block_shape=[BLOCK_N, HEAD_DIM], layout=kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, ROWS_PER_CONSUMER, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, ROWS_PER_CONSUMER, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    qdo_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(qdo_ready.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=NUM_CONSUMERS)
    fence_async_shared()
    num_tiles = gl.cdiv(gl.minimum(start_m + BLOCK_M, N), BLOCK_N)  # key tiles up to the diagonal

    shared = (q_smem, do_smem, k_smem, v_smem, qdo_ready, kv_ready, kv_empty, turn,
              O, DO, LSE, DELTA, DQ, b, h, bh, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don,
              stride_dqb, stride_dqh, stride_dqn, stride_lse, stride_delta, N, start_m, num_tiles, qk_scale, sm_scale)
    loads = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qdo_ready, kv_ready, kv_empty,
             start_m, num_tiles)
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([(_dq_consumer, (shared, gl.constexpr(0), NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, TURNS,
                                            OVERLAP)),
                            (_dq_consumer, (shared, gl.constexpr(1), NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, TURNS,
                                            OVERLAP)),
                            (_dq_producer, (loads, NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_dq_consumer, (shared, gl.constexpr(0), NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, TURNS,
                                            OVERLAP)),
                            (_dq_consumer, (shared, gl.constexpr(1), NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, TURNS,
                                            OVERLAP)),
                            (_dq_consumer, (shared, gl.constexpr(2), NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, TURNS,
                                            OVERLAP)),
                            (_dq_producer, (loads, NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


def launch_dq_pingpong(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, stride_lse: int,
                       delta: Tensor, stride_delta: int, dq: Tensor, sm_scale: float, qk_scale: float, consumers: int,
                       block_n: int, stages: int, turns: bool = True, overlap: bool = False,
                       consumer_regs: int | None = None) -> None:
    """Write the causal dQ of q, k, v, do (B, H, N, D) into dq (q's shape, contiguous last dimension) and
    delta = rowsum(dO ∘ O) into delta's rows (fp32, t + (b·H + h)·stride). Same scope as launch_dkdv_pingpong."""
    B, H, N, D = q.shape
    grid = (-(-N // (consumers * ROWS_PER_CONSUMER.value)), B * H)
    _pingpong_dq_kernel[grid](
        q, k, v, do, o, lse, delta, dq, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        o.stride(0), o.stride(1), o.stride(2), dq.stride(0), dq.stride(1), dq.stride(2),
        stride_lse, stride_delta, H, N, qk_scale, sm_scale,
        HEAD_DIM=D, NUM_CONSUMERS=consumers, BLOCK_N=block_n, STAGES=stages,
        CONSUMER_REGS=consumer_regs or CONSUMER_REGS[consumers], PRODUCER_REGS=PRODUCER_REGS, TURNS=turns,
        OVERLAP=overlap, num_warps=4)

"""The FlashAttention backward on Hopper, warp-specialized, in Gluon (Triton's explicit-layout dialect), for the
causal sizes where it is faster than the Triton kernels of triton_kernels.py (kernels/NOTES.md P, Q), and for ring
attention's blocks:

    P = exp2(Q Kᵀ · scale·log2e − LSE),  dP = dO Vᵀ,  dS = P ∘ (dP − delta),  delta = rowsum(dO ∘ O)
    dV = Pᵀ dO,  dK = scale · dSᵀ Q,  dQ = scale · dS K                       (the same outputs as triton_kernels.py)

Two kernels, each splitting its warps by role (`gl.warp_specialize`) like the ping-pong forward
(forward.py):

- **dK/dV/dQ** (head_dim 64): the five-matmul backward. One producer warp loads the program's 128 keys (K, V) once,
  then streams the query tiles Q_t, dO_t and their LSE/delta rows through a ring of STAGES shared-memory buffers with
  TMA (ready[s]: the copies landed; empty[s]: both consumers are done with the buffer). Two consumer warpgroups own 64
  keys each: per tile a consumer issues Sᵀ_t, dPᵀ_t and the previous tile's dV, dK matmuls, waits for the scores only,
  computes Pᵀ_t, dSᵀ_t while its accumulation runs, and hands dSᵀ_t to shared memory. A third warpgroup reads both
  consumers' dSᵀ_t transposed, computes dQ_t = dS_t K over the 128 keys and adds it into an fp32 accumulator with a
  TMA reduce-add; the caller zeroes the accumulator and casts it to dq. So no kernel recomputes QKᵀ and dO·Vᵀ for dQ,
  at the price of an fp32 accumulator and a dQ whose summation order varies from run to run (not deterministic).
  Each program walks a list of key blocks: one per program as a plain grid (`launch_dkdv_dq`), or, persistent
  (`launch_dkdv_dq_persistent`, NOTES.md T; below 16K tokens), one program per SM over a host-made list (schedule.py),
  with K and V double-buffered so that a block's loads overlap the last one's tail. A block's dK, dV leave through
  shared memory by TMA (device.staged_by_tma: fresh 2-byte outputs), copied out while the next block starts.
- **dK/dV/dQ at head_dim 128** (NOTES.md V, W): there dK and dV take 128 registers per consumer, and a dQ warpgroup
  does not fit beside them. So, as in FlashAttention-3, each consumer computes half of dQ's columns itself from both
  consumers' dS (dS_t K[:, its half]) and reduce-adds them. It does so one tile behind: step t computes Sᵀ_t, dPᵀ_t,
  Pᵀ_t, dSᵀ_t, then issues dQ_{t−1} (both consumers stored dSᵀ_{t−1} by then) with dV_t and dK_t, so the consumers
  need not meet at every tile. The same kernel, with one K/V buffer (for shared memory) also when persistent (below
  8K tokens).
- **dQ** (head_dim 128, the seven-matmul backward's dQ half, deterministic): one program owns 128 query rows (two
  consumers of 64), keeps Q and dO, streams K_j, V_j; per tile S_j, dP_j and the previous tile's dQ matmul are
  issued and dS_j is computed while the dQ matmul runs. Each consumer also writes its rows' delta for the Triton
  dK/dV kernel.

Masks and GQA (`launch_dkdv_dq_masked`, a plain grid, or persistent for a window alone and for documents on a work
queue, one query head per item; the same kernel with the constexprs GQA, WINDOWED, DOCS, which leave the dense code as it was):
query i sees key j iff j <= i < end_j, end_j = min(j + window, the end of j's document), so each key block [start_n,
start_n + 128) is seen by the queries [start_n, end of its last key) and visits only those query tiles. The documents'
ends come from one binary search per token on the device before the launch (torch.searchsorted of the non-decreasing
ids: no host sync), so the kernel reads them with one load per key instead of searching per item. A tile runs without
the elementwise mask where every row of it sees every key of the consumer (past its last key and below end_key0). With
GQA an item is a K/V head's key block: its roles walk the group's query heads in turn through the same ring (counters
run on), the producer naming each query head in its copies' coordinates (its TMA descriptors span every head and are
made once per program), so dK and dV sum over the group in registers and no per-query-head K/V copy exists. A launch
whose grid leaves SMs idle (MQA, or GQA without masks) splits each group instead (`group_splits`, S chosen by the
schedule model): the kernel runs S virtual heads per K/V head (`kv_splits`: virtual head h reads K/V head h // S), each
walking its share of the group's query heads, and all S add their dK, dV into one fp32 dK, dV by atomic adds
(ACCUMULATE_DKDV = DKDV_ATOMIC_ADD; S partial copies of dK, dV took 2.02× the MHA kernel's memory at 8K tokens), rounded
into the caller's dtype after the launch; that fp32 pair may live in memory the caller writes only later
(`split_scratch`: dq's, launch.launch_backward_fused). The order of the S additions varies from run to run, as dQ's
reduce-adds do: this backward is not the deterministic one.

Ring attention's blocks (`launch_dkdv_dq_block`, for launch.launch_backward_block; the same kernel with the
constexprs FULL and ACCUMULATE_DKDV, which leave the code compiled without them as it was): a block off the
diagonal has no causal mask and N_Q query rows against N_K keys (2c × c or c × 2c on a zigzag shard), so with FULL
every key block visits every query tile from query 0 and never runs the elementwise mask; the lse and delta rows it
reads are the whole rows' (the final ones), as in any FlashAttention-2 backward split over key blocks. With
ACCUMULATE_DKDV dK, dV are added to the fp32 buffers they go to (ring attention's travelling accumulator) by a load,
an add and a store per element at the item's end (one program owns a key block's rows). dQ goes, as everywhere here,
by TMA reduce-add into an fp32 2-D array; the launcher points it straight at the caller's fp32 dq rows where their
strides allow (dq_acc_geometry), so a block adds its dQ in place, with no scratch and no conversion pass.

The consumers run free: ordering their matmuls by turns (as the forward does) was 5–12% slower here, since each step
already holds four (dK/dV) or three (dQ) matmuls against one exponential per score. Every matmul is retired within
its step (a wgmma result in flight at the loop's back-edge makes ptxas serialize them all, NOTES.md F). The register
file is split by role (setmaxnreg).

Scope: causal, fp16/bf16, head_dim 64 or 128 (dK/dV/dQ; the dQ kernel at 128), one length for queries and keys (the
dK/dV/dQ kernel: windows, document ids and GQA too; and, for ring attention's blocks, non-causal with N_Q a multiple
of 64 and N_K of 128, GQA, dK/dV added into fp32), TMA-aligned inputs, sm_90; the dK/dV/dQ kernel reads LSE and
delta rows through TMA, so their starts must be 16-byte aligned. dispatch.py's table picks these kernels (ring
attention's blocks: launch.gluon_block_ready); launch.py falls back to the Triton kernels otherwise.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from minigpt_kernels.device import staged_by_tma, strides3
from minigpt_kernels.gluon.common import (CONSUMER_REGS, PRODUCER_REGS, QUEUE_SLOTS, all_heads, all_rows,
                                          hand_out_ticket, head_rows, load_rows, mma_layout, program_items,
                                          store_rows, take_ticket, ticket_barriers, tma_load)
from minigpt_kernels.gluon.schedule import (DOCUMENTS_QUEUED_BACKWARD_HEAD_DIMS, MASKED_PERSISTENT_WAVES,
                                             device_one_each, device_plain_order, device_schedule, modelled_finish,
                                             sm_count)
from minigpt_kernels.relaunch import launch_kernel

TILE = gl.constexpr(64)  # keys (dK/dV) or query rows (dQ) per consumer warpgroup: the M of one wgmma
CONSUMERS = gl.constexpr(2)  # consumer warpgroups per program (the warp_specialize lists below name two)
# How a program's dK, dV reach memory (the constexpr ACCUMULATE_DKDV): written; added by a load, an add and a store
# (ring attention's travelling fp32 accumulator: one program owns the rows); added atomically (fp32: group_splits'
# programs share the rows of the one K/V head)
DKDV_WRITE, DKDV_ADD, DKDV_ATOMIC_ADD = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)
# registers per thread in the dK/dV/dQ kernel: 2 consumer warpgroups + the dQ warpgroup + the producer warp share the
# 64K register file (2·128·208 + 128·88 + 32·24 ≤ 65536); below 208 the consumers' wgmmas serialize (ptxas C7512)
FUSED_CONSUMER_REGS = 208
REDUCER_REGS = 88
# at head_dim 128: 2 consumers (dK, dV: 128 registers each, then their half of dQ) + the producer warp
SPLIT_CONSUMER_REGS = 240


# ------------------------------------------------------------------------------------------------
# dK, dV and dQ: a program owns 128 keys; the producer streams the query tiles Q_t, dO_t with their LSE and delta
# rows; a third warpgroup adds each tile's dQ into an fp32 accumulator
# ------------------------------------------------------------------------------------------------
@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[coord ...] += src (a shared-memory tile), by TMA (cp.reduce.async.bulk.tensor.add): Gluon 3.6 has the
    op but no wrapper for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _pT_dsT(sT, dpT, lse_smem, delta_smem, keys, rows, masked, qk_scale, dtype: gl.constexpr, tmask,
            WINDOWED: gl.constexpr, DOCS: gl.constexpr):
    """Pᵀ and dSᵀ of one tile (keys × queries) from Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, rounded to the input dtype. Rows past N
    read LSE = 0 and delta = 0 (TMA zero fill), so Pᵀ = 1 there; their Q and dO rows are 0 too, so they add exactly 0
    to dV (Pᵀ dO), and dSᵀ = Pᵀ ∘ (V dOᵀ − delta) = 0 adds 0 to dK and dQ, whatever the mask says of them.
    rows: the tile's query indices (a tensor along its columns: head_dim 64), or its first query's (a scalar: head_dim
    128). tmask = (span, -) where WINDOWED or DOCS (_tile_mask): query i sees key j iff j <= i < j + span_j."""
    col_layout: gl.constexpr = gl.SliceLayout(0, sT.type.layout)
    # Pᵀ = exp2(K Qᵀ · scale·log2e − LSE)
    pT = gl.exp2(sT * qk_scale - gl.expand_dims(lse_smem.load(col_layout), 0))
    if masked:  # a tile where some query i misses some key j of this consumer: P_ij = 0 there
        if isinstance(rows, gl.tensor) and rows.type.is_block():  # head_dim 64: i against j and j + span_j
            # (two compares spill less here than one of i − j: 21 STL in the kernel against 119, triton 3.9)
            if WINDOWED or DOCS:  # causal, the window and the document: j <= i < j + span_j
                visible = (gl.expand_dims(rows, 0) >= gl.expand_dims(keys, 1)) & \
                    (gl.expand_dims(rows, 0) < gl.expand_dims(keys, 1) + _expand_span(tmask[0]))
            else:  # causal: i >= j
                visible = gl.expand_dims(rows, 0) >= gl.expand_dims(keys, 1)
        else:  # head_dim 128: from d = i − j, i = rows + c for column c
            # A thread's 16 columns c of the wgmma accumulator are its lane's bits 1-2 (c & 6) or'ed with constants
            # (c & ~6), so d = (c & ~6) + ((c & 6) + rows − j) is one value per row and thread plus immediates. With
            # the query indices as a tensor (the item's, plus t·BLOCK_M) ptxas kept their 16 values a thread live
            # across the tile loop, spilled them at 240 registers and reloaded them on every masked tile (13-21 LDL
            # a tile loop, triton 3.6) rather than rebuild them. The adds wrap, so d is i − j bit for bit.
            c = gl.arange(0, sT.shape[1], layout=col_layout)
            d = gl.expand_dims(c & ~6, 0) + (gl.expand_dims(c & 6, 0) + gl.expand_dims(rows - keys, 1))
            if WINDOWED or DOCS:  # causal, the window and the document: 0 <= i − j < span_j as one unsigned compare
                # (two compares made ptxas pack the tile's predicates into bits: 147 LOP3, 807 instructions a tile
                # against 632)
                visible = d.to(gl.uint32, bitcast=True) < _expand_span(tmask[0]).to(gl.uint32, bitcast=True)
            else:  # causal: i >= j
                visible = d >= 0
        pT = gl.where(visible, pT, 0.0)
    # dSᵀ = Pᵀ ∘ (dPᵀ − delta)
    dsT = pT * (dpT - gl.expand_dims(delta_smem.load(col_layout), 0))
    return pT.to(dtype), dsT.to(dtype)


@gluon.jit
def _expand_span(span):
    """_tile_mask's span (a scalar: the window; or one per key), broadcastable over a tile's columns."""
    if isinstance(span, gl.tensor) and span.type.is_block():
        span = gl.expand_dims(span, 1)
    return span


@gluon.jit
def _hand_over(ds_smem, ds_ready, ds_free, dsT16, t, ME: gl.constexpr):
    """This consumer's dSᵀ_t into shared buffer t % 2 for the dQ warpgroup, once that has read what the buffer held
    (tile t − 2). The store is fenced for the tensor cores (async proxy) before the arrive."""
    u = t % 2
    mbarrier.wait(ds_free.index(u), ((t // 2) & 1) ^ 1)
    ds_smem.index(u * CONSUMERS + ME).store(dsT16)
    fence_async_shared()
    mbarrier.arrive(ds_ready.index(u), count=1)


@gluon.jit
def _tile_scores(k, v, q_smem, do_smem, lse_smem, delta_smem, ready, ds_smem, ds_ready, ds_free, t, ME: gl.constexpr,
                 STAGES: gl.constexpr, zero_s, keys, rows, masked, qk_scale, a_layout: gl.constexpr, tmask,
                 WINDOWED: gl.constexpr, DOCS: gl.constexpr):
    """Query tile t (ring position t) with nothing else in flight: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ, then Pᵀ, dSᵀ and the
    hand-over (a key block's first tile; every tile of the head_dim-128 kernel). Returns (Pᵀ, dSᵀ) as register
    operands of the dV, dK matmuls."""
    mbarrier.wait(ready.index(t % STAGES), (t // STAGES) & 1)
    sT = warpgroup_mma(k, q_smem.index(t % STAGES).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dpT = warpgroup_mma(v, do_smem.index(t % STAGES).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    sT, dpT = warpgroup_mma_wait(0, deps=(sT, dpT))
    pT16, dsT16 = _pT_dsT(sT, dpT, lse_smem.index(t % STAGES), delta_smem.index(t % STAGES), keys, rows, masked,
                          qk_scale, q_smem.dtype, tmask, WINDOWED, DOCS)
    _hand_over(ds_smem, ds_ready, ds_free, dsT16, t, ME)
    return gl.convert_layout(pT16, a_layout), gl.convert_layout(dsT16, a_layout)


@gluon.jit
def _dkdv_step(k, v, q_smem, do_smem, lse_smem, delta_smem, ready, empty, ds_smem, ds_ready, ds_free, t,
               ME: gl.constexpr, STAGES: gl.constexpr, zero_s, dv, dk, pT16, dsT16, keys, cols, masked, qk_scale,
               a_layout: gl.constexpr, tmask, WINDOWED: gl.constexpr, DOCS: gl.constexpr):
    """One query tile at ring position t: issue Sᵀ_t = K Q_tᵀ, dPᵀ_t = V dO_tᵀ, then dV += Pᵀ_{t−1} dO_{t−1} and
    dK += dSᵀ_{t−1} Q_{t−1}; wait for Sᵀ_t, dPᵀ_t only (wgmma groups retire in order) and compute Pᵀ_t, dSᵀ_t and the
    hand-over while dV and dK still run; then release tile t−1's buffers. Returns (dV, dK, Pᵀ_t, dSᵀ_t)."""
    stage = t % STAGES
    prev = (t - 1) % STAGES
    mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
    sT = warpgroup_mma(k, q_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dpT = warpgroup_mma(v, do_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dv = warpgroup_mma(pT16, do_smem.index(prev), dv, is_async=True)
    dk = warpgroup_mma(dsT16, q_smem.index(prev), dk, is_async=True)
    sT, dpT = warpgroup_mma_wait(2, deps=(sT, dpT))
    pT16_t, dsT16_t = _pT_dsT(sT, dpT, lse_smem.index(stage), delta_smem.index(stage), keys, cols, masked, qk_scale,
                              q_smem.dtype, tmask, WINDOWED, DOCS)
    _hand_over(ds_smem, ds_ready, ds_free, dsT16_t, t, ME)
    dv, dk, pT16, dsT16 = warpgroup_mma_wait(0, deps=(dv, dk, pT16, dsT16))
    mbarrier.arrive(empty.index(prev), count=1)  # tile t−1's buffers no longer read by this consumer
    return dv, dk, gl.convert_layout(pT16_t, a_layout), gl.convert_layout(dsT16_t, a_layout)


@gluon.jit
def _dkdv_last(q_smem, do_smem, t, STAGES: gl.constexpr, dv, dk, pT16, dsT16):
    """The last tile's (ring position t) dV += Pᵀ dO and dK += dSᵀ Q."""
    dv = warpgroup_mma(pT16, do_smem.index(t % STAGES), dv, is_async=True)
    dk = warpgroup_mma(dsT16, q_smem.index(t % STAGES), dk, is_async=True)
    dv, dk, pT16, dsT16 = warpgroup_mma_wait(0, deps=(dv, dk, pT16, dsT16))
    return dv, dk


@gluon.jit
def _write_dkdv(dk, dv, DK, DV, b, h, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, N, key0,
                sm_scale, HEAD_DIM: gl.constexpr, ACCUMULATE: gl.constexpr, by_tma=None, ME: gl.constexpr = 0,
                DKDV_TMA: gl.constexpr = False):
    """dK (scaled: dS was taken w.r.t. the scaled scores) and dV of this consumer's 64 keys; keys past N not written.
    ACCUMULATE (DKDV_*): DKDV_WRITE stores them; DKDV_ADD adds them to what DK, DV (fp32) hold (ring attention's
    travelling accumulator), a load, an add and a store, since one program owns a key block's rows (with GQA its K/V
    head's, the group summed); DKDV_ATOMIC_ADD adds them atomically (fp32; group_splits' virtual heads share rows).
    DKDV_TMA (DKDV_WRITE of 2-byte, TMA-aligned outputs at head_dim 64: staged_by_tma): into this consumer (ME)'s two
    shared staging buffers instead, copied out by TMA while the consumer goes on (by_tma = (dK's descriptor, dV's,
    the staging buffers); the descriptors end at N)."""
    d_layout: gl.constexpr = dk.type.layout
    dk = dk * sm_scale
    if DKDV_TMA:
        BOX: gl.constexpr = [1, 1, TILE, HEAD_DIM]
        dk_desc, dv_desc, staging = by_tma
        tma.store_wait(0)  # the last item's copies have read the staging buffers
        staging.index(2 * ME).store(dk.to(staging.dtype))
        staging.index(2 * ME + 1).store(dv.to(staging.dtype))
        fence_async_shared()
        store_rows(dk_desc, [b.to(gl.int32), h.to(gl.int32), key0, 0], staging.index(2 * ME), BOX)
        store_rows(dv_desc, [b.to(gl.int32), h.to(gl.int32), key0, 0], staging.index(2 * ME + 1), BOX)
    else:  # from registers
        out_keys = key0 + gl.arange(0, TILE, layout=gl.SliceLayout(1, d_layout))
        out_cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, d_layout)), 0)
        rows64 = gl.expand_dims(out_keys.to(gl.int64), 1)
        mask = gl.expand_dims(out_keys < N, 1)
        dk_ptrs = DK + b * stride_dkb + h * stride_dkh + rows64 * stride_dkn + out_cols
        dv_ptrs = DV + b * stride_dvb + h * stride_dvh + rows64 * stride_dvn + out_cols
        if ACCUMULATE == DKDV_ATOMIC_ADD:  # the other splits of the group add into the same rows
            gl.atomic_add(dk_ptrs, dk, mask=mask, sem="relaxed")
            gl.atomic_add(dv_ptrs, dv, mask=mask, sem="relaxed")
        else:
            if ACCUMULATE == DKDV_ADD:  # dK_j += this block's dK_j (old dK and dV are not live together)
                dk = dk + gl.load(dk_ptrs, mask=mask, other=0.0)
            gl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=mask)
            if ACCUMULATE == DKDV_ADD:  # dV_j += this block's dV_j
                dv = dv + gl.load(dv_ptrs, mask=mask, other=0.0)
            gl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask)


@gluon.jit
def _dq_tile(k0, k1, ds_smem, dq_smem, ds_ready, ds_free, dq_desc, t, row, col, zero, sm_scale):
    """The dQ warpgroup's tile at hand-over position t: dQ_t = scale · Σ_c dS_t[:, keys of c] K_c (dS_t = (dSᵀ_t)ᵀ:
    the stored tiles read transposed), staged in fp32 shared memory and added into the accumulator's rows from `row`
    on (columns from `col` on) by a TMA reduce-add, which runs while the next tile's matmul does."""
    u = t % 2
    mbarrier.wait(ds_ready.index(u), (t // 2) & 1)
    dq = warpgroup_mma(ds_smem.index(u * CONSUMERS).permute((1, 0)), k0, zero, use_acc=False, is_async=True)
    dq = warpgroup_mma(ds_smem.index(u * CONSUMERS + 1).permute((1, 0)), k1, dq, is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq,))
    mbarrier.arrive(ds_free.index(u), count=1)  # the consumers may overwrite buffer u
    _reduce_add_dq(dq_smem.index(u), dq, dq_desc, row, col, sm_scale, 1)  # its last reduce was two tiles ago


@gluon.jit
def _reduce_add_dq(staging, dq, dq_desc, row, col, sm_scale, PENDING: gl.constexpr):
    """DQ_ACC[row:, col:] += scale · dq, through the fp32 shared buffer `staging` by a TMA reduce-add, once at most
    PENDING reduces issued before are still reading their buffers (the last one from `staging` among the done)."""
    tma.store_wait(PENDING)
    staging.store(dq * sm_scale)  # dS was taken w.r.t. the scaled scores
    fence_async_shared()
    _tma_reduce_add(dq_desc, [row, col], staging)  # rows past the array's end are clipped by TMA


@gluon.jit
def _init_hand_over(ds_ready, ds_free, SPLIT_DQ: gl.constexpr):
    """The dSᵀ hand-over's two buffers: ready once both consumers stored theirs; free once their reader is done with
    them, the dQ warpgroup, or at head_dim 128 (SPLIT_DQ) both consumers, which compute dQ themselves."""
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=CONSUMERS)
        mbarrier.init(ds_free.index(i), count=CONSUMERS if SPLIT_DQ else 1)


# ------------------------------------------------------------------------------------------------
# dkdvdq_kernel's consumers at head_dim 128: dQ split between them (FlashAttention-3's split), no dQ warpgroup
# ------------------------------------------------------------------------------------------------
@gluon.jit
def _dq_split_issue(k0, k1, ds_smem, ds_ready, t, zero_q):
    """Issue this consumer's columns of dQ_t = dS_t K (both consumers' keys, K's columns 64·ME ...) once both consumers
    stored dSᵀ_t; the caller retires it."""
    u = t % 2
    mbarrier.wait(ds_ready.index(u), (t // 2) & 1)
    dq = warpgroup_mma(ds_smem.index(u * CONSUMERS).permute((1, 0)), k0, zero_q, use_acc=False, is_async=True)
    return warpgroup_mma(ds_smem.index(u * CONSUMERS + 1).permute((1, 0)), k1, dq, is_async=True)


@gluon.jit
def _dkdv_dq_split_step(k, v, k0, k1, q_smem, do_smem, lse_smem, delta_smem, ready, empty, ds_smem, ds_ready, ds_free,
                        dq_smem, dq_desc, t, dq_row, dq_col, ME: gl.constexpr, STAGES: gl.constexpr, zero_s, zero_q, dv,
                        dk, keys, q, masked, qk_scale, sm_scale, a_layout: gl.constexpr, tmask,
                        WINDOWED: gl.constexpr, DOCS: gl.constexpr):
    """Query tile t ≥ 1 (ring position t), with the previous tile's dQ one step behind: Sᵀ_t, dPᵀ_t, Pᵀ_t, dSᵀ_t and
    the hand-over (_tile_scores); then issue this consumer's columns of dQ_{t−1}, dV += Pᵀ_t dO_t and dK += dSᵀ_t Q_t;
    retire dQ_{t−1} (wgmma groups retire in order) and start its reduce-add (rows from dq_row on, columns from dq_col
    on) while dV and dK run. Waiting for the other consumer's dSᵀ one step late lets the two drift apart, so that one's
    softmax can overlap the other's matmuls (they met at every tile before). q: the tile's first query. Returns (dV,
    dK)."""
    stage = t % STAGES
    pT16, dsT16 = _tile_scores(k, v, q_smem, do_smem, lse_smem, delta_smem, ready, ds_smem, ds_ready, ds_free, t, ME,
                               STAGES, zero_s, keys, q, masked, qk_scale, a_layout, tmask, WINDOWED, DOCS)
    dq = _dq_split_issue(k0, k1, ds_smem, ds_ready, t - 1, zero_q)
    dv = warpgroup_mma(pT16, do_smem.index(stage), dv, is_async=True)
    dk = warpgroup_mma(dsT16, q_smem.index(stage), dk, is_async=True)
    dq = warpgroup_mma_wait(2, deps=(dq,))
    mbarrier.arrive(ds_free.index((t - 1) % 2), count=1)  # both consumers' arrivals free the buffer of dSᵀ_{t−1}
    _reduce_add_dq(dq_smem.index(ME), dq, dq_desc, dq_row, dq_col, sm_scale, 0)
    dv, dk, pT16, dsT16 = warpgroup_mma_wait(0, deps=(dv, dk, pT16, dsT16))
    mbarrier.arrive(empty.index(stage), count=1)  # tile t's buffers no longer read by this consumer
    return dv, dk


@gluon.jit
def _split_key_block(k, v, k0, k1, q_smem, do_smem, lse_smem, delta_smem, ready, empty, ds_smem, ds_ready, ds_free,
                     dq_smem, dq_desc, g, num_tiles, row0, col, ME: gl.constexpr, STAGES: gl.constexpr, zero_s, zero_q,
                     dv, dk, keys, q0, qk_scale, sm_scale, a_layout: gl.constexpr, BLOCK_M: gl.constexpr, tmask,
                     WINDOWED: gl.constexpr, DOCS: gl.constexpr, FULL: gl.constexpr):
    """One key block's share of one query head in the head_dim-128 kernel: its query tiles at ring positions g ...
    g + num_tiles − 1 (tile t holds queries q0 + t·BLOCK_M ...), tile 0 without a dQ behind it, the steps, then the
    last tile's dQ. Its dQ columns go to accumulator rows row0 ... and columns col ...; every read of K and V has
    retired on return. Returns (dV, dK)."""
    MASKED_TILES: gl.constexpr = 0 if FULL else (TILE * (ME + 1) + BLOCK_M - 1) // BLOCK_M  # as _dkdv_query_head
    MASKS: gl.constexpr = WINDOWED or DOCS
    pT16, dsT16 = _tile_scores(k, v, q_smem, do_smem, lse_smem, delta_smem, ready, ds_smem, ds_ready, ds_free, g, ME,
                               STAGES, zero_s, keys, q0, 0 < MASKED_TILES, qk_scale, a_layout, tmask, WINDOWED, DOCS)
    dv, dk = _dkdv_last(q_smem, do_smem, g, STAGES, dv, dk, pT16, dsT16)
    mbarrier.arrive(empty.index(g % STAGES), count=1)
    for t in range(1, num_tiles):
        dv, dk = _dkdv_dq_split_step(k, v, k0, k1, q_smem, do_smem, lse_smem, delta_smem, ready, empty, ds_smem,
                                     ds_ready, ds_free, dq_smem, dq_desc, g + t, row0 + (t - 1) * BLOCK_M, col, ME,
                                     STAGES, zero_s, zero_q, dv, dk, keys, q0 + t * BLOCK_M,
                                     _masked_tile(t, MASKED_TILES, tmask, MASKS), qk_scale, sm_scale, a_layout, tmask,
                                     WINDOWED, DOCS)
    last = g + num_tiles - 1
    dq = _dq_split_issue(k0, k1, ds_smem, ds_ready, last, zero_q)
    dq = warpgroup_mma_wait(0, deps=(dq,))
    mbarrier.arrive(ds_free.index(last % 2), count=1)
    _reduce_add_dq(dq_smem.index(ME), dq, dq_desc, row0 + (num_tiles - 1) * BLOCK_M, col, sm_scale, 0)
    return dv, dk


# ------------------------------------------------------------------------------------------------
# The dK/dV/dQ kernel: each program walks a list of (batch·head, 128-key block) items, one (a plain grid) or many.
# With GQA an item's head is a K/V head, whose group of query heads the item's roles walk in turn; with masks
# (WINDOWED, DOCS) an item visits only the query tiles that see its keys.
# ------------------------------------------------------------------------------------------------
@gluon.jit
def _item_heads(H, group, GQA: gl.constexpr):
    """The heads the work list's items run over: the K/V heads with GQA (H query heads in groups of `group`), else
    the H heads."""
    if GQA:
        heads = H // group
    else:
        heads = H
    return heads


@gluon.jit
def _batch_ends(mask, b, DOCS: gl.constexpr):
    """Batch b's row of document ends (mask = (window, DOC_ENDS, stride_ends)); DOC_ENDS itself without DOCS (never
    read)."""
    if DOCS:
        ends = mask[1] + b * mask[2]
    else:
        ends = mask[1]
    return ends


@gluon.jit
def _query_end(start_n, N, mask, ends, WINDOWED: gl.constexpr, DOCS: gl.constexpr):
    """The end of the queries that see a key of the block from start_n. Query i sees key j iff j <= i (causal),
    i < j + window (WINDOWED: i − window < j), and i lies before the end of j's document (DOCS); each bound grows
    with j, so the block's last key j gives the block's: min(N, j + window, the end of j's document). Every key
    sees itself, so the span is [start_n, end), never empty, and contiguous (the union of [j, end_j), j = start_n
    ... last, with end_j > j non-decreasing)."""
    last = gl.minimum(start_n + CONSUMERS * TILE, N) - 1
    end = N
    if WINDOWED:
        end = gl.minimum(end, last + mask[0])
    if DOCS:  # the first query after the last key's document (at least last + 1 also for ids that decrease,
        # which the contract excludes: every role must take the same tiles, >= 1, or the pipeline would hang)
        end = gl.minimum(end, gl.maximum(gl.load(ends + last), last + 1))
    return end


@gluon.jit
def _key_block(WORK, index, n_kblocks, N, BLOCK_M: gl.constexpr, heads, mask, WINDOWED: gl.constexpr,
               DOCS: gl.constexpr, n_q, FULL: gl.constexpr):
    """Item `index` of the list: (batch·head, first key, query tiles from that key on): to the end (causal), or
    with masks to the end of the queries that see the block (_query_end); FULL (no causal mask): all n_q queries'
    tiles, from query 0 on (_query_origin). heads: _item_heads."""
    item = gl.load(WORK + index)
    start_n = (item % n_kblocks) * (CONSUMERS * TILE)
    bh = item // n_kblocks
    if FULL:  # every query sees every key: the block visits each query tile
        num_tiles = gl.cdiv(n_q, BLOCK_M)
    elif WINDOWED or DOCS:
        ends = _batch_ends(mask, (bh // heads).to(gl.int64), DOCS)
        num_tiles = gl.cdiv(_query_end(start_n, N, mask, ends, WINDOWED, DOCS) - start_n, BLOCK_M)
    else:
        num_tiles = gl.cdiv(N - start_n, BLOCK_M)
    return bh, start_n, num_tiles


@gluon.jit
def _query_origin(start_n, FULL: gl.constexpr):
    """The first query row of the tiles a key block visits: its own first key (causal: no earlier query sees it), or
    query 0 (FULL: every query sees every key)."""
    if FULL:
        origin = 0
    else:
        origin = start_n
    return origin


@gluon.jit
def _query_count(N, n_q, FULL: gl.constexpr):
    """The number of queries: N, the keys' (causal: one length), or n_q (FULL: N_Q query rows against N keys)."""
    if FULL:
        count = n_q
    else:
        count = N
    return count


@gluon.jit
def _tile_mask(mask, bh, heads, key0, keys, start_n, N, BLOCK_M: gl.constexpr, WINDOWED: gl.constexpr,
               DOCS: gl.constexpr):
    """What _pT_dsT and _masked_tile read for one consumer's keys key0 ... key0 + 63 of the item (bh, start_n):
    (span, full_tiles). Key j is seen by the queries j <= i < end_j = j + span_j, end_j = min(j +
    window, the end of j's document) (span: the window alone without documents; 0 for keys past N). Ends never
    decrease with j, so every query i >= key0 + 63 (the causal part, _masked_tile's) with i < end_key0 sees all
    these keys; full_tiles counts the query tiles (from the block's first) whose rows before N all lie below
    end_key0. Unused placeholders without masks."""
    if WINDOWED or DOCS:
        if WINDOWED:  # i − window < j  ⇔  i < j + window
            span = mask[0]
            full_end = gl.minimum(key0 + mask[0], N)
        if DOCS:  # ids[i] == ids[j] with i >= j  ⇔  i < the end of j's document
            ends = _batch_ends(mask, (bh // heads).to(gl.int64), DOCS)
            doc_span = gl.maximum(gl.load(ends + keys, mask=keys < N, other=0) - keys, 0)
            doc_end = gl.load(ends + gl.minimum(key0, N - 1))
            if WINDOWED:
                span = gl.minimum(doc_span, span)
                full_end = gl.minimum(full_end, doc_end)
            else:
                span = doc_span
                full_end = doc_end
        # tile t holds rows start_n + t·BLOCK_M ... + BLOCK_M − 1, clipped to N: all are full if full_end reaches N
        full_tiles = gl.where(full_end >= N, gl.cdiv(N - start_n, BLOCK_M),
                              gl.maximum(full_end - start_n, 0) // BLOCK_M)
        tmask = (span, full_tiles)
    else:
        tmask = (0, 0)
    return tmask


@gluon.jit
def _masked_tile(t, MASKED_TILES: gl.constexpr, tmask, MASKS: gl.constexpr):
    """Whether query tile t of the block needs the elementwise mask for this consumer's keys: it reaches below the
    consumer's last key (t < MASKED_TILES: the causal diagonal), or, with masks, one of its rows misses one of the
    keys by the window or the documents (t >= full_tiles, _tile_mask). Never without a diagonal or masks
    (MASKED_TILES = 0: FULL), as a constant, so the mask's code is not compiled in."""
    if MASKED_TILES == 0 and not MASKS:
        masked = False
    else:
        masked = t < MASKED_TILES
        if MASKS:
            masked = masked | (t >= tmask[1])
    return masked


@gluon.jit
def _group_origin(bh, heads, group, qh, acc_rows_b, acc_rows_h, acc_cols_h, start_n):
    """GQA: (row, column) of the dQ accumulator where query head qh of item bh's group (query head
    (bh % heads)·group + qh of batch bh // heads) adds query start_n's row."""
    h = (bh % heads) * group + qh
    return (bh // heads) * acc_rows_b + h * acc_rows_h + start_n, h * acc_cols_h


@gluon.jit
def _dkdv_query_head(k, v, q_smem, do_smem, lse_smem, delta_smem, ready, empty, ds_smem, ds_ready, ds_free, kv_free,
                     buf, release_kv, g, num_tiles, ME: gl.constexpr, STAGES: gl.constexpr, zero_s, dk, dv, keys, cols,
                     qk_scale, a_layout: gl.constexpr, BLOCK_M: gl.constexpr, tmask, WINDOWED: gl.constexpr,
                     DOCS: gl.constexpr, FULL: gl.constexpr):
    """One query head's share of a key block (head_dim 64): its query tiles at ring positions g ... g + num_tiles − 1
    (tile t holds queries cols + t·BLOCK_M), dV += Pᵀ dO and dK += dSᵀ Q, each tile's dSᵀ handed to the dQ
    warpgroup; tile 0 alone, then a step per tile, then the last tile's dV, dK. release_kv: the block's last query
    head, whose last Sᵀ, dPᵀ are the last reads of K and V: release their buffer (kv_free[buf]) once those have
    retired. Returns (dV, dK)."""
    # query tiles (counted from the block's first key) that reach below this consumer's last key get the mask;
    # none without the causal mask (FULL)
    MASKED_TILES: gl.constexpr = 0 if FULL else (TILE * (ME + 1) + BLOCK_M - 1) // BLOCK_M
    MASKS: gl.constexpr = WINDOWED or DOCS
    pT16, dsT16 = _tile_scores(k, v, q_smem, do_smem, lse_smem, delta_smem, ready, ds_smem, ds_ready, ds_free, g,
                               ME, STAGES, zero_s, keys, cols, 0 < MASKED_TILES, qk_scale, a_layout, tmask, WINDOWED,
                               DOCS)
    for t in range(1, num_tiles):
        dv, dk, pT16, dsT16 = _dkdv_step(k, v, q_smem, do_smem, lse_smem, delta_smem, ready, empty, ds_smem,
                                         ds_ready, ds_free, g + t, ME, STAGES, zero_s, dv, dk, pT16, dsT16, keys,
                                         cols + t * BLOCK_M, _masked_tile(t, MASKED_TILES, tmask, MASKS), qk_scale,
                                         a_layout, tmask, WINDOWED, DOCS)
    if release_kv:
        mbarrier.arrive(kv_free.index(buf), count=1)  # the last Sᵀ, dPᵀ (K, V) have retired
    dv, dk = _dkdv_last(q_smem, do_smem, g + num_tiles - 1, STAGES, dv, dk, pT16, dsT16)
    mbarrier.arrive(empty.index((g + num_tiles - 1) % STAGES), count=1)
    return dv, dk


@gluon.jit
def _dkdv_consumer_item(shared, dkdv_out, consts, index, i, g, ME: gl.constexpr, HEAD_DIM: gl.constexpr,
                        BLOCK_M: gl.constexpr, STAGES: gl.constexpr, GQA: gl.constexpr, WINDOWED: gl.constexpr,
                        DOCS: gl.constexpr, FULL: gl.constexpr, ACCUMULATE_DKDV: gl.constexpr,
                        DKDV_TMA: gl.constexpr):
    """_dkdv_consumer's work on item `index`, the program's i-th, from ring position g; returns the position after."""
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, kv_free, ready, empty, ds_smem, ds_ready,
     ds_free, DK, DV, H, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
     N, qk_scale, sm_scale, WORK, WORK_START, n_kblocks, mask, group, n_q, kv_splits, _tickets) = shared
    zero_s, heads = consts
    s_layout: gl.constexpr = mma_layout(BLOCK_M, 4)
    d_layout: gl.constexpr = mma_layout(HEAD_DIM, 4)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    KV_BUFS: gl.constexpr = k_smem.shape[0] // CONSUMERS
    bh, start_n, num_tiles = _key_block(WORK, index, n_kblocks, N, BLOCK_M, heads, mask, WINDOWED, DOCS, n_q, FULL)
    buf = i % KV_BUFS
    key0 = start_n + ME * TILE
    keys = key0 + gl.arange(0, TILE, layout=gl.SliceLayout(1, s_layout))
    cols = _query_origin(start_n, FULL) + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    tmask = _tile_mask(mask, bh, heads, key0, keys, start_n, N, BLOCK_M, WINDOWED, DOCS)
    dk = gl.zeros([TILE, HEAD_DIM], gl.float32, layout=d_layout)
    dv = gl.zeros([TILE, HEAD_DIM], gl.float32, layout=d_layout)
    k = k_smem.index(buf * CONSUMERS + ME)
    v = v_smem.index(buf * CONSUMERS + ME)
    mbarrier.wait(kv_ready.index(buf * CONSUMERS + ME), (i // KV_BUFS) & 1)
    if GQA:  # the group's query heads in turn, each num_tiles ring positions on
        for qh in range(group):
            dv, dk = _dkdv_query_head(k, v, q_smem, do_smem, lse_smem, delta_smem, ready, empty, ds_smem,
                                      ds_ready, ds_free, kv_free, buf, qh == group - 1, g, num_tiles, ME, STAGES,
                                      zero_s, dk, dv, keys, cols, qk_scale, a_layout, BLOCK_M, tmask, WINDOWED,
                                      DOCS, FULL)
            g += num_tiles
    else:
        dv, dk = _dkdv_query_head(k, v, q_smem, do_smem, lse_smem, delta_smem, ready, empty, ds_smem, ds_ready,
                                  ds_free, kv_free, buf, True, g, num_tiles, ME, STAGES, zero_s, dk, dv, keys,
                                  cols, qk_scale, a_layout, BLOCK_M, tmask, WINDOWED, DOCS, FULL)
        g += num_tiles
    _write_dkdv(dk, dv, DK, DV, (bh // heads).to(gl.int64), ((bh % heads) // kv_splits).to(gl.int64), stride_dkb,
                stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, N, key0, sm_scale, HEAD_DIM,
                ACCUMULATE_DKDV, dkdv_out, ME, DKDV_TMA)
    return g


@gluon.jit
def _dkdv_consumer(shared, dkdv_out, ME: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                   STAGES: gl.constexpr, PERSISTENT: gl.constexpr, QUEUE: gl.constexpr, GQA: gl.constexpr,
                   WINDOWED: gl.constexpr, DOCS: gl.constexpr, FULL: gl.constexpr, ACCUMULATE_DKDV: gl.constexpr,
                   DKDV_TMA: gl.constexpr):
    """Consumer warpgroup ME (head_dim 64): for each of this program's items (QUEUE: as the producer takes them from
    the work queue, common.take_ticket), dK, dV of keys start_n + 64·ME ... + 63 over the query tiles from the
    block's first key on (tile t holds queries start_n + t·BLOCK_M ...; FULL: every query tile from query 0), handing
    each tile's dSᵀ to the dQ warpgroup; with GQA over each query head of the K/V head's group in turn, into the same
    dK, dV, written (or with ACCUMULATE_DKDV added) at the item's end; with DKDV_TMA through shared memory by TMA
    (dkdv_out), copied out while the next item starts. The ring and hand-over counters run on across items and query
    heads (g: the query tiles streamed before); K and V take turns in KV_BUFS buffers (2 where a program has many
    items), each released to the producer (kv_free) after the item's last matmul that reads it."""
    (_k_smem, _v_smem, _q_smem, _do_smem, _lse_smem, _delta_smem, _kv_ready, _kv_free, _ready, _empty, _ds_smem,
     _ds_ready, _ds_free, _DK, _DV, H, _stride_dkb, _stride_dkh, _stride_dkn, _stride_dvb, _stride_dvh, _stride_dvn,
     _N, _qk_scale, _sm_scale, _WORK, WORK_START, _n_kblocks, _mask, group, _n_q, _kv_splits, tickets) = shared
    s_layout: gl.constexpr = mma_layout(BLOCK_M, 4)
    consts = (gl.zeros([TILE, BLOCK_M], gl.float32, layout=s_layout), _item_heads(H, group, GQA))
    g = 0
    if QUEUE:
        i = 0
        index = take_ticket(WORK_START, tickets, i)
        while index >= 0:
            g = _dkdv_consumer_item(shared, dkdv_out, consts, index, i, g, ME, HEAD_DIM, BLOCK_M, STAGES, GQA,
                                    WINDOWED, DOCS, FULL, ACCUMULATE_DKDV, DKDV_TMA)
            i += 1
            index = take_ticket(WORK_START, tickets, i)
    else:
        first, count = program_items(WORK_START, PERSISTENT)
        for i in range(count):
            g = _dkdv_consumer_item(shared, dkdv_out, consts, first + i, i, g, ME, HEAD_DIM, BLOCK_M, STAGES, GQA,
                                    WINDOWED, DOCS, FULL, ACCUMULATE_DKDV, DKDV_TMA)
    if DKDV_TMA:
        tma.store_wait(0)


@gluon.jit
def _dkdv_dq_split_consumer_item(shared, dqs, consts, index, i, g, ME: gl.constexpr, HEAD_DIM: gl.constexpr,
                                 BLOCK_M: gl.constexpr, STAGES: gl.constexpr, GQA: gl.constexpr,
                                 WINDOWED: gl.constexpr, DOCS: gl.constexpr, FULL: gl.constexpr,
                                 ACCUMULATE_DKDV: gl.constexpr):
    """_dkdv_dq_split_consumer's work on item `index`, the program's i-th, from ring position g; returns the position
    after it."""
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, kv_free, ready, empty, ds_smem, ds_ready,
     ds_free, DK, DV, H, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
     N, qk_scale, sm_scale, WORK, WORK_START, n_kblocks, mask, group, n_q, kv_splits, _tickets) = shared
    dq_smem, dq_desc, acc_rows_b, acc_rows_h, acc_cols_h = dqs[2], dqs[7], dqs[10], dqs[11], dqs[12]
    zero_s, zero_q, heads = consts
    HALF: gl.constexpr = HEAD_DIM // 2
    s_layout: gl.constexpr = mma_layout(BLOCK_M, 4)
    d_layout: gl.constexpr = mma_layout(HEAD_DIM, 4)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)
    k = k_smem.index(ME)
    v = v_smem.index(ME)
    k0 = k_smem.index(0).slice(ME * HALF, HALF, dim=1)
    k1 = k_smem.index(1).slice(ME * HALF, HALF, dim=1)
    bh, start_n, num_tiles = _key_block(WORK, index, n_kblocks, N, BLOCK_M, heads, mask, WINDOWED, DOCS, n_q, FULL)
    q0 = _query_origin(start_n, FULL)
    key0 = start_n + ME * TILE
    keys = key0 + gl.arange(0, TILE, layout=gl.SliceLayout(1, s_layout))
    tmask = _tile_mask(mask, bh, heads, key0, keys, start_n, N, BLOCK_M, WINDOWED, DOCS)
    if not GQA:  # the item's first query in the accumulator
        row0 = (bh // heads) * acc_rows_b + (bh % heads) * acc_rows_h + q0
        col = (bh % heads) * acc_cols_h + ME * HALF
    dk = gl.zeros([TILE, HEAD_DIM], gl.float32, layout=d_layout)
    dv = gl.zeros([TILE, HEAD_DIM], gl.float32, layout=d_layout)
    for c in gl.static_range(CONSUMERS):
        mbarrier.wait(kv_ready.index(c), i & 1)
    if GQA:  # the group's query heads in turn (query head (bh % heads)·group + qh), each num_tiles positions on
        for qh in range(group):
            row0, col = _group_origin(bh, heads, group, qh, acc_rows_b, acc_rows_h, acc_cols_h, q0)
            dv, dk = _split_key_block(k, v, k0, k1, q_smem, do_smem, lse_smem, delta_smem, ready, empty, ds_smem,
                                      ds_ready, ds_free, dq_smem, dq_desc, g, num_tiles, row0, col + ME * HALF,
                                      ME, STAGES, zero_s, zero_q, dv, dk, keys, q0, qk_scale, sm_scale,
                                      a_layout, BLOCK_M, tmask, WINDOWED, DOCS, FULL)
            g += num_tiles
        mbarrier.arrive(kv_free.index(0), count=1)  # this consumer's last reads of K and V have retired
    else:
        dv, dk = _split_key_block(k, v, k0, k1, q_smem, do_smem, lse_smem, delta_smem, ready, empty, ds_smem,
                                  ds_ready, ds_free, dq_smem, dq_desc, g, num_tiles, row0, col, ME, STAGES,
                                  zero_s, zero_q, dv, dk, keys, q0, qk_scale, sm_scale, a_layout, BLOCK_M,
                                  tmask, WINDOWED, DOCS, FULL)
        mbarrier.arrive(kv_free.index(0), count=1)  # this consumer's last reads of K and V have retired
        g += num_tiles
    _write_dkdv(dk, dv, DK, DV, (bh // heads).to(gl.int64), ((bh % heads) // kv_splits).to(gl.int64), stride_dkb,
                stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, N, key0, sm_scale, HEAD_DIM,
                ACCUMULATE_DKDV)
    return g


@gluon.jit
def _dkdv_dq_split_consumer(shared, dqs, ME: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                            STAGES: gl.constexpr, PERSISTENT: gl.constexpr, QUEUE: gl.constexpr, GQA: gl.constexpr,
                            WINDOWED: gl.constexpr, DOCS: gl.constexpr, FULL: gl.constexpr,
                            ACCUMULATE_DKDV: gl.constexpr):
    """Consumer warpgroup ME of the head_dim-128 kernel: for each of this program's items (QUEUE: as the producer
    takes them from the work queue, common.take_ticket), dK, dV of keys start_n + 64·ME ... + 63, and columns 64·ME
    ... of each query tile's dQ (FULL: every query tile from query 0); with GQA over each query head of the K/V
    head's group in turn (its dQ into that head's accumulator rows); dK, dV written (or with ACCUMULATE_DKDV added)
    at the item's end. The ring and hand-over counters run on across items and query heads (g); K and V have one
    buffer (shared memory holds no second one beside the dQ staging), released to the producer (kv_free) after the
    item's last dQ matmul, the last that reads them."""
    (_k_smem, _v_smem, _q_smem, _do_smem, _lse_smem, _delta_smem, _kv_ready, _kv_free, _ready, _empty, _ds_smem,
     _ds_ready, _ds_free, _DK, _DV, H, _stride_dkb, _stride_dkh, _stride_dkn, _stride_dvb, _stride_dvh, _stride_dvn,
     _N, _qk_scale, _sm_scale, _WORK, WORK_START, _n_kblocks, _mask, group, _n_q, _kv_splits, tickets) = shared
    HALF: gl.constexpr = HEAD_DIM // 2
    s_layout: gl.constexpr = mma_layout(BLOCK_M, 4)
    q_layout: gl.constexpr = mma_layout(HALF, 4)
    consts = (gl.zeros([TILE, BLOCK_M], gl.float32, layout=s_layout),
              gl.zeros([BLOCK_M, HALF], gl.float32, layout=q_layout), _item_heads(H, group, GQA))
    g = 0
    if QUEUE:
        i = 0
        index = take_ticket(WORK_START, tickets, i)
        while index >= 0:
            g = _dkdv_dq_split_consumer_item(shared, dqs, consts, index, i, g, ME, HEAD_DIM, BLOCK_M, STAGES, GQA,
                                             WINDOWED, DOCS, FULL, ACCUMULATE_DKDV)
            i += 1
            index = take_ticket(WORK_START, tickets, i)
    else:
        first, count = program_items(WORK_START, PERSISTENT)
        for i in range(count):
            g = _dkdv_dq_split_consumer_item(shared, dqs, consts, first + i, i, g, ME, HEAD_DIM, BLOCK_M, STAGES,
                                             GQA, WINDOWED, DOCS, FULL, ACCUMULATE_DKDV)
    tma.store_wait(0)


@gluon.jit
def _dq_reducer_item(dqs, consts, index, i, g, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, GQA: gl.constexpr,
                     WINDOWED: gl.constexpr, DOCS: gl.constexpr, FULL: gl.constexpr):
    """_dq_reducer's work on item `index`, the program's i-th, from ring position g; returns the position after it."""
    (k_smem, ds_smem, dq_smem, kv_ready, kv_free, ds_ready, ds_free, dq_desc, N, H, acc_rows_b, acc_rows_h,
     acc_cols_h, sm_scale, WORK, WORK_START, n_kblocks, mask, group, n_q, _tickets) = dqs
    zero, heads = consts
    KV_BUFS: gl.constexpr = k_smem.shape[0] // CONSUMERS
    bh, start_n, num_tiles = _key_block(WORK, index, n_kblocks, N, BLOCK_M, heads, mask, WINDOWED, DOCS, n_q, FULL)
    q0 = _query_origin(start_n, FULL)
    buf = i % KV_BUFS
    for c in gl.static_range(CONSUMERS):
        mbarrier.wait(kv_ready.index(buf * CONSUMERS + c), (i // KV_BUFS) & 1)
    if GQA:  # the group's query heads in turn, each into its own accumulator rows
        for qh in range(group):
            row0, col = _group_origin(bh, heads, group, qh, acc_rows_b, acc_rows_h, acc_cols_h, q0)
            for t in range(num_tiles):
                _dq_tile(k_smem.index(buf * CONSUMERS), k_smem.index(buf * CONSUMERS + 1), ds_smem, dq_smem,
                         ds_ready, ds_free, dq_desc, g + t, row0 + t * BLOCK_M, col, zero, sm_scale)
            g += num_tiles
        mbarrier.arrive(kv_free.index(buf), count=1)  # its last dQ matmul (K) has retired
    else:
        row0 = (bh // heads) * acc_rows_b + (bh % heads) * acc_rows_h + q0
        col = (bh % heads) * acc_cols_h
        for t in range(num_tiles):
            _dq_tile(k_smem.index(buf * CONSUMERS), k_smem.index(buf * CONSUMERS + 1), ds_smem, dq_smem, ds_ready,
                     ds_free, dq_desc, g + t, row0 + t * BLOCK_M, col, zero, sm_scale)
        mbarrier.arrive(kv_free.index(buf), count=1)  # its last dQ matmul (K) has retired
        g += num_tiles
    return g


@gluon.jit
def _dq_reducer(dqs, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, PERSISTENT: gl.constexpr, QUEUE: gl.constexpr,
                GQA: gl.constexpr, WINDOWED: gl.constexpr, DOCS: gl.constexpr, FULL: gl.constexpr):
    """The dQ warpgroup (head_dim 64): per query tile t of each item (QUEUE: as the producer takes them from the work
    queue; with GQA, of each query head of its group), dQ_t = scale · dS_t K over the item's 128 keys (both
    consumers' dSᵀ_t, read transposed from shared memory), staged in fp32 shared memory and added into the
    accumulator's rows by a TMA reduce-add, which runs while the next tile's matmul does. The accumulator is one 2-D
    array (rows of one head's queries, see dkdvdq_kernel), so its descriptor is made once; a key block's last query
    tile may reach past its head's N rows into the next head's or batch's first ones, where it adds exact zeros
    (queries past N have dS = 0; a non-finite K would make those rows NaN, as it does its own), as do the rows a mask
    hides from every key of the block."""
    (_k_smem, _ds_smem, _dq_smem, _kv_ready, _kv_free, _ds_ready, _ds_free, _dq_desc, _N, H, _acc_rows_b,
     _acc_rows_h, _acc_cols_h, _sm_scale, _WORK, WORK_START, _n_kblocks, _mask, group, _n_q, tickets) = dqs
    dq_layout: gl.constexpr = mma_layout(HEAD_DIM, 4)
    consts = (gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout), _item_heads(H, group, GQA))
    g = 0
    if QUEUE:
        i = 0
        index = take_ticket(WORK_START, tickets, i)
        while index >= 0:
            g = _dq_reducer_item(dqs, consts, index, i, g, HEAD_DIM, BLOCK_M, GQA, WINDOWED, DOCS, FULL)
            i += 1
            index = take_ticket(WORK_START, tickets, i)
    else:
        first, count = program_items(WORK_START, PERSISTENT)
        for i in range(count):
            g = _dq_reducer_item(dqs, consts, first + i, i, g, HEAD_DIM, BLOCK_M, GQA, WINDOWED, DOCS, FULL)
    tma.store_wait(0)


@gluon.jit
def _stream_query_tiles(descs, q_smem, do_smem, lse_smem, delta_smem, ready, empty, g, num_tiles, start_n, b, h, bh,
                        STAGES: gl.constexpr, BLOCK_M: gl.constexpr):
    """Query tiles 0 ... num_tiles − 1 from start_n of query head h of batch b (bh = b·H + h, its LSE and delta row)
    into ring positions g ..., each once both consumers have released what its buffer held (position − STAGES)."""
    q_desc, do_desc, lse_desc, delta_desc = descs
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    TILE_BOX: gl.constexpr = [1, 1, BLOCK_M, HEAD_DIM]
    ROW_BOX: gl.constexpr = [1, BLOCK_M]
    tile_bytes: gl.constexpr = 2 * BLOCK_M * HEAD_DIM * q_smem.dtype.primitive_bitwidth // 8 + 2 * BLOCK_M * 4
    for t in range(num_tiles):
        gt = g + t
        stage = gt % STAGES
        row = start_n + t * BLOCK_M
        mbarrier.wait(empty.index(stage), ((gt // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, tile_bytes)
        load_rows(q_desc, [b, h, row, 0], bar, q_smem.index(stage), TILE_BOX)
        load_rows(do_desc, [b, h, row, 0], bar, do_smem.index(stage), TILE_BOX)
        load_rows(lse_desc, [bh, row], bar, lse_smem.index(stage), ROW_BOX)
        load_rows(delta_desc, [bh, row], bar, delta_smem.index(stage), ROW_BOX)


@gluon.jit
def _dkdvdq_producer_item(loads, consts, index, i, g, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                          STAGES: gl.constexpr, QUEUE: gl.constexpr, GQA: gl.constexpr, WINDOWED: gl.constexpr,
                          DOCS: gl.constexpr, FULL: gl.constexpr):
    """_dkdvdq_producer's loads for item `index`, the program's i-th, from ring position g; returns the position
    after it and, with QUEUE, the next item's index, taken once this item's K and V loads are issued, so that the
    queue's round trip overlaps its query tiles."""
    (Q, K, V, DO, LSE, DELTA, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
     stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don, stride_lse, stride_delta, B, H, N,
     k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, kv_free, ready, empty,
     WORK, WORK_START, n_kblocks, mask, group, n_q, kv_splits, tickets) = loads
    k_desc, v_desc, descs, heads = consts
    dtype: gl.constexpr = q_smem.dtype
    KV_BUFS: gl.constexpr = k_smem.shape[0] // CONSUMERS  # 2, or 1 at head_dim 128
    KV_BOX: gl.constexpr = [1, 1, TILE, HEAD_DIM]
    kv_bytes: gl.constexpr = 2 * TILE * HEAD_DIM * dtype.primitive_bitwidth // 8
    bh, start_n, num_tiles = _key_block(WORK, index, n_kblocks, N, BLOCK_M, heads, mask, WINDOWED, DOCS, n_q, FULL)
    q0 = _query_origin(start_n, FULL)
    b = bh // heads
    h = bh % heads
    buf = i % KV_BUFS
    mbarrier.wait(kv_free.index(buf), ((i // KV_BUFS) & 1) ^ 1)  # item i − KV_BUFS's users are done with it
    for c in gl.static_range(CONSUMERS):
        mbarrier.expect(kv_ready.index(buf * CONSUMERS + c), kv_bytes)
        load_rows(k_desc, [b, h // kv_splits, start_n + c * TILE, 0], kv_ready.index(buf * CONSUMERS + c),
                  k_smem.index(buf * CONSUMERS + c), KV_BOX)
        load_rows(v_desc, [b, h // kv_splits, start_n + c * TILE, 0], kv_ready.index(buf * CONSUMERS + c),
                  v_smem.index(buf * CONSUMERS + c), KV_BOX)
    if QUEUE:
        next_index = hand_out_ticket(WORK_START, tickets, i + 1, B * heads * n_kblocks)
    else:
        next_index = index + 1  # unused
    if GQA:  # query head h·group + qh (its rows b·H + h·group + qh of LSE, delta), qh = 0 ... group − 1
        for qh in range(group):
            _stream_query_tiles(descs, q_smem, do_smem, lse_smem, delta_smem, ready, empty, g, num_tiles, q0, b,
                                h * group + qh, b * H + h * group + qh, STAGES, BLOCK_M)
            g += num_tiles
    else:
        _stream_query_tiles(descs, q_smem, do_smem, lse_smem, delta_smem, ready, empty, g, num_tiles, q0, b, h,
                            bh, STAGES, BLOCK_M)
        g += num_tiles
    return g, next_index


@gluon.jit
def _dkdvdq_producer(loads, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                     PERSISTENT: gl.constexpr, QUEUE: gl.constexpr, GQA: gl.constexpr, WINDOWED: gl.constexpr,
                     DOCS: gl.constexpr, FULL: gl.constexpr):
    """The producer warp, over this program's items (QUEUE: taken from the work queue as the program frees up, each
    handed to the other roles, common.hand_out_ticket): the item's K and V rows into buffer i % KV_BUFS once their
    last users released it (kv_free), then query tile t (Q, dO, LSE, delta) into ring buffer t % STAGES as soon as
    both consumers have released what it held (tile t − STAGES); rows past N read as 0. With GQA, K and V of the
    item's K/V head h, then the query tiles of each query head h·group + qh of its group in turn. Its descriptors
    span every head (common.all_heads, all_rows), made once: an item names its heads only in the copies'
    coordinates, so nothing waits between items but for free buffers. FULL: every item streams all query tiles from
    query 0."""
    (Q, K, V, DO, LSE, DELTA, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
     stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don, stride_lse, stride_delta, B, H, N,
     _k_smem, _v_smem, _q_smem, _do_smem, _lse_smem, _delta_smem, _kv_ready, _kv_free, _ready, _empty,
     _WORK, WORK_START, n_kblocks, _mask, group, n_q, kv_splits, tickets) = loads
    heads = _item_heads(H, group, GQA)
    n_rows = _query_count(N, n_q, FULL)
    k_desc = all_heads(K, B, heads // kv_splits, N, stride_kb, stride_kh, stride_kn, TILE, HEAD_DIM)
    v_desc = all_heads(V, B, heads // kv_splits, N, stride_vb, stride_vh, stride_vn, TILE, HEAD_DIM)
    descs = (all_heads(Q, B, H, n_rows, stride_qb, stride_qh, stride_qn, BLOCK_M, HEAD_DIM),
             all_heads(DO, B, H, n_rows, stride_dob, stride_doh, stride_don, BLOCK_M, HEAD_DIM),
             all_rows(LSE, B * H, n_rows, stride_lse, BLOCK_M),
             all_rows(DELTA, B * H, n_rows, stride_delta, BLOCK_M))
    consts = (k_desc, v_desc, descs, heads)
    g = 0
    if QUEUE:  # items from the queue, each handed to the other roles, then -1: none left
        i = 0
        index = hand_out_ticket(WORK_START, tickets, i, B * heads * n_kblocks)
        while index >= 0:
            g, index = _dkdvdq_producer_item(loads, consts, index, i, g, HEAD_DIM, BLOCK_M, STAGES, QUEUE, GQA,
                                             WINDOWED, DOCS, FULL)
            i += 1
    else:
        first, count = program_items(WORK_START, PERSISTENT)
        for i in range(count):
            g, _next = _dkdvdq_producer_item(loads, consts, first + i, i, g, HEAD_DIM, BLOCK_M, STAGES, QUEUE, GQA,
                                             WINDOWED, DOCS, FULL)


@gluon.jit
def dkdvdq_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, WORK, WORK_START,
                              stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                              stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                              stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                              stride_lse, stride_delta, B, H, N, n_kblocks, acc_rows, acc_cols, acc_rows_b, acc_rows_h,
                              acc_cols_h, qk_scale, sm_scale, group, kv_splits, DOC_ENDS, stride_ends, window, n_q,
                              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                              KV_BUFS: gl.constexpr, PERSISTENT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                              PRODUCER_REGS: gl.constexpr, REDUCER_REGS: gl.constexpr, GQA: gl.constexpr,
                              WINDOWED: gl.constexpr, DOCS: gl.constexpr, FULL: gl.constexpr,
                              ACCUMULATE_DKDV: gl.constexpr, DKDV_TMA: gl.constexpr, QUEUE: gl.constexpr = False):
    """dK, dV of blocks of 128 keys of one (batch, head), causal, over the queries from the block's first key on, and
    each block's share of dQ for those queries, added into DQ_ACC; program p takes items WORK[WORK_START[p] :
    WORK_START[p+1]] (QUEUE: WORK's items as the programs take them from the work queue WORK_START,
    common.hand_out_ticket; item = bh · n_kblocks + key block). DQ_ACC: fp32, one 2-D (acc_rows, acc_cols) array in which
    head h of batch b adds its query n into row b·acc_rows_b + h·acc_rows_h + n at columns h·acc_cols_h ...: (B·H·N,
    HEAD_DIM) with (H·N, N, 0) for (B, H, N, D) memory, (B·N, H·HEAD_DIM) with (N, 0, HEAD_DIM) for (B, N, H, D) rows
    (the model's layout). At head_dim 128 the consumers compute dQ themselves (a dQ warpgroup does not fit the
    register file beside two consumers holding dK and dV, 128 registers each; NOTES.md V) and REDUCER_REGS is unused.
    KV_BUFS: K/V buffers, 2 to load an item's keys during the last one's tail (head_dim 64 with many items per
    program), else 1. H: query heads. GQA: an item's bh is b·(H / group) + h over the K/V heads (K, V, DK, DV), and
    it sums its dK, dV over the query heads h·group ... h·group + group − 1 (Q, DO, LSE, DELTA, DQ_ACC). kv_splits
    (group_splits): the items' heads are each K/V head's group split kv_splits ways, so item head h reads K/V head
    h // kv_splits and adds its dK, dV there (ACCUMULATE_DKDV = DKDV_ATOMIC_ADD); 1 otherwise. WINDOWED:
    query i sees key j only if i − window < j; DOCS: only if both lie in one document, i.e. (i >= j) i < DOC_ENDS[b,
    j], the end of j's document (B, N) int32, rows stride_ends apart (launch_dkdv_dq_masked finds them from the
    ids). Without them the last four are unused.
    FULL (ring attention's blocks off the diagonal, launch_dkdv_dq_block): no causal mask, n_q query rows (Q, DO,
    LSE, DELTA, DQ_ACC) against N keys (K, V, DK, DV), every key block over every query tile from query 0; not with
    WINDOWED or DOCS. Else n_q is unused (one length N). ACCUMULATE_DKDV (_write_dkdv): DKDV_WRITE writes dK, dV
    (any float dtype); DKDV_ADD adds them to what DK, DV (fp32) hold; DKDV_ATOMIC_ADD adds them atomically (fp32:
    a split's programs share rows). Neither flag changes the code compiled without it. DKDV_TMA (head_dim 64,
    DKDV_WRITE, DK and DV 2-byte and TMA-aligned): dK, dV leave through shared memory by TMA, not by stores from
    registers."""
    gl.static_assert(not (FULL and (WINDOWED or DOCS)), "FULL (no causal mask) takes no window or documents")
    dtype: gl.constexpr = Q.dtype.element_ty
    SPLIT_DQ: gl.constexpr = HEAD_DIM > 64
    DQ_COLS: gl.constexpr = HEAD_DIM // 2 if SPLIT_DQ else HEAD_DIM  # columns per dQ reduce-add
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, HEAD_DIM], dtype)
    qd_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, BLOCK_M], dtype)
    acc_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, DQ_COLS], gl.float32)
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    dq_desc = tma.make_tensor_descriptor(DQ_ACC, shape=[acc_rows, acc_cols], strides=[acc_cols, 1],
                                         block_shape=[BLOCK_M, DQ_COLS], layout=acc_layout)
    k_smem = gl.allocate_shared_memory(dtype, [KV_BUFS * CONSUMERS, TILE, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [KV_BUFS * CONSUMERS, TILE, HEAD_DIM], kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], qd_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2 * CONSUMERS, TILE, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, DQ_COLS], acc_layout)
    if DKDV_TMA:  # each consumer's dK, dV staged for their TMA copies out
        gl.static_assert(not SPLIT_DQ and ACCUMULATE_DKDV == DKDV_WRITE, "DKDV_TMA: head_dim 64, dK and dV written")
        out_dtype: gl.constexpr = DK.dtype.element_ty
        dkdv_out = (all_heads(DK, B, H // group // kv_splits, N, stride_dkb, stride_dkh, stride_dkn, TILE, HEAD_DIM),
                    all_heads(DV, B, H // group // kv_splits, N, stride_dvb, stride_dvh, stride_dvn, TILE, HEAD_DIM),
                    gl.allocate_shared_memory(out_dtype, [2 * CONSUMERS, TILE, HEAD_DIM],
                                              gl.NVMMASharedLayout.get_default_for([TILE, HEAD_DIM], out_dtype)))
    else:
        dkdv_out = (0, 0, 0)  # unused
    kv_ready = gl.allocate_shared_memory(gl.int64, [KV_BUFS * CONSUMERS, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [KV_BUFS, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(KV_BUFS * CONSUMERS):
        mbarrier.init(kv_ready.index(i), count=1)
    for i in gl.static_range(KV_BUFS):
        if SPLIT_DQ:  # both consumers
            mbarrier.init(kv_free.index(i), count=CONSUMERS)
        else:  # both consumers and the dQ warpgroup
            mbarrier.init(kv_free.index(i), count=CONSUMERS + 1)
    _init_hand_over(ds_ready, ds_free, SPLIT_DQ)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    if QUEUE:  # the producer hands each item it takes to the consumers and the dQ warpgroup (SPLIT_DQ: none)
        tickets = ticket_barriers(CONSUMERS if SPLIT_DQ else CONSUMERS + 1)
    else:
        tickets = (ready, ready)  # unused
    fence_async_shared()
    mask = (window, DOC_ENDS, stride_ends)  # read where WINDOWED or DOCS

    shared = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, kv_free, ready, empty, ds_smem,
              ds_ready, ds_free, DK, DV, H, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
              N, qk_scale, sm_scale, WORK, WORK_START, n_kblocks, mask, group, n_q, kv_splits, tickets)
    loads = (Q, K, V, DO, LSE, DELTA, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
             stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don, stride_lse, stride_delta, B, H, N,
             k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, kv_free, ready, empty,
             WORK, WORK_START, n_kblocks, mask, group, n_q, kv_splits, tickets)
    dqs = (k_smem, ds_smem, dq_smem, kv_ready, kv_free, ds_ready, ds_free, dq_desc, N, H, acc_rows_b, acc_rows_h,
           acc_cols_h, sm_scale, WORK, WORK_START, n_kblocks, mask, group, n_q, tickets)
    if SPLIT_DQ:
        gl.warp_specialize([(_dkdv_dq_split_consumer, (shared, dqs, gl.constexpr(0), HEAD_DIM, BLOCK_M, STAGES,
                                                       PERSISTENT, QUEUE, GQA, WINDOWED, DOCS, FULL,
                                                       ACCUMULATE_DKDV)),
                            (_dkdv_dq_split_consumer, (shared, dqs, gl.constexpr(1), HEAD_DIM, BLOCK_M, STAGES,
                                                       PERSISTENT, QUEUE, GQA, WINDOWED, DOCS, FULL,
                                                       ACCUMULATE_DKDV)),
                            (_dkdvdq_producer, (loads, HEAD_DIM, BLOCK_M, STAGES, PERSISTENT, QUEUE, GQA, WINDOWED,
                                                DOCS, FULL))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_dkdv_consumer, (shared, dkdv_out, gl.constexpr(0), HEAD_DIM, BLOCK_M, STAGES,
                                              PERSISTENT, QUEUE, GQA, WINDOWED, DOCS, FULL, ACCUMULATE_DKDV,
                                              DKDV_TMA)),
                            (_dkdv_consumer, (shared, dkdv_out, gl.constexpr(1), HEAD_DIM, BLOCK_M, STAGES,
                                              PERSISTENT, QUEUE, GQA, WINDOWED, DOCS, FULL, ACCUMULATE_DKDV,
                                              DKDV_TMA)),
                            (_dkdvdq_producer, (loads, HEAD_DIM, BLOCK_M, STAGES, PERSISTENT, QUEUE, GQA, WINDOWED,
                                                DOCS, FULL)),
                            (_dq_reducer, (dqs, HEAD_DIM, BLOCK_M, PERSISTENT, QUEUE, GQA, WINDOWED, DOCS, FULL))],
                           [4, 1, 4], [CONSUMER_REGS, PRODUCER_REGS, REDUCER_REGS])


# ------------------------------------------------------------------------------------------------
# dQ: a program owns 128 query rows; the producer streams the key tiles K_j, V_j (the forward's structure)
# ------------------------------------------------------------------------------------------------
@gluon.jit
def _ds(s, dp, lse, delta, rows, cols, masked, qk_scale, dtype: gl.constexpr, a_layout: gl.constexpr):
    """dS of one tile (rows × keys) from S = Q Kᵀ and dP = dO Vᵀ, as the register A operand of the dQ matmul."""
    # P = exp2(Q Kᵀ · scale·log2e − LSE)
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse, 1))
    if masked:  # the diagonal tile: keys after the row get probability 0
        p = gl.where(gl.expand_dims(rows, 1) >= gl.expand_dims(cols, 0), p, 0.0)
    # dS = P ∘ (dP − delta)
    return gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), a_layout)


@gluon.jit
def _dq_consumer(shared, ME: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Consumer warpgroup ME: dQ of query rows start_m + 64·ME ... + 63 over key tiles 0 .. num_tiles−1, and the rows'
    delta = rowsum(dO ∘ O), written for the dK/dV kernel that runs next."""
    (q_smem, do_smem, k_smem, v_smem, qdo_ready, kv_ready, kv_empty,
     O, DO, LSE, DELTA, DQ, b, h, bh, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don,
     stride_dqb, stride_dqh, stride_dqn, stride_lse, stride_delta, N, start_m, num_tiles, qk_scale, sm_scale) = shared
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_N, 4)   # S, dP: 64 rows × BLOCK_N keys
    d_layout: gl.constexpr = mma_layout(HEAD_DIM, 4)  # dQ: 64 rows × HEAD_DIM
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=d_layout, k_width=2)  # dS in registers
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # O and dO rows, for delta
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row0 = start_m + ME * TILE
    rows = row0 + gl.arange(0, TILE, layout=row_s)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    full_tiles = row0 // BLOCK_N  # key tiles wholly at or before this consumer's first row need no mask

    # delta_i = Σ_d dO_id · O_id; LSE (+inf past N, so P = 0 there)
    io_rows = row0 + gl.arange(0, TILE, layout=gl.SliceLayout(1, io_layout))
    io_cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout)), 0)
    io_mask = gl.expand_dims(io_rows < N, 1)
    io_rows64 = gl.expand_dims(io_rows.to(gl.int64), 1)
    o = gl.load(O + b * stride_ob + h * stride_oh + io_rows64 * stride_on + io_cols, mask=io_mask, other=0.0)
    do = gl.load(DO + b * stride_dob + h * stride_doh + io_rows64 * stride_don + io_cols, mask=io_mask, other=0.0)
    delta = gl.convert_layout(gl.sum(o.to(gl.float32) * do.to(gl.float32), 1), row_s)
    gl.store(DELTA + bh.to(gl.int64) * stride_delta + rows, delta, mask=rows < N)
    lse = gl.load(LSE + bh.to(gl.int64) * stride_lse + rows, mask=rows < N, other=float("inf"))

    zero_s = gl.zeros([TILE, BLOCK_N], gl.float32, layout=s_layout)
    dq = gl.zeros([TILE, HEAD_DIM], gl.float32, layout=d_layout)
    q = q_smem.index(ME)
    do_s = do_smem.index(ME)
    mbarrier.wait(qdo_ready.index(ME), 0)

    # tile 0: S_0 = Q K_0ᵀ and dP_0 = dO V_0ᵀ alone (no dQ yet)
    mbarrier.wait(kv_ready.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dp = warpgroup_mma(do_s, v_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s, dp = warpgroup_mma_wait(0, deps=(s, dp))
    ds16 = _ds(s, dp, lse, delta, rows, cols, 0 >= full_tiles, qk_scale, dtype, a_layout)

    for j in range(1, num_tiles):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(kv_ready.index(stage), (j // STAGES) & 1)
        # issue S_j = Q K_jᵀ, dP_j = dO V_jᵀ, then dQ += dS_{j−1} K_{j−1}
        s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_s, v_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dq = warpgroup_mma(ds16, k_smem.index(prev), dq, is_async=True)
        # wait for S_j, dP_j; dS_j while the dQ matmul still runs
        s, dp = warpgroup_mma_wait(1, deps=(s, dp))
        ds16_j = _ds(s, dp, lse, delta, rows, cols + j * BLOCK_N, j >= full_tiles, qk_scale, dtype, a_layout)
        dq, ds16 = warpgroup_mma_wait(0, deps=(dq, ds16))
        mbarrier.arrive(kv_empty.index(prev), count=1)  # K_{j−1}, V_{j−1} no longer read by this consumer
        ds16 = ds16_j

    last = (num_tiles - 1) % STAGES
    dq = warpgroup_mma(ds16, k_smem.index(last), dq, is_async=True)
    dq, ds16 = warpgroup_mma_wait(0, deps=(dq, ds16))

    dq = dq * sm_scale  # dS was taken w.r.t. the scaled scores
    out_rows = row0 + gl.arange(0, TILE, layout=gl.SliceLayout(1, d_layout))
    out_cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, d_layout)), 0)
    gl.store(DQ + b * stride_dqb + h * stride_dqh + gl.expand_dims(out_rows.to(gl.int64), 1) * stride_dqn + out_cols,
             dq.to(DQ.dtype.element_ty), mask=gl.expand_dims(out_rows < N, 1))


@gluon.jit
def _dq_producer(loads, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The producer warp: each consumer's Q and dO rows once, then K_j, V_j into buffer j % STAGES as soon as both
    consumers have released what it held (tile j − STAGES). Rows past N read as 0 (TMA)."""
    (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qdo_ready, kv_ready, kv_empty,
     start_m, num_tiles) = loads
    dtype: gl.constexpr = q_smem.dtype
    qdo_bytes: gl.constexpr = 2 * TILE * HEAD_DIM * dtype.primitive_bitwidth // 8
    kv_bytes: gl.constexpr = 2 * BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
    for c in gl.static_range(CONSUMERS):
        mbarrier.expect(qdo_ready.index(c), qdo_bytes)
        tma_load(q_desc, [start_m + c * TILE, 0], qdo_ready.index(c), q_smem.index(c))
        tma_load(do_desc, [start_m + c * TILE, 0], qdo_ready.index(c), do_smem.index(c))
    for j in range(num_tiles):
        stage = j % STAGES
        mbarrier.wait(kv_empty.index(stage), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(kv_ready.index(stage), kv_bytes)
        tma_load(k_desc, [j * BLOCK_N, 0], kv_ready.index(stage), k_smem.index(stage))
        tma_load(v_desc, [j * BLOCK_N, 0], kv_ready.index(stage), v_smem.index(stage))


@gluon.jit
def dq_kernel(Q, K, V, DO, O, LSE, DELTA, DQ,
               stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
               stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
               stride_ob, stride_oh, stride_on, stride_dqb, stride_dqh, stride_dqn,
               stride_lse, stride_delta, H, N, qk_scale, sm_scale,
               HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
               CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """dQ (and delta) of one tile of 128 query rows of one (batch, head), causal; the last rows (most keys) first."""
    dtype: gl.constexpr = Q.dtype.element_ty
    BLOCK_M: gl.constexpr = CONSUMERS * TILE
    start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_desc = head_rows(Q, b, h, stride_qb, stride_qh, stride_qn, N, TILE, HEAD_DIM, q_layout)
    do_desc = head_rows(DO, b, h, stride_dob, stride_doh, stride_don, N, TILE, HEAD_DIM, q_layout)
    k_desc = head_rows(K, b, h, stride_kb, stride_kh, stride_kn, N, BLOCK_N, HEAD_DIM, kv_layout)
    v_desc = head_rows(V, b, h, stride_vb, stride_vh, stride_vn, N, BLOCK_N, HEAD_DIM, kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, TILE, HEAD_DIM], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, TILE, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    qdo_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(qdo_ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=CONSUMERS)
    fence_async_shared()
    num_tiles = gl.cdiv(gl.minimum(start_m + BLOCK_M, N), BLOCK_N)  # key tiles up to the diagonal

    shared = (q_smem, do_smem, k_smem, v_smem, qdo_ready, kv_ready, kv_empty,
              O, DO, LSE, DELTA, DQ, b, h, bh, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don,
              stride_dqb, stride_dqh, stride_dqn, stride_lse, stride_delta, N, start_m, num_tiles, qk_scale, sm_scale)
    loads = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qdo_ready, kv_ready, kv_empty,
             start_m, num_tiles)
    gl.warp_specialize([(_dq_consumer, (shared, gl.constexpr(0), HEAD_DIM, BLOCK_N, STAGES)),
                        (_dq_consumer, (shared, gl.constexpr(1), HEAD_DIM, BLOCK_N, STAGES)),
                        (_dq_producer, (loads, HEAD_DIM, BLOCK_N, STAGES))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------------------------
# Launchers (the caller checks the scope and sets Triton's scratch allocator for the device-side TMA descriptors)
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def key_block_costs(n: int, keys: int, block_m: int) -> tuple[float, ...]:
    """Each block of `keys` keys' work in the causal backward: its query tiles, from the block's first key on."""
    return tuple(float(-(-(n - kb * keys) // block_m)) for kb in range(-(-n // keys)))


AccGeometry = tuple[tuple[int, int], tuple[int, int, int]]  # ((rows, cols), (rows_b, rows_h, cols_h)): dkdvdq_kernel's


def dq_acc_geometry(dq: Tensor) -> AccGeometry | None:
    """How dkdvdq_kernel can address an fp32 (B, H, N, D) dQ accumulator given as a strided view (ring attention's dq
    rows, a slice of q's layout): as one 2-D array from dq's first element, `cols` elements a row (the row stride),
    query n of head h of batch b at row b·rows_b + h·rows_h + n, columns h·cols_h ... + D − 1. None where its
    strides have no such form, or TMA cannot take it (a 16-byte aligned start and row stride; a contiguous last
    dimension). With one query a row is D elements wide (its row stride is never stepped)."""
    B, H, N, D = dq.shape
    sb, sh, sn, sd = dq.stride()
    sn = sn if N > 1 else D
    if dq.dtype != torch.float32 or (sd != 1 and D > 1) or sn < D or dq.data_ptr() % 16 or (sn * 4) % 16:
        return None
    if H == 1:
        rows_h, cols_h = 0, 0
    elif sh % sn == 0:  # heads in rows of their own: (B, H, N, D) memory
        rows_h, cols_h = sh // sn, 0
    elif sh < sn and (H - 1) * sh + D <= sn:  # heads side by side in each row: (B, N, H, D) memory
        rows_h, cols_h = 0, sh
    else:
        return None
    if B == 1:
        rows_b = 0
    elif sb % sn == 0:
        rows_b = sb // sn
    else:
        return None
    rows = (B - 1) * rows_b + (H - 1) * rows_h + N  # the last query's row + 1: nothing past the view is addressed
    return (rows, sn), (rows_b, rows_h, cols_h)


def _launch_dkdvdq(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, stride_lse: int, delta: Tensor,
                   stride_delta: int, dk: Tensor, dv: Tensor, dq_acc: Tensor, sm_scale: float, qk_scale: float,
                   block_m: int, stages: int, work: Tensor, work_start: Tensor, persistent: bool,
                   window: int | None = None, document_ids: Tensor | None = None, full: bool = False,
                   accumulate_dkdv: bool = False, acc_geometry: AccGeometry | None = None,
                   kv_splits: int = 1, queue_programs: int = 0) -> None:
    """dkdvdq_kernel on a work list (queue_programs > 0: that many programs take its items from a work queue,
    common.hand_out_ticket; work_start unused). q, do: (B, H, N_Q, D); k, v: (B, Hkv, N_K, D), N_Q = N_K unless `full`.
    accumulate_dkdv: dk, dv (fp32) receive dK, dV added (DKDV_ADD); kv_splits > 1: each K/V head's group runs as
    kv_splits virtual heads, which add into dk, dv (fp32) atomically (DKDV_ATOMIC_ADD; group_splits).
    acc_geometry: dq_acc's (dq_acc_geometry); None: dq_acc dense in (B, H, N, D) or (B, N, H, D) memory."""
    B, H, n_q, D = q.shape
    N = k.shape[2]  # keys (and queries, but where full)
    if document_ids is None:
        ends = work  # a placeholder pointer where there are no documents
    else:  # the end of each token's document: the first index whose id is larger (a binary search per token)
        ends = torch.searchsorted(document_ids, document_ids, right=True, out_int32=True)
    if acc_geometry is not None:
        acc_shape, acc_steps = acc_geometry
    elif dq_acc.is_contiguous():  # (B·H·N, D) rows
        acc_shape, acc_steps = (B * H * N, D), (H * N, N, 0)
    elif dq_acc.transpose(1, 2).is_contiguous():  # (B·N, H·D) rows
        acc_shape, acc_steps = (B * N, H * D), (N, 0, D)
    else:
        raise ValueError("the dK/dV/dQ kernel: dq_acc must be dense (B, H, N, D) or (B, N, H, D) memory")
    n_kblocks = -(-N // (CONSUMERS.value * TILE.value))
    atomic_dkdv = kv_splits > 1
    virtual_heads = k.shape[1] * kv_splits  # the items' heads
    if queue_programs:
        work_start = torch.zeros(1 + QUEUE_SLOTS.value * queue_programs, dtype=torch.int32, device=q.device)
    launch_kernel(dkdvdq_kernel, (queue_programs or work_start.numel() - 1,),
        q, k, v, do, lse, delta, dk, dv, dq_acc, work, work_start, *strides3(q), *strides3(k), *strides3(v),
        *strides3(do), *strides3(dk), *strides3(dv), stride_lse, stride_delta, B, H, N, n_kblocks, *acc_shape,
        *acc_steps, qk_scale, sm_scale, H // virtual_heads, kv_splits, ends,
        ends.stride(0) if document_ids is not None else 0,
        window or 0, n_q, HEAD_DIM=D, BLOCK_M=block_m, STAGES=stages,
        KV_BUFS=2 if persistent and D == 64 else 1, PERSISTENT=persistent,
        CONSUMER_REGS=SPLIT_CONSUMER_REGS if D > 64 else FUSED_CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, REDUCER_REGS=REDUCER_REGS, GQA=virtual_heads != H, WINDOWED=window is not None,
        DOCS=document_ids is not None, FULL=full,
        ACCUMULATE_DKDV=(DKDV_ATOMIC_ADD if atomic_dkdv else DKDV_ADD if accumulate_dkdv else DKDV_WRITE).value,
        DKDV_TMA=staged_by_tma(D, dk, dv, accumulate=accumulate_dkdv or atomic_dkdv), QUEUE=queue_programs > 0,
        num_warps=4)


def launch_dkdv_dq(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, stride_lse: int, delta: Tensor,
                   stride_delta: int, dk: Tensor, dv: Tensor, dq_acc: Tensor, sm_scale: float, qk_scale: float,
                   block_m: int, stages: int) -> None:
    """Write the causal dK, dV of q, k, v, do (B, H, N, D) into dk, dv (k's shape, contiguous last dimension) and add
    dQ into dq_acc (fp32, zeroed by the caller, dense in (B, H, N, D) or (B, N, H, D) memory). lse, delta: fp32 rows
    at t + (b·H + h)·stride with 16-byte aligned starts (1-D TMA). qk_scale = sm_scale·log2(e). block_m: queries per
    streamed tile (64: the M of the dQ matmul). One program per 128-key block, as a plain grid: within each head the
    first keys (most queries) first. At head_dim 128 the consumers compute dQ themselves (no dQ warpgroup)."""
    B, H, N, _ = q.shape
    n_kblocks = -(-N // (CONSUMERS.value * TILE.value))
    work, work_start = device_one_each(B * H, tuple(range(n_kblocks)), q.device)
    _launch_dkdvdq(do, q, k, v, lse, stride_lse, delta, stride_delta, dk, dv, dq_acc, sm_scale, qk_scale, block_m,
                   stages, work, work_start, persistent=False)


def launch_dkdv_dq_persistent(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, stride_lse: int,
                              delta: Tensor, stride_delta: int, dk: Tensor, dv: Tensor, dq_acc: Tensor, sm_scale: float,
                              qk_scale: float, block_m: int, stages: int, programs: int | None = None) -> None:
    """launch_dkdv_dq's contract on one program per SM (or `programs`) walking a schedule of (batch·head, 128-key
    block) items (schedule.py), an item costing its query tiles. At head_dim 64 K and V are double-buffered, so that
    an item's loads overlap the last one's tail (two would not fit beside head_dim 128's dQ staging)."""
    B, H, N, D = q.shape
    keys = CONSUMERS.value * TILE.value
    costs = key_block_costs(N, keys, block_m)
    programs = min(programs or sm_count(q.device), B * H * len(costs))
    work, work_start = device_schedule(B * H, costs, programs, q.device)
    _launch_dkdvdq(do, q, k, v, lse, stride_lse, delta, stride_delta, dk, dv, dq_acc, sm_scale, qk_scale, block_m,
                   stages, work, work_start, persistent=True)


def launch_dkdv_dq_masked(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, stride_lse: int, delta: Tensor,
                          stride_delta: int, dk: Tensor, dv: Tensor, dq_acc: Tensor, sm_scale: float, qk_scale: float,
                          block_m: int, stages: int, window: int | None, document_ids: Tensor | None, *,
                          persistent: bool | None = None,
                          split_scratch: tuple[Tensor, Tensor] | None = None) -> None:
    """launch_dkdv_dq's contract with GQA (k, v, dk, dv with H / group heads: dK, dV of a K/V head sum over its
    group's query heads, in one program per key block; over a short grid (one K/V head, or GQA without masks), in
    group_splits programs per key block, each over a part of the group, adding into one fp32 dK, dV atomically) and the
    masks: `window` (query i sees key j only if i − window < j) and `document_ids` ((B, N) int32/int64,
    non-decreasing, rows with a contiguous last dimension; only keys of the query's document). Each key block visits
    only the query tiles that see its keys, found on the device (each token's document end by torch.searchsorted,
    then one load per key); lse and delta are the query heads' rows. With one query head per item, a window without
    document ids runs persistent from MASKED_PERSISTENT_WAVES waves of key blocks, one program per SM over a
    schedule balanced on the host (windowed_key_block_costs), and so do document ids at the head dims of
    schedule.DOCUMENTS_QUEUED_BACKWARD_HEAD_DIMS, taking the plain grid's items from a work queue as each program frees
    up (QUEUE: the spans come from ids only the device reads); persistent=False keeps the plain grid. Everything else
    is a plain grid (documents at other head dims, GQA, splits: persistent measured slower or equal there, or not
    measured; kernels/NOTES.md), GQA alone (no window or documents) in the launch order schedule.plain_order models
    best.
    split_scratch: two fp32 (B, Hkv, N, D) views (any strides, a contiguous last dimension) that the splits' dK, dV
    may use (zeroed here), e.g. memory of an output written only later; None: new buffers for one K/V head, no
    split for several."""
    B, H, N, D = q.shape
    kv_heads = k.shape[1]
    n_kblocks = -(-N // (CONSUMERS.value * TILE.value))
    programs = sm_count(q.device)
    unmasked = window is None and document_ids is None
    splits = group_splits(B, H, kv_heads, n_kblocks, programs, N if unmasked else None, block_m)
    if kv_heads > 1 and split_scratch is None:  # GQA splits only into memory lent: with fp32 dK, dV of its own it
        splits = 1  # would take more than MHA's
    if splits > 1:  # each K/V head's group split over `splits` programs per key block, adding into one fp32 dK, dV
        dk_out, dv_out = dk, dv
        if split_scratch is None:
            split_scratch = tuple(torch.empty((B, kv_heads, N, D), dtype=torch.float32, device=q.device)
                                  for _ in range(2))
        elif len(split_scratch) != 2 or any(t.shape != (B, kv_heads, N, D) or t.dtype != torch.float32
                                            or t.stride(-1) != 1 or t.device != q.device for t in split_scratch):
            raise ValueError(f"the dK/dV/dQ kernel: split_scratch must be two fp32 ({B}, {kv_heads}, {N}, {D}) views "
                             f"on q's device with a contiguous last dimension")
        dk, dv = (t.zero_() for t in split_scratch)
    heads = B * kv_heads * splits  # the items' (batch, virtual head) pairs
    group = H // (kv_heads * splits)  # query heads per item
    # persistent where an item walks one query head (MHA, or a split of one query head per program): a window alone
    # on a schedule balanced on the host, documents on the work queue (schedule.DOCUMENTS_QUEUED_BACKWARD_HEAD_DIMS)
    windowed = window is not None and document_ids is None and group == 1
    documents = document_ids is not None and group == 1 and D in DOCUMENTS_QUEUED_BACKWARD_HEAD_DIMS
    queue_programs = 0
    if persistent is None:
        persistent = (windowed or documents) and heads * n_kblocks >= MASKED_PERSISTENT_WAVES * programs
    elif persistent and not (windowed or documents):
        raise ValueError("the dK/dV/dQ kernel runs a masked launch persistent only for a window alone or for "
                         f"documents at head_dim {' or '.join(map(str, DOCUMENTS_QUEUED_BACKWARD_HEAD_DIMS))}, one "
                         "query head per item")
    if persistent and documents:  # the plain grid's items, taken from a work queue
        work, work_start = device_one_each(heads, tuple(range(n_kblocks)), q.device)
        queue_programs = min(programs, heads * n_kblocks)
    elif persistent:
        costs = windowed_key_block_costs(N, CONSUMERS.value * TILE.value, block_m, window)
        work, work_start = device_schedule(heads, costs, min(programs, heads * n_kblocks), q.device)
    elif unmasked and (kv_heads != H or splits > 1):  # GQA alone: each item walks its K/V head's query heads (or
        # its split's, perhaps one) over the query tiles from its keys on: a plain grid in the order that balances
        # best (plain_order; its costs leave out the split's SPLIT_ADD_TILES, as measured: with them the order
        # changes at 16:1 16K, 16:1 8K batch 2 and 32:1 8K, not measured)
        costs = tuple(group * c for c in key_block_costs(N, CONSUMERS.value * TILE.value, block_m))
        work, work_start = device_plain_order(heads, costs, programs, q.device)
    else:
        work, work_start = device_one_each(heads, tuple(range(n_kblocks)), q.device)
    _launch_dkdvdq(do, q, k, v, lse, stride_lse, delta, stride_delta, dk, dv, dq_acc, sm_scale, qk_scale, block_m,
                   stages, work, work_start, persistent=persistent, window=window, document_ids=document_ids,
                   kv_splits=splits, queue_programs=queue_programs)
    if splits > 1:  # dK = Σ over the splits' query heads, summed in fp32 and rounded once
        dk_out.copy_(dk)
        dv_out.copy_(dv)


@functools.lru_cache(maxsize=64)
def windowed_key_block_costs(n: int, keys: int, block_m: int, window: int) -> tuple[float, ...]:
    """Each key block's query tiles under a causal window: the queries from its first key to before its last key +
    window (_query_end)."""
    out = []
    for start in range(0, n, keys):
        last = min(start + keys, n) - 1
        out.append(float(-(-(min(n, last + window) - start) // block_m)))
    return tuple(out)


# group_splits' model: an item's atomic adds of its dK, dV rows, in tiles of work (fit to 16:1 at 8K and 32K tokens,
# head_dim 64, and 8:1 at 8K, head_dim 128, on an H200: kernels/NOTES.md, session 20)
SPLIT_ADD_TILES = 3.0


def group_splits(B: int, H: int, kv_heads: int, n_kblocks: int, sms: int, causal_n: int | None = None,
                 block_m: int = 64) -> int:
    """Programs per key block and K/V head (the kernel's kv_splits): the plain grid has B·kv_heads·n_kblocks
    programs, each walking its K/V head's group of H / kv_heads query heads, which leaves most SMs idle where that
    grid is short (MQA at 8K tokens, batch 1: 64 programs for 132 SMs, 2.8x the MHA kernel's time; GQA 8:2: 128).
    Splitting each group into `splits` parts makes splits times the programs, at the cost of one fp32 dK, dV that
    they add into atomically. Which divisor of the group: for a causal call of causal_n tokens without masks, the one
    whose grid the schedule model finishes first, no split included (split_costs: fewer, longer items add less but
    balance worse; 16:1 at 8K ran 1.007 ms with 4 splits, 1.029 with 8; at 32K 15.77 with 2, 15.56 with 4); with
    windows or documents (costs the host does not model here), for one K/V head only, the fewest that give two waves
    (GQA with masks keeps its grid: a window of 1K with GQA 8:2 at 8K ran 1.24x slower cut per K/V head). 1 (no
    split) where the grid has two waves already, but for a causal one-K/V-head call without masks, which the model
    still splits where it finishes first (16:1 at 40K tokens, 320 items: 24.29 ms in 4 splits against 26.30
    unsplit; MHA 24.19; GQA past two waves measured no steadier gain, kernels/NOTES.md session 21)."""
    group = H // kv_heads
    if group == 1:
        return 1
    waves = B * kv_heads * n_kblocks >= 2 * sms
    if causal_n is not None and (kv_heads == 1 or not waves):
        return _modelled_splits(B * kv_heads, group, causal_n, block_m, sms)
    if waves or kv_heads != 1:
        return 1
    return next((s for s in range(2, H + 1) if H % s == 0 and B * n_kblocks * s >= 2 * sms), H)


@functools.lru_cache(maxsize=64)
def _modelled_splits(B: int, H: int, n: int, block_m: int, sms: int) -> int:
    """The split count (1, or a divisor of H) whose grid schedule.modelled_finish ends first; ties: the fewer splits.
    B: the call's (batch, K/V head) pairs; H: the query heads of each."""
    return min((s for s in range(1, H + 1) if H % s == 0),
               key=lambda s: (modelled_finish(B * s, split_costs(H, s, n, block_m), sms), s))


@functools.lru_cache(maxsize=64)
def split_costs(H: int, splits: int, n: int, block_m: int) -> tuple[float, ...]:
    """A split's item at each key block position of a causal call, in tiles of work: its H / splits query heads'
    query tiles, plus SPLIT_ADD_TILES for adding its dK, dV rows atomically where there is more than one split (one
    split's items write dK, dV: GQA 16:4 at 8K tokens, 256 items on 132 SMs, ran 1.05x slower split in two)."""
    add = SPLIT_ADD_TILES if splits > 1 else 0.0
    return tuple((H // splits) * c + add for c in key_block_costs(n, CONSUMERS.value * TILE.value, block_m))


def launch_dkdv_dq_block(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, stride_lse: int, delta: Tensor,
                         stride_delta: int, dk: Tensor, dv: Tensor, dq_acc: Tensor, acc_geometry: AccGeometry,
                         sm_scale: float, qk_scale: float, block_m: int, stages: int, causal: bool,
                         accumulate_dkdv: bool, persistent: bool = False, programs: int | None = None) -> None:
    """One block of ring attention's backward (launch.launch_backward_block): dK, dV of the N_K keys of k, v
    (B, Hkv, N_K, D) over the N_Q query rows of q, do (B, H, N_Q, D), written into dk, dv (k's shape, contiguous last
    dimension) or with accumulate_dkdv added to what they hold (fp32); dQ added into dq_acc, an fp32 view addressed
    as acc_geometry says (dq_acc_geometry), with TMA reduce-adds (the caller zeroes it for a fresh dQ). causal: a
    block against itself (N_Q = N_K), each key block over the query tiles from its first key; else every key block
    over every query tile (FULL), N_Q a multiple of block_m and N_K of 128 (no tile reaches past a view's rows).
    lse and delta: the whole rows' (B, H, N_Q) fp32 rows at t + (b·H + h)·stride, 16-byte aligned starts. GQA (Hkv <
    H): one program per K/V head's key block sums dK, dV over its group. persistent (not with GQA): one program per SM
    (or `programs`) over a schedule of the (batch·head, key block) items, as launch_dkdv_dq_persistent."""
    B, H, n_q, D = q.shape
    n_k = k.shape[2]
    keys = CONSUMERS.value * TILE.value
    n_kblocks = -(-n_k // keys)
    if causal and n_q != n_k:
        raise ValueError(f"the dK/dV/dQ kernel: a causal block is a sequence against itself, got {n_q} queries and "
                         f"{n_k} keys")
    if not causal and (n_q % block_m or n_k % keys):
        raise ValueError(f"the dK/dV/dQ kernel: a non-causal block takes multiples of {block_m} queries and {keys} "
                         f"keys, got {n_q} and {n_k}")
    if persistent and k.shape[1] != H:
        raise ValueError("the dK/dV/dQ kernel: no persistent schedule with GQA")
    if persistent:
        # an item's cost: its query tiles, from its first key (causal) or all of them
        costs = key_block_costs(n_q, keys, block_m) if causal else (float(n_q // block_m),) * n_kblocks
        programs = min(programs or sm_count(q.device), B * H * n_kblocks)
        work, work_start = device_schedule(B * H, costs, programs, q.device)
    else:
        work, work_start = device_one_each(B * k.shape[1], tuple(range(n_kblocks)), q.device)
    _launch_dkdvdq(do, q, k, v, lse, stride_lse, delta, stride_delta, dk, dv, dq_acc, sm_scale, qk_scale, block_m,
                   stages, work, work_start, persistent=persistent, full=not causal, accumulate_dkdv=accumulate_dkdv,
                   acc_geometry=acc_geometry)


def launch_dq(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, stride_lse: int, delta: Tensor,
              stride_delta: int, dq: Tensor, sm_scale: float, qk_scale: float, block_n: int, stages: int) -> None:
    """Write the causal dQ of q, k, v, do (B, H, N, D) into dq (q's shape, contiguous last dimension), and
    delta = rowsum(dO ∘ O) into delta's rows (fp32, t + (b·H + h)·stride). block_n: keys per streamed tile."""
    B, H, N, D = q.shape
    grid = (-(-N // (CONSUMERS.value * TILE.value)), B * H)
    launch_kernel(dq_kernel, grid, q, k, v, do, o, lse, delta, dq, *strides3(q), *strides3(k), *strides3(v),
                  *strides3(do), *strides3(o), *strides3(dq), stride_lse, stride_delta, H, N, qk_scale, sm_scale,
                  HEAD_DIM=D, BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=CONSUMER_REGS[CONSUMERS.value],
                  PRODUCER_REGS=PRODUCER_REGS, num_warps=4)

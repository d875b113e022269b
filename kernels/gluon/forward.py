"""The FlashAttention forward on Hopper with FlashAttention-3's structure, in Gluon (Triton's explicit-layout
dialect): warp-specialized, with consumer warpgroups taking turns at the tensor cores ("ping-pong").

    o = softmax(scale · q kᵀ [+ causal mask]) v,   lse = log2 Σ_j 2^(s_j)     (the same outputs as triton_kernels.py)

Why a second forward: on long sequences the Triton forward runs three independent 64-row programs per SM, each
waiting on its own matmuls. Here one program owns 64·NUM_CONSUMERS query rows and splits its warps by role
(`gl.warp_specialize`):

- one producer warp streams the key/value tiles K_j, V_j through a ring of STAGES shared-memory buffers with TMA
  (k_ready[s] / v_ready[s]: the copy landed; k_empty[s] / v_empty[s]: every consumer is done with it; K_j is
  released as soon as S_j retires, a step before V_j, so the next K copies start a step earlier);
- NUM_CONSUMERS consumer warpgroups own 64 query rows each and take turns at the tensor cores, ordered by one
  mbarrier per consumer (turn[c] completes when consumer c may issue its matmuls). At its turn a consumer issues
  S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} together and hands the turn on; it then computes the softmax of S_j while
  the next consumer's matmuls run, so the tensor cores and the exponential unit work at the same time.

The register file is split by role (setmaxnreg): 24 registers per producer thread, the rest to the consumers, whose
64×BLOCK_N scores and 64×HEAD_DIM accumulator live in registers. Measured in kernels/NOTES.md (O): 12% faster than
the Triton forward at 128K tokens (head_dim 64), slower below 8K tokens (each program pays its set-up for one query
tile of little work); dispatch.py's table says where each variant runs.

Each program walks a list of such query tiles (items), and both launchers run the same kernel: a plain grid
(`launch_forward_pingpong`, one item per program, the last query tiles of each head first) or one program per SM
(`launch_forward_persistent`, NOTES.md S) over a list made on the host (schedule.py), so the set-up and pipeline
fill of one tile overlap the last key tiles of the one before: the producer loads the next tile's Q and first K/V
while the consumers finish. Shorter sequences, many tiles of little work each, gain most (4K tokens: 8% faster than
the Triton forward at head_dim 64, 27% at 128). With QUEUE the programs take their items from a work queue instead,
each as it frees up (common.hand_out_ticket: the producer takes the next item by an atomic add and hands its index to
the consumers), for work whose cost no list made on the host can balance (document masks).

Scope: fp16/bf16, head_dim 64 or 128, TMA-aligned inputs, sm_90 (wgmma); o in the inputs' dtype or fp32 (any
strides with a contiguous last dimension), LSE rows a fixed distance apart. CAUSAL: one length for queries and keys,
key j visible to query i iff j <= i (fresh launches write a contiguous LSE). Without CAUSAL (ring attention's blocks of
other ranks, 2c rows against c keys or c against 2c): Nq query rows against Nk keys, every key visible; each query tile
visits every key tile, and only a last one that reaches past Nk gets a mask. CONTINUE: o (fp32) and lse hold the rows'
attention over other keys, which the epilogue folds in (_write_rows): ring attention continues its running result this
way, block after block. GQA (fewer K/V heads than query heads) goes with either. With WINDOWED / DOCS
(launch_forward_masked, a plain grid, or persistent for a window alone and for documents; causal fresh launches
only) it also takes a sliding window and document ids: each query tile visits only the key tiles its rows see, and
only the tiles some row cannot fully see get the elementwise mask, a comparison of positions with each row's first
visible key. FOLD (from 32K keys, dispatch.fold_tiles): the tensor cores truncate as they add P·V into acc, which
over a million keys shrinks o by 3e-3; every FOLD key tiles each consumer folds acc into a round-to-nearest fp32 sum
in shared memory (_fold), so no chain is longer than 2048 keys (kernels/NOTES.md, the last sections). Each flag is
a constexpr: the causal fresh variants compile to the code they had without them. dispatch.py picks the variants by
sequence length (and masks); launch.py (gluon_forward_ready) falls back to the Triton forward otherwise.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from minigpt_kernels.device import staged_by_tma
from minigpt_kernels.gluon.common import (CONSUMER_REGS, PRODUCER_REGS, QUEUE_SLOTS, all_heads, hand_out_ticket,
                                          load_rows, mma_layout, program_items, store_rows, take_ticket,
                                          ticket_barriers)
from minigpt_kernels.dispatch import fold_tiles
from minigpt_kernels.gluon.schedule import MASKED_PERSISTENT_WAVES, device_one_each, device_schedule, sm_count
from minigpt_kernels.relaunch import launch_kernel

ROWS_PER_CONSUMER = gl.constexpr(64)  # query rows per consumer warpgroup: the M of one wgmma


@gluon.jit
def _online_softmax(s, m_i, l_i, rows, cols, key0, masked, qk_scale, mask, n_keys, CAUSAL: gl.constexpr,
                    WINDOWED: gl.constexpr, DOCS: gl.constexpr):
    """Fold one tile of scores into the running row max m and row sum l (base 2). Returns (p, α, m_new, l_new):
    p = exp2(s·scale − m_new) are the tile's unnormalized probabilities, α = exp2(m_old − m_new) rescales what was
    accumulated under the old max. `mask` = (window, the rows' first visible keys, ...) where WINDOWED or DOCS
    (_row_bounds): row i sees keys first_i <= j <= i; a masked tile may then leave a row with no key seen yet (its
    max stays −inf). Without CAUSAL a masked tile is the last one, reaching past the n_keys keys: only those are left
    out (every row sees key 0)."""
    if masked:
        keys = key0 + cols
        if CAUSAL:  # keys after the row (and so keys past the end), out of the window or of the row's document: p = 0
            visible = gl.expand_dims(rows, 1) >= gl.expand_dims(keys, 0)
        else:  # every key up to the last one: p = 0 past it
            visible = gl.expand_dims(keys < n_keys, 0)
        if WINDOWED or DOCS:  # keys before the row's first visible one
            visible = visible & (gl.expand_dims(keys, 0) >= gl.expand_dims(mask[1], 1))
        s = gl.where(visible, s, float("-inf"))
    # m_new = max(m_old, rowmax(s)·scale)
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_use = m_new
    if WINDOWED or DOCS:  # a row that has seen no key yet: subtract 0, not −inf, so p = α = 0 instead of NaN
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    # p = exp2(s·scale − m_new), one fused multiply-add and one exponential per score
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    # l_new = α·l_old + rowsum(p)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr, PACK_BY_HAND: gl.constexpr):
    """P as the P·V wgmma's register operand: rounded to 16 bits, two values per 32-bit register. PACK_BY_HAND rounds
    each pair with one cvt.rn.bf16x2/f16x2 (element 0 into the low half, the same rounding as two scalar conversions):
    at three consumers (160 registers each) the compiler's conversion, scalar conversions packed only before the P·V
    wgmma, leaves ptxas swapping the halves of every packed register back (32 PRMT per key tile, kernels/NOTES.md Z);
    at two consumers ptxas packs them itself, and packing by hand only adds register moves per query tile."""
    if PACK_BY_HAND:
        if dtype == gl.bfloat16:
            p16 = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.bfloat16,
                                            is_pure=True, pack=2)
        else:
            p16 = gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.float16,
                                            is_pure=True, pack=2)
    else:
        p16 = p.to(dtype)
    return gl.convert_layout(p16, p_layout)


@gluon.jit
def _first_scores(q, k_smem, k_ready, k_empty, turn, t, turn_phase, ME: gl.constexpr, NEXT: gl.constexpr,
                  STAGES: gl.constexpr, no_scores, m_i, l_i, rows, cols, key0, masked, qk_scale, p_layout: gl.constexpr,
                  PACK_P: gl.constexpr, mask, n_keys, CAUSAL: gl.constexpr, WINDOWED: gl.constexpr, DOCS: gl.constexpr):
    """A query tile's first key tile (ring position t), at this consumer's turn: S_0 = Q K_0ᵀ alone (there is no P V
    yet), then its softmax. Returns (P_0 in the input dtype as the next matmul's operand, m, l)."""
    mbarrier.wait(turn.index(ME), turn_phase)
    mbarrier.wait(k_ready.index(t % STAGES), (t // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(t % STAGES).permute((1, 0)), no_scores, use_acc=False, is_async=True)
    mbarrier.arrive(turn.index(NEXT), count=1)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(t % STAGES), count=1)  # K_0 no longer read by this consumer
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, rows, cols, key0, masked, qk_scale, mask, n_keys, CAUSAL,
                                         WINDOWED, DOCS)
    return _p_operand(p, q.dtype, p_layout, PACK_P), m_i, l_i


@gluon.jit
def _pingpong_step(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, t, turn_phase, ME: gl.constexpr,
                   NEXT: gl.constexpr, STAGES: gl.constexpr, no_scores, acc, p16, m_i, l_i, rows, cols, key0, masked,
                   qk_scale, p_layout: gl.constexpr, row_o: gl.constexpr, PACK_P: gl.constexpr, mask, n_keys,
                   CAUSAL: gl.constexpr, WINDOWED: gl.constexpr, DOCS: gl.constexpr):
    """One key tile at ring position t: at this consumer's turn issue S_j = Q K_jᵀ and O += P_{j-1} V_{j-1}; then the
    softmax of S_j while the other consumers' matmuls run. Both matmuls are retired within the step: ptxas serializes
    every wgmma of a loop whose in-flight results cross the back-edge (NOTES.md F). Returns (acc, P_j, m, l)."""
    stage = t % STAGES
    prev = (t - 1) % STAGES
    mbarrier.wait(turn.index(ME), turn_phase)
    mbarrier.wait(k_ready.index(stage), (t // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), no_scores, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(prev), ((t - 1) // STAGES) & 1)
    acc = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
    mbarrier.arrive(turn.index(NEXT), count=1)
    s = warpgroup_mma_wait(1, deps=(s,))  # S_j done; P_{j-1} V_{j-1} may still run
    mbarrier.arrive(k_empty.index(stage), count=1)  # K_j no longer read by this consumer
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, rows, cols, key0, masked, qk_scale, mask, n_keys, CAUSAL,
                                         WINDOWED, DOCS)
    acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
    mbarrier.arrive(v_empty.index(prev), count=1)  # nor V_{j-1}
    # acc = α·acc: what P_{j-1} V_{j-1} added was under the old max, as was the rest
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    return acc, _p_operand(p, q.dtype, p_layout, PACK_P), m_i, l_i


@gluon.jit
def _last_pv(v_smem, v_ready, turn, t, turn_phase, ME: gl.constexpr, NEXT: gl.constexpr, STAGES: gl.constexpr, acc,
             p16):
    """The last O += P V (ring position t), at one more turn: the turns stay in step across consumers."""
    mbarrier.wait(turn.index(ME), turn_phase)
    mbarrier.wait(v_ready.index(t % STAGES), (t // STAGES) & 1)
    acc = warpgroup_mma(p16, v_smem.index(t % STAGES), acc, is_async=True)
    mbarrier.arrive(turn.index(NEXT), count=1)
    acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
    return acc


@gluon.jit
def _key_tiles(j0, j1, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, kv, turns, ME: gl.constexpr,
               NEXT: gl.constexpr, STAGES: gl.constexpr, no_scores, acc, p16, m_i, l_i, rows, cols, first_tile, full_lo,
               full_hi, full_tiles, qk_scale, p_layout: gl.constexpr, row_o: gl.constexpr, PACK_P: gl.constexpr,
               row_mask, N_K, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WINDOWED: gl.constexpr,
               DOCS: gl.constexpr):
    """Key tiles j0 .. j1 − 1 of an item (ring positions kv + j): one _pingpong_step each."""
    for j in range(j0, j1):
        key0 = (first_tile + j) * BLOCK_N
        if WINDOWED or DOCS:
            masked = _needs_mask(key0, full_lo, full_hi, BLOCK_N)
        else:  # causal: past the tiles before the first row; else past the last whole tile of the N_K keys
            masked = j >= full_tiles
        acc, p16, m_i, l_i = _pingpong_step(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, kv + j,
                                            (turns + j) & 1, ME, NEXT, STAGES, no_scores, acc, p16, m_i, l_i, rows,
                                            cols, key0, masked, qk_scale, p_layout, row_o, PACK_P, row_mask, N_K,
                                            CAUSAL, WINDOWED, DOCS)
    return acc, p16, m_i, l_i


@gluon.jit
def _fold(outer, m_fold, acc, m_i, row_o: gl.constexpr):
    """outer · 2^(m_fold − m) + acc under the row max m, and a fresh acc: the tensor cores truncate as they add into
    acc, so a chain of many key tiles loses about one fp32 unit per 16 keys, all toward zero (kernels/NOTES.md); this
    addition rounds to nearest. m_fold = −inf: outer is empty (its scale 0, not NaN where m is −inf too)."""
    scale = gl.where(m_fold == float("-inf"), 0.0, gl.exp2(m_fold - m_i))
    return outer * gl.expand_dims(gl.convert_layout(scale, row_o), 1) + acc


@gluon.jit
def _write_rows(acc, m_i, l_i, O, LSE, b, h, bh, stride_ob, stride_oh, stride_on, stride_lse, N, row0, rows, lse_in,
                HEAD_DIM: gl.constexpr, row_o: gl.constexpr, CONTINUE: gl.constexpr, o_out, ME: gl.constexpr,
                O_TMA: gl.constexpr):
    """o = acc / l (in O's dtype) and LSE = m + log2(l) for this consumer's 64 rows (rows past N are not written);
    the (batch, head) rows of LSE lie stride_lse apart. O_TMA: o goes into this consumer's staging buffer and out by
    TMA (o_out = (O's descriptor over every head, the staging buffers)), copied while the next item starts.
    CONTINUE: first fold in what O (fp32) and LSE held, the rows' (o_in, lse_in) over other keys (lse_in read at the
    item's start), so that

        lse = log2(2^lse_in + Σ_j 2^s_j),    o = (2^lse_in · o_in + Σ_j 2^s_j v_j) / 2^lse,

    the attention over both key sets. A row with lse_in = −inf holds nothing yet: o_in is not read (it may be NaN)."""
    if CONTINUE:
        # the new keys' state (m, l, acc), Σ_j 2^s_j = 2^m · l, and the old keys' (lse_in, 1, o_in) under one max
        # m' = max(m, lse_in): a = 2^(lse_in − m') and c = 2^(m − m') (each <= 1; a = 0 where lse_in = −inf; m is
        # finite, every row having seen a key), l' = a + c·l, acc' = a·o_in + c·acc
        m_new = gl.maximum(m_i, lse_in)
        a = gl.exp2(lse_in - m_new)
        c = gl.exp2(m_i - m_new)
        l_i = a + c * l_i
        m_i = m_new
    o = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    gl.store(LSE + bh.to(gl.int64) * stride_lse + rows, m_i + gl.log2(l_i), mask=rows < N)
    out_rows = row0 + gl.arange(0, ROWS_PER_CONSUMER, layout=row_o)
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc.type.layout))
    offs = b * stride_ob + h * stride_oh + gl.expand_dims(out_rows.to(gl.int64), 1) * stride_on \
        + gl.expand_dims(out_cols, 0)
    if CONTINUE:  # o' = (a·o_in + c·acc) / l' = a/l'·o_in + c·(acc / l')
        held = (out_rows < N) & (gl.convert_layout(lse_in, row_o) > float("-inf"))
        o_in = gl.load(O + offs, mask=gl.expand_dims(held, 1), other=0.0)
        o = o * gl.expand_dims(gl.convert_layout(c, row_o), 1) \
            + o_in * gl.expand_dims(gl.convert_layout(a / l_i, row_o), 1)
    if O_TMA:  # not with CONTINUE (pingpong_fwd_kernel)
        O_BOX: gl.constexpr = [1, 1, ROWS_PER_CONSUMER, HEAD_DIM]
        o_desc, staging = o_out
        tma.store_wait(0)  # the last item's copy has read the staging buffer
        staging.index(ME).store(o.to(staging.dtype))
        fence_async_shared()
        store_rows(o_desc, [b.to(gl.int32), h.to(gl.int32), row0, 0], staging.index(ME), O_BOX)
    else:
        gl.store(O + offs, o.to(O.dtype.element_ty), mask=gl.expand_dims(out_rows < N, 1))


# ------------------------------------------------------------------------------------------------
# The kernel: each program walks a list of (batch·head, query tile) items, one item (a plain grid) or many
# ------------------------------------------------------------------------------------------------
def consumers_can_stop_early(consumers: int, block_n: int) -> bool:
    """Whether some consumer's 64 rows of a query tile end a key tile earlier than the tile's last row does (then it
    skips the key tiles past its own diagonal, which are all masked for it, and only takes its remaining turns). Not
    so for 2 consumers over 128-key tiles: both halves of a 128-row tile end in its last key tile. The pattern repeats
    every block_n / 64 query tiles."""
    block_m = 64 * consumers
    return any((block_m * m + 64 * (c + 1) - 1) // block_n < (block_m * m + block_m - 1) // block_n
               for m in range(block_n // 64 + 1) for c in range(consumers - 1))


@gluon.jit
def _key_span(first, last, mask, N, WINDOWED: gl.constexpr, DOCS: gl.constexpr):
    """The keys of causal query rows first..last under the masks: [lo, hi) holds every key one of them sees, [a, b)
    the keys all of them see. Each row sees an interval of keys whose ends never decrease with the row (the window's
    i − window < j, its document's first key, the diagonal), so the first row bounds the span from below and the last
    from above, and the other way round for the keys all see. mask = (window, -, starts, ends, N): each token's
    document runs from starts[i] to ends[i] (exclusive), so four independent loads give the span."""
    lo = first * 0
    hi = last + 1
    a = lo
    b = first + 1
    if WINDOWED:  # keys i − window < j
        lo = gl.maximum(lo, first - mask[0] + 1)
        a = gl.maximum(a, last - mask[0] + 1)
    if DOCS:  # from the first row's document's first key to the last row's document's last
        starts, ends = mask[2], mask[3]
        lo = gl.maximum(lo, gl.load(starts + first))
        hi = gl.minimum(hi, gl.load(ends + last))
        a = gl.maximum(a, gl.load(starts + last))
        b = gl.minimum(b, gl.load(ends + first))
    return lo, hi, a, b


@gluon.jit
def _batch_bounds(mask, b, DOCS: gl.constexpr):
    """`mask` with batch b's rows of document starts and ends ((B, N) rows, N apart)."""
    if DOCS:
        mask = (mask[0], mask[1], mask[2] + b * mask[4], mask[3] + b * mask[4], mask[4])
    return mask


@gluon.jit
def _row_bounds(mask, rows, N, WINDOWED: gl.constexpr, DOCS: gl.constexpr):
    """`mask` with each of these causal query rows' first visible key: the row sees keys first <= j <= i, where
    first = max(i − window + 1, its document's first key). For documents that is the ids' test ids[j] == ids[i]
    with j <= i, as ids never decrease along the row; the tile loop then compares positions only, with no id loads
    (the backward reads each key's document end the same way). Rows past N see no key."""
    first = rows * 0
    if WINDOWED:  # keys i − window < j
        first = gl.maximum(first, rows - mask[0] + 1)
    if DOCS:
        first = gl.maximum(first, gl.load(mask[2] + rows, mask=rows < N, other=N))
    first = gl.where(rows < N, first, rows + 1)
    return (mask[0], first, mask[2], mask[3], mask[4])


@gluon.jit
def _needs_mask(key0, full_lo, full_hi, BLOCK_N: gl.constexpr):
    """Whether the key tile from key0 holds a key that some of the rows do not see (outside [full_lo, full_hi))."""
    return (key0 < full_lo) | (key0 + BLOCK_N > full_hi)


@gluon.jit
def _work_item(WORK, index, n_qtiles, BLOCK_M: gl.constexpr, N, N_K, BLOCK_N: gl.constexpr, mask, H,
               CAUSAL: gl.constexpr, WINDOWED: gl.constexpr, DOCS: gl.constexpr):
    """Item `index` of the list: (batch·head, first query row, first key tile, key tiles): causal without masks from
    the first key to the tile's last row; with masks the tiles of _key_span's [lo, hi); without CAUSAL every key
    tile of the N_K keys."""
    item = gl.load(WORK + index)
    start_m = (item % n_qtiles) * BLOCK_M
    last = gl.minimum(start_m + BLOCK_M, N) - 1
    if WINDOWED or DOCS:
        batch_mask = _batch_bounds(mask, (item // n_qtiles // H).to(gl.int64), DOCS)
        lo, hi, a, b = _key_span(start_m, last, batch_mask, N, WINDOWED, DOCS)
        first_tile = lo // BLOCK_N
        num_tiles = gl.cdiv(hi, BLOCK_N) - first_tile
    elif CAUSAL:
        first_tile = 0
        num_tiles = gl.cdiv(last + 1, BLOCK_N)
    else:
        first_tile = 0
        num_tiles = gl.cdiv(N_K, BLOCK_N)
    return item // n_qtiles, start_m, first_tile, num_tiles



@gluon.jit
def _consumer_item(shared, o_out, consts, index, i, kv, ME: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
                   HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SKIP: gl.constexpr,
                   WINDOWED: gl.constexpr, DOCS: gl.constexpr, CAUSAL: gl.constexpr, CONTINUE: gl.constexpr,
                   FOLD: gl.constexpr, O_TMA: gl.constexpr):
    """Consumer ME's share of work item `index`, the program's i-th, from ring position kv (_consumer); returns the
    ring position after it."""
    (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, O, LSE, H, stride_ob,
     stride_oh, stride_on, stride_lse, N, N_K, qk_scale, WORK, WORK_START, n_qtiles, mask, fold_smem,
     _tickets) = shared
    q, cols, no_scores = consts
    BLOCK_M: gl.constexpr = NUM_CONSUMERS * ROWS_PER_CONSUMER
    s_layout: gl.constexpr = mma_layout(BLOCK_N, 4)
    o_layout: gl.constexpr = mma_layout(HEAD_DIM, 4)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    PACK_P: gl.constexpr = NUM_CONSUMERS == 3  # see _p_operand
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    NEXT: gl.constexpr = (ME + 1) % NUM_CONSUMERS
    # the fold's shared sum written at the first fold instead of zeroed per item: with documents, whose lengths the
    # launch cannot know (FOLD is on from 32K keys), short documents' items, one chain each, never touch it; elsewhere
    # zeroed (fewer instructions in the tile loop: the dense 3-consumer fold 594 against 648, sm90_build)
    LAZY_FOLD: gl.constexpr = DOCS
    bh, start_m, first_tile, num_tiles = _work_item(WORK, index, n_qtiles, BLOCK_M, N, N_K, BLOCK_N, mask, H,
                                                    CAUSAL, WINDOWED, DOCS)
    turns = kv + i
    row0 = start_m + ME * ROWS_PER_CONSUMER
    rows = row0 + gl.arange(0, ROWS_PER_CONSUMER, layout=gl.SliceLayout(1, s_layout))
    if CAUSAL:  # without masks: key tiles wholly at or before the first row need none
        full_tiles = row0 // BLOCK_N
    else:  # every key visible (first_tile = 0): only a tile reaching past the last key needs the mask
        full_tiles = N_K // BLOCK_N
    if WINDOWED or DOCS:  # the keys all of this consumer's rows see (rows past N: the last row's)
        row_mask = _row_bounds(_batch_bounds(mask, (bh // H).to(gl.int64), DOCS), rows, N, WINDOWED, DOCS)
        _lo, _hi, full_lo, full_hi = _key_span(gl.minimum(row0, N - 1),
                                               gl.minimum(row0 + ROWS_PER_CONSUMER, N) - 1, row_mask, N,
                                               WINDOWED, DOCS)
        masked0 = _needs_mask(first_tile * BLOCK_N, full_lo, full_hi, BLOCK_N)
    else:
        row_mask = mask
        masked0 = 0 >= full_tiles
    if SKIP:  # this consumer's own key tiles: up to its last row
        my_tiles = gl.cdiv(gl.minimum(row0 + ROWS_PER_CONSUMER, N), BLOCK_N)
    else:
        my_tiles = num_tiles
    m_i = gl.full([ROWS_PER_CONSUMER], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS_PER_CONSUMER], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS_PER_CONSUMER, HEAD_DIM], gl.float32, layout=o_layout)
    if FOLD:  # the sum of the folded chains, in shared memory, under the row max m_fold (see _fold)
        outer = fold_smem.index(ME)
        if not LAZY_FOLD:
            outer.store(gl.zeros([ROWS_PER_CONSUMER, HEAD_DIM], gl.float32, layout=o_layout))
        m_fold = gl.full([ROWS_PER_CONSUMER], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    if CONTINUE:  # the rows' lse over other keys, folded in when they are written (its load has the item to land)
        lse_in = gl.load(LSE + bh.to(gl.int64) * stride_lse + rows, mask=rows < N, other=float("-inf"))
    else:
        lse_in = m_i
    mbarrier.wait(q_ready.index(ME), i & 1)

    p16, m_i, l_i = _first_scores(q, k_smem, k_ready, k_empty, turn, kv, turns & 1, ME, NEXT, STAGES, no_scores,
                                  m_i, l_i, rows, cols, first_tile * BLOCK_N, masked0, qk_scale, p_layout, PACK_P,
                                  row_mask, N_K, CAUSAL, WINDOWED, DOCS)
    if not (WINDOWED or DOCS):  # only the masked spans read these
        full_lo = full_tiles
        full_hi = full_tiles
    if FOLD:  # chains of FOLD key tiles, each folded into `outer` (kernels/NOTES.md), the loop itself unchanged
        for j0 in range(1, my_tiles, FOLD):
            acc, p16, m_i, l_i = _key_tiles(j0, gl.minimum(j0 + FOLD, my_tiles), q, k_smem, v_smem, k_ready,
                                            v_ready, k_empty, v_empty, turn, kv, turns, ME, NEXT, STAGES,
                                            no_scores, acc, p16, m_i, l_i, rows, cols, first_tile, full_lo,
                                            full_hi, full_tiles, qk_scale, p_layout, row_o, PACK_P, row_mask, N_K,
                                            BLOCK_N, CAUSAL, WINDOWED, DOCS)
            # whole chains only: a last, shorter one is folded below with the last P V. Chains then end at fixed
            # tile indices, so a consumer that stops at its diagonal (SKIP) folds the same sums as one that runs
            # on over masked tiles (adding zeros): the persistent kernel equals the plain one bitwise
            if j0 + FOLD <= my_tiles:
                if LAZY_FOLD and j0 == 1:  # the first chain: nothing folded before it
                    folded = acc
                else:
                    folded = _fold(outer.load(o_layout), m_fold, acc, m_i, row_o)
                outer.store(folded)
                m_fold = m_i
                acc = gl.zeros_like(acc)
    else:
        acc, p16, m_i, l_i = _key_tiles(1, my_tiles, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn,
                                        kv, turns, ME, NEXT, STAGES, no_scores, acc, p16, m_i, l_i, rows, cols,
                                        first_tile, full_lo, full_hi, full_tiles, qk_scale, p_layout, row_o,
                                        PACK_P, row_mask, N_K, BLOCK_N, CAUSAL, WINDOWED, DOCS)
    mbarrier.arrive(q_empty.index(ME), count=1)  # every S of this item has retired: the producer may reload Q
    acc = _last_pv(v_smem, v_ready, turn, kv + my_tiles - 1, (turns + my_tiles) & 1, ME, NEXT, STAGES, acc, p16)
    mbarrier.arrive(v_empty.index((kv + my_tiles - 1) % STAGES), count=1)
    # key tiles past this consumer's rows: its turns and buffer releases only, so the others stay in step
    for j in range(my_tiles + 1, num_tiles + 1):
        mbarrier.wait(turn.index(ME), (turns + j) & 1)
        mbarrier.arrive(turn.index(NEXT), count=1)
        mbarrier.arrive(k_empty.index((kv + j - 1) % STAGES), count=1)
        mbarrier.arrive(v_empty.index((kv + j - 1) % STAGES), count=1)
    kv += num_tiles
    if FOLD:
        if not LAZY_FOLD or my_tiles > FOLD:  # the last chain folded in: acc is the whole row's Σ p·v under m
            acc = _fold(outer.load(o_layout), m_fold, acc, m_i, row_o)
    _write_rows(acc, m_i, l_i, O, LSE, (bh // H).to(gl.int64), (bh % H).to(gl.int64), bh, stride_ob, stride_oh,
                stride_on, stride_lse, N, row0, rows, lse_in, HEAD_DIM, row_o, CONTINUE, o_out, ME, O_TMA)
    return kv


@gluon.jit
def _consumer(shared, o_out, ME: gl.constexpr, NUM_CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SKIP: gl.constexpr, PERSISTENT: gl.constexpr,
              QUEUE: gl.constexpr, WINDOWED: gl.constexpr, DOCS: gl.constexpr, CAUSAL: gl.constexpr,
              CONTINUE: gl.constexpr, FOLD: gl.constexpr, O_TMA: gl.constexpr):
    """Consumer warpgroup ME: for each of this program's items in turn (QUEUE: as the producer takes them from the
    work queue and hands them over, common.take_ticket), attention of query rows start_m + 64·ME ...
    + 63 over key tiles 0 .. num_tiles−1. The turn and ring counters run on across items (item i starts at turn
    kv + i: each item before took one turn per key tile and one more), so no barrier is reset. With SKIP, a consumer
    whose rows end before the item's last key tile only takes its turns there. With masks (WINDOWED, DOCS) the key
    tiles run from the item's first one (_work_item) and each gets the mask unless all of this consumer's rows see
    all of its keys. Without CAUSAL every key tile, the mask only on a last one that reaches past N_K. CONTINUE:
    the (o, lse) that O and LSE hold over other keys is folded into the rows as they are written (_write_rows). O_TMA:
    o leaves by TMA through shared memory (o_out, _write_rows)."""
    (q_smem, _k_smem, _v_smem, _q_ready, _q_empty, _k_ready, _v_ready, _k_empty, _v_empty, turn, _O, _LSE, _H,
     _stride_ob, _stride_oh, _stride_on, _stride_lse, _N, _N_K, _qk_scale, _WORK, WORK_START, _n_qtiles, _mask,
     _fold_smem, tickets) = shared
    s_layout: gl.constexpr = mma_layout(BLOCK_N, 4)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    no_scores = gl.zeros([ROWS_PER_CONSUMER, BLOCK_N], gl.float32, layout=s_layout)
    q = q_smem.index(ME)
    if ME == NUM_CONSUMERS - 1:  # the last consumer opens the first turn, so consumer 0 goes first
        mbarrier.arrive(turn.index(0), count=1)
    kv = 0  # key/value tiles of the items before: the ring position
    consts = (q, cols, no_scores)
    if QUEUE:  # items as the producer takes them from the queue, until it hands out none (-1)
        i = 0
        index = take_ticket(WORK_START, tickets, i)
        while index >= 0:
            kv = _consumer_item(shared, o_out, consts, index, i, kv, ME, NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES,
                                SKIP, WINDOWED, DOCS, CAUSAL, CONTINUE, FOLD, O_TMA)
            i += 1
            index = take_ticket(WORK_START, tickets, i)
    else:
        first, count = program_items(WORK_START, PERSISTENT)
        for i in range(count):
            kv = _consumer_item(shared, o_out, consts, first + i, i, kv, ME, NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES,
                                SKIP, WINDOWED, DOCS, CAUSAL, CONTINUE, FOLD, O_TMA)
    if O_TMA:
        tma.store_wait(0)


@gluon.jit
def _producer_item(loads, index, i, kv, NUM_CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, QUEUE: gl.constexpr, GQA: gl.constexpr, WINDOWED: gl.constexpr,
                   DOCS: gl.constexpr, CAUSAL: gl.constexpr):
    """The producer's loads for work item `index`, the program's i-th, from ring position kv (_producer); returns
    the ring position after it and, with QUEUE, the next item's index, taken once this item's Q loads are issued, so
    that the queue's round trip overlaps this item's key tiles."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, H, N, N_K,
     WORK, WORK_START, n_qtiles, mask, group, B, tickets) = loads
    dtype: gl.constexpr = q_smem.dtype
    BLOCK_M: gl.constexpr = NUM_CONSUMERS * ROWS_PER_CONSUMER
    q_bytes: gl.constexpr = ROWS_PER_CONSUMER * HEAD_DIM * dtype.primitive_bitwidth // 8
    kv_bytes: gl.constexpr = BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
    Q_BOX: gl.constexpr = [1, 1, ROWS_PER_CONSUMER, HEAD_DIM]
    KV_BOX: gl.constexpr = [1, 1, BLOCK_N, HEAD_DIM]
    bh, start_m, first_tile, num_tiles = _work_item(WORK, index, n_qtiles, BLOCK_M, N, N_K, BLOCK_N, mask, H,
                                                    CAUSAL, WINDOWED, DOCS)
    b = bh // H
    h = bh % H
    if GQA:
        h_kv = h // group
    else:
        h_kv = h
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.wait(q_empty.index(c), (i & 1) ^ 1)  # a fresh barrier passes parity 1
        mbarrier.expect(q_ready.index(c), q_bytes)
        load_rows(q_desc, [b, h, start_m + c * ROWS_PER_CONSUMER, 0], q_ready.index(c), q_smem.index(c), Q_BOX)
    if QUEUE:
        next_index = hand_out_ticket(WORK_START, tickets, i + 1, B * H * n_qtiles)
    else:
        next_index = index + 1  # unused
    for j in range(num_tiles):
        t = kv + j
        stage = t % STAGES
        row = (first_tile + j) * BLOCK_N
        mbarrier.wait(k_empty.index(stage), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(stage), kv_bytes)
        load_rows(k_desc, [b, h_kv, row, 0], k_ready.index(stage), k_smem.index(stage), KV_BOX)
        mbarrier.wait(v_empty.index(stage), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(v_ready.index(stage), kv_bytes)
        load_rows(v_desc, [b, h_kv, row, 0], v_ready.index(stage), v_smem.index(stage), KV_BOX)
    kv += num_tiles
    return kv, next_index


@gluon.jit
def _producer(loads, NUM_CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, PERSISTENT: gl.constexpr, QUEUE: gl.constexpr, GQA: gl.constexpr,
              WINDOWED: gl.constexpr, DOCS: gl.constexpr, CAUSAL: gl.constexpr):
    """The producer warp, over this program's items: each consumer's Q rows, then K_j, V_j into buffer j % STAGES as
    soon as every consumer has released what the buffer held (tile j − STAGES); rows past the end read as 0 (TMA). It
    loads each consumer's Q once that consumer's last S of the previous item has retired (q_empty), so the next
    item's loads run while the consumers finish the last. The descriptors span every head (common.all_heads), so
    an item only names its (batch, head) in the copies' coordinates. GQA: query head h reads K/V head h // group."""
    (_q_desc, _k_desc, _v_desc, _q_smem, _k_smem, _v_smem, _q_ready, _q_empty, _k_ready, _v_ready, _k_empty, _v_empty,
     H, _N, _N_K, _WORK, WORK_START, n_qtiles, _mask, _group, B, tickets) = loads
    kv = 0
    if QUEUE:  # items from the queue, each handed to the consumers (common.hand_out_ticket), then -1: none left
        i = 0
        index = hand_out_ticket(WORK_START, tickets, i, B * H * n_qtiles)
        while index >= 0:
            kv, index = _producer_item(loads, index, i, kv, NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, QUEUE, GQA,
                                       WINDOWED, DOCS, CAUSAL)
            i += 1
    else:
        first, count = program_items(WORK_START, PERSISTENT)
        for i in range(count):
            kv, _next = _producer_item(loads, first + i, i, kv, NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, QUEUE, GQA,
                                       WINDOWED, DOCS, CAUSAL)


@gluon.jit
def pingpong_fwd_kernel(Q, K, V, O, LSE, WORK, WORK_START,
                        stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                        B, H, N, n_qtiles, qk_scale, group, window, DOC_STARTS, DOC_ENDS, stride_lse,
                        N_K, HEAD_DIM: gl.constexpr, NUM_CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                        SKIP: gl.constexpr, PERSISTENT: gl.constexpr, GQA: gl.constexpr, WINDOWED: gl.constexpr,
                        DOCS: gl.constexpr, CAUSAL: gl.constexpr, CONTINUE: gl.constexpr, FOLD: gl.constexpr = 0,
                        O_TMA: gl.constexpr = False, QUEUE: gl.constexpr = False):
    """Program p computes items WORK[WORK_START[p] : WORK_START[p+1]] (QUEUE: WORK's items as the programs take them
    from the work queue WORK_START, common.hand_out_ticket; item = bh · n_qtiles + query tile): attention
    of one tile of 64·NUM_CONSUMERS of the N query rows of one (batch, head) each over the N_K keys, causal (N_K = N)
    or, without CAUSAL, every key. B: batches; H: query heads; GQA: K/V head h // group. LSE rows lie stride_lse apart.
    WINDOWED: keys i − window < j; DOCS: keys of the row's document, given by DOC_STARTS and DOC_ENDS ((B, N)
    contiguous int32: where each token's document starts and ends, exclusive), found from the ids before the launch
    (both causal only). Without them the last four are unused. CONTINUE: O (fp32) and LSE hold the rows' attention
    over other keys, continued here and overwritten with the attention over both key sets. O_TMA (fresh 2-byte,
    TMA-aligned O; staged_by_tma): each consumer's rows of O leave through shared memory by TMA, not by stores from
    registers."""
    gl.static_assert(CAUSAL or not (SKIP or WINDOWED or DOCS), "SKIP and the masks go with the causal mask")
    gl.static_assert(not (O_TMA and CONTINUE), "O_TMA writes O fresh; CONTINUE reads it")
    gl.static_assert(not (CONTINUE and (WINDOWED or DOCS)), "the masks go with fresh launches")
    # Causal launches are a sequence against itself (N keys), and the fresh ones write LSE rows N apart: those variants
    # read N for both, as before N_K and stride_lse were arguments (a runtime value there changes their compiled code)
    if CAUSAL:
        N_K = N
        if not CONTINUE:
            stride_lse = N
    dtype: gl.constexpr = Q.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS_PER_CONSUMER, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, ROWS_PER_CONSUMER, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)
    if QUEUE:  # the producer hands each item it takes to the consumers (common.hand_out_ticket)
        tickets = ticket_barriers(NUM_CONSUMERS)
    else:
        tickets = (turn, turn)  # unused
    fence_async_shared()
    # the rows' first visible keys (the 0) are filled in per item by the consumers (_row_bounds)
    mask = (window, 0, DOC_STARTS, DOC_ENDS, N)

    if FOLD:  # each consumer's folded sum (kernels/NOTES.md): in shared memory, so the loop holds no more registers
        fold_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        fold_smem = gl.allocate_shared_memory(gl.float32, [NUM_CONSUMERS, ROWS_PER_CONSUMER, HEAD_DIM], fold_layout)
    else:
        fold_smem = q_smem  # unused
    if O_TMA:  # each consumer's rows of O staged for their TMA copy out
        out_dtype: gl.constexpr = O.dtype.element_ty
        o_out = (all_heads(O, B, H, N, stride_ob, stride_oh, stride_on, ROWS_PER_CONSUMER, HEAD_DIM),
                 gl.allocate_shared_memory(out_dtype, [NUM_CONSUMERS, ROWS_PER_CONSUMER, HEAD_DIM],
                                           gl.NVMMASharedLayout.get_default_for([ROWS_PER_CONSUMER, HEAD_DIM],
                                                                                out_dtype)))
    else:
        o_out = (0, 0)  # unused
    shared = (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, O, LSE, H, stride_ob,
              stride_oh, stride_on, stride_lse, N, N_K, qk_scale, WORK, WORK_START, n_qtiles, mask, fold_smem,
              tickets)
    # TMA descriptors over every head, made once here, before the warps split (in the producer they cost the ring's
    # continued D128 forward a spill in its key-tile loops: kernels/NOTES.md, session 15)
    q_desc = all_heads(Q, B, H, N, stride_qb, stride_qh, stride_qn, ROWS_PER_CONSUMER, HEAD_DIM)
    k_desc = all_heads(K, B, H // group, N_K, stride_kb, stride_kh, stride_kn, BLOCK_N, HEAD_DIM)
    v_desc = all_heads(V, B, H // group, N_K, stride_vb, stride_vh, stride_vn, BLOCK_N, HEAD_DIM)
    loads = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, H,
             N, N_K, WORK, WORK_START, n_qtiles, mask, group, B, tickets)
    if NUM_CONSUMERS == 2:
        gl.warp_specialize(
            [(_consumer, (shared, o_out, gl.constexpr(0), NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, SKIP,
                          PERSISTENT, QUEUE, WINDOWED, DOCS, CAUSAL, CONTINUE, FOLD, O_TMA)),
             (_consumer, (shared, o_out, gl.constexpr(1), NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, SKIP,
                          PERSISTENT, QUEUE, WINDOWED, DOCS, CAUSAL, CONTINUE, FOLD, O_TMA)),
             (_producer, (loads, NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, PERSISTENT, QUEUE, GQA, WINDOWED,
                          DOCS, CAUSAL))],
            [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize(
            [(_consumer, (shared, o_out, gl.constexpr(0), NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, SKIP,
                          PERSISTENT, QUEUE, WINDOWED, DOCS, CAUSAL, CONTINUE, FOLD, O_TMA)),
             (_consumer, (shared, o_out, gl.constexpr(1), NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, SKIP,
                          PERSISTENT, QUEUE, WINDOWED, DOCS, CAUSAL, CONTINUE, FOLD, O_TMA)),
             (_consumer, (shared, o_out, gl.constexpr(2), NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, SKIP,
                          PERSISTENT, QUEUE, WINDOWED, DOCS, CAUSAL, CONTINUE, FOLD, O_TMA)),
             (_producer, (loads, NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, PERSISTENT, QUEUE, GQA, WINDOWED,
                          DOCS, CAUSAL))],
            [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


@functools.lru_cache(maxsize=64)
def query_tile_costs(n: int, block_m: int, block_n: int, n_keys: int | None = None) -> tuple[float, ...]:
    """Each query tile's work in the forward: its key tiles, up to the tile's last row (causal), or all of n_keys's
    (not causal: every tile the same)."""
    if n_keys is not None:
        return (float(-(-n_keys // block_n)),) * -(-n // block_m)
    return tuple(float(-(-min((t + 1) * block_m, n) // block_n)) for t in range(-(-n // block_m)))


def _launch(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, qk_scale: float, consumers: int, block_n: int,
            stages: int, work: Tensor, work_start: Tensor, persistent: bool, window: int | None = None,
            document_ids: Tensor | None = None, causal: bool = True, accumulate: bool = False,
            stride_lse: int | None = None, queue_programs: int = 0) -> None:
    """queue_programs > 0: that many programs take the items of `work` from a work queue (common.hand_out_ticket;
    work_start unused), else program p walks work[work_start[p] : work_start[p + 1]]."""
    B, H, N, D = q.shape
    masks = window is not None or document_ids is not None
    if masks and not (causal and not accumulate):
        raise ValueError("the Gluon forward takes windows and document ids in causal fresh launches only")
    fold = fold_tiles(k.shape[2], block_n, window)  # the accumulator folded in shared memory (dispatch.FOLD_KEYS)
    if fold and D == 128:  # the folded sums (2 × 32 KB) fit beside two K/V stages, not three
        stages = min(stages, 2)
    skip = persistent and causal and not masks and consumers_can_stop_early(consumers, block_n)
    if skip and stages < 2:  # a consumer past its diagonal releases a ring buffer the others finished two tiles before
        raise ValueError(f"the persistent forward with {consumers} consumers needs at least 2 stages, got {stages}")
    if causal and not accumulate and stride_lse not in (None, N) and B * H > 1:
        raise ValueError(f"causal fresh launches write LSE rows N = {N} apart (a contiguous LSE), got {stride_lse}")
    if document_ids is None:  # placeholder pointers where there are no documents
        starts = ends = work
    else:  # each token's document as [start, end): two binary searches per token on the device (no host sync), so
        # that a work item reads its key span with four loads and each row its first key with one (NOTES.md)
        starts = torch.searchsorted(document_ids, document_ids, out_int32=True)
        ends = torch.searchsorted(document_ids, document_ids, right=True, out_int32=True)
    if queue_programs:
        work_start = torch.zeros(1 + QUEUE_SLOTS.value * queue_programs, dtype=torch.int32, device=q.device)
    launch_kernel(pingpong_fwd_kernel, (queue_programs or work_start.numel() - 1,),
        q, k, v, o, lse, work, work_start, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2), B, H, N,
        -(-N // (consumers * ROWS_PER_CONSUMER.value)), qk_scale, H // k.shape[1], window or 0, starts, ends,
        N if stride_lse is None else stride_lse, k.shape[2],
        HEAD_DIM=D, NUM_CONSUMERS=consumers, BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=CONSUMER_REGS[consumers],
        PRODUCER_REGS=PRODUCER_REGS, SKIP=skip, PERSISTENT=persistent, GQA=k.shape[1] != H,
        WINDOWED=window is not None, DOCS=document_ids is not None, CAUSAL=causal, CONTINUE=accumulate, FOLD=fold,
        O_TMA=staged_by_tma(D, o, accumulate=accumulate), QUEUE=queue_programs > 0, num_warps=4)


def launch_forward_pingpong(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, qk_scale: float, consumers: int,
                            block_n: int, stages: int, *, causal: bool = True, accumulate: bool = False,
                            stride_lse: int | None = None) -> None:
    """Write attention of q (B, H, Nq, D) over k, v (B, H or H / group, Nk, D) into o (q's shape, q's dtype or fp32,
    any strides with a contiguous last dimension) and lse ((B, H, Nq) fp32, base 2; its (batch, head) rows
    stride_lse apart, Nq by default), one program per query tile, as a plain grid: within each head the last query
    tiles (most keys) first. causal: Nq == Nk, key j visible to query i iff j <= i; else every key, any Nq and Nk.
    accumulate: o (fp32) and lse hold these rows' attention over other keys (o normalized; lse = −inf: nothing yet)
    and are overwritten with the attention over both key sets. qk_scale = softmax scale · log2(e). The caller checks
    the scope (launch.gluon_forward_ready) and has set Triton's scratch allocator for the device-side TMA
    descriptors."""
    B, H, N, _ = q.shape
    n_qtiles = -(-N // (consumers * ROWS_PER_CONSUMER.value))
    work, work_start = device_one_each(B * H, tuple(reversed(range(n_qtiles))), q.device)
    _launch(q, k, v, o, lse, qk_scale, consumers, block_n, stages, work, work_start, persistent=False, causal=causal,
            accumulate=accumulate, stride_lse=stride_lse)


def launch_forward_persistent(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, qk_scale: float,
                              consumers: int, block_n: int, stages: int, programs: int | None = None, *,
                              causal: bool = True, accumulate: bool = False, stride_lse: int | None = None) -> None:
    """launch_forward_pingpong's contract, on one program per SM (or `programs`) walking schedule.py's
    work list (an item costing its key tiles, query_tile_costs)."""
    B, H, N, _ = q.shape
    costs = query_tile_costs(N, consumers * ROWS_PER_CONSUMER.value, block_n, None if causal else k.shape[2])
    programs = min(programs or sm_count(q.device), B * H * len(costs))
    work, work_start = device_schedule(B * H, costs, programs, q.device)
    _launch(q, k, v, o, lse, qk_scale, consumers, block_n, stages, work, work_start, persistent=True, causal=causal,
            accumulate=accumulate, stride_lse=stride_lse)


@functools.lru_cache(maxsize=64)
def windowed_query_tile_costs(n: int, block_m: int, block_n: int, window: int) -> tuple[float, ...]:
    """Each query tile's key tiles under a causal window: the keys (first row − window, last row]."""
    out = []
    for t in range(-(-n // block_m)):
        first, last = t * block_m, min((t + 1) * block_m, n) - 1
        out.append(float(last // block_n - max(0, first - window + 1) // block_n + 1))
    return tuple(out)


def launch_forward_masked(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, qk_scale: float, consumers: int,
                          block_n: int, stages: int, window: int | None, document_ids: Tensor | None, *,
                          stride_lse: int | None = None, persistent: bool | None = None) -> None:
    """launch_forward_pingpong's causal fresh contract with GQA (k, v with H / group heads) and the masks: `window`
    (keys i − window < j) and `document_ids` ((B, N) int32/int64, non-decreasing, rows with a contiguous last dimension;
    keys of the row's document). Each query tile visits only the key tiles its rows see, found on the device (each
    token's document bounds by torch.searchsorted, then four loads per item). From MASKED_PERSISTENT_WAVES waves of
    query tiles it runs one program per SM: a window alone over a schedule balanced on the host
    (windowed_query_tile_costs); document ids, whose tiles per item only the device reads, taking the plain grid's
    items from a work queue as each program frees up (QUEUE; schedule.DOCUMENTS_QUEUED_BACKWARD_HEAD_DIMS says why).
    persistent=False keeps the plain grid, as ring attention asks; True forces one program per SM."""
    B, H, N, D = q.shape
    rows = consumers * ROWS_PER_CONSUMER.value
    n_qtiles = -(-N // rows)
    programs = sm_count(q.device)
    windowed = window is not None and document_ids is None
    queue_programs = 0
    if persistent is None:
        persistent = (windowed or document_ids is not None) and B * H * n_qtiles >= MASKED_PERSISTENT_WAVES * programs
    if persistent and windowed:
        costs = windowed_query_tile_costs(N, rows, block_n, window)
        work, work_start = device_schedule(B * H, costs, min(programs, B * H * n_qtiles), q.device)
    elif persistent:  # the plain grid's items, taken from a work queue
        work, work_start = device_one_each(B * H, tuple(reversed(range(n_qtiles))), q.device)
        queue_programs = min(programs, B * H * n_qtiles)
    else:
        work, work_start = device_one_each(B * H, tuple(reversed(range(n_qtiles))), q.device)
    _launch(q, k, v, o, lse, qk_scale, consumers, block_n, stages, work, work_start, persistent=persistent,
            window=window, document_ids=document_ids, stride_lse=stride_lse, queue_programs=queue_programs)

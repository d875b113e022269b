"""Issue 10, session 24: the ping-pong forward made persistent. One program per SM walks a host-made list of work
items (one item = 64·C query rows of one (batch, head)); the producer runs ahead into the next item (its Q and first
K/V tiles load while the consumers finish the last one), so per-item set-up and pipeline fill overlap compute.
SKIP: each consumer stops at its own diagonal (it still takes its turns, without matmuls)."""
from __future__ import annotations

import functools
import heapq

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from minigpt_kernels.flash_forward_pingpong import (ROWS_PER_CONSUMER, _head_rows, _mma_layout, _online_softmax,
                                                    CONSUMER_REGS, PRODUCER_REGS)


@gluon.jit
def _item(WORK, idx, n_qblocks, BLOCK_M: gl.constexpr, N, BLOCK_N: gl.constexpr):
    item = gl.load(WORK + idx)
    bh = item // n_qblocks
    start_m = (item % n_qblocks) * BLOCK_M
    num_tiles = gl.cdiv(gl.minimum(start_m + BLOCK_M, N), BLOCK_N)
    return bh, start_m, num_tiles


@gluon.jit
def _consumer(shared, ME: gl.constexpr, NUM_CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, SKIP: gl.constexpr):
    (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, turn,
     O, LSE, H, stride_ob, stride_oh, stride_on, N, qk_scale, WORK, first, count, n_qblocks) = shared
    dtype: gl.constexpr = q_smem.dtype
    BLOCK_M: gl.constexpr = NUM_CONSUMERS * ROWS_PER_CONSUMER
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, 4)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, 4)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    NEXT: gl.constexpr = (ME + 1) % NUM_CONSUMERS
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    no_scores = gl.zeros([ROWS_PER_CONSUMER, BLOCK_N], gl.float32, layout=s_layout)
    q = q_smem.index(ME)
    if ME == NUM_CONSUMERS - 1:  # the last consumer opens the first turn, so consumer 0 goes first
        mbarrier.arrive(turn.index(0), count=1)
    turns = 0  # turns taken so far (this consumer's turn barrier phase)
    kv = 0  # key/value tiles consumed so far (ring position)
    for i in range(count):
        bh, start_m, num_tiles = _item(WORK, first + i, n_qblocks, BLOCK_M, N, BLOCK_N)
        b = (bh // H).to(gl.int64)
        h = (bh % H).to(gl.int64)
        row0 = start_m + ME * ROWS_PER_CONSUMER
        rows = row0 + gl.arange(0, ROWS_PER_CONSUMER, layout=gl.SliceLayout(1, s_layout))
        full_tiles = row0 // BLOCK_N
        if SKIP:  # this consumer's own key tiles: up to its last row
            my_tiles = gl.cdiv(gl.minimum(row0 + ROWS_PER_CONSUMER, N), BLOCK_N)
        else:
            my_tiles = num_tiles
        m_i = gl.full([ROWS_PER_CONSUMER], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS_PER_CONSUMER], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([ROWS_PER_CONSUMER, HEAD_DIM], gl.float32, layout=o_layout)
        mbarrier.wait(q_ready.index(ME), i & 1)

        # tile 0
        mbarrier.wait(turn.index(ME), turns & 1)
        mbarrier.wait(k_ready.index(kv % STAGES), (kv // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(kv % STAGES).permute((1, 0)), no_scores, use_acc=False, is_async=True)
        mbarrier.arrive(turn.index(NEXT), count=1)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, rows, cols, 0, 0 >= full_tiles, qk_scale)
        p16 = gl.convert_layout(p.to(dtype), p_layout)

        # this consumer's key tiles 1 .. my_tiles-1: the production loop
        for j in range(1, my_tiles):
            t = kv + j
            stage = t % STAGES
            prev = (t - 1) % STAGES
            mbarrier.wait(turn.index(ME), (turns + j) & 1)
            mbarrier.wait(k_ready.index(stage), (t // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), no_scores, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((t - 1) // STAGES) & 1)
            acc = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
            mbarrier.arrive(turn.index(NEXT), count=1)
            s = warpgroup_mma_wait(1, deps=(s,))
            p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, rows, cols, j * BLOCK_N, j >= full_tiles, qk_scale)
            acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
            mbarrier.arrive(kv_empty.index(prev), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p16 = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.arrive(q_empty.index(ME), count=1)  # every S of this item has retired

        # the last O += P V, at turn my_tiles
        last = kv + my_tiles - 1
        mbarrier.wait(turn.index(ME), (turns + my_tiles) & 1)
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        acc = warpgroup_mma(p16, v_smem.index(last % STAGES), acc, is_async=True)
        mbarrier.arrive(turn.index(NEXT), count=1)
        acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
        mbarrier.arrive(kv_empty.index(last % STAGES), count=1)
        # past this consumer's diagonal: its turns and buffer releases only, so the other consumers stay in step
        for j in range(my_tiles + 1, num_tiles + 1):
            mbarrier.wait(turn.index(ME), (turns + j) & 1)
            mbarrier.arrive(turn.index(NEXT), count=1)
            mbarrier.arrive(kv_empty.index((kv + j - 1) % STAGES), count=1)
        turns += num_tiles + 1
        kv += num_tiles

        o = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
        gl.store(LSE + bh.to(gl.int64) * N + rows, m_i + gl.log2(l_i), mask=rows < N)
        out_rows = row0 + gl.arange(0, ROWS_PER_CONSUMER, layout=row_o)
        out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        offs = b * stride_ob + h * stride_oh + gl.expand_dims(out_rows.to(gl.int64), 1) * stride_on \
            + gl.expand_dims(out_cols, 0)
        gl.store(O + offs, o.to(dtype), mask=gl.expand_dims(out_rows < N, 1))


@gluon.jit
def _producer(loads, NUM_CONSUMERS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    (Q, K, V, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
     q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, H, N, WORK, first, count, n_qblocks) = loads
    dtype: gl.constexpr = q_smem.dtype
    BLOCK_M: gl.constexpr = NUM_CONSUMERS * ROWS_PER_CONSUMER
    q_bytes: gl.constexpr = ROWS_PER_CONSUMER * HEAD_DIM * dtype.primitive_bitwidth // 8
    kv_bytes: gl.constexpr = BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS_PER_CONSUMER, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    kv = 0
    for i in range(count):
        bh, start_m, num_tiles = _item(WORK, first + i, n_qblocks, BLOCK_M, N, BLOCK_N)
        b = (bh // H).to(gl.int64)
        h = (bh % H).to(gl.int64)
        if i > 0:  # the last item's copies have landed before its descriptors are rewritten
            mbarrier.wait(k_ready.index((kv - 1) % STAGES), ((kv - 1) // STAGES) & 1)
            mbarrier.wait(v_ready.index((kv - 1) % STAGES), ((kv - 1) // STAGES) & 1)
        q_desc = _head_rows(Q, b, h, stride_qb, stride_qh, stride_qn, N, ROWS_PER_CONSUMER, HEAD_DIM, q_layout)
        k_desc = _head_rows(K, b, h, stride_kb, stride_kh, stride_kn, N, BLOCK_N, HEAD_DIM, kv_layout)
        v_desc = _head_rows(V, b, h, stride_vb, stride_vh, stride_vn, N, BLOCK_N, HEAD_DIM, kv_layout)
        for c in gl.static_range(NUM_CONSUMERS):
            mbarrier.wait(q_empty.index(c), (i & 1) ^ 1)
            mbarrier.expect(q_ready.index(c), q_bytes)
            tma.async_copy_global_to_shared(q_desc, [start_m + c * ROWS_PER_CONSUMER, 0], q_ready.index(c),
                                            q_smem.index(c))
        for j in range(num_tiles):
            t = kv + j
            stage = t % STAGES
            mbarrier.wait(kv_empty.index(stage), ((t // STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(stage), kv_bytes)
            tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
            mbarrier.expect(v_ready.index(stage), kv_bytes)
            tma.async_copy_global_to_shared(v_desc, [j * BLOCK_N, 0], v_ready.index(stage), v_smem.index(stage))
        kv += num_tiles


@gluon.jit
def _persistent_fwd_kernel(Q, K, V, O, LSE, WORK, WORK_START,
                           stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                           stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                           H, N, n_qblocks, qk_scale,
                           HEAD_DIM: gl.constexpr, NUM_CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr,
                           STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                           SKIP: gl.constexpr):
    dtype: gl.constexpr = Q.dtype.element_ty
    pid = gl.program_id(0)
    first = gl.load(WORK_START + pid)
    count = gl.load(WORK_START + pid + 1) - first
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
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=NUM_CONSUMERS)
    fence_async_shared()

    shared = (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, turn,
              O, LSE, H, stride_ob, stride_oh, stride_on, N, qk_scale, WORK, first, count, n_qblocks)
    loads = (Q, K, V, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
             q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, H, N, WORK, first, count, n_qblocks)
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([(_consumer, (shared, gl.constexpr(0), NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, SKIP)),
                            (_consumer, (shared, gl.constexpr(1), NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, SKIP)),
                            (_producer, (loads, NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consumer, (shared, gl.constexpr(0), NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, SKIP)),
                            (_consumer, (shared, gl.constexpr(1), NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, SKIP)),
                            (_consumer, (shared, gl.constexpr(2), NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES, SKIP)),
                            (_producer, (loads, NUM_CONSUMERS, HEAD_DIM, BLOCK_N, STAGES))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


def _simulate(items, cost, programs):
    heap = [(0.0, p) for p in range(programs)]
    lists = [[] for _ in range(programs)]
    for it in items:
        t, p = heapq.heappop(heap)
        lists[p].append(it)
        heapq.heappush(heap, (t + cost[it], p))
    return max(t for t, _ in heap), lists


def _orders(bh, nq, programs):
    head = [h * nq + qb for h in range(bh) for qb in reversed(range(nq))]
    yield "head", head
    for k in (1, 2, 3, 4, 6):
        t = min(len(head), k * programs)
        yield f"tail{k}", head[:-t] + sorted(head[-t:], key=lambda it: -(it % nq))
    for g0 in (2, 3, 4):
        ng = -(-bh // -(-g0 * programs // nq))
        bounds = [round(i * bh / ng) for i in range(ng + 1)]
        yield f"group{g0}", [h * nq + qb for a, b in zip(bounds, bounds[1:]) for qb in reversed(range(nq))
                             for h in range(a, b)]


@functools.lru_cache(maxsize=64)
def work_lists(bh: int, n: int, block_m: int, block_n: int, programs: int, overhead: float = 2.0,
               order: str = "auto") -> tuple[list[int], list[int], str]:
    nq = -(-n // block_m)
    cost = {}
    for h in range(bh):
        for qb in range(nq):
            cost[h * nq + qb] = -(-min((qb + 1) * block_m, n) // block_n) + overhead
    best = None
    for name, items in _orders(bh, nq, programs):
        if order not in ("auto", name):
            continue
        span, lists = _simulate(items, cost, programs)
        if best is None or span < best[0] * 0.998:
            best = (span, lists, name)
    flat, start = [], [0]
    for lst in best[1]:
        flat += lst
        start.append(len(flat))
    return flat, start, best[2]


_DEVICE_LISTS: dict = {}


def launch_forward_persistent(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, qk_scale: float,
                              consumers: int, block_n: int, stages: int, programs: int | None = None,
                              skip: bool = False, overhead: float = 2.0, order: str = "auto") -> None:
    B, H, N, D = q.shape
    block_m = consumers * ROWS_PER_CONSUMER.value
    nq = -(-N // block_m)
    if programs is None:
        programs = torch.cuda.get_device_properties(q.device).multi_processor_count
    programs = min(programs, B * H * nq)
    key = (B * H, N, block_m, block_n, programs, overhead, order, q.device)
    if key not in _DEVICE_LISTS:
        flat, start, _ = work_lists(B * H, N, block_m, block_n, programs, overhead, order)
        _DEVICE_LISTS[key] = (torch.tensor(flat, dtype=torch.int32, device=q.device),
                              torch.tensor(start, dtype=torch.int32, device=q.device))
    work, work_start = _DEVICE_LISTS[key]
    _persistent_fwd_kernel[(programs,)](
        q, k, v, o, lse, work, work_start, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2), H, N, nq, qk_scale,
        HEAD_DIM=D, NUM_CONSUMERS=consumers, BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=CONSUMER_REGS[consumers],
        PRODUCER_REGS=PRODUCER_REGS, SKIP=skip, num_warps=4)

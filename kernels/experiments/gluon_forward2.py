"""Issue 10 experiment G (kernels/NOTES.md), kept in the history only: the Gluon forward of experiment E with every
wgmma retired within its step. Bench: bench_gluon_forward2.py."""

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



@gluon.jit
def _fwd2_kernel(Q, K, V, O, LSE,
                 stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                 H, N, qk_scale,
                 CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Step j issues S_{j+1} = Q K_{j+1}ᵀ, runs the online softmax of S_j while it computes, then acc += P_j V_j, and
    retires both before the step ends (ptxas serializes every wgmma of a loop whose in-flight results cross the
    back-edge and are read by other instructions)."""
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
        full_tiles = start_m // BLOCK_N
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
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready.index(0), 0)
    s_cur = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s_cur = warpgroup_mma_wait(0, deps=(s_cur,))
    for j in range(num_tiles):
        st = j % STAGES
        # the stage of tile j-1 is free (its P V was retired last step): fetch tile j + STAGES - 1 into it
        nt = j + STAGES - 1
        ns = nt % STAGES
        pred = nt < num_tiles
        mbarrier.expect(ready.index(ns), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [nt * BLOCK_N, 0], ready.index(ns), k_smem.index(ns), pred=pred)
        tma.async_copy_global_to_shared(v_desc, [nt * BLOCK_N, 0], ready.index(ns), v_smem.index(ns), pred=pred)
        # S_{j+1} in flight during this tile's softmax (past the last tile it reads a stale stage, never used)
        n1 = (j + 1) % STAGES
        mbarrier.wait(ready.index(n1), ((j + 1) // STAGES) & 1, pred=j + 1 < num_tiles)
        s_next = warpgroup_mma(q_smem, k_smem.index(n1).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        # online softmax of S_j (base 2)
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
        # acc = α·acc + P_j V_j
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p16 = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p16, v_smem.index(st), acc, is_async=True)
        s_cur, acc, p16 = warpgroup_mma_wait(0, deps=(s_next, acc, p16))
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    o = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    gl.store(LSE + bh.to(gl.int64) * N + rows, m_i + gl.log2(l_i), mask=rows < N)
    out_rows = start_m + gl.arange(0, BLOCK_M, layout=row_o)
    out_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    offs = b * stride_ob + h * stride_oh + gl.expand_dims(out_rows.to(gl.int64), 1) * stride_on \
        + gl.expand_dims(out_cols, 0)
    gl.store(O + offs, o.to(dtype), mask=gl.expand_dims(out_rows < N, 1))


LOG2E = 1.4426950408889634


def _s3(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _alloc(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def gluon_fwd2(q, k, v, causal, sm_scale, block_m=64, block_n=64, warps=4, stages=3):
    from minigpt_kernels.flash_attention import _empty_in_layout_of
    B, H, N, D = q.shape
    o = _empty_in_layout_of(q)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    triton.set_allocator(_alloc)
    _fwd2_kernel[(triton.cdiv(N, block_m), B * H)](
        q, k, v, o, lse, *_s3(q), *_s3(k), *_s3(v), *_s3(o), H, N, sm_scale * LOG2E,
        causal, D, block_m, block_n, stages, num_warps=warps)
    return o, lse

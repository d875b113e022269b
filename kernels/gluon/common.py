"""What the Hopper (Gluon) kernels share: the TMA copy, the wgmma accumulator layout, one head's rows as a TMA
descriptor, the register split between producer and consumer warps.

One module so that forward.py and backward.py import each other's helpers from neither."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

# The TMA copy of a tile into shared memory: async_copy_global_to_shared in triton 3.6 (what the GPU machines run),
# async_load in later releases, where the old name is kept only to raise.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

PRODUCER_REGS = 24  # registers per producer thread; the consumers take what is left (setmaxnreg)
CONSUMER_REGS = {2: 232, 3: 160}  # per consumer thread: 2 warpgroups of 232 + the producer's, or 3 of 160


@gluon.constexpr_function
def mma_layout(cols, num_warps):
    """The wgmma accumulator layout of a 64-row tile, with the widest instruction N (≤ 256) that divides cols."""
    n = 256
    while n > cols or cols % n:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def head_rows(X, b, h, stride_b, stride_h, stride_n, N, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
              layout: gl.constexpr):
    """One (batch, head)'s N rows of X (HEAD_DIM wide) as a TMA descriptor of ROWS-row tiles; rows past N read as 0."""
    return tma.make_tensor_descriptor(X + b * stride_b + h * stride_h, shape=[N, HEAD_DIM], strides=[stride_n, 1],
                                      block_shape=[ROWS, HEAD_DIM], layout=layout)



@gluon.jit
def program_items(WORK_START, PERSISTENT: gl.constexpr):
    """(first, count): this program's items of the work list, WORK[first : first + count]. Persistent programs read
    their share from WORK_START; a plain grid's program has one item, at its own index, and a count the compiler
    knows, so it drops the loop over items and the counters that run on across them."""
    if PERSISTENT:
        first = gl.load(WORK_START + gl.program_id(0))
        count = gl.load(WORK_START + gl.program_id(0) + 1) - first
    else:
        first = gl.program_id(0)
        count: gl.constexpr = 1
    return first, count

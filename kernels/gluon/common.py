"""What the Hopper (Gluon) kernels share: the TMA copy, the wgmma accumulator layout, TMA descriptors over one head's
rows (the dQ kernel's) or every head's (the work-list kernels'), the register split between producer and consumer
warps.

One module so that forward.py and backward.py import each other's helpers from neither."""
from __future__ import annotations

import inspect

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

# The TMA copy of a tile into shared memory: async_copy_global_to_shared in triton 3.6 (what the GPU machines run),
# async_load in later releases, where the old name is kept only to raise.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# ... and its way back, async_copy_shared_to_global in 3.6, async_store later
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# A shared-memory view's reshape takes the new layout in triton 3.6 and infers it in later releases.
RESHAPE_TAKES_LAYOUT = gl.constexpr("layout" in inspect.signature(gl.shared_memory_descriptor.reshape).parameters)

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


@gluon.constexpr_function
def box_layout(box, dtype):
    """The shared layout of a TMA box: the default swizzle for its last dimension (none for fp32 rows)."""
    return gl.NVMMASharedLayout.get_default_for(list(box), dtype)


@gluon.jit
def all_heads(X, B, H, N, stride_b, stride_h, stride_n, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """X's (B, H, N, HEAD_DIM) rows as one TMA descriptor whose boxes are ROWS rows of one head, [1, 1, ROWS,
    HEAD_DIM] at [b, h, row, 0]; each head's rows past N read as 0. A box names its head, so a program makes this
    once and its items never rewrite it (one descriptor per head cost a producer over 1 µs each, and a wait for the
    copies in flight through it: kernels/NOTES.md, session 15)."""
    BOX: gl.constexpr = [1, 1, ROWS, HEAD_DIM]
    return tma.make_tensor_descriptor(X, shape=[B, H, N, HEAD_DIM], strides=[stride_b, stride_h, stride_n, 1],
                                      block_shape=BOX, layout=box_layout(BOX, X.dtype.element_ty))


@gluon.jit
def all_rows(X, n_rows, n, stride, BLOCK: gl.constexpr):
    """n_rows fp32 rows of n values, `stride` apart (LSE, delta: one row per (batch, head)), as one TMA descriptor
    of [1, BLOCK] boxes at [row, i]; values past n read as 0. stride·4 bytes must be a multiple of 16."""
    BOX: gl.constexpr = [1, BLOCK]
    return tma.make_tensor_descriptor(X, shape=[n_rows, n], strides=[stride, 1], block_shape=BOX,
                                      layout=box_layout(BOX, gl.float32))


@gluon.jit
def load_rows(desc, coord, bar, smem, BOX: gl.constexpr):
    """Copy desc's box at coord into smem, a buffer of the box's last dimensions (a [rows, D] tile or a [rows] row),
    viewed as the box (its leading 1s added), completing on mbarrier bar."""
    layout: gl.constexpr = box_layout(BOX, smem.dtype)
    if RESHAPE_TAKES_LAYOUT:
        tma_load(desc, coord, bar, smem.reshape(BOX, layout))
    else:
        tma_load(desc, coord, bar, smem.reshape(BOX))


@gluon.jit
def store_rows(desc, coord, smem, BOX: gl.constexpr):
    """Copy smem, a buffer of the box's last dimensions, into desc's box at coord (load_rows' way back); rows past
    the descriptor's extent are not written. The caller fences smem's stores first and waits (tma.store_wait)
    before it writes smem again."""
    layout: gl.constexpr = box_layout(BOX, smem.dtype)
    if RESHAPE_TAKES_LAYOUT:
        tma_store(desc, coord, smem.reshape(BOX, layout))
    else:
        tma_store(desc, coord, smem.reshape(BOX))


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


# A work queue: programs take items as they free up, in the work list's order, as a plain grid's programs start (the
# hardware starts the next program where one ends), but without a program's set-up per item. For work whose cost only
# the device knows (document masks), where a list balanced on the host cannot be made. QUEUE (int32 on the device,
# zeroed per launch): [0] the next item; [1 + 2p + s] program p's ticket slot s. Each program's producer takes an item
# by an atomic add and writes its index into a ticket slot, which the program's other roles read behind an mbarrier;
# two slots, so the producer can take the next item while the others still read the last one's ticket.
QUEUE_SLOTS = gl.constexpr(2)


@gluon.jit
def ticket_barriers(readers: gl.constexpr):
    """(ready, free) mbarriers for each ticket slot: ready completes when the producer has written the slot, free
    when all `readers` roles have read it."""
    ready = gl.allocate_shared_memory(gl.int64, [QUEUE_SLOTS, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [QUEUE_SLOTS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(QUEUE_SLOTS):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(free.index(s), count=readers)
    return ready, free


@gluon.jit
def _warp_atomic_take(QUEUE):
    """QUEUE[0]'s value, incremented by one: lane 0 of the (one-warp) caller adds, and a shuffle hands the old
    value to the other lanes. gl.atomic_add on a scalar does the same through shared memory (a store, a warp barrier
    and a load of a fixed scratch word); in the head_dim-128 backward that version, in the producer's code alone,
    made ptxas keep consumer 0's sixteen K/V wgmma descriptors in registers across its tile loop and spill them (11
    more LDL a tile, triton 3.6), where with the shuffle it rebuilds them from one uniform register each tile, as
    without the queue; the consumers' PTX is the same either way (kernels/NOTES.md, session 26)."""
    gl.static_assert(gl.num_warps() == 1, "one warp takes one item")
    return gl.inline_asm_elementwise(
        "{ .reg .pred lane0; .reg .b32 lane; mov.u32 lane, %laneid; setp.eq.u32 lane0, lane, 0; mov.u32 $0, 0;"
        " @lane0 atom.global.gpu.relaxed.add.u32 $0, [$1], 1; shfl.sync.idx.b32 $0, $0, 0, 0x1f, 0xffffffff; }",
        "=r,l", [QUEUE], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def hand_out_ticket(QUEUE, tickets, i, total):
    """The producer's i-th item (the producer: one warp): the queue's next index, or −1 once all `total` are taken,
    written into ticket slot i % 2 for the other roles (take_ticket) when they have read what the slot held two
    items ago."""
    ready, free = tickets
    index = _warp_atomic_take(QUEUE)
    index = gl.where(index < total, index, -1)
    slot = i % QUEUE_SLOTS
    mbarrier.wait(free.index(slot), ((i // QUEUE_SLOTS) & 1) ^ 1)  # a fresh barrier passes parity 1
    gl.store(QUEUE + 1 + QUEUE_SLOTS * gl.program_id(0) + slot, index)
    mbarrier.arrive(ready.index(slot), count=1)  # releases the store to the roles that wait on it
    return index


@gluon.jit
def take_ticket(QUEUE, tickets, i):
    """A reader role's i-th item, as the producer handed it out (hand_out_ticket): −1 means none is left."""
    ready, free = tickets
    slot = i % QUEUE_SLOTS
    mbarrier.wait(ready.index(slot), (i // QUEUE_SLOTS) & 1)
    index = gl.load(QUEUE + 1 + QUEUE_SLOTS * gl.program_id(0) + slot, volatile=True)
    mbarrier.arrive(free.index(slot), count=1)
    return index

"""Ring attention over our Triton FlashAttention kernel: causal attention of a sequence split over K ranks, within a
sliding window and within documents where the model asks for them, with fewer K/V heads than query heads (GQA).
It takes the call every backend takes, (q, k, v, causal, *, window, document_ids), on this rank's zigzag shard.

Layout (zigzag, sharding.py): the sequence is cut into 2K chunks of c tokens and rank r holds chunks r and
2K-1-r, in that order, so every rank has one early and one late chunk and the same amount of causal work. The
document ids are sharded the same way. What each block of keys contributes to a rank's queries under the masks,
as kernel launches, and which ring steps carry a block anyone needs, is ring_plan.py's arithmetic on this layout.

Forward, on rank r: the key/value blocks travel around the ring, each as one message of k and v stacked (the Hkv
heads as they are: GQA sends no repeated heads) with the block's document ids beside it. The offsets need no
message: a block's positions follow from whose it is. The plain ring sends towards rank+1, so at step s rank r holds
block src = r - s; a windowed layer sends both ways, and only as far as any rank's window reaches (ring_plan.
ring_schedule). At each step the rank runs the plan's launches for block src: for causal attention, with or without
documents, one launch on a contiguous run of rows and keys (the local block causal, the others without a mask), the
query rows' and keys' document ids going with it; with a window, one launch per (query chunk, key chunk) pair in
reach, at the pair's global offsets. Blocks or pairs that nothing reaches are no launch; document tiles that
nothing sees are skipped inside the kernel (it finds each tile's span of visible keys on the device).

The kernel itself folds each launch into the rows' running result: the output (o, lse) lives in fp32 buffers, which
the local block writes and each later launch continues from (`accumulate`). With base-2 LSEs (the kernel's LSE is
log2 Σ_j exp2(scale·log2(e)·q·k_j), the softmax scale folded in), continuing from (o, lse) means starting the online
softmax at m = lse, l = 1, acc = o, which after the new keys gives

    lse' = log2(2^lse + Σ_j 2^s_j),     o' = (2^lse · o + Σ_j 2^s_j v_j) / 2^lse'

the softmax over both key sets, with no merge pass between the steps.

Backward (FlashAttention-2): a block's dQ, dK, dV need only the final o, the final lse and
delta = rowsum(dO ∘ O), so each step reruns the backward on the same launches with the final (o, lse). The blocks
travel the ring again, except on short shards, where the forward kept them (KEEP_BLOCKS_BYTES):
dQ_rows += dS K_keys and dK_keys += dSᵀ Q_rows, dV_keys += Pᵀ dO_rows, each added by the kernel into an fp32
buffer (with GQA the kernel sums a K/V head's group of query heads itself). One launch gives all three where the
fused five-matmul Gluon kernel takes it (sm_90, no mask on the launch: the full off-diagonal blocks and the causal
local block of dense attention), else the Triton dQ and dK/dV kernels run (launch.launch_backward_block). dQ stays
local; each block's dK/dV accumulator (fp32, Hkv heads) starts at the first other rank that holds the block,
travels with it and, after the block's last hop, goes straight back to the block's owner in k's dtype (half the
bytes, and no fp32 buffer of k's size waiting for it), which adds its own share, computed last, while that hop is
under way. Where a block's first holder in a direction is also its last (two ranks; a window's one hop each way),
its one launch writes the share in k's dtype straight into the message home: no fp32 accumulator, no cast.

Communication is `torch.distributed.batch_isend_irecv` on the context-parallel group, posted before the
step's compute so the transfer overlaps it. Every rank issues the same sends and receives in the same
order, whatever its data: recomputing a block (levers.py) runs the forward's ring again on all ranks.

Memory: NCCL's sends and receives pin their tensors to NCCL's stream, so the allocator reuses a freed message only
once the GPU has passed that point. The host waits for a long shard's ring call at its end and keeps at most two
short ones in flight (CallFence), or each layer's messages would take fresh memory.
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from minigpt.attention import AttentionBackend, FlashAttention
from minigpt.distributed.mesh import Mesh
from minigpt.distributed.ring_plan import Launch, RingSchedule, block_launches, ring_schedule


# ------------------------------------------------------------------------------------------------
# One block: the plan's launches of the local query rows against its keys
# ------------------------------------------------------------------------------------------------
def _rows(t: Tensor, rows: slice) -> Tensor:
    """Rows of a (B, H, N, ...) tensor: a view."""
    return t[:, :, rows]


def _masks(launch: Launch, q_ids: Tensor | None, k_ids: Tensor | None) -> dict:
    """The launchers' mask arguments for one launch: its window and offsets, and the document ids of its rows and
    keys (views of the (B, 2c) ids; None without documents)."""
    docs = {} if q_ids is None else {"q_doc_ids": q_ids[:, launch.rows], "k_doc_ids": k_ids[:, launch.keys]}
    return dict(window=launch.window, q_offset=launch.q_offset, k_offset=launch.k_offset, **docs)


def _block_forward(q: Tensor, k: Tensor, v: Tensor, q_ids: Tensor | None, k_ids: Tensor | None,
                   launches: list[Launch], sm_scale: float, o: Tensor, lse: Tensor) -> None:
    """Fold a block's keys into the running fp32 (o, lse) of the local rows that see them: its launches, each
    continuing the rows' result, or writing their first state (the local block's first launch for those rows).
    Plain grids, never the table's persistent ones: NCCL's kernel of the transfer in flight holds SMs, and a
    persistent kernel's work lists, fixed per SM on the host, wait for it (a block's dK/dV/dQ took 2.90 ms beside
    a hop against 1.47 ms alone on an H100)."""
    from minigpt_kernels.launch import launch_forward

    for l in launches:
        launch_forward(_rows(q, l.rows), _rows(k, l.keys), _rows(v, l.keys), l.causal, sm_scale,
                       out=(_rows(o, l.rows), _rows(lse, l.rows)), accumulate=not l.fresh_rows, persistent=False,
                       **_masks(l, q_ids, k_ids))


def _block_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, q_ids: Tensor | None, k_ids: Tensor | None,
                    lse: Tensor, delta: Tensor, launches: list[Launch], sm_scale: float, dq: Tensor, dk: Tensor,
                    dv: Tensor) -> None:
    """A block's dQ, dK, dV over the local queries, one launch_backward_block per launch (the fused five-matmul Gluon
    kernel where it takes the launch, else the Triton dQ and dK/dV kernels): dQ added into the fp32 dq, dK/dV added
    into the fp32 (dk, dv) (the block's travelling accumulator), or written there by the local block's first launch
    for those keys. lse and delta are the final ones: P = exp2(s − lse) and delta = rowsum(dO ∘ O) of the whole row.
    Plain grids, as _block_forward's."""
    from minigpt_kernels.launch import launch_backward_block

    for l in launches:
        launch_backward_block(_rows(do, l.rows), _rows(q, l.rows), _rows(k, l.keys), _rows(v, l.keys),
                              _rows(lse, l.rows), _rows(delta, l.rows), l.causal, sm_scale, _rows(dq, l.rows),
                              _rows(dk, l.keys), _rows(dv, l.keys), accumulate_dq=True,
                              accumulate_dkdv=not l.fresh_keys, persistent=False, **_masks(l, q_ids, k_ids))


# ------------------------------------------------------------------------------------------------
# The ring: peer-to-peer exchange with the neighbours, posted before the compute it overlaps
# ------------------------------------------------------------------------------------------------
class Ring:
    """This rank's place in a process group's ring: it sends to rank+1 and receives from rank-1 (or, for blocks
    travelling the other way or going home, to and from other ranks at a given distance)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size  # ranks in the group

    def send(self, tensors: tuple[Tensor | None, ...], shift: int,
             into: tuple[Tensor | None, ...] | None = None) -> Callable[[], tuple[Tensor | None, ...]]:
        """Send the tensors (contiguous, not to be modified until the returned wait is called; None: nothing) to rank
        + shift and receive the same shapes from rank − shift; the returned function waits and gives the received
        ones. `into`: buffers to receive them in (contiguous, of the same shapes and dtypes; None: new ones), which the
        transfer overwrites once the work queued before this call has run. Every rank of the group calls it with the
        same shift at the same point."""
        to, frm = (self.rank + shift) % self.size, (self.rank - shift) % self.size
        ops, received = [], []
        for t, buf in zip(tensors, into or (None,) * len(tensors)):
            received.append(None if t is None else torch.empty_like(t) if buf is None else buf)
            if t is not None:
                ops += [dist.P2POp(dist.isend, t, group=self.group, group_peer=to),
                        dist.P2POp(dist.irecv, received[-1], group=self.group, group_peer=frm)]
        reqs = dist.batch_isend_irecv(ops)

        def wait() -> tuple[Tensor | None, ...]:
            for req in reqs:
                req.wait()
            return tuple(received)

        return wait

    def pass_on(self, t: Tensor) -> Callable[[], Tensor]:
        """Send t to the next rank and receive the previous rank's tensor of the same shape (see send)."""
        wait = self.send((t,), 1)
        return lambda: wait()[0]


class CallFence:
    """Keeps the host at most `lag` ring calls (0, 1 or 2) ahead of the GPU, so that the ring's buffers reuse memory.

    PyTorch's NCCL send and receive record their tensors on NCCL's stream (for point-to-point ops whatever
    TORCH_NCCL_AVOID_RECORD_STREAMS says), and the caching allocator hands a freed block of such a tensor out again
    only after NCCL's stream has passed, on the GPU, the point where the host freed it. In a training step nothing
    makes the host wait until the loss is read, so it runs a whole backward ahead: every layer's messages and
    accumulators were freed long before the GPU got there, and each layer's took fresh memory (21.0 GiB reserved for
    6.0 allocated per rank at 256K tokens on 2 × H100). As a call starts, the host waits until the GPU has finished
    the call `lag` calls back: at most `lag` calls' buffers wait. With lag 1 the GPU runs out of queued ring work
    while the host posts the next call's first kernel (~1 ms); lag 2 keeps a whole call queued. Measured at 256K
    against main in the same job: lag 1 reserved 8.2 GiB for a step 0.5-0.6% slower, lag 2 10.5 GiB and no slower.
    With lag 1 the buffers of the call in flight (2.25 GiB at 256K) still wait while the host allocates the next
    layer's; lag 0 waits at a call's end for the call itself, so none of its buffers is left waiting (with the home
    hop in k's dtype: 6.1 GiB reserved for 5.9 allocated at 256K, the step no slower than lag 1 with an fp32 hop).
    Long shards take lag 0 (their calls take tens of ms, beside which the host's ~1 ms is small), short ones lag 2."""

    def __init__(self, new_event: Callable[[], object] = torch.cuda.Event):
        self.new_event = new_event  # an event on the current stream (a stand-in in tests)
        self.ends: deque = deque()  # events after the last calls' work, oldest first

    def enter(self, lag: int) -> None:
        """A call starts: wait until the GPU has finished the call `lag` calls back (lag 0: nothing is in flight)."""
        self._wait_until_in_flight(max(lag - 1, 0))

    def leave(self, lag: int) -> None:
        """A call has been issued (its last waits on NCCL's stream included): mark its end on the current stream;
        with lag 0, wait for it, so that the buffers it frees are reusable as soon as the host goes on."""
        end = self.new_event()
        end.record()
        self.ends.append(end)
        if lag == 0:
            self._wait_until_in_flight(0)

    def _wait_until_in_flight(self, calls: int) -> None:
        while len(self.ends) > calls:
            self.ends.popleft().synchronize()


def fence_lag(k: Tensor) -> int:
    """How many ring calls the host may run ahead: none for a long shard (a K/V message of SERIAL_HOP_BYTES or more:
    the call takes tens of ms, beside which the host's ~1 ms to post the next work is small), else 2."""
    return 0 if 2 * k.numel() * k.element_size() >= SERIAL_HOP_BYTES else 2


FENCE = CallFence()  # this process's ring calls on CUDA (one GPU per process)


def stack_kv(k: Tensor, v: Tensor) -> Tensor:
    """k and v in one contiguous message (2, B, N, Hkv, D): the model's layout, which the kernels read as strided
    (B, Hkv, N, D) views (and the dK/dV accumulator's layout). When k and v already are the two halves of such a
    buffer (the block recompute makes them so), that buffer is the message and nothing is copied."""
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    base = kt._base
    if (base is not None and base is vt._base and base.shape == (2, *kt.shape) and base.is_contiguous()
            and kt.data_ptr() == base[0].data_ptr() and vt.data_ptr() == base[1].data_ptr()
            and kt.stride() == base[0].stride() and vt.stride() == base[1].stride()):
        return base
    return torch.stack((kt, vt))


def unstack_kv(kv: Tensor) -> tuple[Tensor, Tensor]:
    """The (B, Hkv, N, D) views of k and v in a stack_kv message."""
    return kv[0].transpose(1, 2), kv[1].transpose(1, 2)


def _check(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor | None) -> None:
    if (q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]
            or q.shape[1] % k.shape[1]):
        raise ValueError(f"ring attention: q (B, Hq, N_local, D) and k, v (B, Hkv, N_local, D) with Hq a multiple of "
                         f"Hkv expected (local shards), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % 2:
        raise ValueError(f"ring attention: the local shard has {q.shape[2]} tokens; zigzag shards hold two chunks "
                         f"of equal length (pad the sequence to a multiple of 2 x context ranks: padded_len)")
    if document_ids is not None and tuple(document_ids.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"ring attention: document_ids must be this rank's zigzag shard ({q.shape[0]}, {q.shape[2]}) "
                         f"(sharding.shard_batch), got {tuple(document_ids.shape)}")


class _Plan:
    """What one call computes on this rank: the ring, its schedule of steps and each step's block and launches."""

    def __init__(self, group: dist.ProcessGroup | None, n_local: int, window: int | None):
        self.ring = Ring(group)
        k, c, r = self.ring.size, n_local // 2, self.ring.rank
        self.schedule = ring_schedule(k, c, window)
        self.local = block_launches(r, r, k, c, window)
        # (direction, depth, the block's launches) of each step after the local block
        self.steps = [(d, depth, block_launches(RingSchedule.source(r, k, d, depth), r, k, c, window))
                      for d, depth in self.schedule.steps()]

    def depth(self, direction: int) -> int:
        """How far the blocks travel in this direction (+1: towards rank+1)."""
        return self.schedule.forward if direction > 0 else self.schedule.backward


def ring_forward(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None, sm_scale: float, *,
                 window: int | None = None, document_ids: Tensor | None = None,
                 received: list | None = None) -> tuple[Tensor, Tensor]:
    """(o, lse) of causal attention of the local zigzag queries against the whole sequence's keys (within `window`
    and documents where given); no autograd. o has q's dtype and memory layout; lse is the base-2 row log-sum-exp,
    fp32 (B, H, N_local). `received`: a list that takes the other ranks' blocks as they arrive, (kv, their document
    ids), in step order, where keeps_blocks says they are small enough to keep for ring_backward."""
    from minigpt_kernels.launch import empty_in_layout_of

    if q.is_cuda:
        lag = fence_lag(k)
        FENCE.enter(lag)
    plan = _Plan(group, q.shape[2], window)
    ids = None if document_ids is None else document_ids.contiguous()
    local = (stack_kv(k, v), ids) if plan.steps else None  # the local block as it travels (if it does)
    held = {1: local, -1: local}  # the newest block of each direction
    del local
    # the running result, fp32: written by the local block (every row sees its diagonal), then continued
    o, lse = empty_in_layout_of(q, torch.float32), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)

    def post(i: int) -> Callable[[], tuple] | None:  # step i's transfer: its direction's newest block, one hop on
        return plan.ring.send(held[plan.steps[i][0]], plan.steps[i][0]) if i < len(plan.steps) else None

    incoming = post(0)  # posted first, so it overlaps the local block's compute
    keep = received is not None and keeps_blocks(k, len(plan.steps))
    _block_forward(q, k, v, ids, ids, plan.local, sm_scale, o, lse)
    for i, (direction, _, launches) in enumerate(plan.steps):
        held[direction] = incoming()
        incoming = post(i + 1)
        kv, k_ids = held[direction]
        if keep:
            received.append(held[direction])
        _block_forward(q, *unstack_kv(kv), ids, k_ids, launches, sm_scale, o, lse)
    held.clear()  # the other ranks' blocks: freed before o's cast, the call's last allocation
    kv = k_ids = None
    if q.is_cuda:
        FENCE.leave(lag)
    return o.to(q.dtype), lse


def ring_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                  group: dist.ProcessGroup | None, sm_scale: float, *, window: int | None = None,
                  document_ids: Tensor | None = None, received: list | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of ring attention, from the final o and lse of ring_forward (the same window and document ids).
    `received`: the blocks ring_forward kept (its `received`, every step's): no K/V travels again, and the first
    block's launches start at once instead of waiting for its transfer (KEEP_BLOCKS_BYTES says why and when).

    Each other rank's block is processed as it arrives, in one launch per plan launch that adds its dQ into the
    local fp32 dq and its dK/dV into the block's accumulator, which then travels on with the block, or home after the
    block's last hop (in k's dtype; written there directly where this rank is the block's only holder in that
    direction). The local block comes last: its launches run while the accumulators of the other
    ranks' dK/dV for it make their last hop home (the larger transfer), so that hop does not wait alone."""
    from minigpt_kernels.launch import empty_in_layout_of, launch_backward_delta

    if q.is_cuda:
        lag = fence_lag(k)
        FENCE.enter(lag)
    plan = _Plan(group, q.shape[2], window)
    ids = None if document_ids is None else document_ids.contiguous()
    if received is not None and len(received) != len(plan.steps):
        raise ValueError(f"ring attention: {len(received)} kept blocks for a plan of {len(plan.steps)} steps")
    local = (stack_kv(k, v), ids) if plan.steps and received is None else None
    held = {1: local, -1: local}
    del local

    def post(i: int) -> Callable[[], tuple] | None:
        if i >= len(plan.steps):
            return None
        if received is not None:  # kept by the forward: here already
            return lambda: received[i]
        return plan.ring.send(held[plan.steps[i][0]], plan.steps[i][0])

    incoming = post(0)
    do, delta = launch_backward_delta(do, o, lse)
    dq = empty_in_layout_of(q, torch.float32).zero_()  # every block adds its share, the local block's last
    # per direction, the (dK, dV) accumulator (fp32, laid out as the kv message) of the block this rank holds next in
    # it, arriving from the previous holder; after a direction's last step, this rank's own block's, coming home
    arriving: dict[int, Callable[[], Tensor] | None] = {1: None, -1: None}
    spare = None  # a long shard's last hop in k's dtype, sent by the time the local block runs (in stream order)
    for i, (direction, depth, launches) in enumerate(plan.steps):
        held[direction] = incoming()
        incoming = post(i + 1)
        kv, k_ids = held[direction]
        last = depth == plan.depth(direction)
        if last and arriving[direction] is None and len(launches) == 1:
            # the block's only holder in this direction (its first hop is also its last: two ranks, or a window's
            # one hop each way) and one launch writes its share: straight into the message home, in k's dtype, the
            # keys it does not reach zero; no fp32 accumulator, no cast (the same rounding: the kernel rounds its
            # fp32 sums as the cast did)
            hop = torch.empty_like(kv)
            for keys in _other_rows(launches[0].keys, kv.shape[2]):
                hop[:, :, keys] = 0
            launches = [dataclasses.replace(launches[0], fresh_keys=True)]
            _block_backward(do, q, *unstack_kv(kv), ids, k_ids, lse, delta, launches, sm_scale, dq, *unstack_kv(hop))
        else:
            # the first rank after a block's owner starts its accumulator: fp32 zeros laid out as kv
            dkv = (arriving[direction] or _ready(torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)))()
            _block_backward(do, q, *unstack_kv(kv), ids, k_ids, lse, delta, launches, sm_scale, dq, *unstack_kv(dkv))
            # hand the accumulator on with its block (fp32: the next holders add into it); after the block's last
            # hop, straight home to its owner in k's dtype: half the bytes to send and to land, and this last fp32
            # copy is not handed to NCCL, so it is free at once. The share is rounded to k's dtype before the owner
            # adds it (and the sum once more after): one rounding more than an fp32 hop, within the tests' tolerance
            hop = dkv.to(kv.dtype) if last else dkv
            del dkv
        landing = None
        if last:  # the block goes no further: its buffer takes the share that comes home in its place (the receive
            # is queued after this step's launches, which read it), so the two are not live together; not a kept
            # block (the forward's saved tensor stays as it was)
            landing = kv if kv.shape == hop.shape and kv.dtype == hop.dtype and received is None else None
            held[direction] = None
            kv = k_ids = None
        wait = plan.ring.send((hop,), -direction * depth if last else direction, into=(landing,))
        landing = None
        arriving[direction] = lambda wait=wait: wait()[0]
        if hop.numel() * hop.element_size() >= SERIAL_HOP_BYTES:
            arriving[direction] = _ready(arriving[direction]())  # a long shard: wait now, one accumulator in flight
            if last and hop.dtype == k.dtype:  # the wait covers its send too: the local block may write into it
                spare = hop
        del hop
    held.clear()  # the blocks of other ranks are done with: free them before the local block's launches
    kv = k_ids = None
    homes = [arriving[d] for d in (1, -1) if arriving[d] is not None]
    # the local block, during the last hops: dK/dV in k's dtype from one launch that writes them all (the causal
    # block; no fp32 copy of k's size beside the arriving accumulators at the layer's peak), else (a window's
    # launches) in an fp32 buffer that they write and add into
    one_launch = len(plan.local) == 1 and plan.local[0].fresh_keys and plan.local[0].keys == slice(0, k.shape[2])
    dtype = k.dtype if one_launch else torch.float32
    if one_launch and spare is not None:  # a long shard: the buffer that carried a share home takes the local dK/dV,
        # instead of a fresh block of k's size while the allocator waits for NCCL's stream to pass the freed one
        dk, dv = unstack_kv(spare)
    else:
        dk, dv = empty_in_layout_of(k, dtype), empty_in_layout_of(v, dtype)
    spare = None
    _block_backward(do, q, k, v, ids, ids, lse, delta, plan.local, sm_scale, dq, dk, dv)
    for home in homes:  # dK = mine + the other ranks' shares (in k's dtype), each added into mine; where a window
        # has two, mine is fp32 and holds their sum (cast in one pass below)
        theirs_k, theirs_v = unstack_kv(home())
        dk, dv = dk.add_(theirs_k), dv.add_(theirs_v)
    theirs_k = theirs_v = None  # the landed shares: freed before dq's cast allocates (not beside it at the peak)
    dq = dq.to(q.dtype)
    if q.is_cuda:
        FENCE.leave(lag)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _other_rows(keys: slice, n: int) -> list[slice]:
    """The rows of 0 .. n − 1 outside `keys` (a slice with start and stop), as at most two slices."""
    return [r for r in (slice(0, keys.start or 0), slice(keys.stop, n)) if r.stop > r.start]


# The other ranks' K/V blocks are kept from the forward for the backward while all of them together take at most
# this: the backward then starts without waiting for a transfer (about 0.25 ms exposed per call at 8K tokens per
# GPU, 5% of the call). Longer shards send them again: their compute hides the wait, and the kept blocks would cost
# the whole sequence's K/V per layer at the lengths where memory sets the frontier.
KEEP_BLOCKS_BYTES = 128 << 20


def keeps_blocks(k: Tensor, steps: int) -> bool:
    """Whether ring_forward keeps the `steps` blocks it receives (each a K/V message of k's size twice)."""
    return steps * 2 * k.numel() * k.element_size() <= KEEP_BLOCKS_BYTES


# An accumulator hop of at least this size is waited for at once instead of during the next block's dQ kernel: two
# fp32 (dK, dV) accumulators in flight take 12 KB per local token (for 768 channels; 6 KB going home in bf16), and at
# such sizes the hop (~4 ms per GiB over NVLink) is small beside a block's compute.
SERIAL_HOP_BYTES = 256 << 20


def _ready(t: Tensor) -> Callable[[], Tensor]:
    """A tensor already at hand, in the shape of a pending transfer (a function that gives it)."""
    return lambda: t


class RingAttentionFunction(torch.autograd.Function):
    """Differentiable ring attention: forward ring_forward (or a precomputed (o, lse)), backward ring_backward."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None, sm_scale: float,
                precomputed: tuple[Tensor, Tensor] | None, window: int | None, document_ids: Tensor | None) -> Tensor:
        masks = dict(window=window, document_ids=document_ids)
        received = []  # the other ranks' blocks, where short enough to keep (keeps_blocks)
        o, lse = ring_forward(q, k, v, group, sm_scale, received=received, **masks) if precomputed is None \
            else precomputed
        ctx.save_for_backward(q, k, v, o, lse, document_ids, *(t for block in received for t in block))
        ctx.group, ctx.sm_scale, ctx.window, ctx.kept = group, sm_scale, window, len(received)
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, o, lse, document_ids, *flat = ctx.saved_tensors
        received = [tuple(flat[2 * i:2 * i + 2]) for i in range(ctx.kept)] if ctx.kept else None
        dq, dk, dv = ring_backward(do, q, k, v, o, lse, ctx.group, ctx.sm_scale, window=ctx.window,
                                   document_ids=document_ids, received=received)
        return dq, dk, dv, None, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None, causal: bool = True,
                   softmax_scale: float | None = None, precomputed: tuple[Tensor, Tensor] | None = None, *,
                   window: int | None = None, document_ids: Tensor | None = None) -> Tensor:
    """Causal attention of zigzag-sharded q (B, H, N_local, D) over k, v (B, Hkv, N_local, D) (H a multiple of Hkv)
    across the ranks of `group`, within `window` tokens (None: all earlier ones) and, with `document_ids` (this
    rank's (B, N_local) zigzag shard of non-decreasing ids), within documents; returns the local output.
    `precomputed=(o, lse)` from ring_forward on the same inputs skips the forward (kept attention)."""
    if not causal:
        raise ValueError("ring attention: only causal attention (the zigzag layout balances causal work)")
    _check(q, k, v, document_ids)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return RingAttentionFunction.apply(q, k, v, group, sm_scale, precomputed, window, document_ids)


class RingFlashAttention(FlashAttention):
    """The `flash` backend with the sequence split over a context-parallel group: what the model calls as its
    attention under context parallelism, with its windows, document ids and GQA. Returns its LSE, so kept attention
    works as with `flash`."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def attend_projection(self, qkv: Tensor, cos: Tensor, sin: Tensor, *, n_kv_head: int, window: int | None = None,
                          document_ids: Tensor | None = None) -> None:
        return None  # the ring takes rotated q, k, v (flash's single-GPU path would skip the other ranks)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, *, window: int | None = None,
                 document_ids: Tensor | None = None) -> Tensor:
        return ring_attention(q, k, v, self.group, causal, window=window, document_ids=document_ids)

    def forward_with_lse(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, *, window: int | None = None,
                         document_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if not causal:
            raise ValueError("ring attention: only causal attention")
        _check(q, k, v, document_ids)
        with torch.no_grad():
            return ring_forward(q, k, v, self.group, 1.0 / math.sqrt(q.shape[-1]), window=window,
                                document_ids=document_ids)

    def attend_saved(self, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool = True, *,
                     window: int | None = None, document_ids: Tensor | None = None) -> Tensor:
        return ring_attention(q, k, v, self.group, causal, precomputed=(o, lse), window=window,
                              document_ids=document_ids)


def mesh_attention(mesh: Mesh, backend: AttentionBackend) -> AttentionBackend:
    """The model's attention on this mesh: ring attention over the cp group when the sequence is split."""
    return RingFlashAttention(mesh.cp_group) if mesh.cp > 1 else backend

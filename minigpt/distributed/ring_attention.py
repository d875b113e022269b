"""Ring attention over our Triton FlashAttention kernel: causal attention of a sequence split over K ranks.

Layout (zigzag, sharding.py): the sequence is cut into 2K chunks of c tokens and rank r holds chunks r and
2K-1-r, in that order, so every rank has one early and one late chunk and the same amount of causal work.

Forward, on rank r with local queries q = [q_a | q_b] (chunks r and 2K-1-r): the key/value blocks travel
around the ring (rank r sends to r+1 and receives from r-1), so at step s rank r holds the block of rank
src = r - s (mod K), keys [k_a | k_b] of chunks src and 2K-1-src. Which (query chunk, key chunk) pairs see
each other follows from the chunk order alone:

    src == r   (step 0): the local block; plain causal attention over the 2c local tokens (chunk r comes
               before chunk 2K-1-r, so the local order is the global order).
    src <  r:  chunk src precedes both query chunks, chunk 2K-1-src follows both: all 2c queries attend to
               k_a in full, to k_b not at all.
    src >  r:  both key chunks precede chunk 2K-1-r and follow chunk r: q_b attends to all 2c keys in full,
               q_a to none.

So every step other than the local one is plain (non-causal) attention of a contiguous run of query rows
against a contiguous run of keys: rows [0, 2c) against keys [0, c), or rows [c, 2c) against keys [0, 2c).
Each step is one launch of our kernel on those rows and keys (it takes Nq queries against Nk keys without the
mask), and the kernel itself folds them into the rows' running result: the output (o, lse) lives in fp32
buffers, which the local causal step writes and each later step continues from (`accumulate`). With base-2
LSEs (the kernel's LSE is log2 Σ_j exp2(scale·log2(e)·q·k_j), the softmax scale folded in), continuing from
(o, lse) means starting the online softmax at m = lse, l = 1, acc = o, which after the new keys gives

    lse' = log2(2^lse + Σ_j 2^s_j),     o' = (2^lse · o + Σ_j 2^s_j v_j) / 2^lse'

the softmax over both key sets, with no merge pass between the steps.

Backward (FlashAttention-2): a block's dQ, dK, dV need only the final o, the final lse and
delta = rowsum(dO ∘ O), so each step reruns our backward kernels on the same rows and keys with the final
(o, lse): dQ_rows += dS K_keys and dK_keys += dSᵀ Q_rows, dV_keys += Pᵀ dO_rows, each added by the kernel into
an fp32 buffer. dQ stays local; each block's dK/dV accumulator (fp32) starts at the first other rank that
holds the block, travels around the ring with it and comes back to the block's owner, which adds its own
share, computed last, while that hop is under way.

Communication is `torch.distributed.batch_isend_irecv` on the context-parallel group, posted before the
step's compute so the transfer overlaps it. Every rank issues the same sends and receives in the same
order, whatever its data: recomputing a block (levers.py) runs the forward's ring again on all ranks.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from minigpt.attention import AttentionBackend, FlashAttention
from minigpt.distributed.mesh import Mesh


# ------------------------------------------------------------------------------------------------
# One block: which local query rows see which of its keys
# ------------------------------------------------------------------------------------------------
def _visible(src: int, rank: int, c: int) -> tuple[slice, slice]:
    """(query rows, key rows) of the local queries and another rank's block src (chunks src and 2K-1-src) that
    see each other, in full: all 2c rows see k_a if src < rank; q_b sees all 2c keys if src > rank."""
    if src < rank:
        return slice(0, 2 * c), slice(0, c)
    return slice(c, 2 * c), slice(0, 2 * c)


def _rows(t: Tensor, rows: slice) -> Tensor:
    """Rows of a (B, H, N, ...) tensor: a view."""
    return t[:, :, rows]


def _block_forward(q: Tensor, k: Tensor, v: Tensor, src: int, rank: int, sm_scale: float, o: Tensor,
                   lse: Tensor) -> None:
    """Fold block src's keys into the running fp32 (o, lse) of the local rows that see them: one kernel launch."""
    from minigpt_kernels.launch import launch_forward

    if src == rank:  # the local block: causal over the local order; it writes every row's first state
        launch_forward(q, k, v, True, sm_scale, out=(o, lse))
        return
    rows, keys = _visible(src, rank, q.shape[2] // 2)
    launch_forward(_rows(q, rows), _rows(k, keys), _rows(v, keys), False, sm_scale,
                   out=(_rows(o, rows), _rows(lse, rows)), accumulate=True)


def _block_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, src: int, rank: int,
                    sm_scale: float, dq: Tensor, accumulator: Callable[[], Tensor]) -> Tensor:
    """Another rank's block src's share of the backward, added by the kernels into fp32 buffers: dQ into dq, then
    dK/dV into the block's travelling accumulator (laid out as a stack_kv message), which `accumulator()` gives.
    It is asked for only once the dQ kernel is launched, so its hop overlaps that kernel. Returns it.
    lse and delta are the final ones: P = exp2(s − lse) and delta = rowsum(dO ∘ O) are those of the whole row."""
    from minigpt_kernels.launch import launch_backward_dkdv, launch_backward_dq

    rows, keys = _visible(src, rank, q.shape[2] // 2)
    mine = [_rows(t, rows) for t in (do, q)]
    theirs = [_rows(t, keys) for t in (k, v)]
    stats = [_rows(t, rows) for t in (lse, delta)]
    launch_backward_dq(*mine, *theirs, *stats, False, sm_scale, out=_rows(dq, rows), accumulate=True)
    dkv = accumulator()
    launch_backward_dkdv(*mine, *theirs, *stats, False, sm_scale,
                         out=tuple(_rows(t, keys) for t in unstack_kv(dkv)), accumulate=True)
    return dkv


# ------------------------------------------------------------------------------------------------
# The ring: peer-to-peer exchange with the neighbours, posted before the compute it overlaps
# ------------------------------------------------------------------------------------------------
class Ring:
    """This rank's neighbours in a process group: it sends to rank+1 and receives from rank-1."""

    def __init__(self, group: dist.ProcessGroup | None):
        super().__init__()  # the ring's backward is the deterministic seven-matmul one (its launchers accumulate)
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size  # ranks in the group

    def pass_on(self, t: Tensor) -> Callable[[], Tensor]:
        """Send t (contiguous, not to be modified until the returned wait is called) to the next rank and receive
        the previous rank's tensor of the same shape; the returned function waits and gives the received one."""
        recv = torch.empty_like(t)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, group=self.group, group_peer=self.next),
                                       dist.P2POp(dist.irecv, recv, group=self.group, group_peer=self.prev)])

        def wait() -> Tensor:
            for req in reqs:
                req.wait()
            return recv

        return wait


def stack_kv(k: Tensor, v: Tensor) -> Tensor:
    """k and v in one contiguous message (2, B, N, H, D): the model's layout, which the kernels read as strided
    (B, H, N, D) views (and the dK/dV accumulator's layout). When k and v already are the two halves of such a
    buffer (the block recompute makes them so), that buffer is the message and nothing is copied."""
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    base = kt._base
    if (base is not None and base is vt._base and base.shape == (2, *kt.shape) and base.is_contiguous()
            and kt.data_ptr() == base[0].data_ptr() and vt.data_ptr() == base[1].data_ptr()
            and kt.stride() == base[0].stride() and vt.stride() == base[1].stride()):
        return base
    return torch.stack((kt, vt))


def unstack_kv(kv: Tensor) -> tuple[Tensor, Tensor]:
    """The (B, H, N, D) views of k and v in a stack_kv message."""
    return kv[0].transpose(1, 2), kv[1].transpose(1, 2)


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    if not (q.shape == k.shape == v.shape) or q.dim() != 4:
        raise ValueError(f"ring attention: q, k, v must be local shards of one shape (B, H, N_local, D), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % 2:
        raise ValueError(f"ring attention: the local shard has {q.shape[2]} tokens; zigzag shards hold two chunks "
                         f"of equal length (pad the sequence to a multiple of 2 x context ranks: padded_len)")


def ring_forward(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None, sm_scale: float
                 ) -> tuple[Tensor, Tensor]:
    """(o, lse) of causal attention of the local zigzag queries against the whole sequence's keys; no autograd.
    o has q's dtype and memory layout; lse is the base-2 row log-sum-exp, fp32 (B, H, N_local)."""
    from minigpt_kernels.launch import empty_in_layout_of

    ring = Ring(group)
    kv = stack_kv(k, v)
    # the running result, fp32: written by the local block (step 0, every row sees its diagonal), then continued
    o, lse = empty_in_layout_of(q, torch.float32), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size  # whose block we hold now
        # post the next block's transfer first, so it overlaps this block's compute
        incoming = ring.pass_on(kv) if step + 1 < ring.size else None
        _block_forward(q, *unstack_kv(kv), src, ring.rank, sm_scale, o, lse)
        if incoming is not None:
            kv = incoming()
    return o.to(q.dtype), lse


def ring_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                  group: dist.ProcessGroup | None, sm_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of ring attention, from the final o and lse of ring_forward.

    The local block comes first and last: its dQ kernel runs while the first other block arrives, and its dK/dV
    kernel while the accumulator of the other ranks' dK/dV for it makes its last hop home, so neither transfer
    waits alone. In between, each other rank's block is processed as it arrives: its dQ kernel first, while the
    block's accumulator is still arriving, then its dK/dV kernel adding into that accumulator."""
    from minigpt_kernels.launch import (empty_in_layout_of, launch_backward_delta, launch_backward_dkdv,
                                                 launch_backward_dq)

    ring = Ring(group)
    kv = stack_kv(k, v)
    kv_incoming = ring.pass_on(kv) if ring.size > 1 else None
    do, delta = launch_backward_delta(do, o, lse)
    dq = launch_backward_dq(do, q, k, v, lse, delta, True, sm_scale, out=empty_in_layout_of(q, torch.float32))
    dkv_incoming = None  # the (dK, dV) accumulator (fp32, laid out as kv) of the block we hold: it travels with it
    for step in range(1, ring.size):
        src = (ring.rank - step) % ring.size  # whose block arrives now
        kv = kv_incoming()
        kv_incoming = ring.pass_on(kv) if step + 1 < ring.size else None
        # this block's share, computed while the next block (and, during its dQ kernel, its accumulator) is in flight
        # the first rank after a block's owner starts its accumulator: fp32 zeros laid out as kv
        accumulator = dkv_incoming or _ready(torch.zeros(kv.shape, dtype=torch.float32, device=kv.device))
        dkv = _block_backward(do, q, *unstack_kv(kv), lse, delta, src, ring.rank, sm_scale, dq, accumulator)
        # hand the accumulator on with its block; after the last hop each one is back at its owner
        dkv_incoming = ring.pass_on(dkv)
        if dkv.numel() * dkv.element_size() >= SERIAL_HOP_BYTES:
            dkv_incoming = _ready(dkv_incoming())  # a long shard: wait now, one accumulator in flight, not two
        del dkv
    del kv
    dq = dq.to(q.dtype)
    dk, dv = launch_backward_dkdv(do, q, k, v, lse, delta, True, sm_scale)  # the local block, during the last hop
    if dkv_incoming is None:  # a ring of one
        return dq, dk, dv
    # dK = mine + the other ranks' (fp32), added in fp32 and cast into mine in one pass
    theirs_k, theirs_v = unstack_kv(dkv_incoming())
    return dq, dk.add_(theirs_k), dv.add_(theirs_v)


# An accumulator hop of at least this size is waited for at once instead of during the next block's dQ kernel: two
# fp32 (dK, dV) accumulators in flight take 12 KB per local token (for 768 channels), and at such sizes the hop
# (~4 ms per GiB over NVLink) is small beside a block's compute.
SERIAL_HOP_BYTES = 256 << 20


def _ready(t: Tensor) -> Callable[[], Tensor]:
    """A tensor already at hand, in the shape of a pending transfer (a function that gives it)."""
    return lambda: t


class RingAttentionFunction(torch.autograd.Function):
    """Differentiable ring attention: forward ring_forward (or a precomputed (o, lse)), backward ring_backward."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None, sm_scale: float,
                precomputed: tuple[Tensor, Tensor] | None) -> Tensor:
        o, lse = ring_forward(q, k, v, group, sm_scale) if precomputed is None else precomputed
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.group, ctx.sm_scale = group, sm_scale
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(do, q, k, v, o, lse, ctx.group, ctx.sm_scale)
        return dq, dk, dv, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | None, causal: bool = True,
                   softmax_scale: float | None = None, precomputed: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Causal attention of zigzag-sharded q, k, v (B, H, N_local, D) over the ranks of `group`; returns the local
    output. `precomputed=(o, lse)` from ring_forward on the same inputs skips the forward (kept attention)."""
    if not causal:
        raise ValueError("ring attention: only causal attention (the zigzag layout balances causal work)")
    _check(q, k, v)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return RingAttentionFunction.apply(q, k, v, group, sm_scale, precomputed)


class RingFlashAttention(FlashAttention):
    """The `flash` backend with the sequence split over a context-parallel group: what the model calls as its
    attention under context parallelism. Returns its LSE, so kept attention works as with `flash`."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def attend_projection(self, qkv: Tensor, cos: Tensor, sin: Tensor, *, n_kv_head: int, window: int | None = None,
                          document_ids: Tensor | None = None) -> None:
        return None  # the ring takes rotated q, k, v (flash's single-GPU path would skip the other ranks)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, *, window: int | None = None,
                 document_ids: Tensor | None = None) -> Tensor:
        _no_masks(window, document_ids)
        return ring_attention(q, k, v, self.group, causal)

    def forward_with_lse(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = True, *, window: int | None = None,
                         document_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if not causal:
            raise ValueError("ring attention: only causal attention")
        _no_masks(window, document_ids)
        _check(q, k, v)
        with torch.no_grad():
            return ring_forward(q, k, v, self.group, 1.0 / math.sqrt(q.shape[-1]))

    def attend_saved(self, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool = True, *,
                     window: int | None = None, document_ids: Tensor | None = None) -> Tensor:
        _no_masks(window, document_ids)
        return ring_attention(q, k, v, self.group, causal, precomputed=(o, lse))


def _no_masks(window: int | None, document_ids: Tensor | None) -> None:
    """The ring has no windows or document masks (config.py refuses them with parallel.context > 1)."""
    if window is not None or document_ids is not None:
        raise ValueError("ring attention: no window or document mask (model.window, data.document_mask); "
                         "use parallel.context=1 for them")


def mesh_attention(mesh: Mesh, backend: AttentionBackend) -> AttentionBackend:
    """The model's attention on this mesh: ring attention over the cp group when the sequence is split."""
    return RingFlashAttention(mesh.cp_group) if mesh.cp > 1 else backend

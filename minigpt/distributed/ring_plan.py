"""What ring attention computes where: for each block of keys a rank holds, the kernel launches that cover the
(query, key) pairs its masks leave visible, and which ring steps are worth a transfer. Host-side arithmetic on the
zigzag layout only (no tensors, no communication), so every rank derives the same plan and the tests check it
against a brute-force mask.

Zigzag layout (sharding.py): the padded sequence is cut into 2K chunks of c tokens; rank r holds chunks r and
2K-1-r, local rows [0, c) and [c, 2c), and chunk j starts at global position j·c. A block is one rank's K/V (its two
chunks), so block src's key rows [0, c) and [c, 2c) are chunks src and 2K-1-src.

Causal attention, with or without documents: the pairs follow from the chunk order alone, and each block is one
launch on contiguous runs of rows and keys (the launches dense attention always had):

    src == r:  the local block, causal over the local order (chunk r precedes chunk 2K-1-r, so the local order is
               the global order): rows [0, 2c) against keys [0, 2c);
    src <  r:  chunk src precedes both query chunks and chunk 2K-1-src follows both: rows [0, 2c) see keys [0, c)
               in full;
    src >  r:  both key chunks precede chunk 2K-1-r and follow chunk r: rows [c, 2c) see keys [0, 2c) in full.

Document ids need no positions (a query sees the keys of its document), so they ride on these launches: the query
rows' ids and the keys' ids go with each launch, and the kernel skips the tiles whose documents differ.

Sliding window w (query i sees keys i − w < j <= i): positions matter, and the two chunks of a rank are far apart,
so each (query chunk, key chunk) pair is its own launch at its global offsets (q_offset, k_offset): the diagonal
pairs causal, a key chunk entirely before its query chunk non-causal (the window alone masks it; |i − j| < w is the
causal window when every key precedes every query). A pair the window cannot reach (its nearest query-key distance
>= w) or whose keys all follow its queries is no launch at all; a window wider than a pair's farthest distance is
dropped from that launch (the dense kernel runs).

Which steps are worth a transfer: rank r needs block src only if some launch covers it. With a window, the blocks
a rank needs are its neighbours' on both sides of the ring (query chunk r reaches back into chunks r-1, r-2, ..., held
by ranks r-1, r-2, ...; query chunk 2K-1-r into chunks 2K-2-r, ..., held by ranks r+1, r+2, ...), so a one-way ring
would carry every block through every rank. `ring_schedule` instead sends blocks both ways: `forward` hops towards
rank+1 (rank r then holds blocks r-1, ..., r-forward in turn) and `backward` hops towards rank-1 (r+1, ..., r+backward),
the fewest hops in total that bring every rank every block it needs. Without a window that is the plain ring
(forward = K-1, backward = 0); with a window within a chunk, one hop each way, whatever K.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a rank's local query rows against rows of a block's keys (slices of the 2c of each).

    causal, window, q_offset and k_offset go to the launchers as they are (None: unused). fresh_rows: the first
    launch of the local block to write these rows' output (the forward's (o, lse) and the backward's dQ), which the
    later ones continue (`accumulate`); fresh_keys: the same for the local block's dK/dV. Launches of another rank's
    block always continue what the local block wrote."""

    rows: slice
    keys: slice
    causal: bool
    window: int | None = None
    q_offset: int | None = None
    k_offset: int | None = None
    fresh_rows: bool = False
    fresh_keys: bool = False


def chunks(rank: int, k: int) -> tuple[int, int]:
    """The chunks rank holds in the zigzag layout of 2k chunks, in local order."""
    return rank, 2 * k - 1 - rank


def effective_window(window: int | None, k: int, c: int) -> int | None:
    """The window, or None where it leaves out nothing of a sequence of 2k·c tokens (window >= its length)."""
    return None if window is None or window >= 2 * k * c else window


def block_launches(src: int, rank: int, k: int, c: int, window: int | None = None) -> list[Launch]:
    """The launches of rank's local queries against block src under causal attention within `window` (None: all
    earlier tokens); document ids go with every launch (they need no positions). Local block first launches fresh."""
    window = effective_window(window, k, c)
    first, second, both = slice(0, c), slice(c, 2 * c), slice(0, 2 * c)
    if window is None:
        if src == rank:
            return [Launch(both, both, True, fresh_rows=True, fresh_keys=True)]
        return [Launch(both, first, False)] if src < rank else [Launch(second, both, False)]
    launches = []
    for q_chunk, rows in zip(chunks(rank, k), (first, second)):
        for k_chunk, keys in zip(chunks(src, k), (first, second)):
            if k_chunk > q_chunk:
                continue  # every key follows every query
            nearest = 0 if k_chunk == q_chunk else (q_chunk - k_chunk - 1) * c + 1
            farthest = (q_chunk - k_chunk + 1) * c - 1
            if nearest >= window:
                continue  # out of the window's reach
            w = window if farthest >= window else None
            if k_chunk == q_chunk:  # a diagonal pair: causal, the same positions on both sides
                launches.append(Launch(rows, keys, True, w))
            else:  # every key precedes every query: the window alone masks, at the pair's global positions
                offsets = (q_chunk * c, k_chunk * c) if w is not None else (None, None)
                launches.append(Launch(rows, keys, False, w, *offsets))
    launches.sort(key=lambda l: not l.causal)  # diagonal pairs first: they write every row and key of the local block
    if src != rank:
        return launches
    done_rows, done_keys, out = set(), set(), []
    for l in launches:
        out.append(Launch(l.rows, l.keys, l.causal, l.window, l.q_offset, l.k_offset,
                          fresh_rows=l.rows.start not in done_rows, fresh_keys=l.keys.start not in done_keys))
        done_rows.add(l.rows.start)
        done_keys.add(l.keys.start)
    return out


@dataclass(frozen=True)
class RingSchedule:
    """How far the blocks travel: `forward` hops towards rank+1, `backward` hops towards rank-1."""

    forward: int
    backward: int

    def steps(self) -> list[tuple[int, int]]:
        """The ring steps after the local block, as (direction, depth): direction +1 brings block rank − depth
        (it travelled towards rank+1), −1 block rank + depth; the two directions alternate, so their transfers
        overlap each other's compute."""
        out = []
        for depth in range(1, max(self.forward, self.backward) + 1):
            if depth <= self.forward:
                out.append((1, depth))
            if depth <= self.backward:
                out.append((-1, depth))
        return out

    @staticmethod
    def source(rank: int, size: int, direction: int, depth: int) -> int:
        """Whose block a rank holds at the step (direction, depth)."""
        return (rank - direction * depth) % size


@functools.lru_cache(maxsize=64)  # asked at every layer's forward and backward
def ring_schedule(k: int, c: int, window: int | None = None) -> RingSchedule:
    """The fewest hops that bring every rank of the ring every block it has launches for (the same on every rank).
    Ties go to the plain one-way ring."""
    window = effective_window(window, k, c)
    needed = {s for s in range(1, k) for r in range(k) if block_launches((r - s) % k, r, k, c, window)}
    best = RingSchedule(max(needed, default=0), 0)  # one way: every needed offset s = 1..forward
    for split in range(k - 1):  # offsets <= split travel forward, the others backward (offset s = K − depth)
        forward = max((s for s in needed if s <= split), default=0)
        backward = k - min((s for s in needed if s > split), default=k)
        if forward + backward < best.forward + best.backward:
            best = RingSchedule(forward, backward)
    return best

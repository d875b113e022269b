"""Ring attention's plan (minigpt/distributed/ring_plan.py), checked by brute force without processes or kernels:
the launches of every (block, rank) pair cover exactly the (query, key) pairs the causal mask and the window leave
visible, each once; the schedule brings every rank every block it has launches for, in the fewest hops; and the
document ids shard like the tokens.
"""
import pytest
import torch

from minigpt.distributed.ring_plan import RingSchedule, block_launches, chunks, ring_schedule
from minigpt.distributed.sharding import shard_document_ids, zigzag_positions, zigzag_shard, zigzag_unshard


def positions(rank: int, k: int, c: int) -> list[int]:
    """Global positions of rank's 2c local rows (the zigzag layout)."""
    a, b = chunks(rank, k)
    return [a * c + i for i in range(c)] + [b * c + i for i in range(c)]


def launch_pairs(launch, q_pos: list[int], k_pos: list[int]) -> set[tuple[int, int]]:
    """The (query, key) global positions one launch attends, as the launchers read its arguments: causal and window
    on the launch's own indices, shifted by q_offset − k_offset (which must be the rows' real positions)."""
    shift = (launch.q_offset or 0) - (launch.k_offset or 0)
    pairs = set()
    for i in range(*launch.rows.indices(len(q_pos))):
        for j in range(*launch.keys.indices(len(k_pos))):
            if launch.q_offset is not None:
                assert launch.q_offset + i - launch.rows.start == q_pos[i]
                assert launch.k_offset + j - launch.keys.start == k_pos[j]
            d = (i - launch.rows.start) - (j - launch.keys.start) + shift
            if (not launch.causal or d >= 0) and (launch.window is None or abs(d) < launch.window):
                pairs.add((q_pos[i], k_pos[j]))
    return pairs


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_the_launches_cover_the_visible_pairs_exactly_once(k):
    """Every window from 1 to beyond the sequence (and none), chunks of 1 to 4 tokens: on every rank the launches
    of all blocks together attend exactly the pairs with key <= query within the window, none twice; a launch
    writing fresh comes before any that continues its rows or keys; the schedule holds every needed block."""
    for c in range(1, 5):
        n = 2 * k * c
        for window in [None, *range(1, n + 2)]:
            steps = ring_schedule(k, c, window).steps()
            for rank in range(k):
                held = {rank} | {RingSchedule.source(rank, k, d, depth) for d, depth in steps}
                assert len(held) == 1 + len(steps)  # no block arrives twice
                got = set()
                for src in range(k):
                    launches = block_launches(src, rank, k, c, window)
                    assert not launches or src in held, (k, c, window, rank, src)
                    for launch in launches:
                        pairs = launch_pairs(launch, positions(rank, k, c), positions(src, k, c))
                        assert pairs and not pairs & got, (k, c, window, rank, src, launch)
                        got |= pairs
                    if src == rank:  # every row and key of the local block is written fresh first
                        fresh = [(l.fresh_rows, l.fresh_keys) for l in launches]
                        assert fresh[0] == (True, True) and sum(f[0] for f in fresh) == len({l.rows.start for l in launches})
                    else:
                        assert not any(l.fresh_rows or l.fresh_keys for l in launches)
                want = {(i, j) for i in positions(rank, k, c) for j in range(n)
                        if j <= i and (window is None or i - j < window)}
                assert got == want, (k, c, window, rank)


def test_causal_blocks_are_one_launch_each_and_windows_send_both_ways_only_as_far_as_they_reach():
    k, c = 4, 16
    # causal (documents alike): one launch per block, the plain one-way ring of K-1 hops
    assert all(len(block_launches(s, r, k, c)) == 1 for s in range(k) for r in range(k))
    assert ring_schedule(k, c) == RingSchedule(3, 0) and ring_schedule(k, c, 2 * k * c) == RingSchedule(3, 0)
    # a window within a chunk reaches the neighbours on both sides: one hop each way, whatever K
    assert ring_schedule(k, c, 16) == RingSchedule(1, 1) and ring_schedule(8, c, 2) == RingSchedule(1, 1)
    assert RingSchedule(1, 1).steps() == [(1, 1), (-1, 1)]
    assert ring_schedule(8, c, 33) == RingSchedule(2, 2)  # two chunks back: two hops each way, not 7
    assert ring_schedule(k, c, 1) == RingSchedule(0, 0)  # each token sees itself only: no transfer at all
    assert ring_schedule(2, c, 5) == RingSchedule(1, 0)
    # the launches of a window are per chunk pair, at the pair's global offsets; out of reach: none
    launches = block_launches(2, 3, k, c, 5)  # rank 3 holds chunks 3, 4; rank 2 chunks 2, 5
    assert [(l.rows, l.keys, l.causal, l.window, l.q_offset, l.k_offset) for l in launches] == [
        (slice(0, 16), slice(0, 16), False, 5, 48, 32)]  # chunk 3 reaches back into chunk 2; chunk 5 follows both
    assert block_launches(0, 3, k, c, 5) == []  # chunks 0 and 7 are beyond rank 3's reach


def test_document_ids_shard_like_the_tokens_and_the_padding_is_a_document_of_its_own():
    ids = torch.tensor([[0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.int32)
    shards = [shard_document_ids(ids, 3, r) for r in range(3)]  # 11 tokens padded to 12: 6 chunks of 2
    assert all(s.dtype == torch.int32 and s.shape == (2, 4) for s in shards)
    full = zigzag_unshard(shards, dim=1)
    assert torch.equal(full[:, :11], ids) and full[:, 11].tolist() == [4, 4]  # above every real id
    for r, s in enumerate(shards):  # the positions the tokens get, and ids non-decreasing in the local order
        assert torch.equal(s, zigzag_shard(ids, 3, r, dim=1, pad=4))
        assert torch.equal(full[:, zigzag_positions(12, 3, r)], s) and bool((s[:, 1:] >= s[:, :-1]).all())

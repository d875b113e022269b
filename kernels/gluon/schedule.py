"""Work lists for the persistent Gluon kernels (one program per SM, each walking its own list of tiles).

The hardware hands the next program of a plain grid to whichever SM frees first. `schedule` replays that on the host
(greedy list scheduling) with a cost model, each item's tiles plus a constant for its set-up, and keeps, among a few
launch orders, the one whose modelled finish is earliest. Head after head (longest items first within a head) keeps
one head's keys and values hot in L2 but ends on a ragged tail; the other candidates smooth that tail: the same order
with its last k·programs items re-sorted longest first, or groups of heads taken longest first across the group.
Longest first across all heads balances best but thrashed L2 on an H200 (kernels/NOTES.md S), so it is not a
candidate. Items are numbered head · tiles_per_head + position; the lists are cached per shape.
"""
from __future__ import annotations

import functools
import heapq

import torch
from torch import Tensor

MODEL_OVERHEAD_TILES = 2.0  # an item's set-up and pipeline fill, in tiles of work
MAX_ITEMS_TO_COMPARE = 20_000  # past this, head after head only (long sequences: its tail is already small)


def greedy(items: list[int], cost: list[float], programs: int) -> tuple[float, list[list[int]]]:
    """Each item in turn to the program that is free first; the finish time of the last one, and each one's items."""
    free_at = [(0.0, p) for p in range(programs)]
    lists: list[list[int]] = [[] for _ in range(programs)]
    for it in items:
        t, p = heapq.heappop(free_at)
        lists[p].append(it)
        heapq.heappush(free_at, (t + cost[it], p))
    return max(t for t, _ in free_at), lists


def launch_orders(heads: int, position_costs: tuple[float, ...], programs: int):
    """The candidate orders of the items head · len(position_costs) + position."""
    per_head = len(position_costs)
    longest_first = sorted(range(per_head), key=lambda pos: -position_costs[pos])
    head = [h * per_head + pos for h in range(heads) for pos in longest_first]
    yield head
    if len(head) > MAX_ITEMS_TO_COMPARE:
        return
    for k in (1, 2, 3, 4, 6):
        tail = min(len(head), k * programs)
        yield head[:-tail] + sorted(head[-tail:], key=lambda it: -position_costs[it % per_head])
    for g0 in (2, 3, 4):
        groups = -(-heads // -(-g0 * programs // per_head))
        bounds = [round(i * heads / groups) for i in range(groups + 1)]
        yield [h * per_head + pos for lo, hi in zip(bounds, bounds[1:]) for pos in longest_first
               for h in range(lo, hi)]


def _best_order(heads: int, position_costs: tuple[float, ...],
                programs: int) -> tuple[list[int], list[list[int]], float]:
    """The candidate of launch_orders whose greedy replay finishes first (ties keep the earlier, more L2-friendly
    order): (that order, each program's items in it, its finish). An item costs its tiles plus
    MODEL_OVERHEAD_TILES."""
    cost = [position_costs[it % len(position_costs)] + MODEL_OVERHEAD_TILES
            for it in range(heads * len(position_costs))]
    best = None
    for order in launch_orders(heads, position_costs, programs):
        finish, lists = greedy(order, cost, programs)
        if best is None or finish < best[0] * 0.998:
            best = (finish, order, lists)
    return best[1], best[2], best[0]


def _work_list(items, starts, device: torch.device) -> tuple[Tensor, Tensor]:
    """(items, starts) as the kernels' int32 work list on the device; starts None: one item per program."""
    starts = range(len(items) + 1) if starts is None else starts
    return (torch.tensor(items, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device))


def _flatten(lists: list[list[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(items, starts) of programs' lists: program p takes items[starts[p]:starts[p+1]]."""
    items, starts = [], [0]
    for lst in lists:
        items += lst
        starts.append(len(items))
    return tuple(items), tuple(starts)


@functools.lru_cache(maxsize=64)
def schedule(heads: int, position_costs: tuple[float, ...], programs: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(items, starts): program p takes items[starts[p]:starts[p+1]] in that order; every item exactly once.
    position_costs[pos]: the work of the item at that position of a head (its tiles), without the set-up."""
    return _flatten(_best_order(heads, position_costs, programs)[1])


@functools.lru_cache(maxsize=64)
def plain_order(heads: int, position_costs: tuple[float, ...], programs: int) -> tuple[int, ...]:
    """A plain grid's items in the launch order, among launch_orders', whose greedy replay (what the hardware does
    with a plain grid: each next program to the SM that frees first) finishes first; ties keep the earlier order.
    Few long items per head make head after head a poor order: GQA 16:4 at 8K tokens (4 K/V heads of 64 key blocks,
    each walking 4 query heads) modelled 764 tile-units head after head against 514 longest first."""
    return tuple(_best_order(heads, position_costs, programs)[0])


def modelled_finish(heads: int, position_costs: tuple[float, ...], programs: int) -> float:
    """When plain_order's grid ends in the greedy replay, in tile-units: what a choice between grids compares."""
    return _best_order(heads, position_costs, programs)[2]


@functools.lru_cache(maxsize=32)
def device_plain_order(heads: int, position_costs: tuple[float, ...], programs: int,
                       device: torch.device) -> tuple[Tensor, Tensor]:
    """plain_order's items as a plain grid's work list on the device (one item per program), made once per shape."""
    return _work_list(plain_order(heads, position_costs, programs), None, device)


@functools.lru_cache(maxsize=32)
def device_schedule(heads: int, position_costs: tuple[float, ...], programs: int,
                    device: torch.device) -> tuple[Tensor, Tensor]:
    """schedule's (items, starts) as int32 tensors on the device, made once per shape."""
    return _work_list(*schedule(heads, position_costs, programs), device)


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    """The GPU's SMs: a persistent kernel's programs."""
    return torch.cuda.get_device_properties(device).multi_processor_count


# masked launches with a window alone run persistent where they have at least this many waves of items: their items
# are short (a 1K window's query tile sees 8-9 key tiles), so a program's set-up (barriers, device-side TMA
# descriptors, the first loads) weighs on each one where a plain grid starts a program per item
MASKED_PERSISTENT_WAVES = 4
# document ids (items whose cost only the device reads from the ids) run persistent on a work queue (gluon/common.py,
# QUEUE): the programs take the plain grid's items as each frees up, so they balance as a plain grid does, at any head
# count and document length. Lists dealt out in advance did not: a 32K document at gpt2-small's 12 heads ended 1.6×
# later than balanced (kernels/NOTES.md, session 25). The backward takes the queue at both head dims: at 128 it
# spilled until the producer took its tickets by one lane's atomic (session 26); now 7% faster than the plain grid on
# 1K documents, the same on longer ones. A head dim left out here keeps the plain grid.
DOCUMENTS_QUEUED_BACKWARD_HEAD_DIMS = (64, 128)


def _head_after_head(heads: int, positions: tuple[int, ...]) -> list[int]:
    """A plain grid's items head after head, each head's at `positions` in that order."""
    return [h * len(positions) + pos for h in range(heads) for pos in positions]


@functools.lru_cache(maxsize=32)
def device_one_each(heads: int, positions: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """A plain grid as a work list: one item per program, head after head, each head's items at `positions` in
    that order (the hardware starts programs in order, so the first positions start first)."""
    return _work_list(_head_after_head(heads, positions), None, device)

"""What each rank holds of a batch: its data-parallel rows, and its zigzag shard of each sequence.

Data parallel: dp rank d takes rows [d·B, (d+1)·B) of data.batch(split, index, B·dp) (tokens, targets and document
ids alike), a function of (step, rank),
so dp ranks train exactly what one process with batch_size=B·dp would, and a resumed run sees the same data.

Zigzag layout (context parallel, for causal load balance): the sequence is cut into 2K chunks of c tokens and
rank r holds chunks r and 2K-1-r, in that order, so every rank has one early and one late chunk and the same
amount of causal work. The sequence is padded at the end to a multiple of 2K (pads are ignored by the loss
and, being last, seen by no real token; with document ids they are a document of their own); RoPE rotates with each
token's global position (`zigzag_positions`), and ring attention places windows by it too (ring_plan.py).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from minigpt.distributed.mesh import Mesh

IGNORE = -100  # target of a padding token: F.cross_entropy's default ignore_index


def padded_len(n: int, k: int) -> int:
    """The shortest length >= n that splits into 2k equal chunks."""
    return -(-n // (2 * k)) * 2 * k


def zigzag_positions(n: int, k: int, rank: int, device: torch.device | str = "cpu") -> Tensor:
    """Global positions (int64, n/k of them) of rank's tokens: chunks rank and 2k-1-rank of n tokens."""
    if n % (2 * k):
        raise ValueError(f"zigzag: sequence length {n} does not split into 2*{k} equal chunks; pad it to "
                         f"{padded_len(n, k)} (padded_len)")
    c = n // (2 * k)
    return torch.cat((torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * k - 1 - rank) * c, (2 * k - rank) * c, device=device)))


def zigzag_shard(x: Tensor, k: int, rank: int, dim: int = 1, pad: float = 0) -> Tensor:
    """rank's zigzag shard of x along `dim`; x is first padded at the end with `pad` to a multiple of 2k
    (padding at the end is exact for causal attention: no real token sees a later one)."""
    n = x.shape[dim]
    extra = padded_len(n, k) - n
    if extra:
        shape = list(x.shape)
        shape[dim] = extra
        x = torch.cat((x, x.new_full(shape, pad)), dim=dim)
    return x.index_select(dim, zigzag_positions(x.shape[dim], k, rank, x.device))


def zigzag_unshard(shards: list[Tensor], dim: int = 1, n: int | None = None) -> Tensor:
    """The full sequence from every rank's shard (in rank order), cut back to n tokens."""
    k = len(shards)
    c = shards[0].shape[dim] // 2
    chunks: list[Tensor | None] = [None] * (2 * k)
    for r, s in enumerate(shards):
        chunks[r], chunks[2 * k - 1 - r] = s.narrow(dim, 0, c), s.narrow(dim, c, c)
    full = torch.cat(chunks, dim=dim)
    return full if n is None else full.narrow(dim, 0, n)


def shard_document_ids(ids: Tensor, k: int, rank: int) -> Tensor:
    """rank's zigzag shard of document ids (B, N), split as x and y are. The padding gets an id above every real
    one (a document of its own, last): the ids stay non-decreasing, and no real token sees a pad."""
    return zigzag_shard(ids, k, rank, dim=1, pad=int(ids.max()) + 1 if ids.numel() else 0)


def shard_batch(mesh: Mesh, data: Any, split: str, index: int, batch_size: int
                ) -> tuple[Tensor, Tensor, Tensor | None]:
    """This rank's (x, y, document ids or None): its dp rows of the global batch, and its zigzag shard of each
    sequence (tokens, targets and document ids alike)."""
    if not mesh.active:
        return data.batch(split, index, batch_size)
    x, y, ids = data.batch(split, index, batch_size * mesh.dp)
    rows = slice(mesh.dp_rank * batch_size, (mesh.dp_rank + 1) * batch_size)
    x, y, ids = x[rows], y[rows], None if ids is None else ids[rows]
    if mesh.cp > 1:
        x, y = zigzag_shard(x, mesh.cp, mesh.cp_rank, dim=1), zigzag_shard(y, mesh.cp, mesh.cp_rank, 1, IGNORE)
        ids = None if ids is None else shard_document_ids(ids, mesh.cp, mesh.cp_rank)
    return x, y, ids


def local_positions(mesh: Mesh, seq_len: int, device: torch.device) -> Tensor | None:
    """Global positions of this rank's tokens (for RoPE), None when it holds whole sequences."""
    if mesh.cp == 1:
        return None
    return zigzag_positions(padded_len(seq_len, mesh.cp), mesh.cp, mesh.cp_rank, device)

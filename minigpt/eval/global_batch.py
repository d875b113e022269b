"""Held-out numbers of the global batch from this rank's share of it (data and context parallel, sharding.py):
the mean loss, and how many sequences have every key digit right. In one process, the batch itself."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from minigpt.distributed.mesh import Mesh
from minigpt.distributed.reductions import sum_f64
from minigpt.distributed.sharding import IGNORE


def mean_loss(mesh: Mesh, model: nn.Module, h: Tensor, y: Tensor) -> float:
    """The mean loss of the global batch, from this rank's hidden states h and targets y."""
    if not mesh.active:
        return model.loss(h, y).item()
    total, count = sum_f64([model.summed_loss(h, y).item(), (y != IGNORE).sum().item()]).tolist()
    return total / count


def key_hits(mesh: Mesh, model: nn.Module, h: Tensor, y: Tensor, answer: slice, positions: Tensor | None
             ) -> tuple[int, int]:
    """(sequences whose key digits are all the argmax predictions, sequences) of the global batch; `answer`
    indexes the key in the (unsharded) sequence, `positions` are this rank's tokens' (sharding.local_positions)."""
    if not mesh.active:
        pred = model.head(h[:, answer]).argmax(dim=-1)
        return int((pred == y[:, answer]).all(dim=-1).sum().item()), y.shape[0]
    local = torch.arange(y.shape[1], device=h.device)
    if positions is not None:  # the key's tokens this rank holds
        local = local[(positions >= answer.start) & (positions < answer.stop)]
    else:
        local = local[answer]
    wrong = (model.head(h[:, local]).argmax(dim=-1) != y[:, local]).sum(dim=-1).float()
    if mesh.cp > 1:  # a sequence's key may be split over its cp ranks
        dist.all_reduce(wrong, group=mesh.cp_group)
    # count each sequence once: on cp rank 0 of its dp rank
    mine = [float((wrong == 0).sum()), float(y.shape[0])] if mesh.cp_rank == 0 else [0.0, 0.0]
    hits, total = sum_f64(mine).tolist()
    return int(hits), int(total)

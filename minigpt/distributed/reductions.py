"""The few collectives the trainer needs, over every rank of the mesh; in one process each is the value itself.

Small control values travel as CPU tensors (gloo, also beside NCCL): no GPU synchronization for them.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from minigpt.config import ConfigError
from minigpt.distributed.mesh import Mesh


def mean(mesh: Mesh, t: Tensor) -> Tensor:
    """t averaged over all ranks (t itself in one process)."""
    if not mesh.active:
        return t
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / mesh.world


def sum_f64(values: list[float] | Tensor) -> Tensor:
    """The sum over all ranks, as a float64 CPU tensor (needs an initialized process group)."""
    t = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    dist.all_reduce(t)
    return t


def max_int(mesh: Mesh, value: int) -> int:
    """The largest value any rank has."""
    if not mesh.active:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def agree(mesh: Mesh, value: int, what: str) -> None:
    """Raise ConfigError unless every rank has the same value (e.g. the step a resume found)."""
    if mesh.active and max_int(mesh, value) != -max_int(mesh, -value):
        raise ConfigError(f"{what}: the ranks disagree (rank {mesh.rank} has {value}); every node must see the "
                          f"same files (put ckpt_dir on a filesystem all nodes share)")


def on_main(mesh: Mesh, fn: Callable[[], Any]) -> Any:
    """fn() run by rank 0 only, its result (or its ConfigError) given to every rank."""
    if not mesh.active:
        return fn()
    box: list[Any] = [None]
    if mesh.is_main:
        try:
            box[0] = ("ok", fn())
        except ConfigError as e:
            box[0] = ("error", str(e))
    dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
    kind, value = box[0]
    if kind == "error":
        raise ConfigError(value)
    return value

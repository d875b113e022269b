"""The ranks of a torchrun job as a 2-D DeviceMesh ("dp", "cp") of shape (N/K, K); the axes are named here once.

- data parallel (dp): each dp rank trains its own rows of the global batch (sharding.py), and DDP averages the
  gradients (data_parallel.py);
- context parallel (cp): the K ranks of a dp rank split each sequence in zigzag order (sharding.py) and attend
  with ring attention over the cp group (ring_attention.py).

A single process (no torchrun) gets `Mesh()`: one rank on both axes, no groups, no communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch.distributed as dist

from minigpt.config import ConfigError
from minigpt.distributed.process import use_local_gpu


class MeshAxis(str, Enum):
    """The mesh's dimension names, in mesh order."""

    DP = "dp"  # data parallel: rows of the global batch
    CP = "cp"  # context parallel: chunks of each sequence


@dataclass(frozen=True)
class Mesh:
    """This process's place on the mesh; a single process by default."""

    world: int = 1
    rank: int = 0
    dp: int = 1
    dp_rank: int = 0
    cp: int = 1
    cp_rank: int = 0
    cp_group: Any = None  # dist.ProcessGroup of this rank's context-parallel ranks

    @classmethod
    def setup(cls, context: int, device_type: str) -> Mesh:
        """The mesh of an initialized process group (process.start_distributed), else a single process."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return cls()
        from torch.distributed.device_mesh import init_device_mesh

        if device_type == "cuda":
            use_local_gpu()  # before the mesh's groups, whose NCCL half works on the current device

        world = dist.get_world_size()
        if world % context:
            raise ConfigError(f"parallel.context={context}: must divide the number of processes ({world})")
        mesh = init_device_mesh(device_type, (world // context, context),
                                mesh_dim_names=tuple(axis.value for axis in MeshAxis))
        dp, cp = MeshAxis.DP.value, MeshAxis.CP.value
        return cls(world=world, rank=dist.get_rank(), dp=world // context, dp_rank=mesh.get_local_rank(dp),
                   cp=context, cp_rank=mesh.get_local_rank(cp), cp_group=mesh.get_group(cp))

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes files and logs."""
        return self.rank == 0

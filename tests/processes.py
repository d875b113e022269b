"""Start test processes the way torchrun starts them: its environment variables, then the target, one process
per rank (torch.multiprocessing.spawn; a failure in one raises in the caller)."""
import os
import socket

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, target, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    target(rank, *args)


def launch(world: int, target, *args) -> None:
    """target(rank, *args) in `world` fresh processes with torchrun's environment (a failure in one raises here)."""
    mp.spawn(_entry, args=(world, _free_port(), target, args), nprocs=world)

"""This process's part in a torchrun job: torchrun's environment in, the process group joined and left.

    torchrun --nproc_per_node=N scripts/train.py ... parallel.context=K        (K divides N)

torchrun stays the launcher (no launcher of our own). Rank 0 writes everything (summary.json, checkpoints, the
W&B run) and speaks for the job on stdout; the other ranks write nothing and print only their own errors.
"""
from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def launched_world_size() -> int:
    """How many processes torchrun started (WORLD_SIZE), 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_gpu() -> int:
    """This process's GPU under torchrun (LOCAL_RANK), 0 without it."""
    return int(os.environ.get("LOCAL_RANK", "0"))


# NCCL's kernels on a high-priority stream: the GPU's scheduler gives a transfer's few programs the first SMs that free
# up, so the ring's hops overlap the attention kernel running beside them instead of waiting for its last wave
# (2 x H100, ring attention at 16K tokens per GPU: efficiency 0.86 -> 0.89 at head_dim 64, 0.85 -> 0.90 at 128).
# It applies to every NCCL group, data parallel's gradient all-reduces too (measured on the ring only).
NCCL_ENV = {"TORCH_NCCL_HIGH_PRIORITY": "1"}


def use_nccl_settings() -> dict[str, str]:
    """Set NCCL_ENV where the environment does not say otherwise (before NCCL's process groups are made); returns the
    settings in effect. The trainer and the ring benchmark call it, so both run with the same settings."""
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in NCCL_ENV}


def nccl_settings() -> dict[str, str | None]:
    """NCCL_ENV's keys and every NCCL_* variable of the environment, as a benchmark records them (what a run's
    transfers depend on: e.g. NCCL_MAX_P2P_NCHANNELS, how many SMs a send/receive may take)."""
    keys = set(NCCL_ENV) | {key for key in os.environ if key.startswith("NCCL_")}
    return {key: os.environ.get(key) for key in sorted(keys)}


def start_distributed() -> bool:
    """Join torchrun's process group (its env: MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK), if launched by
    torchrun with more than one process and not joined yet. Returns True when this call joined it (the caller
    then leaves it with stop_distributed). With GPUs: NCCL for CUDA tensors (its settings: use_nccl_settings) and
    gloo for CPU ones (small control messages); gloo alone without. NCCL/NVLink env variables are otherwise left as
    they are. CUDA does not start here (no device_id: NCCL starts lazily, and the mesh's groups get both backends):
    the run sets the CUDA allocator up first (minigpt/cuda_allocator.py), then takes its GPU (use_local_gpu, from
    Mesh.setup)."""
    if launched_world_size() == 1 or dist.is_initialized():
        return False
    if torch.cuda.is_available():
        use_nccl_settings()
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    return True


def use_local_gpu() -> None:
    """Make GPU LOCAL_RANK this process's current device (this starts CUDA in the process)."""
    torch.cuda.set_device(local_gpu())


MAIN_DONE_KEY = "minigpt/rank0-done"
MAIN_GRACE_S = 60.0  # rank 0 may still be writing a checkpoint and its W&B run


def stop_distributed(failed: bool = False) -> None:
    """Leave the process group (if joined). torchrun stops every worker as soon as one exits with an error, so a
    rank other than 0 that is leaving with one (a bad setting, a signal, ...) first waits, up to MAIN_GRACE_S, until
    rank 0 has finished too: rank 0 then always writes its summary, checkpoint and last line. (The wait is on
    torchrun's key-value store, not a collective, so it cannot be mistaken for one rank 0 is still in.)"""
    if not dist.is_initialized():
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        if dist.get_rank() == 0:
            store.set(MAIN_DONE_KEY, "1")
        elif failed:
            store.wait([MAIN_DONE_KEY], timedelta(seconds=MAIN_GRACE_S))
    except Exception:  # noqa: BLE001 - rank 0's store gone (it exited) or the wait timed out: leave anyway
        pass
    dist.destroy_process_group()


class TorchrunProcess(contextlib.AbstractContextManager):
    """The process's part in a torchrun job, for the length of a `with`: joins the process group (if torchrun
    started this process and nobody joined yet), sends stdout of ranks other than 0 to /dev/null (rank 0 speaks
    for the job; errors still go to stderr), and leaves the group at the end. Set `ok = True` when the work
    succeeded, so that a failing rank other than 0 waits for rank 0 to finish its files (stop_distributed)."""

    def __init__(self) -> None:
        self.ok, self.joined, self._quiet = False, False, contextlib.ExitStack()

    def __enter__(self) -> TorchrunProcess:
        self.joined = start_distributed()
        rank = dist.get_rank() if dist.is_initialized() else env_rank()
        if rank != 0:
            self._quiet.enter_context(contextlib.redirect_stdout(self._quiet.enter_context(open(os.devnull, "w"))))
        return self

    def __exit__(self, *exc: object) -> None:
        self._quiet.close()
        if self.joined:
            stop_distributed(failed=not self.ok)

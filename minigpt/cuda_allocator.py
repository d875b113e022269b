"""The CUDA caching allocator's settings, set by the trainer in one place (run.py, before the process group's mesh
and the model start CUDA), the same for one GPU and several: the config key `cuda_alloc_conf` goes into the
environment variables PyTorch reads when CUDA starts in a process (each torchrun worker starts its own).

The default, `expandable_segments:True`, lets the allocator grow a segment in place instead of reserving a new one
of each size it meets: ring attention's buffers of several sizes and the levers' chunks had left per-rank reserved
memory far above the allocated peak (docs/parallel.md, 2 GPUs: 43.5 GiB reserved for 30.3 allocated at 2M tokens,
35.1 for 16.8 at 1M, 21.8 for 6.0 at 256K). Most of that was the ring's messages waiting for NCCL's stream, which
ring_attention.CallFence bounds; expandable segments alone took 256K from 23.1 to 21.0 GiB. `cuda_alloc_conf=null` leaves the environment's setting (if any) as it is.
"""
from __future__ import annotations

import os

import torch

# The name PyTorch reads first since 2.8, then the older one (the only one before 2.8): both are set, so every
# version reads the same value.
ALLOC_CONF_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def allocator_settings() -> str | None:
    """The allocator settings this process's environment gives PyTorch (the first of ALLOC_CONF_ENV set), or None."""
    return next((os.environ[name] for name in ALLOC_CONF_ENV if os.environ.get(name)), None)


def use_allocator_settings(setting: str | None) -> str | None:
    """Give the CUDA allocator `setting` ("key:value,..."; None: the environment's) and return the settings in effect,
    for the run summary. Set before CUDA starts in this process, PyTorch reads every key when it does; where CUDA
    already runs here (a caller that used it before run()), the keys that can change at runtime (expandable_segments
    among them) change now."""
    if setting is None:
        return allocator_settings()
    for name in ALLOC_CONF_ENV:
        os.environ[name] = setting
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        change = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
        change(setting)
    return setting

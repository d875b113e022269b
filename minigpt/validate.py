"""The checks of a TrainConfig that need runtime knowledge, run before anything of the run is created.

config.py checks what a value allows by itself; here come the checks that ask the code and the machine:
the attention registry (a backend's name, options and capabilities on this device, dtype and head_dim, e.g.
that flash needs Triton and a GPU; context parallelism's ring runs over flash), the GPU itself, W&B credentials
for an online run, and torchrun's world size; and, for the CLI before Hydra writes anything, that the directories
a run writes are writable. Each failure is a ConfigError of one line (exit code 2).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from minigpt.attention import BACKENDS, SDPA_BACKEND_CHOICES, attention_names, get_attention
from minigpt.config import ConfigError, TrainConfig, one_of
from minigpt.distributed.process import launched_world_size, local_gpu
from minigpt.loggers import check_wandb


def validate(cfg: TrainConfig) -> None:
    """cfg's own checks (config.py), then the runtime ones; raises ConfigError for the first that fails."""
    one_of("attention", cfg.attention.name, attention_names())
    one_of("attention.sdpa_backend", cfg.attention.sdpa_backend, SDPA_BACKEND_CHOICES)
    cfg.validate()
    check_device(cfg)
    check_attention_fits(cfg)
    check_context_parallel(cfg)
    check_wandb(cfg.logger)
    world = launched_world_size()  # torchrun's; 1 without it
    if world % cfg.parallel.context:
        raise ConfigError(f"parallel.context={cfg.parallel.context}: must divide the number of processes ({world}; "
                          f"torchrun --nproc_per_node x nodes)")


def check_device(cfg: TrainConfig) -> None:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda: no CUDA GPU is visible; use device=cpu or device=auto")
    if cfg.torch_device().type == "cpu" and cfg.compute_dtype() == torch.float16:
        raise ConfigError("dtype=float16: not on CPU; use dtype=auto (float32) or bfloat16")


def check_attention_fits(cfg: TrainConfig) -> None:
    """The backend's own capability check on this run's device (under torchrun, this process's GPU), dtype and
    head_dim, GQA and masks."""
    name = cfg.attention.name
    masks, gqa = cfg.masks(), cfg.gqa()
    device = cfg.torch_device()
    if device.type == "cuda":
        device = torch.device("cuda", local_gpu())
    reason = get_attention(name, **cfg.attention.options()).unsupported(
        device, cfg.compute_dtype(), cfg.model.head_dim, gqa=bool(gqa), masks=bool(masks))
    if reason:
        raise ConfigError(f"attention={name}: {reason}")
    if cfg.model.keep_attention and not BACKENDS[name].returns_lse:
        with_lse = [n for n, b in BACKENDS.items() if b.returns_lse]
        raise ConfigError(f"model.keep_attention=true: needs a backend that returns its log-sum-exp "
                          f"(attention={' or '.join(with_lse)}), not attention={name}")


def check_context_parallel(cfg: TrainConfig) -> None:
    """Context parallelism is ring attention over our kernel (minigpt/distributed/ring_attention.py), which takes
    what flash takes: windows, document masks and GQA, alone or together (the flash check above covers the device,
    dtype and head_dim). Other backends have no ring."""
    if cfg.parallel.context > 1 and cfg.attention.name != "flash":
        raise ConfigError(f"attention={cfg.attention.name}: context parallelism (parallel.context="
                          f"{cfg.parallel.context}) needs attention=flash (ring attention over our kernel)")


def unwritable(path: str | Path) -> str | None:
    """Why a directory could not be created or written at `path` (its nearest existing ancestor decides), or None."""
    path = Path(path).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):  # root passes, as it may write anywhere; a read-only mount not
        read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        return f"{existing} is {'on a read-only file system' if read_only else 'not writable (permission denied)'}"
    return None


def check_writable(places: list[tuple[str, str | Path]]) -> None:
    """ConfigError naming the first (setting, directory) of `places` that cannot be written."""
    for key, path in places:
        if reason := unwritable(path):
            raise ConfigError(f"{key}={path}: cannot write there: {reason}; point {key} at a writable directory")

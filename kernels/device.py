"""Where the kernels run and what they ask of tensors: Triton's CPU interpreter or a GPU (its compute capability),
16-byte alignment for TMA, the strides the launchers pass. A leaf without triton, so dispatch.py, launch.py,
rotary.py and the Gluon launchers share one answer."""
from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (the tests off the GPU)


@functools.lru_cache(maxsize=16)
def capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability, asked once per device (torch's query costs a few µs per launch)."""
    return torch.cuda.get_device_capability(device)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers' grids. Host code does not call triton.cdiv: it is a constexpr_function, whose
    every call unwraps its arguments (µs per call, and a launch makes several)."""
    return -(-a // b)


def strides3(t: Tensor) -> tuple[int, int, int]:
    """A (B, H, N, D) tensor's batch, head and row strides (its last dimension is contiguous)."""
    return t.stride()[:3]


def tma_ready(*tensors: Tensor) -> bool:
    """TMA needs 16-byte aligned bases and strides (but the last, contiguous dimension's): (B, H, N, D) tiles whose
    head bases and rows are aligned, (B, H, N) LSE/delta whose head rows are. Views that break this take the pointer
    path."""
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or any(stride * size % 16 for stride in t.stride()[:-1]):
            return False
    return True


def staged_by_tma(head_dim: int, *outputs: Tensor, accumulate: bool) -> bool:
    """Whether a Gluon kernel writes these outputs through shared memory by TMA (the forward's O_TMA, the backward's
    DKDV_TMA) rather than by stores from registers: at head_dim 64, where a [64, 64] staging buffer per consumer fits
    beside the ring (at 128 shared memory is full), for outputs written fresh (not added into), 2-byte and
    TMA-aligned. Stores from registers held up each item's end: by TMA 1K windows ran 5% faster fwd+bwd and the short
    forwards 3-6% (kernels/NOTES.md, sessions 17 and 18)."""
    return head_dim == 64 and not accumulate and all(t.element_size() == 2 for t in outputs) and tma_ready(*outputs)


def tma_scratch(size: int, alignment: int, stream: int | None) -> Tensor:
    """Triton's scratch allocator for TMA descriptors made on the device (triton.set_allocator)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")

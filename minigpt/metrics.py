"""FLOP counts, MFU and GPU memory: the numbers every run reports.

Conventions (DESIGN.md): attention forward = 4·B·H·N²·D (halved when causal), backward = 2.5 × forward
(it recomputes the scores); a training step costs 6·params·tokens plus the attention FLOPs of every layer.
"""
from __future__ import annotations

import torch

# Dense bf16 tensor-core peak in TFLOP/s by the vendors' datasheets, matched by substring of the device name.
GPU_PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A10G": 70.0,
    "L40S": 362.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
}


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool = True, pass_: str = "fwd") -> float:
    """FLOPs of one attention call: pass_ is 'fwd', 'bwd' or 'fwd+bwd'."""
    fwd = 4.0 * batch * heads * seq_len * seq_len * head_dim * (0.5 if causal else 1.0)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}[pass_]


def train_step_flops(n_params: int, n_layer: int, n_head: int, head_dim: int, batch: int, seq_len: int) -> float:
    """FLOPs of one forward+backward over batch×seq_len tokens (dense matmuls plus causal attention)."""
    dense = 6.0 * n_params * batch * seq_len
    return dense + n_layer * attention_flops(batch, n_head, seq_len, head_dim, causal=True, pass_="fwd+bwd")


def peak_tflops(device_name: str) -> float | None:
    for key, tflops in GPU_PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return tflops
    return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


GIB = float(1 << 30)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> tuple[float, float]:
    """(peak allocated, peak reserved) GiB since the last reset; zeros on CPU."""
    if device.type != "cuda":
        return 0.0, 0.0
    return torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB


def versions() -> dict[str, str | None]:
    """torch and triton versions, for the run summary and benchmark files."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version}


def git_commit() -> str | None:
    """The source commit: MINIGPT_COMMIT if set (GPU machines get a copy of the tree whose .git, if any, may be stale),
    else git's."""
    import os
    import subprocess
    from pathlib import Path

    if os.environ.get("MINIGPT_COMMIT"):
        return os.environ["MINIGPT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None

"""Checkpoints: written atomically (temp file + rename), found again by `resume=auto`.

A checkpoint holds what a resumed run needs to continue exactly where it stopped: model and
optimizer state, the step (which is also the data position and the schedule position, since
batches and learning rate are functions of the step) and the RNG states.
"""
from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

_NAME = re.compile(r"^ckpt_(\d+)\.pt$")


def save_checkpoint(ckpt_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    config: dict[str, Any], keep: int = 2) -> Path:
    """Write ckpt_<step>.pt atomically and keep only the newest `keep` checkpoints."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "config": config,
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
    }
    path = ckpt_dir / f"ckpt_{step:08d}.pt"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)
    for old in list_checkpoints(ckpt_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Checkpoints in ckpt_dir, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def find_checkpoint(resume: str, ckpt_dir: str | Path) -> Path | None:
    """The checkpoint `resume` points to: none -> None; auto -> latest in ckpt_dir (or None); a file or dir."""
    if resume == "none":
        return None
    if resume == "auto":
        found = list_checkpoints(ckpt_dir)
        return found[-1] if found else None
    path = Path(resume)
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise FileNotFoundError(f"resume={resume}: no ckpt_*.pt in that directory")
        return found[-1]
    return path


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore model, optimizer and RNG states; returns the step to continue from."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    return int(state["step"])

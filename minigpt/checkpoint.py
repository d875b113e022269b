"""Checkpoints: the training state, saved atomically, verified on load, with fallback to an older intact one.

A checkpoint holds what a resumed run needs to continue exactly where it stopped: model and optimizer state,
the step (which is also the data position and the schedule position, since batches and learning rate are
functions of the step), the RNG states and the run's config. Each `ckpt_<step>.pt` has a small manifest
`ckpt_<step>.json` with its size and BLAKE2b digest, written after it: a truncated, overwritten or bit-rotted
file is detected before torch ever unpickles it. (Activation recomputation is something else: minigpt/levers.py.)
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import sys
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
import torch

from minigpt.config import ConfigError
from minigpt.files import atomic_write, atomic_write_text

_NAME = re.compile(r"^ckpt_(\d+)\.pt$")
ARCHITECTURE_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size", "rope_base")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or used; the message names the file and says what to do."""


class _Hashing:
    """A write-through file wrapper that hashes what passes, so the digest costs no second read."""

    def __init__(self, f: BinaryIO):
        self.f, self.digest, self.size = f, hashlib.blake2b(), 0
        self.error: OSError | None = None  # torch.save reports a failed write as a RuntimeError; keep the OS's reason

    def write(self, b: bytes) -> int:
        self.digest.update(b)
        self.size += len(b)
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _manifest(path: Path) -> Path:
    return path.with_suffix(".json")


def step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Checkpoints in ckpt_dir, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted((p for p in ckpt_dir.iterdir() if _NAME.match(p.name)), key=step_of)


def save_checkpoint(ckpt_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    config: dict[str, Any], keep: int = 2) -> Path:
    """Write ckpt_<step>.pt and its manifest atomically, then keep only the newest `keep` checkpoints.

    A failed write (disk full, say) raises WriteError and leaves the earlier checkpoints as they were.
    """
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
    path = Path(ckpt_dir) / f"ckpt_{step:08d}.pt"
    hashing: list[_Hashing] = []

    def write(f: BinaryIO) -> None:
        hashing.append(_Hashing(f))
        try:
            torch.save(state, hashing[0])
        except Exception:
            if hashing[0].error is not None:
                raise hashing[0].error from None  # e.g. ENOSPC: "disk full", not torch's "unexpected pos"
            raise

    atomic_write(path, write)
    atomic_write_text(_manifest(path), json.dumps({"step": step, "bytes": hashing[0].size,
                                                   "blake2b": hashing[0].digest.hexdigest()}) + "\n")
    for old in list_checkpoints(ckpt_dir)[:-keep]:
        old.unlink(missing_ok=True)
        _manifest(old).unlink(missing_ok=True)
    return path


def _verify(path: Path) -> None:
    """Raise CheckpointError if the file does not match its manifest (size, then digest)."""
    manifest = _manifest(path)
    if not manifest.exists():
        return  # written by an older minigpt, or the manifest was lost: torch.load still checks the zip
    try:
        expected = json.loads(manifest.read_text())
        size, digest = int(expected["bytes"]), str(expected["blake2b"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest}: unreadable manifest ({e})") from e
    actual = path.stat().st_size
    if actual != size:
        raise CheckpointError(f"{path} is truncated or overwritten ({actual:,} bytes, its manifest says {size:,})")
    h = hashlib.blake2b()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    if h.hexdigest() != digest:
        raise CheckpointError(f"{path} is corrupt (its contents do not match the digest in {manifest.name})")


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The training state in `path`, verified; CheckpointError (one line) if it is damaged or not a checkpoint."""
    _verify(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a damaged zip or pickle raises many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is unreadable (truncated or corrupt: {first[:100]})") from e
    missing = {"step", "model", "optimizer", "rng"} - set(state) if isinstance(state, dict) else {"everything"}
    if missing:
        raise CheckpointError(f"{path} is not a minigpt checkpoint (no {', '.join(sorted(missing))})")
    return state


def find_and_load(resume: str, ckpt_dir: str | Path, warn: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
                  ) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint `resume` asks for, loaded: none -> None; auto -> newest intact in ckpt_dir (None if there
    are none); a directory -> newest intact there; a file -> that file.

    A damaged newest checkpoint is skipped, and the next older one is tried; falling back prints one warning
    naming the damaged file(s). If none is intact, CheckpointError says so.
    """
    if resume == "none":
        return None
    target = Path(ckpt_dir) if resume == "auto" else Path(resume)
    if target.is_file():
        return target, load_checkpoint(target)
    found = list_checkpoints(target)
    if not found:
        if resume == "auto":
            return None
        raise CheckpointError(f"resume={resume}: no ckpt_*.pt in that directory")
    damaged = []
    for path in reversed(found):
        try:
            state = load_checkpoint(path)
        except CheckpointError as e:
            damaged.append(str(e))
            continue
        if damaged:
            warn(f"warning: skipping damaged checkpoint(s): {'; '.join(damaged)}; resuming from the older {path}")
        return path, state
    raise CheckpointError(f"no intact checkpoint in {target} ({len(damaged)} damaged, newest: {damaged[0]}); "
                          f"start a new run (resume=none in a new directory)")


def restore(state: dict[str, Any], path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            model_config: dict[str, Any]) -> int:
    """Put the checkpoint's model, optimizer and RNG states in place; returns the step to continue from.

    A checkpoint of another model size is a bad setting (ConfigError naming the keys that differ).
    """
    saved = (state.get("config") or {}).get("model") or {}
    differ = [k for k in ARCHITECTURE_KEYS if k in saved and saved[k] != model_config.get(k)]
    if differ:
        was = ", ".join(f"model.{k}={saved[k]}" for k in differ)
        now = ", ".join(f"model.{k}={model_config.get(k)}" for k in differ)
        raise ConfigError(f"resume: {path} was written with {was}, this run has {now}; resume with the same model "
                          f"settings, or start a new run (resume=none in a new directory)")
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise ConfigError(f"resume: {path} does not fit this model ({str(e).strip().splitlines()[0][:120]}); resume "
                          f"with the settings it was written with, or start a new run") from e
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    return int(state["step"])

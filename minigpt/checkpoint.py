"""Checkpoints: the training state, saved atomically, verified on load, with fallback to an older intact one.

A checkpoint holds what a resumed run needs to continue exactly where it stopped: model and optimizer state,
the step (which is also the data position and the schedule position, since batches and learning rate are
functions of the step), the RNG states and the run's config. Each `ckpt_<step>.pt` has a small manifest
`ckpt_<step>.json` with its size and BLAKE2b digest, written after it: a truncated, overwritten or bit-rotted
file is detected before torch ever reads it. (Activation recomputation is something else: minigpt/levers.py.)

The format (FORMAT = 2) holds only tensors and plain types (dict, list, tuple, str, int, float, bool, None):

    {"format": 2, "step": int, "model": state_dict, "optimizer": state_dict, "config": {...plain...},
     "rng": {"torch": uint8 tensor, "cuda": [uint8 tensor, ...] | None,
             "numpy": {"bit_generator": str, "state": int64 tensor, "pos": int, "has_gauss": int,
                       "cached_gaussian": float},
             "python": {"version": int, "state": int64 tensor, "gauss_next": float | None}}}

so every load (`load_checkpoint`, the one loader) uses `torch.load(weights_only=True)`, which cannot run code.
A file that needs more than that to load (a checkpoint of an earlier minigpt, whose RNG states were pickled
numpy and Python objects, or anything else that asks the unpickler for a function) is refused with
UnsafeCheckpointError, never skipped over for an older one. For a file the user trusts, a one-time converter:

    python -m minigpt.checkpoint upgrade PATH --trust      # PATH: a ckpt_*.pt or a directory of them
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import pickletools
import random
import re
import shutil
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, TypedDict

import numpy as np
import torch

from minigpt.config import ROPE_KEYS, ConfigError
from minigpt.files import WriteError, atomic_write, atomic_write_text, remove_stale_temps
from minigpt.summary import SUMMARY_FILE

FORMAT = 2  # 1 (no "format" key): minigpt up to e668b53, RNG states pickled as numpy/Python objects
_NAME = re.compile(r"^ckpt_(\d+)\.pt$")
ARCHITECTURE_KEYS = ("n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size", "window", "window_pattern", *ROPE_KEYS)
# a checkpoint written before these keys existed had these values (plain RoPE; all heads, no window)
ROPE_DEFAULTS = {"rope_scaling": "none", "rope_factor": 1.0, "rope_original_len": None}
ATTENTION_DEFAULTS = {"n_kv_head": None, "window": None, "window_pattern": None}
UPGRADE = "python -m minigpt.checkpoint upgrade {path} --trust"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or used; the message names the file and says what to do."""


class UnsafeCheckpointError(CheckpointError, ConfigError):
    """A file that only an unpickler allowed to run code could load: refused (a bad setting, exit code 2)."""


class CheckpointState(TypedDict):
    """What load_checkpoint returns (see the module docstring for the types inside)."""

    format: int
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    config: dict[str, Any]
    rng: dict[str, Any]


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
    """Paths named like checkpoints in ckpt_dir, oldest first (whether they are intact is for the loader)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted((p for p in ckpt_dir.iterdir() if _NAME.match(p.name)), key=step_of)


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------
def _plain(x: Any) -> Any:
    """x with containers as dict/list and leaves as str/int/float/bool/None (others, e.g. a Path, as str)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def _rng_plain(torch_state: torch.Tensor, cuda: list[torch.Tensor] | None, numpy_state: tuple, python_state: tuple
               ) -> dict[str, Any]:
    """The RNG states as tensors and plain types (what np.random.get_state() and random.getstate() give, converted)."""
    kind, keys, pos, has_gauss, cached = numpy_state
    version, internal, gauss_next = python_state
    return {
        "torch": torch_state,
        "cuda": cuda,
        "numpy": {"bit_generator": str(kind), "state": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": None if gauss_next is None else float(gauss_next)},
    }


def _state(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any]
           ) -> dict[str, Any]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    rng = _rng_plain(torch.get_rng_state(), cuda, np.random.get_state(), random.getstate())
    return {"format": FORMAT, "step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "config": _plain(config), "rng": rng}


def _write(path: Path, state: dict[str, Any]) -> Path:
    """torch.save(state) to path atomically, then its manifest (size and digest, computed while writing)."""
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
    atomic_write_text(_manifest(path), json.dumps({"step": state["step"], "bytes": hashing[0].size,
                                                   "blake2b": hashing[0].digest.hexdigest()}) + "\n")
    return path


def save_checkpoint(ckpt_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    config: dict[str, Any], keep: int = 2) -> Path:
    """Write ckpt_<step>.pt and its manifest atomically, then keep only the newest `keep` checkpoints.

    A failed write (disk full, say) raises WriteError and leaves the earlier checkpoints as they were.
    Temp files of earlier saves killed mid-write are removed first (one line each).
    """
    remove_stale_temps(ckpt_dir)
    path = _write(Path(ckpt_dir) / f"ckpt_{step:08d}.pt", _state(step, model, optimizer, config))
    saved = [p for p in list_checkpoints(ckpt_dir) if p.is_file()]  # a directory with such a name is not ours
    for old in saved[:-keep]:
        old.unlink(missing_ok=True)
        _manifest(old).unlink(missing_ok=True)
    return path


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------
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


def _pickle_globals(path: Path) -> list[str] | None:
    """The functions and classes the pickle in `path` asks for (a torch zip's data.pkl, or the file itself), without
    running any of it; None if it is not a well-formed pickle (a damaged file rather than an unsafe one)."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                data = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"))
        else:
            data = path.read_bytes()
        names, strings = [], []
        for op, arg, _ in pickletools.genops(data):
            if isinstance(arg, str):
                strings.append(arg)
            if op.name in ("GLOBAL", "INST"):
                names.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL":
                names.append(".".join(strings[-2:]))
    except Exception:  # noqa: BLE001 - any failure to parse means: not a well-formed pickle
        return None
    return names


def _unsafe(path: Path, names: list[str]) -> UnsafeCheckpointError:
    shown = sorted({n for n in names if not n.startswith(("torch.", "collections.OrderedDict"))})
    needs = f" (it asks for {', '.join(shown[:3])}{', ...' if len(shown) > 3 else ''})" if shown else ""
    return UnsafeCheckpointError(
        f"{path} needs code to run to load{needs}: a checkpoint of an earlier minigpt, or not a minigpt checkpoint; "
        f"refused. Only if you trust where it came from, convert it once: {UPGRADE.format(path=path)}")


def _check(path: Path, state: Any) -> CheckpointState:
    """CheckpointError unless `state` has the keys and RNG layout of FORMAT."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a minigpt checkpoint (it holds a {type(state).__name__})")
    missing = {"format", "step", "model", "optimizer", "rng"} - set(state)
    if missing:
        raise CheckpointError(f"{path} is not a minigpt checkpoint (no {', '.join(sorted(missing))})")
    if state["format"] != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {state['format']!r}, this minigpt reads format {FORMAT}")
    rng = state["rng"]
    try:
        assert isinstance(rng["torch"], torch.Tensor) and isinstance(rng["numpy"]["state"], torch.Tensor)
        assert isinstance(rng["python"]["state"], torch.Tensor)
    except (AssertionError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is not a minigpt checkpoint (its RNG states are incomplete)") from e
    return state  # type: ignore[return-value]


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> CheckpointState:
    """The training state in `path`, verified, loaded with torch.load(weights_only=True) (no code can run).

    Raises UnsafeCheckpointError (one line naming the converter; a ConfigError too, so the CLI exits 2) if the
    file would need an unpickler allowed to run code, and CheckpointError (one line) if it is damaged, not a
    file, or not a minigpt checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} is not a checkpoint file ({'a directory' if path.is_dir() else 'missing'})")
    _verify(path)
    try:
        with warnings.catch_warnings():  # torch warns (on stderr) about pickle protocols it did not write
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # a damaged zip or pickle raises many types
        if isinstance(e, pickle.UnpicklingError) and (names := _pickle_globals(path)) is not None:
            raise _unsafe(path, names) from None  # a well-formed pickle the weights-only unpickler refused
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is unreadable (truncated or corrupt: {first[:100]})") from None
    return _check(path, state)


def recorded_checkpoint(run_dir: str | Path | None) -> Path | None:
    """The checkpoint the run in run_dir last recorded in its summary (summary.json, else the newest earlier
    attempt's summary.attempt<k>.json that names one), if that file exists."""
    if run_dir is None:
        return None
    run_dir = Path(run_dir)
    attempts = sorted(run_dir.glob("summary.attempt*.json"),
                      key=lambda p: int(re.sub(r"\D", "", p.name) or 0), reverse=True)
    for summary in (run_dir / SUMMARY_FILE, *attempts):
        try:
            recorded = json.loads(summary.read_text()).get("checkpoint")
        except (OSError, ValueError, AttributeError):
            continue
        if recorded:
            return Path(recorded) if Path(recorded).is_file() and _NAME.match(Path(recorded).name) else None
    return None


def resume_candidates(ckpt_dir: str | Path, run_dir: str | Path | None) -> list[Path]:
    """What resume=auto chooses from, oldest first: the checkpoints in ckpt_dir, and the one the run recorded last
    if it is newer than those (it is elsewhere when an earlier attempt wrote to another ckpt_dir, e.g. after its
    disk filled up; a copied run directory's summary names the original's files, which are then not newer)."""
    found = list_checkpoints(ckpt_dir)
    recorded = recorded_checkpoint(run_dir)
    if recorded is not None and (not found or step_of(recorded) > step_of(found[-1])):
        found.append(recorded)
    return found


def newest_intact(candidates: list[Path], warn: Callable[[str], None] | None = None) -> tuple[Path, CheckpointState]:
    """The newest of `candidates` (oldest first, not empty) that loads, with its state. A damaged one is skipped
    for the next older one (one warning naming the damaged files, if `warn`), and if none is intact,
    CheckpointError says so; an unsafe one is refused (UnsafeCheckpointError), never skipped."""
    damaged = []
    for path in reversed(candidates):
        try:
            state = load_checkpoint(path)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as e:
            damaged.append(str(e))
            continue
        if damaged and warn:
            warn(f"warning: skipping damaged checkpoint(s): {'; '.join(damaged)}; resuming from the older {path}")
        return path, state
    where = ", ".join(sorted({str(p.parent) for p in candidates}))
    raise CheckpointError(f"no intact checkpoint in {where} ({len(damaged)} damaged, newest: {damaged[0]}); "
                          f"start a new run (resume=none in a new directory)")


def find_and_load(resume: str, ckpt_dir: str | Path, warn: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
                  run_dir: str | Path | None = None) -> tuple[Path, CheckpointState] | None:
    """The checkpoint `resume` asks for, loaded: none -> None; auto -> the newest intact of ckpt_dir's and the one
    run_dir's summary recorded (None if there are none); a directory -> newest intact there; a file -> that file.

    A damaged newest checkpoint is skipped, and the next older one is tried; falling back prints one warning
    naming the damaged file(s). If none is intact, CheckpointError says so. A file that needs code to load is
    refused (UnsafeCheckpointError), not skipped.
    """
    if resume == "none":
        return None
    target = Path(ckpt_dir) if resume == "auto" else Path(resume)
    if resume != "auto" and target.is_file():
        return target, load_checkpoint(target)
    found = resume_candidates(target, run_dir) if resume == "auto" else list_checkpoints(target)
    if not found:
        if resume == "auto":
            return None
        raise CheckpointError(f"resume={resume}: no ckpt_*.pt in that directory")
    return newest_intact(found, warn)


def _saved_model(state: CheckpointState) -> dict[str, Any]:
    saved = (state.get("config") or {}).get("model") or {}
    if "n_head" in saved:
        saved = {**ATTENTION_DEFAULTS, **saved}
    return {**ROPE_DEFAULTS, **saved} if "rope_base" in saved else saved


def _architecture(model: dict[str, Any], key: str) -> Any:
    """A model config's value of an architecture key; n_kv_head null is n_head (the same model)."""
    if key == "n_kv_head":
        return model.get("n_kv_head") or model.get("n_head")
    return model.get(key)


def extension(state: CheckpointState, config: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """The RoPE settings and seq_len that differ between the checkpoint's config and this run's (`config`, the
    resolved config dict), as {"from": {...}, "to": {...}} with keys model.rope_* and seq_len; None when none do."""
    saved_config = state.get("config") or {}
    saved, now = _saved_model(state), config.get("model") or {}
    keys = [(f"model.{k}", saved.get(k), now.get(k)) for k in ROPE_KEYS if k in saved]
    if "seq_len" in saved_config:
        keys.append(("seq_len", saved_config["seq_len"], config.get("seq_len")))
    changed = [(k, a, b) for k, a, b in keys if a != b]
    return {"from": {k: a for k, a, _ in changed}, "to": {k: b for k, _, b in changed}} if changed else None


def restore(state: CheckpointState, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            model_config: dict[str, Any], extend: bool = False) -> int:
    """Put the checkpoint's model, optimizer and RNG states in place; returns the step to continue from.

    A checkpoint of another model size, attention (key/value heads, window) or RoPE is a bad setting (ConfigError
    naming the keys that differ); with `extend` (resume_extend=true, a length-extension stage) the RoPE settings
    (config.ROPE_KEYS) may differ.
    """
    saved = _saved_model(state)
    keys = [k for k in ARCHITECTURE_KEYS if not (extend and k in ROPE_KEYS)]
    differ = [k for k in keys if k in saved and _architecture(saved, k) != _architecture(model_config, k)]
    if differ:
        was = ", ".join(f"model.{k}={saved[k]}" for k in differ)
        now = ", ".join(f"model.{k}={model_config.get(k)}" for k in differ)
        hint = "" if extend or not set(differ) <= set(ROPE_KEYS) else \
            " (or resume_extend=true for a length-extension stage)"
        raise ConfigError(f"resume: {path} was written with {was}, this run has {now}; resume with the same model "
                          f"settings{hint}, or start a new run (resume=none in a new directory)")
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
    n, py = rng["numpy"], rng["python"]
    np.random.set_state((n["bit_generator"], n["state"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    return int(state["step"])


# --------------------------------------------------------------------------------------------
# the converter: python -m minigpt.checkpoint upgrade PATH --trust
# --------------------------------------------------------------------------------------------
def _upgraded(path: Path, old: Any) -> dict[str, Any]:
    """A format-1 state (as e668b53 wrote it) in FORMAT; CheckpointError if it is not one."""
    try:
        rng = old["rng"]
        state = {"format": FORMAT, "step": int(old["step"]), "model": old["model"], "optimizer": old["optimizer"],
                 "config": _plain(old.get("config") or {}),
                 "rng": _rng_plain(rng["torch"], rng["cuda"], rng["numpy"], rng["python"])}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a checkpoint of an earlier minigpt ({type(e).__name__}: {e}); "
                              f"not converted") from e
    return state


def upgrade(path: Path, say: Callable[[str], None] = print) -> bool:
    """Convert one trusted checkpoint to FORMAT in place (the original kept as <name>.bak); False if it already
    was. Loads it with weights_only=False: call it only for files the user said they trust."""
    try:
        load_checkpoint(path)
        say(f"{path}: already in format {FORMAT} (loads with weights_only=True); nothing changed")
        return False
    except UnsafeCheckpointError:  # verified against its manifest, and needs the unpickler that runs code
        pass
    backup = path.with_name(path.name + ".bak")
    if backup.exists():
        raise CheckpointError(f"{backup} exists (an earlier upgrade's?); move it aside, then run the upgrade again")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            old = torch.load(path, map_location="cpu", weights_only=False)  # noqa: S614 - the user vouched for it
    except Exception as e:  # noqa: BLE001 - whatever the file's code raised
        raise CheckpointError(f"{path} does not load even with --trust ({type(e).__name__}: {e}); not converted") from e
    state = _upgraded(path, old)
    with open(path, "rb") as src:
        atomic_write(backup, lambda f: shutil.copyfileobj(src, f))
    _manifest(path).unlink(missing_ok=True)  # until the new one is written, the zip's own checks stand alone
    _write(path, state)
    load_checkpoint(path)  # it must now load the safe way
    say(f"upgraded {path} (step {state['step']}) to checkpoint format {FORMAT}: RNG states and config as tensors "
        f"and plain types, so it loads with weights_only=True; the original is kept as {backup}")
    return True


def main(argv: list[str] | None = None) -> int:
    """`python -m minigpt.checkpoint upgrade PATH --trust`: 0 done, 1 a file that cannot be converted, 2 refused."""
    p = argparse.ArgumentParser(prog="python -m minigpt.checkpoint", description="Checkpoint tools.")
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("upgrade", help="convert checkpoints of an earlier minigpt (that load only by running code) "
                                        "to the current format; for files you trust only")
    up.add_argument("path", type=Path, help="a ckpt_*.pt, or a directory: each ckpt_*.pt in it")
    up.add_argument("--trust", action="store_true", help="I trust these files: load them with weights_only=False")
    args = p.parse_args(argv)
    paths = [p for p in list_checkpoints(args.path) if p.is_file()] if args.path.is_dir() else [args.path]
    if not args.path.exists() or not paths:
        print(f"error: {args.path}: no checkpoint there (give a ckpt_*.pt or a directory of them)", file=sys.stderr)
        return 2
    if not args.trust:
        print(f"error: refused: upgrading loads {args.path} with an unpickler that can run any code in it; only if "
              f"you trust where it came from, add --trust", file=sys.stderr)
        return 2
    try:
        for path in paths:
            upgrade(path)
    except (CheckpointError, WriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

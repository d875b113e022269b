"""--export DIR / --import DIR: the recipe's progress carried to a fresh machine in a few small files.

A machine that is given back takes its disk along, and what comes back from one may be small (on the GPU machines
this recipe was planned for: at most 8 files of 16 MiB). An export is

    recipe_state.json         the state (state.py)
    recipe_files.tar.gz       every other file of the output directory under SMALL_FILE bytes but the checkpoints:
                              the log, each command's output, summaries, metrics, tokenizers, corpus manifests,
                              Hydra records, the evaluations; and the W&B offline runs of the trainer and of
                              minigpt-eval --wandb (each wandb/offline-run-*/'s .wandb file and files/, not W&B's
                              logs/ and symlinks: minigpt/wandb_offline.py), as many as keep the tar within
                              TAR_BYTES, the largest runs left out first and named in one line
    weights.json, weights.NN  the newest checkpoint of the live run (state.live: the one model still to be trained
                              or read) as bf16 weights: the tensors' bytes, all high bytes (sign and exponent, which
                              compress well) then all low bytes, zlib, cut into parts of at most PART_BYTES; the
                              manifest has the tensors, their shapes, tied names, the checkpoint's step and config,
                              each part's size and digest, and AdamW's state in a few numbers (its step, each
                              parameter's mean second moment)

small-6l's 21.0M parameters are 40 MiB in bf16, 28 MiB compressed as initialized. An import unpacks the files (the
W&B runs back where they were, byte for byte) and rebuilds that checkpoint with the trainer's own save_checkpoint:
the weights back in fp32, AdamW restarted from its step and mean second moments with a first moment of zero
(restart_adam: about ten steps of warmup, no full-size first step). The run then resumes from it (resume=auto) at
the same step, with the same batches (a batch is a function of the step) and the same schedule; what is lost is the
weights' bits below bf16 and the optimizer's moments beyond those means, so hand off where a stage ends when you
can. An import is skipped when the directory's own state is as new (a machine that kept its disk), unless the
directory lacks the checkpoint the export's weights are of while its state is at that step (given the state alone,
or its checkpoints lost): then only that checkpoint is rebuilt. An export whose state has a model and no
weights.json is refused (a copy that missed a file).
"""
from __future__ import annotations

import hashlib
import json
import sys
import tarfile
import zlib
from dataclasses import asdict
from pathlib import Path, PurePath
from typing import Callable

import numpy as np
import torch

from minigpt.checkpoint import CheckpointError, list_checkpoints, newest_intact, save_checkpoint, step_of
from minigpt.config import TrainConfig
from minigpt.files import atomic_write, atomic_write_text
from minigpt.recipe.plan import Plan, Run
from minigpt.recipe.state import STATE_FILE, RecipeError, RecipeState
from minigpt.wandb_offline import run_folder

FILES_TAR = "recipe_files.tar.gz"
WEIGHTS = "weights.json"
PART_BYTES = 15 << 20
TAR_BYTES = PART_BYTES  # recipe_files.tar.gz: one file of the export like a part, under the machines' 16 MiB
SMALL_FILE = 8 << 20  # larger files stay behind (none of the recipe's own are)
LEFT_OUT_DIRS = {"checkpoints", "wandb"}  # of wandb/, the offline runs travel (run_folder)
LEFT_OUT_NAMES = {"run.lock", STATE_FILE}


# --------------------------------------------------------------------------------------------
# weights <-> bytes
# --------------------------------------------------------------------------------------------
def pack_weights(model: dict[str, torch.Tensor]) -> tuple[bytes, list[dict], dict[str, str]]:
    """(compressed bytes, [{"name", "shape"}] in their order, {tied name: the name it shares its tensor with}) of a
    model state dict, every tensor in bf16."""
    tensors, tied, seen = [], {}, {}
    for name, t in model.items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:  # the tied LM head: the embedding's own tensor
            tied[name] = seen[key]
            continue
        if not t.is_floating_point():
            raise RecipeError(f"{name} is {t.dtype}: only floating-point weights can be handed off")
        seen[key] = name
        tensors.append((name, t))
    flat = torch.cat([t.detach().reshape(-1).to(torch.bfloat16) for _, t in tensors])
    pairs = flat.view(torch.int16).numpy().view(np.uint8).reshape(-1, 2)  # little-endian: [low, high]
    planes = pairs[:, 1].tobytes() + pairs[:, 0].tobytes()
    return zlib.compress(planes, 6), [{"name": n, "shape": list(t.shape)} for n, t in tensors], tied


def unpack_weights(blob: bytes, tensors: list[dict], tied: dict[str, str]) -> dict[str, torch.Tensor]:
    """The fp32 state dict pack_weights packed (tied names share one tensor)."""
    planes = np.frombuffer(zlib.decompress(blob), dtype=np.uint8)
    n = len(planes) // 2
    pairs = np.empty((n, 2), dtype=np.uint8)
    pairs[:, 1], pairs[:, 0] = planes[:n], planes[n:]
    flat = torch.from_numpy(pairs.reshape(-1).view(np.int16).copy()).view(torch.bfloat16).float()
    out, at = {}, 0
    for t in tensors:
        size = int(np.prod(t["shape"], dtype=np.int64))
        out[t["name"]] = flat[at : at + size].view(t["shape"])
        at += size
    if at != len(flat):
        raise RecipeError(f"the weights hold {len(flat)} values, their manifest {at}: not the same export")
    out.update({name: out[target] for name, target in tied.items()})
    return out


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data).hexdigest()


def adam_summary(optimizer: dict) -> dict | None:
    """AdamW's state in a few numbers: its step and each parameter's mean second moment (in the optimizer's order),
    None for an optimizer that has taken no step."""
    state = [optimizer["state"][k] for k in sorted(optimizer["state"], key=int)]
    if not state or any("exp_avg_sq" not in s for s in state):
        return None
    return {"step": float(state[0]["step"]), "exp_avg_sq_mean": [float(s["exp_avg_sq"].float().mean()) for s in state]}


def restart_adam(optimizer: torch.optim.Optimizer, summary: dict | None) -> None:
    """Give a fresh AdamW the step and the mean second moments of `summary`, and a first moment of zero: with no bias
    correction left to undo at that step, its first update is a tenth of a normal one and grows as the first moment
    fills (beta1 = 0.9): a warmup of about ten steps instead of a full-size first step."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if summary is None or len(summary["exp_avg_sq_mean"]) != len(params):
        return
    step = torch.tensor(summary["step"], dtype=torch.float32)
    state = {i: {"step": step.clone(), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.full_like(p, v)}
             for i, (p, v) in enumerate(zip(params, summary["exp_avg_sq_mean"]))}
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------
def _small_files(out: Path, dest: Path) -> tuple[list[Path], list[Path], list[str]]:
    """The files of `out` that travel in the tar: the recipe's own, the W&B offline runs' (run_folder: each .wandb
    file and files/); and the large ones that do not ("path (size)"). Symlinks stay behind."""
    files, wandb_files, large = [], [], []
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out)
        in_run = run_folder(rel) is not None
        if path.is_symlink() or not path.is_file() or (LEFT_OUT_DIRS & set(rel.parts) and not in_run) or \
                path.name in LEFT_OUT_NAMES or ".tmp" in path.name or path.resolve().is_relative_to(dest.resolve()):
            continue
        if path.stat().st_size > SMALL_FILE:
            large.append(f"{rel} ({path.stat().st_size / 2**20:.0f} MiB)")
        else:
            (wandb_files if in_run else files).append(path)
    return files, wandb_files, large


def write_files_tar(out: Path, dest: Path, files: list[Path], wandb_files: list[Path],
                    say: Callable[[str], None]) -> Path:
    """recipe_files.tar.gz in `dest`: `files`, and as many whole W&B runs of `wandb_files` as keep it within
    TAR_BYTES, the largest runs left out first (said in one line): a run without its .wandb file is no run."""
    runs: dict[PurePath, list[Path]] = {}
    for p in wandb_files:
        runs.setdefault(run_folder(p.relative_to(out)), []).append(p)

    def size(run: PurePath) -> int:
        return sum(p.stat().st_size for p in runs[run])
    kept, left = sorted(runs, key=size), []

    def tar(f) -> None:
        with tarfile.open(fileobj=f, mode="w:gz") as t:
            for path in files + [p for run in kept for p in runs[run]]:
                t.add(path, arcname=str(path.relative_to(out)))
    while True:
        path = atomic_write(dest / FILES_TAR, tar)
        over = path.stat().st_size - TAR_BYTES
        if over <= 0 or not kept:
            break
        while kept and over > 0:  # the largest runs out until what they add compressed covers the excess
            left.append(kept.pop())
            over -= sum(len(zlib.compress(p.read_bytes(), 9)) for p in runs[left[-1]])
    if left:
        say(f"export: left out {len(left)} W&B run(s) to keep {FILES_TAR} within {TAR_BYTES / 2**20:g} MiB: " +
            ", ".join(f"{run} ({size(run):,} bytes)" for run in left))
    if over > 0:
        say(f"export: {FILES_TAR} is {path.stat().st_size / 2**20:.1f} MiB without W&B runs, over the "
            f"{TAR_BYTES / 2**20:g} MiB a file of the export should be")
    return path


def export(out: Path, dest: Path, state: RecipeState, plan: Plan, say: Callable[[str], None] = print) -> list[Path]:
    """Write the export of `out` into `dest` (module docstring); returns the files written. An export that cannot be
    made (no checkpoint of the live run) is refused before an earlier export in `dest` is touched."""
    live = state.live(plan)
    newest = live_checkpoint(out, live) if live is not None else None
    dest.mkdir(parents=True, exist_ok=True)
    # the state goes last, atomically: it is what an import reads first, so an export cut short leaves the old
    # state (or none) beside the new files, never a newer state without its files
    for old in [dest / STATE_FILE, *dest.glob("weights.*"), dest / FILES_TAR]:
        old.unlink(missing_ok=True)
    files, wandb_files, large = _small_files(out, dest)
    written = [write_files_tar(out, dest, files, wandb_files, say)]
    if large:
        say(f"export: left out {len(large)} large file(s): {', '.join(large)}")
    if live is not None:
        written += write_weights(*newest, live, dest)
    written.append(atomic_write_text(dest / STATE_FILE, (out / STATE_FILE).read_text()))
    if live is not None:
        say(f"export: {dest} holds the recipe's files and {live.name}'s weights at step "
            f"{json.loads((dest / WEIGHTS).read_text())['step']} ({len(written)} files, "
            f"{sum(p.stat().st_size for p in written) / 2**20:.1f} MiB)")
    else:
        say(f"export: {dest} holds the recipe's files (no model yet)")
    return written


def live_checkpoint(out: Path, run: Run) -> tuple[Path, dict]:
    """The newest intact checkpoint of `run` in `out` (path, loaded); RecipeError if there is none. The state says
    the run has steps only once a checkpoint of them was written, so none here means it was lost."""
    ckpt_dir = out / run.folder / "checkpoints"
    candidates = [p for p in list_checkpoints(ckpt_dir) if p.is_file()]
    if not candidates:
        raise RecipeError(f"{ckpt_dir}: no checkpoint of {run.name} to export (a fresh machine, or checkpoints "
                          f"removed?); --import the export that holds it, or start over in a new --out")
    try:
        return newest_intact(candidates, warn=print)
    except CheckpointError as e:
        raise RecipeError(f"export: {e}") from e


def export_weights(out: Path, run: Run, dest: Path) -> list[Path]:
    """weights.NN and weights.json in `dest` of run's newest intact checkpoint in `out`."""
    return write_weights(*live_checkpoint(out, run), run, dest)


def write_weights(path: Path, ckpt: dict, run: Run, dest: Path) -> list[Path]:
    """weights.NN and weights.json in `dest` of the checkpoint `ckpt` (loaded from `path`) of `run`."""
    blob, tensors, tied = pack_weights(ckpt["model"])
    parts = []
    for i in range(0, len(blob), PART_BYTES):
        part = dest / f"weights.{i // PART_BYTES:02d}"
        data = blob[i : i + PART_BYTES]
        atomic_write(part, lambda f, data=data: f.write(data))
        parts.append({"file": part.name, "bytes": len(data), "blake2b": _digest(data)})
    manifest = {"format": 1, "run": run.name, "folder": run.folder, "checkpoint": path.name, "step": ckpt["step"],
                "dtype": "bfloat16", "layout": "high bytes then low bytes, zlib", "byteorder": sys.byteorder,
                "tensors": tensors, "tied": tied, "parts": parts, "config": ckpt["config"],
                "adam": adam_summary(ckpt["optimizer"])}
    atomic_write_text(dest / WEIGHTS, json.dumps(manifest, indent=1) + "\n")
    return [dest / p["file"] for p in parts] + [dest / WEIGHTS]


# --------------------------------------------------------------------------------------------
# import
# --------------------------------------------------------------------------------------------
def import_handoff(src: Path, out: Path, plan: Plan, say: Callable[[str], None] = print) -> None:
    """Bring the export in `src` into `out`, unless out's own state is as new. ConfigError for an export of another
    plan; RecipeError for a damaged or incomplete one."""
    theirs = RecipeState.read(src / STATE_FILE)
    if theirs is None:
        raise RecipeError(f"--import {src}: no {STATE_FILE} there; give the folder an --export wrote")
    theirs.check(plan, out)
    ours = RecipeState.read(out / STATE_FILE)
    if ours is not None and ours.revision >= theirs.revision:
        lacking = _manifest(src, plan) if (src / WEIGHTS).is_file() else None
        if lacking is None or not _lacks(out, ours, *lacking[1:]):
            say(f"--import {src}: {out} is as new (its state's revision {ours.revision}, the export's "
                f"{theirs.revision}); nothing imported")
            return
        manifest, run, step = lacking  # as new, but without the checkpoint the state is at: only that comes in
        path = rebuild_checkpoint(src, manifest, out / run.folder / "checkpoints")
        say(f"--import {src}: {out}'s state is as new (revision {ours.revision}, the export's {theirs.revision}) "
            f"but had no checkpoint of {run.name} at step {step}; it continues from {path} (bf16 weights, fresh "
            f"optimizer moments)")
        return
    if not (src / FILES_TAR).is_file():
        raise RecipeError(f"--import {src}: no {FILES_TAR}; copy every file of the export")
    live = theirs.live(plan)
    if live is not None and not (src / WEIGHTS).is_file():
        raise RecipeError(f"--import {src}: no {WEIGHTS}, and its state has {live.name}'s model (step "
                          f"{theirs.step(live)}); copy every file of the export")
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(src / FILES_TAR) as t:
        unpack(t, out)
    if (src / WEIGHTS).is_file():
        manifest, run, step = _manifest(src, plan)
        path = rebuild_checkpoint(src, manifest, out / run.folder / "checkpoints")
        theirs.runs[run.name] = step
        say(f"--import {src}: {manifest['run']} continues from {path} (step {manifest['step']}; bf16 weights, "
            f"fresh optimizer moments)")
    atomic_write_text(out / STATE_FILE, json.dumps(asdict(theirs), indent=1) + "\n")
    say(f"--import {src}: the recipe's state (revision {theirs.revision}) and files are in {out}")


def _manifest(src: Path, plan: Plan) -> tuple[dict, Run, int]:
    """weights.json of the export in `src`: (manifest, its run, its step); RecipeError if damaged."""
    try:
        manifest = json.loads((src / WEIGHTS).read_text())
        return manifest, plan.run(manifest["run"]), int(manifest["step"])  # its folder from the plan, not the file
    except (ValueError, KeyError, TypeError) as e:
        raise RecipeError(f"--import {src}: {WEIGHTS} is damaged or of another plan ({type(e).__name__}: {e}); "
                          f"export again") from e


def _lacks(out: Path, ours: RecipeState, run: Run, step: int) -> bool:
    """Our state is at `step` of `run`, and `out` has no checkpoint of it that far (the export's weights would do)."""
    ckpts = [p for p in list_checkpoints(out / run.folder / "checkpoints") if p.is_file() and step_of(p) >= step]
    return ours.step(run) == step and not ckpts


def unpack(tar: tarfile.TarFile, out: Path) -> None:
    """Extract plain files and folders into `out`, none outside it (tarfile's "data" filter where Python has it)."""
    members = tar.getmembers()
    for m in members:
        if not (m.isfile() or m.isdir()) or Path(m.name).is_absolute() or ".." in Path(m.name).parts:
            raise RecipeError(f"{FILES_TAR}: {m.name} is not a file of the recipe's directory; not an export")
    try:
        tar.extractall(out, members, filter="data")
    except TypeError:  # Python before 3.10.12 / 3.11.4: no filters, the check above stands alone
        tar.extractall(out, members)


def rebuild_checkpoint(src: Path, manifest: dict, ckpt_dir: Path) -> Path:
    """The trainer's checkpoint of the exported weights in ckpt_dir, its AdamW restarted (restart_adam)."""
    from minigpt.sample import model_from_checkpoint
    from minigpt.train import make_optimizer

    if manifest.get("format") != 1 or manifest.get("byteorder") != sys.byteorder:
        raise RecipeError(f"{src / WEIGHTS}: format {manifest.get('format')}, byte order {manifest.get('byteorder')}: "
                          f"this minigpt reads format 1 on a {sys.byteorder}-endian machine")
    blob = b""
    for part in manifest["parts"]:
        path = src / part["file"]
        data = path.read_bytes() if path.is_file() else b""
        if len(data) != part["bytes"] or _digest(data) != part["blake2b"]:
            raise RecipeError(f"--import: {path} is missing or damaged ({len(data)} bytes, the manifest says "
                              f"{part['bytes']}); copy every weights.* file of the export")
        blob += data
    config = manifest["config"]
    weights = unpack_weights(blob, manifest["tensors"], manifest["tied"])
    try:
        model, _ = model_from_checkpoint({"config": config, "model": weights}, "sdpa", src / WEIGHTS)
    except CheckpointError as e:
        raise RecipeError(str(e)) from e
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # fused AdamW where the trainer has it
    model.to(device)
    settings = TrainConfig(lr=config["lr"], weight_decay=config["weight_decay"], beta1=config["beta1"],
                           beta2=config["beta2"])
    optimizer = make_optimizer(model, settings, device)
    restart_adam(optimizer, manifest.get("adam"))
    return save_checkpoint(ckpt_dir, int(manifest["step"]), model, optimizer, config)

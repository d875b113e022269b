"""Passkey retrieval over a grid of context lengths × key depths, for a checkpoint or the model being trained.

    minigpt-eval-passkey --checkpoint outputs/<run>                    # its newest intact checkpoint
    minigpt-eval-passkey --checkpoint run/checkpoints/ckpt_00003000.pt --lengths 2048 4096 8192 16384 --wandb

(or `python scripts/eval_passkey.py ...`). The grid itself (key placement, greedy decoding, exact match) is
minigpt/eval/retrieval.py; this module scores a checkpoint with it and writes the table, the heatmap and the W&B run.

Outputs (--out, default `passkey/` in the checkpoint's run directory; publishing is an explicit --out results/...):
passkey_grid.json (the checkpoint's path in it relative), passkey_grid.md, passkey_heatmap.png; with --wandb also a
W&B run holding the grid as a Table and the heatmap.
Exit codes: 0 done, 1 a missing or damaged checkpoint (or an unwritable --out), 2 bad arguments.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minigpt.attention import AttentionBackend, attention_names, get_attention
from minigpt.checkpoint import CheckpointError, UnsafeCheckpointError, find_and_load, list_checkpoints
from minigpt.config import ROPE_SCALINGS, AttentionConfig, ConfigError, ModelConfig
from minigpt.data import DataError, PasskeyData
from minigpt.files import WriteError, atomic_write_text, markdown_table
from minigpt.eval.retrieval import DEFAULT_DEPTHS, DEFAULT_KEYS_PER_CELL, passkey_grid

FILES = ("passkey_grid.json", "passkey_grid.md", "passkey_heatmap.png")


# --------------------------------------------------------------------------------------------
# the grid as a table
# --------------------------------------------------------------------------------------------
def accuracy_matrix(result: dict[str, Any]) -> np.ndarray:
    """(depths, lengths) accuracies in the grid's sorted order."""
    acc = {(c["length"], c["depth"]): c["accuracy"] for c in result["cells"]}
    return np.array([[acc[(n, d)] for n in result["lengths"]] for d in result["depths"]])


def length_label(n: int) -> str:
    """8192 -> 8K, 1048576 -> 1M; other lengths with thousands separators."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"


def grid_table(result: dict[str, Any]) -> str:
    """Markdown: a row per depth, a column per length (the trained one marked), accuracy in %, then the means."""
    trained = result.get("trained_length")
    header = ["depth", *(f"{length_label(n)}{' (trained)' if n == trained else ''}" for n in result["lengths"]),
              "mean"]
    m = accuracy_matrix(result)
    rows = [[f"{d:.2f}", *(f"{100 * a:.0f}%" for a in m[i]), f"{100 * m[i].mean():.0f}%"]
            for i, d in enumerate(result["depths"])]
    rows.append(["**mean**", *(f"**{100 * a:.0f}%**" for a in m.mean(axis=0)), f"**{100 * result['mean_accuracy']:.1f}%**"])
    return markdown_table(header, rows)


# --------------------------------------------------------------------------------------------
# pictures and W&B
# --------------------------------------------------------------------------------------------
def _trained_x(lengths: list[int], trained: int) -> float:
    """Where the trained length falls on the heatmap's column axis (log2-interpolated between columns)."""
    if trained <= lengths[0]:
        return -0.5
    if trained >= lengths[-1]:
        return len(lengths) - 0.5
    j = max(i for i, n in enumerate(lengths) if n <= trained)
    return j + (np.log2(trained) - np.log2(lengths[j])) / (np.log2(lengths[j + 1]) - np.log2(lengths[j]))


def plot_heatmap(result: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """Accuracy by depth (rows, 0 at the top) × length (columns), values annotated; the trained length's column
    is boxed, or a dashed line marks where it would be."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    lengths, depths, trained = result["lengths"], result["depths"], result.get("trained_length")
    m = accuracy_matrix(result)
    fig, ax = plt.subplots(figsize=(max(5.5, 2.2 + 1.1 * len(lengths)), max(3.8, 1.6 + 0.42 * len(depths))))
    image = ax.imshow(m, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{100 * m[i, j]:.0f}", ha="center", va="center", fontsize=8,
                    color="black" if 0.25 < m[i, j] < 0.75 else "white")  # dark ends of the colormap
    ax.set_xticks(range(len(lengths)), [length_label(n) + ("\n(trained)" if n == trained else "") for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("key depth (filler before it)")
    if trained in lengths:
        j = lengths.index(trained)
        ax.add_patch(Rectangle((j - 0.5, -0.5), 1, len(depths), fill=False, edgecolor="black", linewidth=2.5))
    elif trained:
        ax.axvline(_trained_x(lengths, trained), color="black", linestyle="--", linewidth=2)
        ax.set_xlabel(f"context length (tokens); dashed: trained length {length_label(trained)}")
    fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02, label="exact-match accuracy")
    ax.set_title((title + "\n" if title else "") + f"passkey accuracy, {result['keys_per_cell']} keys per cell, "
                 f"mean {100 * result['mean_accuracy']:.1f}%", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


TABLE_COLUMNS = ["length", "depth", "accuracy", "digit_accuracy", "hits", "keys", "trained_length"]


def wandb_table(result: dict[str, Any]):
    """The grid as a wandb.Table, a row per cell (what the trainer logs at eval, e.g. under eval/passkey_grid)."""
    import wandb

    return wandb.Table(columns=TABLE_COLUMNS, data=[[c["length"], c["depth"], c["accuracy"], c["digit_accuracy"],
                                                     c["hits"], c["keys"], result.get("trained_length")]
                                                    for c in result["cells"]])


def log_to_wandb(result: dict[str, Any], heatmap: Path, out_dir: Path, name: str, project: str,
                 group: str | None, config: dict[str, Any]) -> str:
    """One W&B run (mode from WANDB_MODE / credentials, directory WANDB_DIR or out_dir): the Table, the heatmap
    and the means in its summary. Returns where it is (a URL or a directory)."""
    import wandb

    from minigpt.loggers import WandbLogger

    logger = WandbLogger(project=project, name=name, directory=out_dir, group=group, tags=["passkey-eval"],
                         job_type="passkey-eval", config=config)
    logger.log({"passkey/grid": wandb_table(result), "passkey/heatmap": wandb.Image(str(heatmap))})
    summary = {"passkey/mean_accuracy": result["mean_accuracy"],
               **{f"passkey/accuracy_n{n}": a for n, a in result["by_length"].items()}}
    logger.finish(summary, exit_code=0)
    return logger.location


def write_outputs(result: dict[str, Any], out_dir: Path, title: str = "") -> list[Path]:
    """passkey_grid.json, passkey_grid.md and passkey_heatmap.png in out_dir."""
    json_path = atomic_write_text(out_dir / FILES[0], json.dumps(result, indent=1) + "\n")
    md_path = atomic_write_text(out_dir / FILES[1], (f"{title}\n\n" if title else "") + grid_table(result))
    return [json_path, md_path, plot_heatmap(result, out_dir / FILES[2], title)]


# --------------------------------------------------------------------------------------------
# a checkpoint's model
# --------------------------------------------------------------------------------------------
def find_checkpoint(path: Path) -> tuple[Path, dict[str, Any]]:
    """A checkpoint file, or the newest intact one in a checkpoints directory or a run directory (its
    checkpoints/). CheckpointError (one line) when there is none or it is damaged."""
    if not path.exists():
        raise CheckpointError(f"--checkpoint {path}: no such file or directory")
    if path.is_dir() and not list_checkpoints(path) and (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if path.is_dir() and not list_checkpoints(path):
        raise CheckpointError(f"--checkpoint {path}: no ckpt_*.pt there (give a checkpoint, a run directory or "
                              f"its checkpoints/)")
    found = find_and_load(str(path), path)
    assert found is not None
    return found


def model_from_checkpoint(state: dict[str, Any], attention: str | None, path: Path,
                          rope: dict[str, Any] | None = None) -> tuple[torch.nn.Module, AttentionBackend]:
    """The GPT of the checkpoint's config and weights (on CPU) with the named attention backend (default: the
    checkpoint's, with its options); vocab from the weights. `rope`: model.rope_* keys to evaluate with instead of
    the checkpoint's (a length extension at evaluation; ConfigError if they make no sense). Returns (model, backend)."""
    from minigpt.model import GPT

    config = state.get("config") or {}
    saved = config.get("model") or {}
    try:
        cfg = ModelConfig(**{f.name: saved[f.name] for f in fields(ModelConfig) if f.name in saved})
        cfg.validate()
        vocab = state["model"]["wte.weight"].shape[0]
    except (TypeError, KeyError, ConfigError, AttributeError) as e:
        raise CheckpointError(f"{path}: its model config or weights are incomplete ({type(e).__name__}: {e})") from e
    if rope:
        cfg = replace(cfg, **rope)
        cfg.validate()
    saved_attention = AttentionConfig(**(config.get("attention") or {}))
    name = attention or saved_attention.name
    backend = get_attention(name, **(saved_attention.options() if name == saved_attention.name else {}))
    model = GPT(cfg, vocab, backend)
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, KeyError) as e:
        raise CheckpointError(f"{path}: the weights do not fit its own config ({str(e).splitlines()[0][:120]})") from e
    return model, backend


# --------------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eval_passkey", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s --checkpoint PATH [--lengths N ...] [--depths D ...] [--out DIR] "
                                      "[--wandb] [options]")
    p.add_argument("--checkpoint", type=Path, required=True,
                   help="a ckpt_*.pt, or a run directory / checkpoints directory (its newest intact checkpoint)")
    p.add_argument("--lengths", type=int, nargs="+",
                   help="context lengths in tokens (default: the trained length x 1/4, 1/2, 1, 2)")
    p.add_argument("--depths", type=float, nargs="+", default=list(DEFAULT_DEPTHS),
                   help="key depths, fractions of the filler before the key in [0, 1] (default 0, 0.1, ..., 1)")
    p.add_argument("--keys-per-cell", type=int, default=DEFAULT_KEYS_PER_CELL)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    p.add_argument("--seed", type=int, default=0, help="keys are a function of (seed, length, depth, index)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                   help="autocast dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--attention", choices=attention_names(), help="attention backend (default: the checkpoint's)")
    p.add_argument("--rope-scaling", choices=ROPE_SCALINGS, help="evaluate with this RoPE length extension "
                   "(model.rope_scaling; default: the checkpoint's)")
    p.add_argument("--rope-factor", type=float, help="model.rope_factor for --rope-scaling (default: the checkpoint's)")
    p.add_argument("--rope-original-len", type=int, help="model.rope_original_len for --rope-scaling yarn "
                   "(default: the checkpoint's)")
    p.add_argument("--trained-length", type=int, help="marked in the table and heatmap (default: the run's seq_len)")
    p.add_argument("--out", type=Path, help="output directory (default: passkey/ in the checkpoint's run directory)")
    p.add_argument("--wandb", action="store_true", help="also log the grid (Table) and heatmap into a W&B run "
                   "(online with credentials, else offline; WANDB_MODE and WANDB_DIR win)")
    p.add_argument("--project", default="minigpt", help="W&B project")
    p.add_argument("--group", help="W&B group")
    return p


def _check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """Everything that can be refused before the checkpoint is read (exit 2 through p.error)."""
    for key in ("keys_per_cell", "batch_size"):
        if getattr(args, key) < 1:
            p.error(f"argument --{key.replace('_', '-')}: must be >= 1, not {getattr(args, key)}")
    for d in args.depths:
        if not 0.0 <= d <= 1.0:
            p.error(f"argument --depths: {d} is not a fraction in [0, 1]")
    for n in args.lengths or []:
        if too_short := _too_short(n):
            p.error(f"argument --lengths: {n}: {too_short}")
    if args.trained_length is not None and args.trained_length < 1:
        p.error(f"argument --trained-length: must be >= 1, not {args.trained_length}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: cuda, but no CUDA GPU is visible; use --device cpu")
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if args.dtype == "auto" else getattr(torch, args.dtype)
    if device.type == "cpu" and dtype == torch.float16:
        p.error("argument --dtype: float16 is not for CPU; use auto (float32) or bfloat16")
    if args.wandb:  # online needs credentials and a server that answers (minigpt/loggers.py)
        from minigpt.config import ConfigError, LoggerConfig
        from minigpt.loggers import check_wandb

        try:
            check_wandb(LoggerConfig(name="wandb"), none="leave out --wandb")
        except ConfigError as e:
            p.error(f"argument --wandb: {e}")
    return device, dtype


def rope_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The model.rope_* keys given on the command line (--rope-scaling, --rope-factor, --rope-original-len)."""
    given = {"rope_scaling": args.rope_scaling, "rope_factor": args.rope_factor,
             "rope_original_len": args.rope_original_len}
    return {k: v for k, v in given.items() if v is not None}


def _too_short(n: int) -> str | None:
    """Why a length cannot hold the passkey task (PasskeyData's own check), or None."""
    try:
        PasskeyData(seq_len=n, seed=0)
    except DataError as e:
        return str(e)
    return None


def default_out(checkpoint: Path) -> Path:
    """passkey/ in the run directory: the parent of checkpoints/, else the checkpoint's own directory."""
    parent = checkpoint.parent
    return (parent.parent if parent.name == "checkpoints" else parent) / "passkey"


def main(argv: list[str] | None = None) -> int:
    """`minigpt-eval-passkey` / scripts/eval_passkey.py: returns the exit code (0 ok, 1 checkpoint or write
    failure, 2 bad arguments, via argparse's SystemExit)."""
    p = build_parser()
    args = p.parse_args(argv)
    device, dtype = _check_arguments(p, args)
    try:
        path, state = find_checkpoint(args.checkpoint)
        model, backend = model_from_checkpoint(state, args.attention, path, rope_overrides(args))
    except ConfigError as e:
        p.error(f"argument --rope-*: {e}")
    except UnsafeCheckpointError as e:  # a file that would run code: refused as a bad setting, never loaded
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    config, attention = state.get("config") or {}, backend.name
    reason = backend.unsupported(device, dtype, model.cfg.head_dim, gqa=model.cfg.kv_heads != model.cfg.n_head,
                                 masks=model.cfg.window is not None)
    if reason:
        p.error(f"argument --attention: {attention}: {reason}")
    trained = args.trained_length or config.get("seq_len")
    lengths = args.lengths or ([n for n in (trained // 4, trained // 2, trained, 2 * trained) if not _too_short(n)]
                               if trained else None)
    if not lengths:
        p.error("argument --lengths: the checkpoint does not say its seq_len; give --lengths")

    step = int(state["step"])
    title = f"{model.cfg.name} step {step:,}, attention={attention}"
    if model.cfg.rope_scaling != "none":
        title += f", rope={model.cfg.rope_scaling}×{model.cfg.rope_factor:g}"
    print(f"{path}: {title}, {model.num_params() / 1e6:.2f}M parameters; lengths {lengths}, "
          f"{len(args.depths)} depths, {args.keys_per_cell} keys per cell, device={device.type}, "
          f"dtype={str(dtype).removeprefix('torch.')}")
    model.to(device)
    result = passkey_grid(model, lengths, args.depths, args.keys_per_cell, device, dtype, args.seed, args.batch_size,
                          trained, progress=lambda c: print(f"length {c['length']:>8,} depth {c['depth']:.2f}: "
                                                            f"{100 * c['accuracy']:5.1f}%", flush=True))
    # the checkpoint relative to the working directory: results name no machine paths
    result["run"] = {"checkpoint": os.path.relpath(path), "step": step, "model": model.cfg.name, "attention": attention,
                     **{k: getattr(model.cfg, k) for k in ("rope_scaling", "rope_factor", "rope_original_len")},
                     "device": device.type, "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
                     "date": dt.datetime.now().isoformat(timespec="seconds")}
    out = args.out or default_out(path)
    try:
        written = write_outputs(result, out, title)
    except WriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(grid_table(result), end="")
    if args.wandb:
        where = log_to_wandb(result, written[2], out, f"passkey-{model.cfg.name}-{attention}-step{step}",
                             args.project, args.group, {**result["run"], "lengths": result["lengths"],
                                                        "depths": result["depths"], "keys_per_cell": args.keys_per_cell,
                                                        "seed": args.seed, "trained_length": trained})
        print(f"W&B: {where}")
    print(f"mean accuracy {100 * result['mean_accuracy']:.1f}%; results: {out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

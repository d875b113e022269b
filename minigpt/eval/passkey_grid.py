"""The passkey grid of a checkpoint: key depth × context length, per haystack, with its table, heatmap and W&B table.

`minigpt-eval PATH --passkey-grid [--passkey-lengths 16K,32K,64K,128K] [--haystack filler|pycode|both]`
(minigpt/eval/cli.py) runs it. The grid itself (key placement, greedy decoding, exact match) is
minigpt/eval/retrieval.py; the haystacks in a model's own tokens are minigpt/eval/haystack.py. Each length is
scored on its own, so one that runs out of GPU memory is recorded under `oom` and the others still are.

Outputs per haystack (a folder passkey_<haystack>/ of --out): passkey_grid.json (the checkpoint's path in it
relative), passkey_grid.md, passkey_heatmap.png.

A grid too long for one command (the long-context recipe's, at 128K, in segments of a GPU's time limit) runs in
parts, each a set of lengths or one length's run of depths; merge_grids joins their passkey_grid.json into what one
command over every cell writes (keys are a function of seed, length, depth and index, so a cell is the same cell in
any part), and `minigpt-eval PART.json ... --out DIR` writes the merged files.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from minigpt.files import atomic_write_text, markdown_table
from minigpt.eval.retrieval import Haystack, passkey_grid, summarize

FILES = ("passkey_grid.json", "passkey_grid.md", "passkey_heatmap.png")
HAYSTACKS = ("filler", "pycode")


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
    oom = f"; out of memory at {', '.join(map(length_label, result['oom']))}" if result.get("oom") else ""
    ax.set_title((title + "\n" if title else "") + f"passkey accuracy, {result['keys_per_cell']} keys per cell, "
                 f"mean {100 * result['mean_accuracy']:.1f}%{oom}", fontsize=9)
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


def write_outputs(result: dict[str, Any], out_dir: Path, title: str = "") -> list[Path]:
    """passkey_grid.json, passkey_grid.md and passkey_heatmap.png in out_dir (no heatmap when no length could be
    scored: every one ran out of memory)."""
    json_path = atomic_write_text(out_dir / FILES[0], json.dumps(result, indent=1) + "\n")
    parts = [grid_table(result)] if result["lengths"] else []
    if result.get("oom"):
        parts.append(f"out of GPU memory at {', '.join(map(length_label, result['oom']))}\n")
    md_path = atomic_write_text(out_dir / FILES[1], (f"{title}\n\n" if title else "") + "\n".join(parts))
    if not result["lengths"]:
        return [json_path, md_path]
    return [json_path, md_path, plot_heatmap(result, out_dir / FILES[2], title)]


# --------------------------------------------------------------------------------------------
# a grid from its parts
# --------------------------------------------------------------------------------------------
GRID_KEYS = ("haystack", "seed", "keys_per_cell", "trained_length")  # parts of one grid share these
MODEL_KEYS = ("step", "model", "rope", "trained_length", "tokenizer")  # and their model (its path may differ)


def is_grid(result: dict[str, Any]) -> bool:
    """Whether a JSON object is a passkey_grid.json (rather than, say, a loss_by_position.json)."""
    return isinstance(result, dict) and {"cells", "keys_per_cell", "haystack"} <= result.keys()


def merge_grids(parts: Sequence[dict[str, Any]], names: Sequence[str] | None = None) -> dict[str, Any]:
    """One grid from parts that split its cells between them: what one command over every cell writes (the first
    part's `run`). A length that ran out of memory in one part is out of memory in the grid, as in one command.
    ValueError if the parts are of other grids or models, share a cell, or leave a hole in depths x lengths; it
    names a part by `names` (default: grid 1, grid 2, ...)."""
    if not parts:
        raise ValueError("no grids to merge")
    names = list(names or (f"grid {i}" for i in range(1, len(parts) + 1)))
    first = parts[0]
    for name, part in zip(names[1:], parts[1:]):
        for key in GRID_KEYS:
            if part[key] != first[key]:
                raise ValueError(f"{name} has {key} {part[key]!r}, {names[0]} {first[key]!r}: not parts of one grid")
        for key in MODEL_KEYS:
            if part["run"].get(key) != first["run"].get(key):
                raise ValueError(f"{name} is of another model than {names[0]} (its {key} {part['run'].get(key)!r}, "
                                 f"not {first['run'].get(key)!r})")
    cells: dict[tuple[int, float], dict[str, Any]] = {}
    for name, part in zip(names, parts):
        for c in part["cells"]:
            at = (c["length"], c["depth"])
            if at in cells:
                raise ValueError(f"{name}: length {length_label(at[0])} at depth {at[1]:g} is in another part too")
            cells[at] = c
    oom = sorted({n for part in parts for n in part["oom"]})
    depths = sorted({float(d) for part in parts for d in part["depths"]})
    lengths = sorted({n for n, _ in cells} - set(oom))
    missing = [(n, d) for n in lengths for d in depths if (n, d) not in cells]
    if missing:
        n, d = missing[0]
        raise ValueError(f"no grid has length {length_label(n)} at depth {d:g} ({len(missing)} cell(s) missing): "
                         f"give every part")
    result = summarize([cells[(n, d)] for n in lengths for d in depths], first["keys_per_cell"], first["seed"],
                       first["trained_length"])
    return {"haystack": first["haystack"], **result, "depths": depths, "oom": oom, "run": first["run"]}


# --------------------------------------------------------------------------------------------
# running it, one length at a time
# --------------------------------------------------------------------------------------------
def run_grid(model: torch.nn.Module, haystack: Haystack, lengths: Sequence[int], depths: Sequence[float], keys: int,
             device: torch.device, dtype: torch.dtype, seed: int, batch_tokens: int, trained_length: int | None,
             progress: Callable[[dict], None] | None = None, oom: Callable[[int, str], None] | None = None
             ) -> dict[str, Any]:
    """The grid of one haystack, length by length (batch_tokens // length sequences per forward, at least one); a
    length that runs out of GPU memory is listed under `oom` (and `oom(length, message)` called) and the others go
    on. The result is retrieval.passkey_grid's, with `haystack` and `oom` added."""
    cells, failed = [], []
    for length in sorted(set(lengths)):
        try:
            part = passkey_grid(model, [length], depths, keys, device, dtype, seed, max(1, batch_tokens // length),
                                trained_length, progress, haystack)
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            failed.append(length)
            if oom:
                oom(length, str(e).strip().splitlines()[0] if str(e).strip() else "CUDA out of memory")
            continue
        cells += part["cells"]
    result = summarize(cells, keys, seed, trained_length)
    return {"haystack": haystack.name, **result, "depths": sorted(set(float(d) for d in depths)), "oom": failed}


"""`minigpt-eval PATH [PATH ...] [options]` (= `python scripts/eval.py`): loss by position and the passkey grid.

    minigpt-eval runs/final --lengths 32K                                   # loss by position, held-out pycode
    minigpt-eval runs/base2k --lengths 32K --sliding 2K --out runs/base2k/eval_sliding   # a 2K model up to 32K
    minigpt-eval runs/final runs/base2k --lengths 32K --sliding none,2K --out runs/compare   # side by side
    minigpt-eval runs/final/eval/loss_by_position.json runs/base2k/eval_sliding/loss_by_position.json --out cmp
    minigpt-eval runs/final --no-loss --passkey-grid --haystack both --passkey-lengths 16K,32K --wandb
    minigpt-eval parts/*/passkey_filler/passkey_grid.json --out runs/final/eval      # a grid run in parts, merged

PATH is a run directory (its newest intact checkpoint), a checkpoints directory, a ckpt_*.pt, the
loss_by_position.json of an earlier command (drawn and compared, not recomputed), or the passkey_grid.json of
earlier commands that each scored part of one grid (merged, alone). Sizes take K (1024) and M.

Loss by position (minigpt/eval/loss_by_position.py): at each --lengths L, each held-out pycode document's first L
tokens in one window (shorter documents contribute to the bins they reach), mean loss per power-of-two position
bin with a 95 % bootstrap interval over documents; --sliding W reads the same positions through windows of W tokens
every W/2 (--stride). RoPE flags apply a fixed scaling at inference to every model PATH. Refused (exit 2, one line)
when fewer than --min-docs held-out documents have L tokens. The goal figures: mean over --goal-far minus mean over
--goal-near per curve, and the first PATH minus each other PATH over --goal-far (paired over documents).

The passkey grid (--passkey-grid; minigpt/eval/passkey_grid.py): depth × length, --keys keys per cell, in the
synthetic filler and/or held-out pycode text (--haystack). A grid too long for one command can run in parts (some
--passkey-lengths, or some --depths of one length, each into its own --out); their passkey_grid.json files given as
the PATHs are merged per haystack into what one command over every cell writes.

Outputs in --out (default eval/ in the run directory; required with several PATHs): loss_by_position.json and .png;
passkey_<haystack>/passkey_grid.{json,md} and passkey_heatmap.png (under <run name>/ with several model PATHs);
with --wandb one W&B run holding the curves (a table and a line plot), the pictures and the grids.
A length that runs out of GPU memory is recorded as OOM and the others go on.
Exit codes: 0 done; 1 a damaged checkpoint or an unwritable --out; 2 a bad argument, a missing path, a checkpoint
that would need code to load, or too few held-out documents; 3 every length ran out of GPU memory.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from minigpt.attention import attention_names
from minigpt.checkpoint import CheckpointError, UnsafeCheckpointError
from minigpt.config import ROPE_SCALINGS, ConfigError
from minigpt.data import DataError
from minigpt.eval.bootstrap import RESAMPLES
from minigpt.eval.haystack import filler_haystack, pycode_haystack
from minigpt.eval.heldout import HeldOut, check_enough, corpus_settings, heldout_documents, tokenizer_id
from minigpt.eval.loss_by_position import full_windows, score_windows, sliding_windows
from minigpt.eval.loss_report import WANDB_COLUMNS, goal_figures, goal_lines, make_curve, plot_curves, wandb_rows, wrap
from minigpt.eval.passkey_grid import (HAYSTACKS, is_grid, length_label, merge_grids, run_grid, wandb_table,
                                       write_outputs)
from minigpt.eval.retrieval import DEFAULT_DEPTHS, DEFAULT_KEYS_PER_CELL, FillerBytes
from minigpt.files import WriteError, atomic_write_text
from minigpt.metrics import device_name
from minigpt.sample import (SampleError, Tokenizer, find_checkpoint, find_tokenizer, model_from_checkpoint,
                            runnable_attention)

LOSS_FILES = ("loss_by_position.json", "loss_by_position.png")
DEFAULT_PASSKEY_LENGTHS = "16K,32K,64K,128K"


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------
def size(text: str) -> int:
    """'2K' -> 2048, '1M' -> 1048576, '1000' -> 1000."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (a positive number, optionally with K or M)")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20}[m.group(2).lower()]


def sizes(text: str) -> list[int]:
    return [size(t) for t in text.split(",")]


def span(text: str) -> tuple[int, int]:
    """'16K,32K' -> (16384, 32768): positions [lo, hi)."""
    parts = text.split(",")
    try:
        lo, hi = (0 if parts[0].strip() == "0" else size(parts[0])), size(parts[-1])
    except argparse.ArgumentTypeError:
        lo = hi = 0
    if len(parts) != 2 or lo >= hi:
        raise argparse.ArgumentTypeError(f"{text!r} is not a range LO,HI of positions with LO < HI (e.g. 16K,32K)")
    return lo, hi


def slidings(text: str) -> list[int | None]:
    """'2K' or 'none,2K': a window per model PATH (none: one window per document)."""
    return [None if t.strip().lower() == "none" else size(t) for t in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minigpt-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s PATH [PATH ...] [--lengths 2K,8K,32K] [--sliding W] [--rope-scaling "
                                      "none|linear|yarn ...] [--docs N] [--passkey-grid] [--haystack filler|pycode|"
                                      "both] [--out DIR] [--wandb] [options]")
    p.add_argument("paths", type=Path, nargs="+", metavar="PATH",
                   help="a run directory, its checkpoints/, a ckpt_*.pt, or an earlier loss_by_position.json")
    loss = p.add_argument_group("loss by position")
    loss.add_argument("--lengths", type=sizes, help="window lengths, e.g. 2K,8K,32K (default: twice the longest "
                      "trained length of the model PATHs)")
    loss.add_argument("--docs", type=int, help="at most this many held-out documents, the longest (default: all)")
    loss.add_argument("--min-docs", type=int, help="refuse a length that fewer held-out documents reach (default: "
                      "the corpus's guarantee, 20 for the full corpus)")
    loss.add_argument("--sliding", type=slidings, help="score through windows of this many tokens: one for every "
                      "model PATH, or one per model PATH (none for one window per document), e.g. none,2K")
    loss.add_argument("--stride", type=size, help="the sliding windows' stride (default: half the window)")
    loss.add_argument("--goal-far", type=span, default=(16 << 10, 32 << 10), metavar="LO,HI",
                      help="the goal figures' far positions (default 16K,32K)")
    loss.add_argument("--goal-near", type=span, default=(1 << 10, 2 << 10), metavar="LO,HI",
                      help="the goal figures' near positions (default 1K,2K)")
    loss.add_argument("--resamples", type=int, default=RESAMPLES, help="bootstrap resamples (default 1000)")
    loss.add_argument("--no-loss", action="store_true", help="skip loss by position (the passkey grid only)")
    grid = p.add_argument_group("passkey grid")
    grid.add_argument("--passkey-grid", action="store_true", help="also score the passkey grid")
    grid.add_argument("--passkey-lengths", type=sizes, default=sizes(DEFAULT_PASSKEY_LENGTHS),
                      help=f"context lengths of the grid (default {DEFAULT_PASSKEY_LENGTHS})")
    grid.add_argument("--depths", type=float, nargs="+", default=list(DEFAULT_DEPTHS),
                      help="key depths, fractions of the haystack before the key in [0, 1] (default 0, 0.1, ..., 1)")
    grid.add_argument("--keys", type=int, default=DEFAULT_KEYS_PER_CELL, help="keys per cell (default 20)")
    grid.add_argument("--haystack", choices=[*HAYSTACKS, "both"], default="filler",
                      help="the synthetic filler, held-out pycode text, or both (default filler)")
    model = p.add_argument_group("model")
    model.add_argument("--rope-scaling", choices=ROPE_SCALINGS, help="evaluate with this RoPE length extension "
                       "(model.rope_scaling; default: the checkpoint's)")
    model.add_argument("--rope-factor", type=float, help="model.rope_factor (default: the checkpoint's)")
    model.add_argument("--rope-original-len", type=size, help="model.rope_original_len for yarn (default: the "
                       "checkpoint's)")
    model.add_argument("--attention", choices=attention_names(), help="attention backend (default: the checkpoint's)")
    model.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    model.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                       help="autocast dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    model.add_argument("--batch-tokens", type=size, default=64 << 10,
                       help="tokens per forward (whole windows, at least one; default 64K)")
    model.add_argument("--seed", type=int, default=0, help="the passkey keys and the bootstrap's resamples")
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, help="output directory (default: eval/ in the run directory)")
    out.add_argument("--wandb", action="store_true", help="also log everything into one W&B run (online with "
                     "credentials, else offline; WANDB_MODE and WANDB_DIR win)")
    out.add_argument("--project", default="minigpt", help="W&B project")
    out.add_argument("--group", help="W&B group")
    return p


def _is_result(path: Path) -> bool:
    return path.suffix == ".json"


def _is_grid_file(path: Path) -> bool:
    """A passkey_grid.json (a part of a grid to merge); anything unreadable is left to read_result to refuse."""
    try:
        return is_grid(json.loads(path.read_text()))
    except (OSError, ValueError):
        return False


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """Everything that can be refused before a checkpoint is read (exit 2 through p.error)."""
    models = [q for q in args.paths if not _is_result(q)]
    for key in ("keys", "resamples", "docs", "min_docs"):
        value = getattr(args, key)
        if value is not None and value < 1:
            p.error(f"argument --{key.replace('_', '-')}: must be >= 1, not {value}")
    for d in args.depths:
        if not 0.0 <= d <= 1.0:
            p.error(f"argument --depths: {d} is not a fraction in [0, 1]")
    if args.no_loss and not args.passkey_grid:
        p.error("argument --no-loss: nothing left to do; add --passkey-grid")
    if args.passkey_grid and not models:
        p.error("argument --passkey-grid: needs a model PATH (a run directory or checkpoint), not only results")
    if args.sliding is not None and len(args.sliding) not in (1, len(models)):
        p.error(f"argument --sliding: {len(args.sliding)} windows for {len(models)} model PATHs; give one for all "
                f"or one per model PATH")
    if args.stride is not None and not any(args.sliding or []):
        p.error("argument --stride: only with --sliding")
    for w in filter(None, args.sliding or []):
        if args.stride is not None and args.stride > w:
            p.error(f"argument --stride: {args.stride} is longer than the window {w}")
        if args.stride is None and w < 2:
            p.error(f"argument --sliding: a window of {w} token has no half for a stride; give --stride")
    if args.out is None and (len(args.paths) > 1 or not models):
        p.error("argument --out: several PATHs, or only earlier results, are drawn together; say where (--out DIR)")
    for q in args.paths:
        if _is_result(q) and not q.is_file():
            p.error(f"argument PATH: {q}: no such file")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: cuda, but no CUDA GPU is visible; use --device cpu")
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) if args.dtype == "auto" else getattr(torch, args.dtype)
    if device.type == "cpu" and dtype == torch.float16:
        p.error("argument --dtype: float16 is not for CPU; use auto (float32) or bfloat16")
    if args.wandb:  # online needs credentials and a server that answers (minigpt/loggers.py)
        from minigpt.config import LoggerConfig
        from minigpt.loggers import check_wandb

        try:
            check_wandb(LoggerConfig(name="wandb"), none="leave out --wandb")
        except ConfigError as e:
            p.error(f"argument --wandb: {e}")
    return device, dtype


def rope_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The model.rope_* keys given on the command line."""
    given = {"rope_scaling": args.rope_scaling, "rope_factor": args.rope_factor,
             "rope_original_len": args.rope_original_len}
    return {k: v for k, v in given.items() if v is not None}


# --------------------------------------------------------------------------------------------
# a model PATH
# --------------------------------------------------------------------------------------------
@dataclass
class Evaluated:
    """A checkpoint's model, ready to evaluate (on CPU until its turn), with what the results say about it."""

    model: Any  # minigpt.model.GPT, eval mode
    tokenizer: Tokenizer
    checkpoint: Path
    run_dir: Path
    config: dict[str, Any]
    step: int
    attention: str
    source: int  # its index among the PATHs

    @property
    def trained_length(self) -> int | None:
        n = self.config.get("seq_len")
        return n if isinstance(n, int) and n > 0 else None

    @property
    def name(self) -> str:
        return f"{self.run_dir.resolve().name} step {self.step}"

    def rope(self) -> dict[str, Any]:
        return {k.removeprefix("rope_"): getattr(self.model.cfg, k) for k in ("rope_scaling", "rope_factor",
                                                                              "rope_original_len")}

    def meta(self) -> dict[str, Any]:
        """What a curve or grid records about the model (paths relative: results name no machine paths)."""
        return {"checkpoint": os.path.relpath(self.checkpoint), "step": self.step, "model": self.model.cfg.name,
                "attention": self.attention, "rope": self.rope(), "trained_length": self.trained_length,
                "source": self.source}


def load_model(path: Path, source: int, device: torch.device, dtype: torch.dtype, attention: str | None,
               rope: dict[str, Any], warn: Callable[[str], None]) -> Evaluated:
    """PATH's checkpoint as an Evaluated (sample.py finds it and its tokenizer). SampleError, CheckpointError,
    UnsafeCheckpointError, or ConfigError for RoPE flags that make no sense."""
    ckpt, state, run_dir = find_checkpoint(path, warn)
    config = state.get("config") or {}
    tokenizer = find_tokenizer(config, run_dir)
    name = attention or runnable_attention(config, device, dtype, ckpt, warn)
    model, backend = model_from_checkpoint(state, name, ckpt, rope)
    reason = backend.unsupported(device, dtype, model.cfg.head_dim, gqa=model.cfg.kv_heads != model.cfg.n_head,
                                 masks=model.cfg.window is not None)
    if reason:
        raise SampleError(f"--attention {name}: {reason}")
    if tokenizer.vocab_size > model.vocab_size:
        raise SampleError(f"{ckpt}: its model has {model.vocab_size} tokens, fewer than the tokenizer "
                          f"{tokenizer.name} ({tokenizer.vocab_size}): not this run's tokenizer")
    return Evaluated(model.eval(), tokenizer, ckpt, run_dir, config, int(state["step"]), name, source)


def label(e: Evaluated, length: int, window: int | None, stride: int | None) -> str:
    text = f"{e.name} @ {length_label(length)}"
    if window:
        text += f", sliding {length_label(window)}/{length_label(stride)}"
    if e.model.cfg.rope_scaling != "none":
        text += f", {e.model.cfg.rope_scaling}×{e.model.cfg.rope_factor:g}"
    return text


class HeldOutCache:
    """Held-out documents per (corpus settings, tokenizer): built once however many PATHs share them."""

    def __init__(self, say: Callable[[str], None]):
        self.say, self.built = say, {}

    def get(self, e: Evaluated) -> HeldOut:
        settings = corpus_settings(e.config)
        tok = tokenizer_id(e.tokenizer.name)
        key = (repr(settings), tok)
        if key not in self.built:
            self.say(f"held-out pycode documents ({settings.subset or 'full'} corpus), tokenized with {e.tokenizer.name}")
            self.built[key] = heldout_documents(settings, e.tokenizer.encode, e.tokenizer.start, tok, e.run_dir,
                                                log=self.say)
        return self.built[key]


# --------------------------------------------------------------------------------------------
# the two evaluations
# --------------------------------------------------------------------------------------------
def loss_curves(e: Evaluated, docs: HeldOut, lengths: list[int], window: int | None, stride: int | None,
                device: torch.device, dtype: torch.dtype, args: argparse.Namespace,
                say: Callable[[str], None]) -> list[dict[str, Any]]:
    """One curve per length; a length that runs out of GPU memory becomes a curve with status "oom"."""
    curves = []
    n_tokens = [len(t) for t in docs.tokens]
    for length in lengths:
        name = label(e, length, window, stride)
        meta = {"label": name, **e.meta(), "sliding": {"window": window, "stride": stride} if window else None,
                "tokenizer": docs.tokenizer, "corpus_hash": docs.corpus_hash, "run_corpus_hash": docs.run_corpus_hash}
        windows = (sliding_windows(n_tokens, length, window, stride) if window else full_windows(n_tokens, length))
        total = sum(min(n, length) for n in n_tokens)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        began = time.perf_counter()
        try:
            with tqdm(total=total, unit="tok", unit_scale=True, desc=name, mininterval=2.0, file=sys.stderr) as bar:
                losses = score_windows(e.model, docs.tokens, docs.start, windows, device, dtype, args.batch_tokens,
                                       progress=bar.update)
        except torch.cuda.OutOfMemoryError as err:
            torch.cuda.empty_cache()
            first = (str(err).strip().splitlines() or ["CUDA out of memory"])[0]
            say(f"{name}: out of GPU memory ({first[:120]}); recorded as OOM, going on with the others")
            curves.append({**meta, "status": "oom", "length": length, "error": first})
            continue
        meta["seconds"] = round(time.perf_counter() - began, 2)
        meta["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None
        curve = make_curve(losses, docs.paths, length, args.resamples, args.seed, **meta)
        reach = [b for b in curve["bins"] if b["tokens"]]
        peak = f", peak {meta['peak_gib']:.2f} GiB" if meta["peak_gib"] is not None else ""
        say(f"{name}: {sum(b['tokens'] for b in reach):,} tokens of {len(losses)} documents in {meta['seconds']:.1f} s"
            f"{peak}; mean loss " + ", ".join(f"[{b['lo']}, {b['hi']}) {b['mean']:.3f}" for b in reach[-3:]))
        curves.append(curve)
    return curves


def passkey_grids(e: Evaluated, heldout: Callable[[], HeldOut], device: torch.device, dtype: torch.dtype,
                  args: argparse.Namespace, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """The grid per haystack asked for; byte models in the synthetic filler get training's own passkey data."""
    names = HAYSTACKS if args.haystack == "both" else (args.haystack,)
    tok = e.tokenizer
    results = []
    for name in names:
        if name == "filler":
            haystack = FillerBytes() if tok.name == "bytes" else filler_haystack(tok.encode, tok.decode, tok.start)
        else:
            docs = heldout()
            haystack = pycode_haystack(docs.tokens, docs.start, tok.encode, tok.decode)
        cells = len(args.passkey_lengths) * len(set(args.depths))
        with tqdm(total=cells, unit="cell", desc=f"{e.name} passkey {name}", mininterval=2.0, file=sys.stderr) as bar:
            result = run_grid(e.model, haystack, args.passkey_lengths, args.depths, args.keys, device, dtype,
                              args.seed, args.batch_tokens, e.trained_length, progress=lambda c: bar.update(),
                              oom=lambda n, m: say(f"passkey {name} at {length_label(n)}: out of GPU memory ({m[:120]}); "
                                                   f"recorded as OOM, going on with the others"))
        result["run"] = {**e.meta(), "tokenizer": tok.name if tok.name == "bytes" else tokenizer_id(tok.name),
                         "device": device.type, "dtype": str(dtype).removeprefix("torch.")}
        results.append(result)
    return results


# --------------------------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------------------------
def read_result(path: Path, first: int) -> list[dict[str, Any]]:
    """The curves of an earlier loss_by_position.json, its models numbered from `first` on in their order there
    (`source`: the first PATH's first model is A of the paired goal figure); SampleError if it is not one."""
    try:
        data = json.loads(path.read_text())
        curves = data["curves"]
        assert isinstance(curves, list) and all("label" in c and "status" in c for c in curves)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise SampleError(f"{path}: not a loss_by_position.json or passkey_grid.json of minigpt-eval "
                          f"({type(e).__name__}); give a run directory, a checkpoint or such a file") from None
    sources = {s: first + i for i, s in enumerate(dict.fromkeys(c.get("source", 0) for c in curves))}
    return [{**c, "source": sources[c.get("source", 0)]} for c in curves]


def unique_labels(curves: list[dict[str, Any]]) -> None:
    """Give curves that share a label a suffix (#2, #3, ...): labels key the goal figures and W&B lines."""
    seen: dict[str, int] = {}
    for c in curves:
        seen[c["label"]] = seen.get(c["label"], 0) + 1
        if seen[c["label"]] > 1:
            c["label"] = f"{c['label']} #{seen[c['label']]}"


def log_wandb(args: argparse.Namespace, out: Path, command: str, report: dict[str, Any] | None, png: Path | None,
              grids: list[tuple[str, dict[str, Any], Path | None]], name: str) -> str:
    """One W&B run: the curves as a table and a line plot (one line per curve), the pictures, the grids."""
    import wandb

    from minigpt.loggers import WandbLogger

    logger = WandbLogger(project=args.project, name=name, directory=out, group=args.group, tags=["eval"],
                         job_type="eval", config={"command": command})
    logs: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    if report and png:
        table = wandb.Table(columns=WANDB_COLUMNS, data=wandb_rows(report["curves"]))
        logs["loss_by_position/table"] = table
        logs["loss_by_position/plot"] = wandb.plot.line(table, "log2_position", "mean", stroke="curve",
                                                        title="mean loss by log2 position")
        logs["loss_by_position/figure"] = wandb.Image(str(png))
        goals = report["goals"]
        summary.update({f"goal/{k} far-near": r["estimate"] for k, r in goals["range_difference"].items()})
        summary.update({f"goal/{r['a']} - {r['b']}": r["estimate"] for r in goals["paired_difference"]})
    for folder, result, heatmap in grids:
        logs[f"{folder}/grid"] = wandb_table(result)
        if heatmap:
            logs[f"{folder}/heatmap"] = wandb.Image(str(heatmap))
        summary[f"{folder}/mean_accuracy"] = result["mean_accuracy"]
    logger.log(logs)
    logger.finish(summary, exit_code=0)
    return logger.location


def default_out(e: Evaluated) -> Path:
    return e.run_dir / "eval"


def write_grid(result: dict[str, Any], out: Path, folder: str, grids: list, name: str, attention: str,
               rope_scaling: str, rope_factor: float, command: str) -> list[Path]:
    """One haystack's grid written into out/folder (titled with the model and command), added to `grids` (for W&B)
    and its accuracy printed; returns the files written. A grid scored here and one merged from parts alike."""
    rope = f", rope={rope_scaling}×{rope_factor:g}" if rope_scaling != "none" else ""
    title = f"{name}, {result['haystack']} haystack, attention={attention}{rope}; {command}"
    paths = write_outputs(result, out / folder, wrap(title, 110))
    grids.append((folder, result, paths[2] if len(paths) > 2 else None))
    if result["mean_accuracy"] is not None:
        print(f"{name}: passkey ({result['haystack']}) mean accuracy {100 * result['mean_accuracy']:.1f}%, " +
              ", ".join(f"{length_label(int(n))} {100 * a:.0f}%" for n, a in result["by_length"].items()))
    return paths


def merge_grid_files(paths: list[Path], args: argparse.Namespace, command: str, say: Callable[[str], None]) -> int:
    """`minigpt-eval PART.json ... --out DIR`: the parts of each haystack's grid merged into DIR/passkey_<haystack>/,
    as one command over every cell writes it; nothing is written if any haystack's parts do not make one grid."""
    parts = [json.loads(q.read_text()) for q in paths]
    merged = []
    for haystack in dict.fromkeys(part["haystack"] for part in parts):
        mine = [(str(q), part) for q, part in zip(paths, parts) if part["haystack"] == haystack]
        try:
            merged.append((merge_grids([part for _, part in mine], [q for q, _ in mine]), len(mine)))
        except ValueError as e:
            say(f"error: {e}")
            return 2
    grids: list[tuple[str, dict[str, Any], Path | None]] = []
    written: list[Path] = []
    try:
        for result, n in merged:
            run = result["run"]
            rope = run.get("rope") or {}
            written += write_grid(result, args.out, f"passkey_{result['haystack']}", grids,
                                  f"{run.get('checkpoint')} step {run.get('step')}", run.get("attention"),
                                  rope.get("scaling", "none"), rope.get("factor", 1.0),
                                  f"{n} parts merged: {command}")
    except WriteError as e:
        say(f"error: {e}")
        return 1
    if args.wandb:
        print(f"W&B: {log_wandb(args, args.out, command, None, None, grids, 'eval-merge')}")
    print(f"results: {args.out.resolve()} ({', '.join(str(w.relative_to(args.out)) for w in written)})")
    return 0


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """`minigpt-eval` / scripts/eval.py: returns the exit code (module docstring)."""
    from minigpt.metrics import git_commit

    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(argv)
    device, dtype = check_arguments(p, args)
    command = "minigpt-eval " + shlex.join(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    grid_files = [q for q in args.paths if _is_result(q) and _is_grid_file(q)]
    if grid_files:
        if len(grid_files) < len(args.paths) or args.passkey_grid:
            p.error("argument PATH: passkey_grid.json files are merged on their own; give no model, "
                    "loss_by_position.json or --passkey-grid with them")
        return merge_grid_files(grid_files, args, command, say)

    # read everything and refuse what cannot be done before computing anything
    models: list[Evaluated] = []
    curves: list[dict[str, Any]] = []
    try:
        for path in args.paths:  # sources numbered in order: a model, or each model of an earlier result
            source = len(models) + len({c["source"] for c in curves})
            if _is_result(path):
                curves += read_result(path, source)
            else:
                models.append(load_model(path, source, device, dtype, args.attention, rope_overrides(args), say))
    except (SampleError, UnsafeCheckpointError) as e:  # a path refused (an unsafe file never loaded)
        say(f"error: {e}")
        return 2
    except CheckpointError as e:
        say(f"error: {e}")
        return 1
    except ConfigError as e:
        p.error(f"argument --rope-*: {e}")
    trained = [e.trained_length for e in models if e.trained_length]
    lengths = args.lengths or ([2 * max(trained)] if trained else None)
    if models and not args.no_loss and not lengths:
        p.error("argument --lengths: the checkpoint does not say its seq_len; give --lengths")
    windows = args.sliding or [None]
    if len(windows) == 1:
        windows = windows * len(models)
    cache = HeldOutCache(say)
    try:
        if not args.no_loss:
            for e in models:
                docs = cache.get(e).longest(args.docs)
                min_docs = args.min_docs or docs.min_docs
                for n in lengths:
                    check_enough(docs, n, min_docs, f"loss by position at {length_label(n)} ({e.name})")
        for n in args.passkey_lengths if args.passkey_grid else []:
            for e in models:  # each haystack's own check of the length (the task must fit)
                tok = e.tokenizer
                (FillerBytes() if tok.name == "bytes" else filler_haystack(tok.encode, tok.decode, tok.start)
                 ).cell(n, 0.0, 1, args.seed)
    except DataError as e:
        p.error(f"argument --passkey-lengths: {e}")
    except ConfigError as e:  # too few held-out documents
        say(f"error: {e}")
        return 2
    out = args.out or default_out(models[0])
    commit = git_commit()

    # loss by position
    for e, window in zip(models, windows):
        if args.no_loss:
            break
        stride = (args.stride or window // 2) if window else None
        e.model.to(device)
        curves += loss_curves(e, cache.get(e).longest(args.docs), lengths, window, stride, device, dtype, args, say)
        e.model.to("cpu")
    unique_labels(curves)
    report, png = None, None
    written: list[Path] = []
    try:
        if curves:
            goals = goal_figures(curves, args.goal_far, args.goal_near, args.resamples, args.seed)
            report = {"command": command, "commit": commit, "date": dt.datetime.now().isoformat(timespec="seconds"),
                      "torch": torch.__version__, "device": device_name(device),
                      "dtype": str(dtype).removeprefix("torch."),
                      "goals": goals, "curves": curves}
            written.append(atomic_write_text(out / LOSS_FILES[0], json.dumps(report, indent=1) + "\n"))
            title = "loss by position on held-out pycode: " + "; ".join(dict.fromkeys(
                f"{c.get('checkpoint', '?')} (step {c.get('step', '?')})" for c in curves))
            footer = "\n".join([wrap(f"{command}  [commit {commit or 'unknown'}]"), *goal_lines(goals)[:4]])
            png = plot_curves(curves, out / LOSS_FILES[1], wrap(title, 110), footer)
            written.append(png)
            for line in goal_lines(goals) + goals["not_computed"]:
                print(line)
        # the passkey grid
        grids: list[tuple[str, dict[str, Any], Path | None]] = []
        for e in models if args.passkey_grid else []:
            e.model.to(device)
            for result in passkey_grids(e, lambda: cache.get(e), device, dtype, args, say):
                folder = f"passkey_{result['haystack']}" if len(models) == 1 else \
                    f"{e.run_dir.resolve().name}-{e.source}/passkey_{result['haystack']}"
                written += write_grid(result, out, folder, grids, e.name, e.attention, e.model.cfg.rope_scaling,
                                      e.model.cfg.rope_factor, command)
            e.model.to("cpu")
    except WriteError as e:
        say(f"error: {e}")
        return 1
    if args.wandb:
        name = f"eval-{models[0].name.replace(' ', '-')}" if models else "eval-compare"
        print(f"W&B: {log_wandb(args, out, command, report, png, grids, name)}")
    print(f"results: {out.resolve()} ({', '.join(str(w.relative_to(out)) for w in written)})")
    nothing = not any(c["status"] == "ok" for c in curves) and not any(r["cells"] for _, r, _ in grids)
    oom = any(c["status"] == "oom" for c in curves) or any(r["oom"] for _, r, _ in grids)
    return 3 if nothing and oom else 0

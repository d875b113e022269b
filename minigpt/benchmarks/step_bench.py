"""The trainer's step per attention backend, in one process, in rounds that alternate between the backends.

    python scripts/bench_attention.py --step                        # gpt2-small at 1K, 2K, 4K, 8K: flash vs sdpa
    python scripts/bench_attention.py --step --seq 1024 --step-backends flash sdpa naive

Between processes, and between train.py runs, the same step's time moved by up to ±15% on a shared host (kernels/
NOTES.md, session 22), more than the gap being measured at short lengths. Within one process the rounds of every
backend see the same drift, so their ratio holds. Each backend gets the trainer's own setup (minigpt.train.build:
model, optimizer, data, regional compile by default on a GPU) from the same config but for `attention`; after
warm-up steps the rounds run, each timing `steps` calls of minigpt.train.train_step back to back (the trainer's
step: data, fwd+bwd under autocast, clipping, AdamW, and its loss read back, one host sync per step). The table
gives each backend's median and fastest round, in ms per step, its median over sdpa's, and how far that ratio
strays round by round (the noise a verdict must clear).
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from minigpt.compose import compose
from minigpt.files import atomic_write_text, markdown_table
from minigpt.metrics import git_commit, versions
from minigpt.summary import RunSummary
from minigpt.train import build, train_step


@dataclass
class StepRow:
    backend: str
    seq_len: int
    batch: int
    median_ms: float  # ms per step, the median over the rounds
    min_ms: float  # the fastest round's
    rounds: list[float]  # every round's ms per step, in order


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_bench(seq_lens: list[int], backends: list[str], tokens: int = 16384, model: str = "gpt2-small",
               rounds: int = 12, steps: int = 15, warmup: int = 10,
               progress: Callable[[str], None] = print) -> list[StepRow]:
    """Per sequence length, each backend's training step (batch = tokens // seq_len sequences) timed in `rounds`
    rounds of `steps` steps, the backends' order rotating from round to round."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="step_bench_") as run_dir:
        for seq_len in seq_lens:
            batch = max(1, tokens // seq_len)
            runs = {}
            for name in backends:
                cfg = compose([f"model={model}", f"attention={name}", f"seq_len={seq_len}", f"batch_size={batch}",
                               "save_checkpoints=false", "logger=none"], run_dir=run_dir)
                t = build(cfg, asdict(cfg), RunSummary())
                for step in range(warmup):  # compiles, autotunes, fills the allocator's cache
                    train_step(t, step)
                runs[name] = t
            times: dict[str, list[float]] = {name: [] for name in backends}
            for r in range(rounds):
                for name in backends[r % len(backends):] + backends[:r % len(backends)]:
                    t = runs[name]
                    _sync(t.device)
                    start = time.perf_counter()
                    for step in range(steps):
                        train_step(t, warmup + r * steps + step)
                    _sync(t.device)
                    times[name].append(1e3 * (time.perf_counter() - start) / steps)
            for name in backends:
                rows.append(StepRow(name, seq_len, batch, statistics.median(times[name]), min(times[name]),
                                    times[name]))
                progress(f"step {name:6s} seq_len={seq_len:6d} batch={batch:3d}: {rows[-1].median_ms:8.2f} ms "
                         f"(fastest round {rows[-1].min_ms:.2f})")
            del runs, t
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def step_table(rows: list[StepRow], env: dict) -> str:
    """One line per (sequence length, backend): ms per step, median and fastest round, median / sdpa's, and the
    spread of that ratio round by round (a round of each backend against sdpa's of the same round)."""
    sdpa = {r.seq_len: r for r in rows if r.backend == "sdpa"}
    table = []
    for r in rows:
        base = sdpa.get(r.seq_len)
        paired = [a / b for a, b in zip(r.rounds, base.rounds)] if base and r is not base else []
        table.append([r.seq_len, r.batch, r.backend, f"{r.median_ms:.2f}", f"{r.min_ms:.2f}", len(r.rounds),
                      f"{r.median_ms / base.median_ms:.3f}" if base else None,
                      f"{min(paired):.2f}–{max(paired):.2f}" if paired else None])
    return (f"The trainer's step ({env['model']}, {env['tokens']} tokens per step), rounds alternating between the "
            f"backends in one process; {env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}, "
            f"commit {env['commit']}. Command: `{env['command']}`.\n\n"
            + markdown_table(["seq_len", "batch", "attention", "ms/step (median)", "fastest round", "rounds",
                              "/ sdpa", "/ sdpa, round by round"], table))


def write_step_results(rows: list[StepRow], out_dir: Path, model: str, tokens: int, command: str) -> Path:
    """<out_dir>/step_<device>.{json,md}."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    env = {"device": device, **versions(), "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
           "model": model, "tokens": tokens, "command": command}
    stem = "step_" + device.replace(" ", "_")
    atomic_write_text(out_dir / f"{stem}.json", json.dumps({"env": env, "rows": [asdict(r) for r in rows]},
                                                           indent=1) + "\n")
    return atomic_write_text(out_dir / f"{stem}.md", step_table(rows, env) + "\n")

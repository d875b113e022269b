"""The run summary (`summary.json`) and the exit codes: the one contract the sweep, scripts and tests read.

Every run that started writes a summary, whatever happens; its `status` and the process exit code agree:

    status        exit code      when
    ok            0              all steps done (or resume=auto found the run already finished)
    error         1              bad data, a bad checkpoint, a non-finite loss, anything unexpected
    error         2              a bad setting found once the run had started (the message names the key)
    oom           3              CUDA out of memory (the message says what to try)
    interrupted   128 + signal   SIGINT (130), SIGHUP (129) or SIGTERM (143): a checkpoint is written first
    running       -              the run is alive, or was killed (SIGKILL, the OOM killer): see `pid` and `host`

Readers load it with `RunSummary.read(path)`, which fails loudly on a missing or renamed field instead of
handing back None.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from enum import IntEnum
from pathlib import Path
from typing import Any

from minigpt.files import atomic_write_text

SUMMARY_FILE = "summary.json"
STATUSES = ("running", "ok", "error", "oom", "interrupted")


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1
    BAD_SETTING = 2
    OOM = 3
    SIGNAL_BASE = 128  # interrupted by signal s: 128 + s


# fields added after summaries were first kept in results/: a summary without them reads as their default
ADDED_LATER = {"resume_extend", "rank_peak_allocated_gib", "rank_peak_reserved_gib", "cuda_alloc_conf"}


@dataclass
class RunSummary:
    # outcome
    status: str = "running"  # one of STATUSES
    exit_code: int | None = None
    error: str | None = None  # one line: what went wrong and what to do
    steps: int = 0  # optimizer steps done (counting those before a resume)
    max_steps: int = 0
    final_train_loss: float | None = None
    final_val_loss: float | None = None
    passkey_acc: float | None = None
    # speed and memory (medians over steps after warm-up; peaks over the whole run, per process)
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    mfu: float | None = None
    peak_allocated_gib: float = 0.0
    peak_reserved_gib: float = 0.0
    peak_host_offload_gib: float = 0.0  # host RAM (pinned on a GPU) held by offloaded activations (model.offload)
    compile_time_s: float | None = None
    # under torchrun (world_size > 1): tokens_per_s and mfu are of all ranks together, the peaks above rank 0's;
    # per rank (tokens/s from its median step time, peak GiB over the run) the max and the sum over ranks, and
    # each rank's peaks in rank order (gathered from every rank at each step)
    rank_tokens_per_s_max: float | None = None
    rank_tokens_per_s_sum: float | None = None
    rank_peak_allocated_gib_max: float | None = None
    rank_peak_allocated_gib_sum: float | None = None
    rank_peak_reserved_gib_max: float | None = None
    rank_peak_allocated_gib: list[float] | None = None
    rank_peak_reserved_gib: list[float] | None = None
    wall_time_s: float | None = None
    # what ran
    seq_len: int = 0
    batch_size: int = 0
    grad_accum: int = 1
    attention: str = ""
    attention_options: dict[str, Any] = field(default_factory=dict)
    levers: dict[str, Any] = field(default_factory=dict)  # every memory lever of ModelConfig, on or off
    compile: bool = False
    cuda_alloc_conf: str | None = None  # the CUDA allocator's settings the run gave PyTorch (config cuda_alloc_conf)
    world_size: int = 1  # processes (torchrun); data parallel degree = world_size / context_parallel
    context_parallel: int = 1
    model: str = ""
    n_layer: int = 0
    n_params: int | None = None
    vocab_size: int | None = None
    device: str | None = None  # the GPU's name, or "cpu"
    dtype: str | None = None
    torch: str | None = None
    triton: str | None = None
    commit: str | None = None
    # where things are
    run_dir: str = ""
    pid: int | None = None  # the process that wrote it, and its host: a `running` summary whose process is gone
    host: str | None = None  # is a run that was killed (SIGKILL, the out-of-memory killer)
    checkpoint: str | None = None  # the newest checkpoint of this run, if any
    resumed_from: str | None = None
    # a resume with resume_extend=true that changed the RoPE settings or seq_len: {"from": {key: old}, "to": {key: new}}
    resume_extend: dict[str, Any] | None = None
    wandb: str | None = None  # W&B run directory (offline) or URL (online)

    def write(self, run_dir: str | Path) -> Path:
        """Write summary.json atomically (a reader never sees half a file)."""
        path = Path(run_dir) / SUMMARY_FILE
        atomic_write_text(path, json.dumps(asdict(self), indent=2, default=str) + "\n")
        return path

    @classmethod
    def read(cls, path: str | Path) -> RunSummary:
        """Load a summary.json; a missing or unknown field raises ValueError naming it."""
        data = json.loads(Path(path).read_text())
        names = {f.name for f in fields(cls)}
        unknown, missing = set(data) - names, names - set(data) - ADDED_LATER
        if unknown or missing:
            raise ValueError(f"{path}: not a summary of this minigpt version "
                             f"(unknown fields {sorted(unknown)}, missing {sorted(missing)})")
        return cls(**data)

    @property
    def finished(self) -> bool:
        """All max_steps done: resuming it would change nothing."""
        return self.status == "ok" and self.steps >= self.max_steps > 0

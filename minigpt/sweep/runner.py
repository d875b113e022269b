"""How a trial gets its result: the trainer in a fresh process, or the record of an earlier run of it.

`SubprocessRunner` starts `python -m minigpt <overrides>` (a clean CUDA allocator per trial, any working
directory), or with `nproc` > 1 that under torchrun (`python -m torch.distributed.run --standalone
--nproc_per_node N -m minigpt ... parallel.context=K`, whose exit code is 1 for any failed worker: the first
failed worker's own code is read from torchrun's report), with its Hydra run dir at the absolute
<out>/trials/<variant>-n<seq_len>, keeps the trainer's output there in trainer.log, and reads back its summary.json
with `RunSummary.read`. The trainer runs in a process group of its own, so that stopping it (at the time limit, or
when the sweep itself gets SIGINT, SIGTERM or SIGHUP: the same signal is passed on) ends every process it started;
on Linux the kernel also stops it (SIGTERM) if the sweep dies, even by SIGKILL (minigpt/signals.py):

    status    when
    ok        exit code 0 and the summary says ok
    oom       exit code 3, or the summary says oom
    timeout   still running at the trial time limit (then stopped: SIGTERM, SIGKILL after a grace period)
    error     anything else, with the trainer's one-line message: a setting refused before the run
              started (exit code 2, no summary), a bad setting found later, a crash, a killed process

`TrialStore` is trials.jsonl: every trial that finished in an --out, appended as it ends. When a sweep runs
again there, ok and oom trials are results and are reused; a timeout is reused unless the new time limit is
longer than it ran; an error is run again (the setting may have been fixed, the fault may have passed).
"""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from minigpt.signals import Interrupted, own_group, stop_group
from minigpt.sweep.search import Trial, variant_overrides
from minigpt.summary import SUMMARY_FILE, ExitCode, RunSummary

TRAINER = (sys.executable, "-m", "minigpt")
TRIALS_FILE = "trials.jsonl"
LOG_FILE = "trainer.log"
STOP_GRACE_S = 30.0  # after SIGTERM at the time limit: time for the trainer to write its summary and W&B run


@dataclass
class SubprocessRunner:
    """Runs one trial, `runner(variant, seq_len) -> Trial`, as the trainer in a fresh process."""

    out_dir: Path
    base_overrides: list[str]
    sweep_id: str
    steps: int = 2
    time_limit_s: float = 600.0
    logger: str = "wandb"
    trainer: tuple[str, ...] = TRAINER
    nproc: int = 1  # processes per trial (torchrun on one node); 1 = the trainer alone
    context: int = 1  # parallel.context of each trial (divides nproc)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir).resolve()  # the trainer may run anywhere; its run dir must not move

    def run_dir(self, variant: str, seq_len: int) -> Path:
        return self.out_dir / "trials" / f"{variant}-n{seq_len}"

    def command(self, variant: str, seq_len: int) -> list[str]:
        run_dir = str(self.run_dir(variant, seq_len)).replace("'", "\\'")
        overrides = [*self.base_overrides, *variant_overrides(variant), f"seq_len={seq_len}", "batch_size=1",
                     f"max_steps={self.steps}", "warmup_steps=1", "eval_batches=0", "save_checkpoints=false",
                     f"logger={self.logger}", f"hydra.run.dir='{run_dir}'"]
        if self.logger == "wandb":
            overrides += [f"logger.group={self.sweep_id}", f"logger.run_name={variant}-n{seq_len}",
                          "logger.tags=[context-sweep]"]
        if self.context > 1:
            overrides.append(f"parallel.context={self.context}")
        if self.nproc > 1:  # torchrun runs the trainer's module (or script) in nproc processes
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                    str(self.nproc), *self.trainer[1:], *overrides]
        return [*self.trainer, *overrides]

    def __call__(self, variant: str, seq_len: int) -> Trial:
        run_dir = self.run_dir(variant, seq_len)
        shutil.rmtree(run_dir, ignore_errors=True)  # a retried trial must never read the last attempt's summary
        run_dir.mkdir(parents=True)
        t0 = time.perf_counter()
        with open(run_dir / LOG_FILE, "w") as log:
            proc = subprocess.Popen(self.command(variant, seq_len), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, **own_group())
            returncode = _wait(proc, self.time_limit_s)
        output = (run_dir / LOG_FILE).read_text(errors="replace")
        if self.nproc > 1:
            returncode = worker_exit_code(returncode, output)
        trial = read_trial(variant, seq_len, run_dir, returncode, output, time.perf_counter() - t0, self.time_limit_s)
        return replace(trial, run_dir=str(run_dir.relative_to(self.out_dir)))  # the record names no machine path


def _wait(proc: subprocess.Popen, limit_s: float) -> int | None:
    """The trainer's exit code, or None when it ran past the limit (it is stopped then)."""
    try:
        return proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        stop_group(proc, signal.SIGTERM, STOP_GRACE_S)
        return None
    except BaseException as e:  # the sweep is stopping: so does the trial, without being recorded
        stop_group(proc, e.signum if isinstance(e, Interrupted) else signal.SIGTERM, STOP_GRACE_S)
        raise


def worker_exit_code(returncode: int | None, output: str) -> int | None:
    """Under torchrun: the exit code of the first worker that failed (its report's `exitcode : 3`), which says
    more than torchrun's own 1; `returncode` when torchrun succeeded, was stopped or reported none."""
    if not returncode:
        return returncode
    root = output.rfind("Root Cause")  # torchrun's report lists the first failure there, other workers above
    found = re.search(r"exitcode\s*:\s*(-?\d+)", output[max(root, 0):])
    return int(found.group(1)) if found else returncode


def trainer_message(output: str) -> str | None:
    """The trainer's one-line reason: its last `error: ...` line, else its last line (a traceback's)."""
    lines = [line.strip() for line in output.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    line = errors[-1] if errors else lines[-1] if lines else None
    return line.removeprefix("error:").strip() if line else None


def read_trial(variant: str, seq_len: int, run_dir: Path, returncode: int | None, output: str, wall_s: float,
               time_limit_s: float) -> Trial:
    """The trial's outcome from the trainer's exit code (None: stopped at the time limit), summary and output."""
    summary, unreadable = None, None
    if (run_dir / SUMMARY_FILE).exists():
        try:
            summary = RunSummary.read(run_dir / SUMMARY_FILE)
        except (OSError, ValueError) as e:  # a half-written or foreign file: say so, never guess
            unreadable = f"unreadable {SUMMARY_FILE}: {e}"
    said = summary.status if summary else None
    if returncode is None:
        status, error = "timeout", f"still running at the {time_limit_s:.0f} s trial limit"
    elif returncode == ExitCode.OOM or said == "oom":
        status, error = "oom", None
    elif returncode == ExitCode.OK and said == "ok":
        status, error = "ok", None
    else:
        status, error = "error", _error_message(returncode, summary, unreadable, output)
    measured = summary if summary and status != "error" else None
    # under torchrun the fullest GPU decides what fits (the summary's own peak is rank 0's)
    peak = (measured.rank_peak_allocated_gib_max or measured.peak_allocated_gib) if measured else None
    return Trial(variant, seq_len, status,
                 peak_allocated_gib=peak,
                 peak_reserved_gib=measured.peak_reserved_gib if measured else None,
                 tokens_per_s=measured.tokens_per_s if measured else None,
                 step_time_s=measured.step_time_s if measured else None,
                 wall_s=wall_s, n_layer=summary.n_layer if summary else None, error=error, run_dir=str(run_dir),
                 exit_code=returncode,
                 # every rank pins its own offloaded blocks in the one host's memory
                 host_offload_gib=measured.peak_host_offload_gib * (measured.world_size or 1) if measured else None)


def _error_message(returncode: int, summary: RunSummary | None, unreadable: str | None, output: str) -> str:
    if unreadable:
        return unreadable
    if summary and summary.error:
        return summary.error
    if returncode < 0:
        return f"killed by signal {-returncode}"
    if returncode >= ExitCode.SIGNAL_BASE:
        return f"interrupted (exit code {returncode})"
    if returncode == ExitCode.OK:
        return f"the trainer exited 0 but its {SUMMARY_FILE} does not say ok"
    return trainer_message(output) or f"exit code {returncode}"


class TrialStore:
    """trials.jsonl of one --out: every finished trial there, one JSON object a line, in the order they ended."""

    def __init__(self, path: Path, warn: Callable[[str], None] = print):
        self.path = Path(path)
        self.trials: list[Trial] = []
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                self.trials.append(Trial(**json.loads(line)))
            except (ValueError, TypeError) as e:  # e.g. the last line of a sweep killed mid-write
                warn(f"{self.path}:{i}: not a trial record ({e}); ignored")

    def add(self, trial: Trial) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(trial)) + "\n")
        self.trials.append(trial)

    def latest(self) -> list[Trial]:
        """The newest record of each (variant, seq_len), in the order they first ran."""
        newest = {}
        for t in self.trials:
            newest[(t.variant, t.seq_len)] = t
        return list(newest.values())

    def reusable(self, variant: str, seq_len: int, time_limit_s: float) -> Trial | None:
        """The recorded result for this trial, or None if it must run (never ran, error, or a shorter limit)."""
        found = [t for t in self.trials if (t.variant, t.seq_len) == (variant, seq_len)]
        t = found[-1] if found else None
        if t is None or t.is_error or (t.status == "timeout" and (t.wall_s or 0.0) < time_limit_s):
            return None
        return t

"""The run lifecycle: claim the run directory, train, and always leave a summary, an exit code and a last line.

    run(cfg, logger=None) -> exit code          (minigpt/summary.py has the table of statuses and codes)

Nothing is lost:
- one run directory, one run: the run holds the directory's lock (`run.lock`, minigpt/runlock.py; the CLI takes
  it before Hydra writes there) and a run refused for any reason writes nothing there;
- a run never writes over another run: a directory that already holds a run's summary.json or checkpoints is
  refused (exit 2) unless the run resumes it (`resume=auto`); `resume=auto` on a finished run says so and
  changes nothing; a directory whose run failed before its first step is reused (its summary is kept as
  summary.failed<k>.json);
- SIGINT, SIGTERM and SIGHUP end the current step, write a checkpoint and summary.json (status `interrupted`) and
  exit 128 + signal; further signals meanwhile only print a note; a signal during setup stops at once; once every
  step is done the run is finished (status ok, exit 0), whatever signal arrives while it writes its summary;
- every run that started writes summary.json (first with status `running` and its pid and host, so after SIGKILL
  or the out-of-memory killer the next start there says that run was killed; a resumed run keeps the earlier
  attempt's as summary.attempt<k>.json), and its last line says where the results are, or, for a failure, what
  went wrong and what to do.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from minigpt.checkpoint import (CheckpointError, UnsafeCheckpointError, list_checkpoints, newest_intact,
                                resume_candidates, step_of)
from minigpt.config import ConfigError, TrainConfig
from minigpt.cuda_allocator import allocator_settings, use_allocator_settings
from minigpt.data import DataError
from minigpt import runlock
from minigpt.files import WriteError, process_alive, remove_stale_temps
from minigpt.loggers import Logger, MetricsHistory, NullLogger, build_logger, read_history
from minigpt.metrics import git_commit, peak_memory_gib, versions
from minigpt.distributed.mesh import Mesh
from minigpt.distributed.process import TorchrunProcess
from minigpt.distributed.reductions import max_int, on_main
from minigpt.signals import Interrupted, StopSignals
from minigpt.summary import SUMMARY_FILE, ExitCode, RunSummary
from minigpt.train import TrainingError, build, train_loop


class AgreedStop:
    """A stop request that every rank sees at the same step: each call all-reduces the signal numbers (max), so a
    signal on any rank stops all of them after the same step. `signum` is the agreed signal, once there is one."""

    def __init__(self, mesh: Mesh, signals: StopSignals):
        self.mesh, self.signals, self.signum = mesh, signals, None

    def __call__(self) -> bool:
        agreed = max_int(self.mesh, self.signals.signum or 0)
        if agreed:
            self.signum = agreed
        return bool(agreed)


def _earlier_summary(run_dir: Path) -> RunSummary | None:
    try:
        return RunSummary.read(run_dir / SUMMARY_FILE)
    except (OSError, ValueError):
        return None


def _steps_done(cfg: TrainConfig) -> int:
    """The steps a run in cfg.run_dir did, by its newest checkpoint and its metrics.jsonl."""
    steps = [step_of(p) for p in list_checkpoints(cfg.ckpt_dir)]
    if (Path(cfg.run_dir) / MetricsHistory.FILE).is_file():
        steps += [r["step"] for r in read_history(cfg.run_dir) if isinstance(r.get("step"), int)]
    return max(steps, default=0)


def killed_run(cfg: TrainConfig) -> str | None:
    """If the summary in cfg.run_dir says `running` and its process is gone: what happened to it, else None."""
    earlier = _earlier_summary(Path(cfg.run_dir))
    if earlier is None or earlier.status != "running" or earlier.pid is None:
        return None
    if earlier.host == socket.gethostname() and (earlier.pid == os.getpid() or process_alive(earlier.pid)):
        return None
    return (f"its run (pid {earlier.pid} on {earlier.host}) was killed after step {_steps_done(cfg)} "
            f"(SIGKILL, or the out-of-memory killer?)")


def failed_before_first_step(cfg: TrainConfig) -> bool:
    """The run in cfg.run_dir ended (or was killed) before its first step: nothing of it to keep but its summary."""
    earlier = _earlier_summary(Path(cfg.run_dir))
    return earlier is not None and earlier.status != "ok" and not list_checkpoints(cfg.ckpt_dir) and \
        (earlier.status != "running" or killed_run(cfg) is not None) and _steps_done(cfg) == 0


def claim_run_dir(cfg: TrainConfig, key: str = "hydra.run.dir", subject: str | None = None) -> str | None:
    """Refuse (ConfigError) a directory that holds another run unless resuming it; returns a message when the
    run to resume has already finished (nothing to do), else None. Reads only. `key`: the setting that chose the
    directory, which the advice names (a multirun's job: hydra.sweep.dir); `subject`: what the line is about."""
    run_dir, ckpts = Path(cfg.run_dir), list_checkpoints(cfg.ckpt_dir)
    summary_path = run_dir / SUMMARY_FILE
    killed = killed_run(cfg)
    if cfg.resume == "none":
        if ckpts:
            inside = Path(cfg.ckpt_dir).absolute().is_relative_to(run_dir.absolute())  # else a new ckpt_dir will do
            raise ConfigError(f"ckpt_dir={cfg.ckpt_dir}: holds checkpoints of another run (newest: step "
                              f"{step_of(ckpts[-1])}{'; ' + killed if killed else ''}); continue it with resume=auto, "
                              f"or choose a new {key if inside else 'ckpt_dir'}")
        if summary_path.exists() and not failed_before_first_step(cfg):
            raise ConfigError(f"{subject or key + '=' + str(cfg.run_dir)}: holds another run's {SUMMARY_FILE}"
                              f"{' (' + killed + ')' if killed else ''}; choose a new {key}, or continue that run with "
                              f"resume=auto")
        return None
    if cfg.resume != "auto":
        return None
    candidates = resume_candidates(cfg.ckpt_dir, run_dir)
    done = [p for p in candidates if step_of(p) >= cfg.max_steps]
    if done:  # finished only if one of these loads (not a damaged file or a directory with such a name)
        try:
            newest = step_of(newest_intact(done)[0])
        except UnsafeCheckpointError:  # a ConfigError: refused with one line, exit code 2
            raise
        except CheckpointError:
            newest = None  # build() falls back to an older one, with the warning
        if newest is not None:
            return (f"the run in {cfg.run_dir} already finished: its newest checkpoint is at step {newest} and "
                    f"max_steps={cfg.max_steps}; nothing changed (raise max_steps to train further)")
    if not candidates and summary_path.exists():
        earlier = _earlier_summary(run_dir)
        if earlier is not None and earlier.status == "ok" and earlier.steps >= cfg.max_steps:
            return (f"the run in {cfg.run_dir} already finished ({earlier.steps} steps, max_steps={cfg.max_steps}); "
                    f"nothing changed (it kept no checkpoint to continue from)")
    return None


def take_run_dir(cfg: TrainConfig) -> str | None:
    """claim_run_dir, then cfg.run_dir's lock (minigpt/runlock.py), held until release_run_dir. A refused run
    (ConfigError) writes nothing there. Returns claim_run_dir's message of a finished run (then no lock is held)."""
    runlock.check_free(cfg.run_dir)  # a live run's directory is refused as such, before what is in it is judged
    if finished := claim_run_dir(cfg):
        return finished
    runlock.lock(cfg.run_dir)
    try:
        finished = claim_run_dir(cfg)  # again under the lock: a run that ended between the look and the lock
    except BaseException:
        runlock.unlock(cfg.run_dir)
        raise
    if finished:
        runlock.unlock(cfg.run_dir)
    return finished


def release_run_dir(cfg: TrainConfig) -> None:
    runlock.unlock(cfg.run_dir)


def keep_earlier_summary(cfg: TrainConfig) -> str | None:
    """The earlier summary.json of cfg.run_dir is kept beside the new one: summary.attempt<k>.json for a resumed
    run, summary.failed<k>.json for a run that failed before its first step. Returns the line that says what the
    new run found (a killed run, a failed one), or None."""
    run_dir = Path(cfg.run_dir)
    path, killed = run_dir / SUMMARY_FILE, killed_run(cfg)
    holder = runlock.reclaimed(run_dir)
    if not path.exists():
        return f"hydra.run.dir={cfg.run_dir}: reclaimed the lock of {holder}, which is gone" if holder else None
    kind = "attempt" if cfg.resume != "none" else "failed"
    k = 1 + sum(1 for _ in run_dir.glob(f"summary.{kind}*.json"))
    kept = run_dir / f"summary.{kind}{k}.json"
    earlier = _earlier_summary(run_dir)
    path.rename(kept)
    if killed:
        return f"hydra.run.dir={cfg.run_dir}: {killed}; its summary is kept as {kept.name}"
    if kind == "failed":
        why = f" ({earlier.status}: {earlier.error})" if earlier and earlier.error else ""
        return f"hydra.run.dir={cfg.run_dir}: its earlier run failed before its first step{why}; its summary is " \
               f"kept as {kept.name}"
    return None


def new_summary(cfg: TrainConfig) -> RunSummary:
    return RunSummary(
        status="running", max_steps=cfg.max_steps, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
        grad_accum=cfg.grad_accum, attention=cfg.attention.name, attention_options=cfg.attention.options(),
        levers=cfg.model.levers(), compile=cfg.compile_enabled(), model=cfg.model.name, n_layer=cfg.model.n_layer,
        commit=git_commit(), run_dir=str(cfg.run_dir), pid=os.getpid(), host=socket.gethostname(), **versions())


def _oom_line(cfg: TrainConfig, alloc: float) -> str:
    return (f"out of memory: seq_len={cfg.seq_len} attention={cfg.attention.name} model={cfg.model.name} "
            f"batch={cfg.batch_size}, peak {alloc:.1f} GiB allocated; try attention=flash, a smaller seq_len or "
            f"batch_size, model.recompute_every=1, model.loss_chunk=4096 (docs/memory.md)")


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


def _failure(e: BaseException, cfg: TrainConfig, summary: RunSummary) -> tuple[int, str]:
    """(exit code, one line for the user) for an exception that ended the run; updates the summary."""
    if isinstance(e, Interrupted):
        summary.status = "interrupted"
        return ExitCode.SIGNAL_BASE + e.signum, f"{e} during setup: no training step ran"
    if _is_oom(e):
        alloc, reserved = peak_memory_gib(cfg.torch_device())
        summary.peak_allocated_gib = max(summary.peak_allocated_gib, alloc)
        summary.peak_reserved_gib = max(summary.peak_reserved_gib, reserved)
        summary.status, summary.error = "oom", "CUDA out of memory"
        return ExitCode.OOM, _oom_line(cfg, summary.peak_allocated_gib)
    summary.status = "error"
    if isinstance(e, ConfigError):
        code, line = ExitCode.BAD_SETTING, str(e)
    elif isinstance(e, (DataError, CheckpointError, TrainingError, WriteError)):
        code, line = ExitCode.ERROR, str(e)
    else:
        traceback.print_exc()
        code, line = ExitCode.ERROR, f"{type(e).__name__}: {e} (a bug? the traceback is above)"
    summary.error = line
    return code, line


def run(cfg: TrainConfig, logger: Logger | None = None, config_dict: dict[str, Any] | None = None) -> int:
    """Train as configured, write summary.json into cfg.run_dir, and return the process exit code.

    `logger` defaults to the one cfg.logger names; tests pass their own to see the metrics. Under torchrun the
    process joins torchrun's process group (unless its caller did) and leaves it at the end, also on errors;
    rank 0 writes the files and the console lines, the other ranks print only their own errors. The CUDA allocator
    gets cfg.cuda_alloc_conf first, before anything starts CUDA here (minigpt/cuda_allocator.py).
    """
    use_allocator_settings(cfg.cuda_alloc_conf)  # before the mesh and the model start CUDA in this process
    with TorchrunProcess() as process, StopSignals(again=AGAIN) as stop:
        mesh = Mesh.setup(cfg.parallel.context, cfg.torch_device().type)
        code = _run(cfg, logger, config_dict, mesh, stop)
        process.ok = code == ExitCode.OK
        return code


AGAIN = "already stopping (checkpoint and summary.json are being written); please wait"
STEP_NOTE = "finishing this step, then writing a checkpoint and summary.json"
DONE_NOTE = "the training steps are done: the run is complete; writing its summary"


def _run(cfg: TrainConfig, logger: Logger | None, config_dict: dict[str, Any] | None, mesh: Mesh,
         stop: StopSignals) -> int:
    config_dict = config_dict if config_dict is not None else asdict(cfg)
    try:  # rank 0 looks at the directory, takes its lock and tells the others
        finished = on_main(mesh, lambda: take_run_dir(cfg))
    except ConfigError as e:  # nothing of this run exists yet, and the other run's files stay untouched
        if mesh.is_main:
            print(f"error: {e}", file=sys.stderr)
        return ExitCode.BAD_SETTING
    if finished:
        print(finished)
        return ExitCode.OK

    summary = new_summary(cfg)
    summary.world_size, summary.context_parallel = mesh.world, mesh.cp
    summary.cuda_alloc_conf = allocator_settings()
    summary_path = Path(cfg.run_dir) / SUMMARY_FILE
    t_start = time.perf_counter()
    code, line = ExitCode.OK, ""
    stop.note = STEP_NOTE
    stop_requested = AgreedStop(mesh, stop)  # under torchrun: a signal on any rank stops all at one step
    try:
        if mesh.is_main:
            if found := keep_earlier_summary(cfg):
                print(found)
            for directory in (cfg.run_dir, cfg.ckpt_dir):  # temp files of a killed run's writes
                remove_stale_temps(directory)
            summary.write(cfg.run_dir)  # `running`, with this pid and host: even SIGKILL leaves a summary
        logger = logger or (NullLogger() if not mesh.is_main else build_logger(
            cfg.logger, f"{cfg.attention.name}-{cfg.model.name}-n{cfg.seq_len}", cfg.run_dir, config_dict))
        summary.wandb = logger.location
        if mesh.is_main:  # the curves also as metrics.jsonl in the run directory
            logger = MetricsHistory(logger, cfg.run_dir)
        training = build(cfg, config_dict, summary, mesh)
        stop.immediate = False  # from here a signal ends the current step
        train_loop(training, logger, summary, stop_requested)
        signum = stop.signum or stop_requested.signum
        if summary.steps >= cfg.max_steps:  # every step done: finished, whatever arrives now
            stop.note, summary.status = DONE_NOTE, "ok"
        elif signum is not None:
            summary.status, code = "interrupted", ExitCode.SIGNAL_BASE + signum
            line = (f"interrupted by {signal.Signals(signum).name} after step {summary.steps}"
                    + (f"; checkpoint {summary.checkpoint}" if summary.checkpoint else "")
                    + f"; continue with resume=auto hydra.run.dir={cfg.run_dir}")
        else:
            summary.status = "ok"
    except BaseException as e:  # noqa: BLE001 - every failure must still produce a summary and one line
        stop.immediate = False  # failure handling must not be cut short by a signal
        code, line = _failure(e, cfg, summary)
    finally:
        stop.immediate = False
        summary.exit_code, summary.wall_time_s = int(code), time.perf_counter() - t_start
        try:
            if mesh.is_main:
                summary.write(cfg.run_dir)
            logger = logger or NullLogger()
            logger.log({"status/ok": float(summary.status == "ok"), "status/oom": float(summary.status == "oom")},
                       step=summary.steps)
            logger.finish(asdict(summary), int(code))
        finally:
            if mesh.is_main:
                release_run_dir(cfg)
    where = f"summary {summary_path}" + (f", checkpoint {summary.checkpoint}" if summary.checkpoint else "") + \
        (f", W&B {summary.wandb}" if summary.wandb else "")
    if code == ExitCode.OK:
        late = stop.signum or stop_requested.signum
        print(f"done: {summary.steps} steps; {where}" +
              (f" ({signal.Signals(late).name} arrived after the last step)" if late else ""))
    elif not mesh.is_main:  # its own failure (a setting refused on every rank is rank 0's line)
        if summary.status != "interrupted" and code != ExitCode.BAD_SETTING:
            print(f"error: rank {mesh.rank}: {line}", file=sys.stderr)
    else:
        print(f"error: {line} ({where})" if summary.status != "interrupted" else f"{line} ({where})",
              file=sys.stderr)
    return int(code)

"""The run lifecycle (issue 32): every run that started ends with one line, its exit code and its summary, whatever
stops it and whenever (a signal at setup, in a step, a save or an eval; SIGKILL); one run directory, one run (the
lock); a finished run stays finished; a sweep's trials end with the sweep; W&B, unwritable paths and unquoted
overrides are refused up front with one line. The CLI runs as a user starts it (test_faults.py's helpers).

`slow` (subprocess runs of the trainer): `pytest -m slow tests/test_lifecycle.py`. The fast tier keeps one
representative fault (a live run's directory is refused and left untouched) and the in-process units.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minigpt import loggers, runlock
from minigpt.compose import check_overrides
from minigpt.config import ConfigError, LoggerConfig
from minigpt.summary import RunSummary
from test_faults import TINY, _start_and_signal, cli, one_line_error

slow = pytest.mark.slow
NO_EVAL = [a for a in TINY if not a.startswith("eval_batches")]

# The trainer's CLI with one function made slow (4 s, at its first call, after creating `marker`), so that a signal
# sent once the marker exists arrives while the run is in that phase.
PHASE = """
import pathlib, sys, time
import minigpt.loggers, minigpt.run, minigpt.train
phase, marker = sys.argv.pop(1), pathlib.Path(sys.argv.pop(1))
owner, name = {"before-run": (minigpt.run, "run"), "setup": (minigpt.run, "build"),
               "step": (minigpt.train, "train_step"), "save": (minigpt.train, "save"),
               "eval": (minigpt.train, "evaluate"), "finish": (minigpt.loggers.MetricsHistory, "finish")}[phase]
real = getattr(owner, name)
def slow(*a, **k):
    if not marker.exists():
        marker.touch()
        time.sleep(4)
    return real(*a, **k)
setattr(owner, name, slow)
from minigpt.cli import train_main
sys.exit(train_main())
"""


def in_phase(tmp_path: Path, phase: str, sig: int, *args: str, **popen) -> subprocess.CompletedProcess:
    """Run the trainer (hydra.run.dir=run), send `sig` while it is in `phase`; its completed process."""
    marker = tmp_path / f"marker-{phase}"
    proc = subprocess.Popen([sys.executable, "-c", PHASE, phase, str(marker), *args, "hydra.run.dir=run"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, **popen)
    deadline = time.time() + 120
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=180)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def gone(pid: int) -> bool:
    """No process `pid`, or only its zombie (a container's init may not reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return not os.path.exists(f"/proc/{pid}")


def listing(directory: Path) -> dict[str, int]:
    """Every path under directory (and itself) with its mtime in ns."""
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in [directory, *directory.rglob("*")]}


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------------------------
# One run directory, one run
# ------------------------------------------------------------------------------------------------
def test_a_live_runs_directory_is_refused_and_left_untouched(tmp_path):
    """The representative fault of the fast tier: another run (here this test process) holds the lock."""
    run = tmp_path / "run"
    runlock.lock(run)
    try:
        (run / "something.txt").write_text("of the live run")
        before = listing(run)
        time.sleep(0.01)
        proc = cli(tmp_path, *TINY, "max_steps=1", "hydra.run.dir=run")
        one_line_error(proc, 2, "in use by another run", f"pid {os.getpid()}", "choose another hydra.run.dir")
        assert listing(run) == before  # nothing written: no .hydra/, no log, no summary, no mtime changed
    finally:
        runlock.unlock(run)
    assert not (run / runlock.LOCK_FILE).exists()


def test_the_lock_counts_takes_and_reclaims_a_dead_owners_lock(tmp_path):
    path = tmp_path / runlock.LOCK_FILE
    path.write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname(), "started": "then"}))
    runlock.check_free(tmp_path)  # a dead owner's lock is no refusal, and looking writes nothing
    runlock.lock(tmp_path)
    runlock.lock(tmp_path)  # again, as the CLI and then the run take it
    assert runlock.reclaimed(tmp_path).host == socket.gethostname()
    assert json.loads(path.read_text())["pid"] == os.getpid()
    runlock.unlock(tmp_path)
    assert path.exists()
    runlock.unlock(tmp_path)
    assert not path.exists()


def test_a_lock_of_another_host_is_not_reclaimed(tmp_path):
    path = tmp_path / runlock.LOCK_FILE
    path.write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "then"}))
    for take in (runlock.check_free, runlock.lock):
        with pytest.raises(ConfigError, match=f"remove {path}"):
            take(tmp_path)
    assert json.loads(path.read_text())["host"] == "elsewhere"


@slow
def test_a_stale_lock_is_reclaimed_with_a_line(tmp_path):
    (tmp_path / "run").mkdir()
    pid = dead_pid()
    (tmp_path / "run" / runlock.LOCK_FILE).write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
    proc = cli(tmp_path, *TINY, "max_steps=1", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr
    assert f"reclaimed the lock of pid {pid}" in proc.stdout and not (tmp_path / "run" / runlock.LOCK_FILE).exists()


@slow
def test_a_folder_whose_run_failed_before_its_first_step_is_reused(tmp_path):
    failed = cli(tmp_path, *TINY, "max_steps=1", "model.vocab_size=100", "hydra.run.dir=run")
    one_line_error(failed, 2, "model.vocab_size=100")
    proc = cli(tmp_path, *TINY, "max_steps=1", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr
    assert "failed before its first step" in proc.stdout and "summary.failed1.json" in proc.stdout
    assert RunSummary.read(tmp_path / "run" / "summary.failed1.json").status == "error"
    assert RunSummary.read(tmp_path / "run" / "summary.json").status == "ok"


# A multirun (-m): Hydra writes multirun.yaml, each job's .hydra/ and cli.log before our job function runs, so its
# jobs are checked and their folders locked before Hydra starts (minigpt/multirun.py)
@slow
def test_a_multirun_whose_job_folder_is_in_use_writes_nothing(tmp_path):
    runlock.lock(tmp_path / "S" / "0")  # a live run (this test process) in job 0's folder
    try:
        before = listing(tmp_path / "S")
        time.sleep(0.01)
        proc = cli(tmp_path, "-m", *TINY, "max_steps=1", "hydra.sweep.dir=S", "seed=1")
        one_line_error(proc, 2, "S/0 (job #0 of the multirun): in use by another run", f"pid {os.getpid()}",
                       "choose another hydra.sweep.dir")
        assert listing(tmp_path / "S") == before  # no multirun.yaml, .hydra/ or cli.log; no mtime changed
    finally:
        runlock.unlock(tmp_path / "S" / "0")


@slow
def test_a_multirun_into_a_finished_sweep_leaves_it_untouched(tmp_path):
    proc = cli(tmp_path, "-m", *TINY, "max_steps=1", "hydra.sweep.dir=S", "seed=1,2")  # into a fresh folder: runs
    assert proc.returncode == 0 and "2 of 2 jobs ok" in proc.stdout, proc.stderr[-2000:]
    assert all(RunSummary.read(tmp_path / "S" / k / "summary.json").status == "ok" for k in "01")
    assert not list((tmp_path / "S").rglob(runlock.LOCK_FILE))  # every job's lock given back
    before = listing(tmp_path / "S")
    config = (tmp_path / "S" / "0" / ".hydra" / "config.yaml").read_bytes()
    time.sleep(0.01)
    one_line_error(cli(tmp_path, "-m", *TINY, "max_steps=1", "hydra.sweep.dir=S", "seed=3,4"), 2,
                   "holds checkpoints of another run", "or choose a new hydra.sweep.dir")
    proc = cli(tmp_path, "-m", *TINY, "max_steps=1", "hydra.sweep.dir=S", "seed=1,2", "resume=auto")
    assert proc.returncode == 0 and proc.stdout.count("already finished") == 2, proc.stderr[-2000:]
    assert "Launching" not in proc.stdout + proc.stderr  # every job finished: Hydra did not start
    assert listing(tmp_path / "S") == before and \
        (tmp_path / "S" / "0" / ".hydra" / "config.yaml").read_bytes() == config

# ------------------------------------------------------------------------------------------------
# Signals: one line, 128 + signal, a summary; at any phase
# ------------------------------------------------------------------------------------------------
PHASE_ARGS = [*NO_EVAL, "eval_batches=1", "eval_every=1", "ckpt_every=1", "max_steps=5"]


@slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
@pytest.mark.parametrize("phase, steps", [("setup", 0), ("step", 1), ("save", 2), ("eval", 1)])
def test_a_signal_in_any_phase_ends_with_one_line_its_code_and_summary(tmp_path, phase, steps, sig):
    proc = in_phase(tmp_path, phase, sig, *PHASE_ARGS)
    assert proc.returncode == 128 + sig, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    line = last_line(proc.stderr)
    assert line.startswith(f"interrupted by {sig.name}") and "summary.json" in line, line
    s = RunSummary.read(tmp_path / "run" / "summary.json")
    assert (s.status, s.exit_code, s.steps) == ("interrupted", 128 + sig, steps)
    if steps:  # the step ends, a checkpoint of it is written, and the line says how to continue
        assert s.checkpoint and Path(s.checkpoint).name == f"ckpt_{steps:08d}.pt" and "resume=auto" in line
    else:
        assert "during setup" in line
    assert not (tmp_path / "run" / runlock.LOCK_FILE).exists()


@slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_run_stopped_by_a_signal_then_resumed_has_the_losses_of_one_that_was_not(tiny_config, monkeypatch, sig):
    """Nothing lost, to the bit that matters: the signal arrives inside step 3, the step ends with its checkpoint,
    and resume=auto continues with the very losses (and val loss) an uninterrupted run has."""
    import minigpt.train as train
    from conftest import RecordingLogger
    from minigpt.run import run

    args = ("max_steps=6", "lr_decay_steps=6", "ckpt_every=0", "eval_every=3")
    straight = RecordingLogger()
    assert run(tiny_config(*args), logger=straight) == 0
    for path in Path(tiny_config().run_dir).iterdir():  # the same run directory again, empty
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    real = train.train_step

    def signalled(t, step):
        loss = real(t, step)
        if step == 2:
            os.kill(os.getpid(), sig)
        return loss
    head, tail = RecordingLogger(), RecordingLogger()
    with monkeypatch.context() as m:
        m.setattr(train, "train_step", signalled)
        assert run(tiny_config(*args), logger=head) == 128 + sig
    s = RunSummary.read(Path(tiny_config().run_dir) / "summary.json")
    assert (s.status, s.steps) == ("interrupted", 3) and Path(s.checkpoint).name == "ckpt_00000003.pt"
    assert run(tiny_config(*args, "resume=auto"), logger=tail) == 0
    assert len(head.series("train/loss")) == 3 and len(tail.series("train/loss")) == 3
    assert head.series("train/loss") + tail.series("train/loss") == pytest.approx(straight.series("train/loss"),
                                                                                  rel=1e-6, abs=1e-7)
    assert head.series("eval/val_loss") + tail.series("eval/val_loss") == pytest.approx(
        straight.series("eval/val_loss"), rel=1e-6, abs=1e-7)


@slow
def test_a_signal_before_the_run_started_leaves_the_folder_free(tmp_path):
    proc = in_phase(tmp_path, "before-run", signal.SIGTERM, *TINY, "max_steps=1")
    one_line_error(proc, 128 + signal.SIGTERM, "interrupted by SIGTERM before the run started")
    assert not (tmp_path / "run" / "summary.json").exists() and not (tmp_path / "run" / runlock.LOCK_FILE).exists()
    assert cli(tmp_path, *TINY, "max_steps=1", "hydra.run.dir=run").returncode == 0


@slow
@pytest.mark.parametrize("phase", ["eval", "finish"], ids=["final-eval", "logger-finish"])
def test_a_run_whose_steps_all_finished_stays_finished(tmp_path, phase):
    proc = in_phase(tmp_path, phase, signal.SIGTERM, *NO_EVAL, "eval_batches=1", "max_steps=2")
    assert proc.returncode == 0, proc.stderr
    assert last_line(proc.stdout).startswith("done: 2 steps") and "SIGTERM arrived after the last step" in proc.stdout
    s = RunSummary.read(tmp_path / "run" / "summary.json")
    assert (s.status, s.exit_code, s.steps) == ("ok", 0, 2)


@slow
def test_sighup_under_nohup_is_left_ignored(tmp_path):
    def nohup():
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    proc = in_phase(tmp_path, "step", signal.SIGHUP, *TINY, "max_steps=2", preexec_fn=nohup)
    assert proc.returncode == 0 and RunSummary.read(tmp_path / "run" / "summary.json").steps == 2, proc.stderr


def test_blocked_stop_signals_are_unblocked_where_handled_and_in_started_children():
    """A parent that blocks the stop signals (some CI runners do) must not make a run unstoppable."""
    code = """
import signal, subprocess, sys
from minigpt.signals import StopSignals, own_group
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
show = "import signal; print(sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))"
print(subprocess.run([sys.executable, "-c", show], capture_output=True, text=True).stdout.strip())
print(subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, **own_group()).stdout.strip())
with StopSignals():
    exec(show)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    inherited, own, handled = out.stdout.splitlines()
    assert inherited == "['SIGHUP', 'SIGINT', 'SIGTERM']"  # the check can fail: a plain child keeps the mask
    assert own == "[]" and handled == "[]"


def test_a_stop_inside_the_python_api_leaves_the_handlers_as_found_and_a_command_ignores_later_ones():
    """The in-process API (StopSignals without exiting) restores the handlers it found after a stop signal, so a
    notebook, or the test process before its next child, keeps them; a command's outermost context (exiting=True)
    ignores later stop signals while its process ends."""
    from minigpt.signals import StopSignals

    found = signal.getsignal(signal.SIGTERM)
    for exiting in (False, True):
        with StopSignals(exiting=exiting) as stop:
            stop.immediate = False  # record the signal, as a run does once it has a step to finish
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.time() + 5
            while not stop.requested() and time.time() < deadline:
                time.sleep(0.01)
        assert stop.requested()
        assert signal.getsignal(signal.SIGTERM) == (signal.SIG_IGN if exiting else found)
    signal.signal(signal.SIGTERM, found)


@slow
def test_a_killed_run_is_named_at_the_next_start(tmp_path):
    proc = _start_and_signal(tmp_path, signal.SIGKILL, seq_len=128)  # after its first checkpoint
    proc.wait(timeout=60)
    killed = RunSummary.read(tmp_path / "run" / "summary.json")
    assert killed.status == "running" and killed.pid == proc.pid and killed.host == socket.gethostname()
    assert (tmp_path / "run" / runlock.LOCK_FILE).exists()
    again = cli(tmp_path, *TINY, "max_steps=1000", "hydra.run.dir=run")
    one_line_error(again, 2, f"pid {proc.pid}", "was killed after step", "resume=auto")
    newest = max(int(p.stem[5:]) for p in (tmp_path / "run" / "checkpoints").glob("ckpt_*.pt"))
    resumed = cli(tmp_path, *TINY, f"max_steps={newest + 1}", "resume=auto", "hydra.run.dir=run")
    assert resumed.returncode == 0, resumed.stderr
    assert f"pid {proc.pid}" in resumed.stdout and "was killed after step" in resumed.stdout  # its last logged step
    assert RunSummary.read(tmp_path / "run" / "summary.attempt1.json").pid == proc.pid


@slow
def test_a_run_killed_before_its_first_step_leaves_a_reusable_folder(tmp_path):
    proc = in_phase(tmp_path, "setup", signal.SIGKILL, *TINY, "max_steps=1")
    assert proc.returncode == -signal.SIGKILL
    again = cli(tmp_path, *TINY, "max_steps=1", "hydra.run.dir=run")
    assert again.returncode == 0, again.stderr
    assert "was killed after step 0" in again.stdout and "summary.failed1.json" in again.stdout
    assert RunSummary.read(tmp_path / "run" / "summary.failed1.json").status == "running"


# ------------------------------------------------------------------------------------------------
# A sweep's trials end with it
# ------------------------------------------------------------------------------------------------
def start_sweep(tmp_path: Path) -> tuple[subprocess.Popen, RunSummary]:
    """A CPU sweep whose first trial trains for a long time; returns it and that trial's running summary."""
    proc = subprocess.Popen([sys.executable, "-m", "minigpt.sweep.sweep", "--cpu", "--variants", "sdpa", "--steps",
                             "100000", "--trial-time-limit", "600", "--logger", "none", "--out", "out"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    trial = tmp_path / "out" / "trials" / "sdpa-n128"
    deadline = time.time() + 120
    while not (trial / "metrics.jsonl").exists() and time.time() < deadline:  # its first step is done
        time.sleep(0.1)
    return proc, RunSummary.read(trial / "summary.json")


@slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stopped_sweep_stops_its_trial_and_writes_its_report(tmp_path, sig):
    proc, trial = start_sweep(tmp_path)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, (out[-2000:], err[-2000:])
    assert "Traceback" not in err and last_line(err).startswith(f"interrupted by {sig.name}")
    assert (tmp_path / "out" / "results.md").exists() and gone(trial.pid)
    stopped = RunSummary.read(tmp_path / "out" / "trials" / "sdpa-n128" / "summary.json")
    assert (stopped.status, stopped.exit_code) == ("interrupted", 128 + sig)


@slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_a_killed_sweeps_trial_stops_too(tmp_path):
    proc, trial = start_sweep(tmp_path)
    proc.kill()
    proc.wait()
    deadline = time.time() + 60
    while not gone(trial.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert gone(trial.pid)
    stopped = RunSummary.read(tmp_path / "out" / "trials" / "sdpa-n128" / "summary.json")
    assert (stopped.status, stopped.exit_code) == ("interrupted", 128 + signal.SIGTERM)


# ------------------------------------------------------------------------------------------------
# Refused up front: W&B without its server, unwritable paths, unquoted overrides
# ------------------------------------------------------------------------------------------------
UNREACHABLE = {"WANDB_API_KEY": "x" * 40, "WANDB_MODE": "online", "WANDB_BASE_URL": "http://127.0.0.1:9"}


def test_an_unreachable_wandb_server_is_refused_quickly(monkeypatch):
    for key, value in UNREACHABLE.items():
        monkeypatch.setenv(key, value)
    loggers._unreachable.cache_clear()  # asked once per process: ask again here
    tried = []
    real = loggers.socket.create_connection
    monkeypatch.setattr(loggers.socket, "create_connection",
                        lambda address, timeout=None, **kw: tried.append((address, timeout)) or real(address, timeout, **kw))
    with pytest.raises(ConfigError, match="cannot reach the W&B server http://127.0.0.1:9.*WANDB_MODE=offline"):
        loggers.check_wandb(LoggerConfig(name="wandb"))
    assert tried == [(("127.0.0.1", 9), loggers.WANDB_CONNECT_TIMEOUT_S)]  # one try, bounded: no W&B retry loop


@slow
def test_wandb_online_without_its_server_is_one_line_exit_2(tmp_path):
    proc = cli(tmp_path, *[a for a in TINY if a != "logger=none"], "logger=wandb", "max_steps=1", "hydra.run.dir=run",
               env=UNREACHABLE)
    one_line_error(proc, 2, "cannot reach the W&B server", "WANDB_MODE=offline")
    assert not (tmp_path / "run").exists()


@slow
@pytest.mark.parametrize("logger", [["logger=none"], ["logger=wandb", "logger.mode=offline"],
                                    ["logger=wandb", "logger.mode=disabled"]], ids=["none", "offline", "disabled"])
def test_other_loggers_work_without_a_wandb_server(tmp_path, logger):
    env = {**UNREACHABLE, "WANDB_MODE": ""}
    proc = cli(tmp_path, *[a for a in TINY if a != "logger=none"], *logger, "max_steps=1", "hydra.run.dir=run", env=env)
    assert proc.returncode == 0, proc.stderr
    assert RunSummary.read(tmp_path / "run" / "summary.json").status == "ok"


def _unwritable(tmp_path: Path, how: str) -> Path:
    if how == "under-a-file":
        (tmp_path / "a-file").write_text("not a directory")
        return tmp_path / "a-file" / "sub"
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only (chmod) directory; the under-a-file case covers root")
    locked = tmp_path / "read-only"
    locked.mkdir(mode=0o555)
    return locked / "sub"


def _pointing_at(tmp_path, key: str, bad) -> tuple[list[str], dict[str, str]]:
    """A one-step tiny run's arguments and environment with `key` (a setting, or WANDB_DIR) pointing at `bad`."""
    args, env = [*TINY, "max_steps=1"], {}
    if key == "data.cache_dir":
        (tmp_path / "corpus.txt").write_text("some text\n" * 100)
        args += ["data=text", "data.path=corpus.txt"]
    if key == "WANDB_DIR":
        args, env = [*[a for a in args if a != "logger=none"], "logger=wandb"], {"WANDB_MODE": "offline",
                                                                               "WANDB_DIR": str(bad)}
    else:
        args.append(f"{key}={bad}")
    if key != "hydra.run.dir":
        args.append("hydra.run.dir=run")
    return args, env


@slow
@pytest.mark.parametrize("how", ["under-a-file", "chmod"])
@pytest.mark.parametrize("key", ["hydra.run.dir", "ckpt_dir", "data.cache_dir", "WANDB_DIR"])
def test_an_unwritable_directory_is_one_line_exit_2(tmp_path, key, how):
    bad = _unwritable(tmp_path, how)
    args, env = _pointing_at(tmp_path, key, bad)
    one_line_error(cli(tmp_path, *args, env=env), 2, f"{key}={bad}", "point", "writable")
    assert not (tmp_path / "run").exists() and not (tmp_path / "outputs").exists()


def _read_only_mounts() -> bool:
    """Whether this machine lets an unprivileged user namespace mount a file system (unshare -rm): where it does, a
    test can make a real read-only file system, which refuses root too (the chmod case is skipped for root)."""
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or not _read_only_mounts(),
                    reason="needs unshare -rm (a user namespace) to mount a read-only file system")
@pytest.mark.parametrize("key", ["hydra.run.dir", "ckpt_dir", "data.cache_dir", "WANDB_DIR"])
def test_a_read_only_file_system_is_one_line_exit_2(tmp_path, key):
    """The first round's case: the run folder on a read-only file system (EROFS) ended in a traceback from Hydra's
    logging setup. A tmpfs mounted read-only in a user namespace, the CLI started inside it."""
    mount = tmp_path / "ro"
    mount.mkdir()
    bad = mount / "sub"
    args, env = _pointing_at(tmp_path, key, bad)
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o ro none "$0" && exec "$@"', str(mount),
                           sys.executable, "-m", "minigpt", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    one_line_error(proc, 2, f"{key}={bad}", f"{mount} is on a read-only file system", "point", "writable")
    assert not (tmp_path / "run").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("argv, hint", [
    (["data.path=/a", "b/c"], """'data.path="/a b/c"'"""),  # data.path=/a b/c typed unquoted: the shell splits it
    (["data.path=/tmp/ünï"], """'data.path="/tmp/ünï"'"""),
    (["data.path=/a=b"], """'data.path="/a=b"'"""),
    (["data.path=/a,b"], """'data.path="/a,b"'"""),
], ids=["space", "non-ascii", "equals", "comma"])
def test_an_unquoted_value_says_how_to_quote_it(argv, hint):
    with pytest.raises(ConfigError, match="quote") as e:
        check_overrides(argv)
    assert hint in str(e.value)
    check_overrides([eval(hint)])  # the quoting it gives parses (the shell's quotes removed)


@slow
def test_an_unquoted_path_is_one_line_exit_2(tmp_path):
    proc = cli(tmp_path, *TINY, "data=text", "data.path=/a", "b/c", "hydra.run.dir=run")
    one_line_error(proc, 2, """'data.path="/a b/c"'""")
    assert not (tmp_path / "run").exists()

"""Fault injection: the trainer's CLI run as a user would, in a fresh directory, for every way a run can go wrong.

Each case asserts the exit code, that no traceback is printed, that the failure is one line saying what to
do, and which files exist afterwards (summaries, checkpoints; nothing of another run deleted or rewritten).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minigpt.summary import RunSummary

TINY = ["model=tiny", "seq_len=128", "batch_size=2", "eval_batches=0", "logger=none", "device=cpu", "warmup_steps=1"]


def cli(cwd: Path, *args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """`python -m minigpt ARGS` in `cwd`, as a user would start it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "minigpt", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def one_line_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """The run exited with `code`, printed no traceback, and its stderr is one line holding every needle."""
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_once(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("finished")
    proc = cli(cwd, *TINY, "max_steps=3", "ckpt_every=1", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr
    return cwd / "run"


@pytest.fixture
def finished_run(finished_once, tmp_path) -> Path:
    """A copy of a finished 3-step run (checkpoints at steps 2 and 3) for this test to do as it likes with."""
    return Path(shutil.copytree(finished_once, tmp_path / "run"))


# ------------------------------------------------------------------------------------------------
# A. Nothing lost
# ------------------------------------------------------------------------------------------------
def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-m", "minigpt", *TINY, "max_steps=1"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=180) == 0, p.stderr.read()
    runs = sorted((tmp_path / "outputs").iterdir())
    assert len(runs) == 2 and all((r / "summary.json").exists() and list((r / "checkpoints").glob("*.pt")) for r in runs)


def test_the_last_line_says_where_the_results_are(finished_run):
    proc = cli(finished_run.parent, *TINY, "max_steps=1", "hydra.run.dir=other")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0 and last.startswith("done:")
    assert str(finished_run.parent / "other" / "summary.json") in last and "ckpt_00000001.pt" in last


def test_a_new_run_never_touches_another_runs_checkpoints(finished_run):
    before = files(finished_run)
    proc = cli(finished_run.parent, *TINY, "max_steps=5", "hydra.run.dir=run")
    one_line_error(proc, 2, "ckpt_dir", "resume=auto")
    assert files(finished_run) == before  # nothing pruned, summary.json not rewritten


def test_resume_auto_on_a_finished_run_changes_nothing(finished_run):
    before = files(finished_run)
    proc = cli(finished_run.parent, *TINY, "max_steps=3", "resume=auto", "hydra.run.dir=run")
    assert proc.returncode == 0 and "already finished" in proc.stdout and "Traceback" not in proc.stderr
    assert files(finished_run) == before
    assert RunSummary.read(finished_run / "summary.json").steps == 3


@pytest.mark.parametrize("damage", ["truncate", "overwrite"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one(finished_run, damage):
    newest = finished_run / "checkpoints" / "ckpt_00000003.pt"
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    else:  # same size, garbage in the middle: only the digest can tell
        newest.write_bytes(data[:1000] + bytes(4096) + data[1000 + 4096:])
    proc = cli(finished_run.parent, *TINY, "max_steps=4", "resume=auto", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr
    assert "ckpt_00000003.pt" in proc.stderr and "warning" in proc.stderr and "Traceback" not in proc.stderr
    assert "resumed from" in proc.stdout and "ckpt_00000002.pt" in proc.stdout
    assert RunSummary.read(finished_run / "summary.json").steps == 4


def test_resume_auto_on_a_finished_run_without_checkpoints_changes_nothing(tmp_path):
    assert cli(tmp_path, *TINY, "max_steps=2", "save_checkpoints=false", "hydra.run.dir=run").returncode == 0
    before = files(tmp_path / "run")
    proc = cli(tmp_path, *TINY, "max_steps=2", "resume=auto", "hydra.run.dir=run")
    assert proc.returncode == 0 and "already finished" in proc.stdout and files(tmp_path / "run") == before


def test_no_intact_checkpoint_is_one_line(finished_run):
    for p in (finished_run / "checkpoints").glob("*.pt"):
        p.write_bytes(b"not a checkpoint")
    proc = cli(finished_run.parent, *TINY, "max_steps=5", "resume=auto", "hydra.run.dir=run")
    one_line_error(proc, 1, "no intact checkpoint")
    assert RunSummary.read(finished_run / "summary.json").status == "error"


def test_a_checkpoint_of_another_model_size_is_a_bad_setting(finished_run):
    proc = cli(finished_run.parent, *TINY, "max_steps=5", "model.n_layer=3", "resume=auto", "hydra.run.dir=run")
    one_line_error(proc, 2, "model.n_layer=2", "model.n_layer=3")


# A user's disk filling up while the checkpoint of step 2 is written: the OS answers ENOSPC part-way through.
DISK_FULL = """
import builtins, errno, io, sys
real_open = builtins.open
class Full(io.RawIOBase):
    def __init__(self, f): self.f, self.n = f, 0
    def write(self, b):
        self.n += len(b)
        if self.n > 4096: raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(b)
    def flush(self): self.f.flush()
    def fileno(self): return self.f.fileno()
    def close(self): self.f.close()
    def __enter__(self): return self
    def __exit__(self, *a): self.close()
def full_open(file, mode="r", *a, **k):
    f = real_open(file, mode, *a, **k)
    return Full(f) if ".ckpt_00000002.pt.tmp" in str(file) else f
builtins.open = full_open
from minigpt.cli import train_main
sys.exit(train_main())
"""


def test_disk_full_keeps_the_previous_checkpoint_and_no_temp_files(tmp_path):
    proc = subprocess.run([sys.executable, "-c", DISK_FULL, *TINY, "max_steps=4", "ckpt_every=1",
                           "hydra.run.dir=run"], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    one_line_error(proc, 1, "disk full", "ckpt_00000001.pt is intact")
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["ckpt_00000001.json", "ckpt_00000001.pt"]  # no temp files
    s = RunSummary.read(tmp_path / "run" / "summary.json")
    assert s.status == "error" and s.exit_code == 1 and "disk full" in s.error


def _start_and_signal(tmp_path: Path, *signals: signal.Signals, seq_len: int) -> subprocess.Popen:
    """Start a long run, wait until it has finished a step, then send `signals` (back to back)."""
    out = open(tmp_path / "log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "minigpt", *TINY, f"seq_len={seq_len}", "max_steps=100000",
                             "ckpt_every=1", "hydra.run.dir=run"], cwd=tmp_path, stdout=out, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    while not list((tmp_path / "run" / "checkpoints").glob("ckpt_*.json")) and time.time() < deadline:
        time.sleep(0.1)
    for s in signals:
        proc.send_signal(s)
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("signals", [(signal.SIGTERM,), (signal.SIGINT, signal.SIGINT, signal.SIGTERM)],
                         ids=["sigterm", "ctrl-c-twice-then-sigterm"])
def test_a_signal_ends_the_step_with_a_checkpoint_and_resume_continues(tmp_path, signals):
    # with more than one signal, steps long enough (~1 s) that the later ones arrive while the run is stopping
    seq_len = 128 if len(signals) == 1 else 4096
    proc = _start_and_signal(tmp_path, *signals, seq_len=seq_len)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signals[0], err
    assert "Traceback" not in err
    if len(signals) > 1:
        assert "already stopping" in err
    s = RunSummary.read(tmp_path / "run" / "summary.json")
    assert s.status == "interrupted" and s.exit_code == 128 + signals[0] and s.steps >= 1
    assert s.checkpoint and Path(s.checkpoint).name == f"ckpt_{s.steps:08d}.pt" and Path(s.checkpoint).exists()
    resumed = cli(tmp_path, *TINY, f"seq_len={seq_len}", f"max_steps={s.steps + 1}", "resume=auto", "hydra.run.dir=run")
    assert resumed.returncode == 0 and f"at step {s.steps}" in resumed.stdout, resumed.stderr
    assert RunSummary.read(tmp_path / "run" / "summary.json").status == "ok"
    assert RunSummary.read(tmp_path / "run" / "summary.attempt1.json") == s  # the interrupted attempt's, kept


# ------------------------------------------------------------------------------------------------
# B. One clear error
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,needles", [
    (["+unknown_key=1"], ["unknown_key"]),
    (["+model.foo=2"], ["model.foo"]),
    (["model.vocab_size=100"], ["model.vocab_size=100"]),  # found only once the data is built: still exit 2
    (["attention.sdpa_backend=cudnn"], ["attention", "cudnn"]),
    (["logger=wandb", "logger.mode=online"], ["no W&B credentials"]),
    (["resume=/no/such/checkpoint"], ["resume=/no/such/checkpoint"]),
])
def test_bad_settings_exit_2_with_one_line(tmp_path, args, needles):
    env = {"WANDB_API_KEY": "", "WANDB_MODE": "", "NETRC": str(tmp_path / "none"), "HOME": str(tmp_path)}
    one_line_error(cli(tmp_path, *TINY, "max_steps=2", *args, env=env), 2, *needles)


def test_flash_with_a_head_dim_the_kernel_lacks_is_refused_before_it_starts(tmp_path):
    proc = cli(tmp_path, *TINY, "attention=flash", "model.n_embd=80", "model.n_head=4", env={"TRITON_INTERPRET": "1"})
    one_line_error(proc, 2, "attention=flash", "head_dim 20")
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("summary.json"))


def test_a_multirun_with_a_failed_job_fails(tmp_path):
    proc = cli(tmp_path, "-m", *TINY, "max_steps=1", "model.vocab_size=100,512")  # job 0 fails as it builds its data
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "1 of 2 jobs ok" in proc.stderr and "model.vocab_size=100" in proc.stderr


def test_a_multirun_with_a_bad_setting_in_a_job_is_refused_before_hydra_writes(tmp_path):
    one_line_error(cli(tmp_path, "-m", *TINY, "max_steps=1", "seq_len=128,-5"), 2, "multirun job #1: seq_len=-5")
    assert not list(tmp_path.iterdir())  # not even the sweep directory it reserved


def test_without_a_gpu_and_no_model_the_run_is_cpu_sized(tmp_path):
    proc = cli(tmp_path, "max_steps=1", "logger=none", "eval_batches=0")
    assert proc.returncode == 0, proc.stderr
    assert "CPU-sized defaults" in proc.stdout and "model=tiny" in proc.stdout
    (summary,) = (tmp_path / "outputs").rglob("summary.json")
    assert RunSummary.read(summary).model == "tiny"


def test_binary_text_data_is_one_line(tmp_path):
    (tmp_path / "data.txt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    proc = cli(tmp_path, *TINY, "data=text", "data.path=data.txt", f"data.cache_dir={tmp_path / 'cache'}",
               "hydra.run.dir=run")
    one_line_error(proc, 1, "data.txt")
    assert RunSummary.read(tmp_path / "run" / "summary.json").status == "error"


def test_wandb_dir_is_respected(tmp_path):
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb-here")}
    proc = cli(tmp_path, *[a for a in TINY if a != "logger=none"], "max_steps=1", "hydra.run.dir=run", env=env)
    assert proc.returncode == 0, proc.stderr
    runs = list((tmp_path / "wandb-here").rglob("offline-run-*"))
    assert runs and not (tmp_path / "run" / "wandb").exists()
    assert str(runs[0]) in json.loads((tmp_path / "run" / "summary.json").read_text())["wandb"]

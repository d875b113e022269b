"""Checkpoints: a format that loads without running code, refusal (and the --trust converter) for files that
would need it, no checkpoint of a non-finite state, paths that are not checkpoints, stale temp files, and the
disk-full advice followed to the letter."""
import contextlib
import hashlib
import json
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import minigpt.checkpoint as checkpoint
import minigpt.train as train
from conftest import RecordingLogger
from minigpt.checkpoint import CheckpointError, UnsafeCheckpointError, load_checkpoint
from minigpt.config import ConfigError
from minigpt.files import atomic_write, remove_stale_temps
from minigpt.loggers import read_history
from minigpt.run import run
from minigpt.summary import ExitCode, RunSummary
from test_faults import DISK_FULL, TINY, cli, finished_once, finished_run, one_line_error  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parent.parent


class Planted:
    """Unpickling this creates `marker`: stands for any code a pickle can run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def plant(path: Path, marker: Path, raw: bool = False) -> Path:
    """A file with a checkpoint's name and a valid manifest whose pickle would create `marker` when loaded."""
    state = {"format": 2, "step": checkpoint.step_of(path), "model": Planted(marker), "optimizer": {}, "rng": {}}
    if raw:
        path.write_bytes(pickle.dumps(state, protocol=4))
    else:
        torch.save(state, path)
    data = path.read_bytes()
    checkpoint._manifest(path).write_text(json.dumps({"step": state["step"], "bytes": len(data),
                                                      "blake2b": hashlib.blake2b(data).hexdigest()}))
    return path


def old_format_state(step, model, optimizer, config):
    """The training state exactly as minigpt wrote it up to e668b53 (minigpt/checkpoint.py, save_checkpoint)."""
    return {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "config": config,
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
    }


def losses(cfg) -> list[float]:
    logger = RecordingLogger()
    assert run(cfg, logger=logger) == 0
    return logger.series("train/loss")


def stderr_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def upgrade_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minigpt.checkpoint", "upgrade", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------------------------
# 1. The format: tensors and plain types only
# ------------------------------------------------------------------------------------------------
def test_a_checkpoint_loads_with_weights_only_and_restores_the_rng_states(tiny_config):
    cfg = tiny_config("max_steps=2")
    assert run(cfg) == 0
    path = Path(cfg.ckpt_dir) / "ckpt_00000002.pt"
    raw = torch.load(path, weights_only=True)  # torch's own safe unpickler, not only ours
    assert raw["format"] == checkpoint.FORMAT and raw["step"] == 2 and raw["config"]["model"]["name"] == "tiny"

    def draws():
        return np.random.rand(3).tolist(), [random.random() for _ in range(3)], torch.rand(3).tolist()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    np.random.seed(1), random.seed(1), torch.manual_seed(1)
    random.gauss(0, 1), np.random.randn()  # cached gaussians are part of the states too
    saved = checkpoint._write(path.with_name("ckpt_00000005.pt"), checkpoint._state(5, model, optimizer, {}))
    expected = draws()
    np.random.seed(7), random.seed(7), torch.manual_seed(7)
    assert checkpoint.restore(load_checkpoint(saved), saved, model, optimizer, {}) == 5
    assert draws() == expected


# ------------------------------------------------------------------------------------------------
# 2. A file that would run code is refused, and its code never runs
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [False, True], ids=["torch-zip", "plain-pickle"])
def test_the_loader_refuses_a_pickle_that_would_run_code(tmp_path, raw):
    trap = plant(tmp_path / "ckpt_00000001.pt", tmp_path / "ran", raw=raw)
    with pytest.raises(UnsafeCheckpointError) as e:
        load_checkpoint(trap)
    assert isinstance(e.value, ConfigError) and "\n" not in str(e.value)
    assert "io.open" in str(e.value) or "builtins.open" in str(e.value)
    assert f"python -m minigpt.checkpoint upgrade {trap} --trust" in str(e.value)
    assert not (tmp_path / "ran").exists()
    with contextlib.suppress(RuntimeError):  # a plain pickle is not torch's legacy format: it runs, then fails
        torch.load(plant(tmp_path / "ckpt_00000002.pt", tmp_path / "ran2", raw=raw), weights_only=False)
    assert (tmp_path / "ran2").exists()  # the trap is real: an unsafe load does run it


@pytest.mark.parametrize("max_steps", [5, 3], ids=["resumes", "would-be-finished"])
def test_resume_auto_through_the_cli_refuses_a_planted_newest_checkpoint(finished_run, max_steps):
    marker = finished_run.parent / "ran"
    plant(finished_run / "checkpoints" / "ckpt_00000004.pt", marker)
    before = (finished_run / "checkpoints" / "ckpt_00000003.pt").read_bytes()
    proc = cli(finished_run.parent, *TINY, f"max_steps={max_steps}", "resume=auto", "hydra.run.dir=run")
    one_line_error(proc, 2, "ckpt_00000004.pt", "refused", "python -m minigpt.checkpoint upgrade", "--trust")
    assert not marker.exists()
    assert "resumed from" not in proc.stdout  # no silent fallback to ckpt_00000003.pt
    assert (finished_run / "checkpoints" / "ckpt_00000003.pt").read_bytes() == before


def test_resume_through_the_python_api_refuses_a_planted_checkpoint(tiny_config, tmp_path, capsys):
    cfg = tiny_config("max_steps=2")
    assert run(cfg) == 0
    plant(Path(cfg.ckpt_dir) / "ckpt_00000003.pt", tmp_path / "ran")
    capsys.readouterr()
    assert run(tiny_config("max_steps=4", "resume=auto")) == ExitCode.BAD_SETTING
    assert "--trust" in stderr_line(capsys)
    explicit = tiny_config("max_steps=4", f"resume={Path(cfg.ckpt_dir) / 'ckpt_00000003.pt'}")
    assert run(explicit) == ExitCode.BAD_SETTING
    assert not (tmp_path / "ran").exists()
    assert RunSummary.read(Path(cfg.run_dir) / "summary.json").exit_code == ExitCode.BAD_SETTING


# ------------------------------------------------------------------------------------------------
# 3. A checkpoint of an earlier minigpt: refused, converted with --trust, then resumed exactly
# ------------------------------------------------------------------------------------------------
def test_an_old_checkpoint_is_refused_then_converted_then_resumes_exactly(tiny_config, tmp_path, monkeypatch, capsys):
    straight = losses(tiny_config("max_steps=8", "lr_decay_steps=8"))
    first = tiny_config("max_steps=4", "lr_decay_steps=8")
    first.run_dir, first.ckpt_dir = str(tmp_path / "b"), str(tmp_path / "b" / "ckpt")
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "_state", old_format_state)
        head = losses(first)
    old = Path(first.ckpt_dir) / "ckpt_00000004.pt"
    original = old.read_bytes()
    with pytest.raises(pickle.UnpicklingError):
        torch.load(old, weights_only=True)  # really the old format

    second = tiny_config("max_steps=8", "lr_decay_steps=8", "resume=auto")
    second.run_dir, second.ckpt_dir = str(tmp_path / "b"), first.ckpt_dir
    capsys.readouterr()
    assert run(second) == ExitCode.BAD_SETTING
    line = stderr_line(capsys)
    assert str(old) in line and "numpy" in line and f"python -m minigpt.checkpoint upgrade {old} --trust" in line

    refused = upgrade_cli(str(old))
    assert refused.returncode == 2 and "--trust" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert old.read_bytes() == original and not old.with_name(old.name + ".bak").exists()

    done = upgrade_cli(first.ckpt_dir, "--trust")  # a directory: each of its checkpoints
    assert done.returncode == 0, done.stderr
    assert f"upgraded {old}" in done.stdout and f"{old}.bak" in done.stdout
    assert old.with_name(old.name + ".bak").read_bytes() == original
    assert torch.load(old, weights_only=True)["format"] == checkpoint.FORMAT
    assert upgrade_cli(str(old), "--trust").stdout.count("nothing changed") == 1  # twice is harmless

    tail = losses(second)
    assert len(head) == 4 and len(tail) == 4
    assert head + tail == pytest.approx(straight, rel=1e-6, abs=1e-7)


def test_the_converter_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    assert checkpoint.main(["upgrade", str(tmp_path / "nothing"), "--trust"]) == 2
    junk = tmp_path / "ckpt_00000001.pt"
    junk.write_bytes(b"not a checkpoint")
    assert checkpoint.main(["upgrade", str(junk), "--trust"]) == 1
    assert "unreadable" in capsys.readouterr().err and junk.read_bytes() == b"not a checkpoint"


# ------------------------------------------------------------------------------------------------
# 4. No checkpoint of a state that cannot be resumed from
# ------------------------------------------------------------------------------------------------
def _poison_after(step_index: int, monkeypatch, then=None) -> None:
    """Parameters turn NaN in the update of step `step_index` (its loss was finite)."""
    real = train.train_step

    def step(t, s):
        loss = real(t, s)
        if s == step_index:
            with torch.no_grad():
                next(t.model.parameters()).fill_(float("nan"))
            if then:
                then()
        return loss
    monkeypatch.setattr(train, "train_step", step)


def test_non_finite_parameters_at_the_last_step_keep_the_last_good_checkpoint(tiny_config, monkeypatch, capsys):
    cfg = tiny_config("max_steps=4", "ckpt_every=2")
    _poison_after(3, monkeypatch)
    assert run(cfg) == ExitCode.ERROR
    line = stderr_line(capsys)
    good = Path(cfg.ckpt_dir) / "ckpt_00000002.pt"
    assert "non-finite parameters after step 4" in line and f"{good} is kept" in line
    assert sorted(p.name for p in Path(cfg.ckpt_dir).glob("*.pt")) == [good.name]
    assert RunSummary.read(Path(cfg.run_dir) / "summary.json").checkpoint == str(good)


def test_non_finite_parameters_when_interrupted_write_no_checkpoint(tiny_config, monkeypatch, capsys):
    cfg = tiny_config("max_steps=6")
    _poison_after(1, monkeypatch, then=lambda: os.kill(os.getpid(), signal.SIGINT))
    assert run(cfg) == ExitCode.ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert "SIGINT: finishing this step" in err[0] and "non-finite parameters after step 2" in err[-1] and len(err) == 2
    assert not list(Path(cfg.ckpt_dir).glob("*.pt"))


@pytest.mark.parametrize("nan_at, kept", [(5, "ckpt_00000004.pt"), (1, None)], ids=["after-a-checkpoint", "before-any"])
def test_a_non_finite_loss_says_what_is_kept_and_resume_takes_the_last_good_checkpoint(tiny_config, monkeypatch,
                                                                                      capsys, nan_at, kept):
    """The first round's case: the loss turned NaN, the line said the last good checkpoint was kept, and yet one of
    the NaN state was written after it. Now nothing is written; the line counts the step as the others do (steps
    done: the NaN is step `nan_at`'s), and names the checkpoint kept, or says there is none."""
    from minigpt.model import GPT

    cfg = tiny_config("max_steps=6", "ckpt_every=2")
    real, calls = GPT.forward, []

    def nan_at_step(self, *args, **kwargs):
        loss = real(self, *args, **kwargs)
        calls.append(1) if self.training else None
        return loss * float("nan") if self.training and len(calls) == nan_at else loss
    with monkeypatch.context() as m:
        m.setattr(GPT, "forward", nan_at_step)
        assert run(cfg) == ExitCode.ERROR
    line = stderr_line(capsys)
    assert f"non-finite loss (nan) at step {nan_at}:" in line and "not saved" in line, line
    assert (f"the last good checkpoint {Path(cfg.ckpt_dir) / kept} is kept" if kept else "no checkpoint was written") \
        in line, line
    saved = sorted(p.name for p in Path(cfg.ckpt_dir).glob("*.pt"))
    assert saved == (["ckpt_00000002.pt", kept] if kept else [])
    assert RunSummary.read(Path(cfg.run_dir) / "summary.json").steps == nan_at - 1
    if kept:  # resume=auto continues from the last good one
        assert run(tiny_config("max_steps=6", "ckpt_every=2", "resume=auto")) == 0
        assert f"resumed from {Path(cfg.ckpt_dir) / kept} at step {nan_at - 1}" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# 5. A path with a checkpoint's name that is not a checkpoint
# ------------------------------------------------------------------------------------------------
def test_a_directory_named_like_a_checkpoint_is_skipped_not_taken_as_finished(tiny_config, capsys):
    cfg = tiny_config("max_steps=2", "ckpt_every=1")
    assert run(cfg) == 0
    (Path(cfg.ckpt_dir) / "ckpt_00000009.pt").mkdir()
    capsys.readouterr()
    assert run(tiny_config("max_steps=3", "ckpt_every=1", "resume=auto")) == 0
    out = capsys.readouterr()
    assert "already finished" not in out.out and "resumed from" in out.out and "ckpt_00000002.pt at step 2" in out.out
    assert "warning" in out.err and "ckpt_00000009.pt is not a checkpoint file (a directory)" in out.err
    assert RunSummary.read(Path(cfg.run_dir) / "summary.json").steps == 3
    assert (Path(cfg.ckpt_dir) / "ckpt_00000009.pt").is_dir() and (Path(cfg.ckpt_dir) / "ckpt_00000003.pt").is_file()
    with pytest.raises(CheckpointError, match="a directory"):
        load_checkpoint(Path(cfg.ckpt_dir) / "ckpt_00000009.pt")


# ------------------------------------------------------------------------------------------------
# 6. Temp files of atomic writes
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_atomic_write_leaves_no_temp_file_when_the_writer_fails(tmp_path, error):
    target = tmp_path / "f"
    target.write_text("old")

    def write(f):
        f.write(b"half")
        raise error()
    with pytest.raises(error):
        atomic_write(target, write)
    assert [p.name for p in tmp_path.iterdir()] == ["f"] and target.read_text() == "old"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temp_files_of_dead_writers_are_removed_at_the_next_start(tiny_config, capsys):
    cfg = tiny_config("max_steps=2")
    assert run(cfg) == 0
    ckpts, host, dead = Path(cfg.ckpt_dir), socket.gethostname(), _dead_pid()
    stale = [ckpts / f".ckpt_00000003.pt.tmp-{host}-{dead}", ckpts / f".ckpt_00000003.json.tmp-{dead}",
             Path(cfg.run_dir) / f".summary.json.tmp-{host}-{dead}"]
    kept = [ckpts / f".ckpt_00000003.pt.tmp-{host}-{os.getppid()}",  # a live process (pytest's parent) is writing
            ckpts / f".ckpt_00000003.pt.tmp-another-host-{dead}"]  # cannot tell from here: left alone
    for p in stale + kept:
        p.write_bytes(b"partial")
    capsys.readouterr()
    assert run(tiny_config("max_steps=3", "resume=auto")) == 0
    out = capsys.readouterr().out
    assert all(not p.exists() and f"removed {p}" in out for p in stale) and all(p.exists() for p in kept)
    assert remove_stale_temps(ckpts, say=lambda m: None) == []


# ------------------------------------------------------------------------------------------------
# 7. The disk-full advice, followed to the letter, continues the run
# ------------------------------------------------------------------------------------------------
def _train_losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["train/loss"] for row in read_history(run_dir) if "train/loss" in row}


def test_following_the_disk_full_advice_continues_the_run(tmp_path):
    args = [*TINY, "max_steps=4", "ckpt_every=1"]
    assert cli(tmp_path, *args, "hydra.run.dir=straight").returncode == 0
    full = subprocess.run([sys.executable, "-c", DISK_FULL, *args, "hydra.run.dir=run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    line = one_line_error(full, 1, "disk full", "ckpt_00000001.pt is intact", "set ckpt_dir=<elsewhere>",
                          f"resume=auto hydra.run.dir={tmp_path / 'run'}")
    elsewhere = tmp_path / "elsewhere"
    advice = line.split("set ")[1].split("; then continue with ")
    overrides = [advice[0].replace("<elsewhere>", str(elsewhere)), *advice[1].split(" (")[0].split()]
    assert overrides == [f"ckpt_dir={elsewhere}", "resume=auto", f"hydra.run.dir={tmp_path / 'run'}"]
    resumed = cli(tmp_path, *args, *overrides)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'ckpt_00000001.pt'} at step 1" in resumed.stdout
    s = RunSummary.read(tmp_path / "run" / "summary.json")
    assert s.status == "ok" and s.steps == 4 and Path(s.checkpoint) == elsewhere / "ckpt_00000004.pt"
    straight, continued = _train_losses(tmp_path / "straight"), _train_losses(tmp_path / "run")
    assert sorted(continued) == [1, 2, 3, 4]
    assert [continued[k] for k in range(1, 5)] == pytest.approx([straight[k] for k in range(1, 5)], rel=1e-6)
    again = cli(tmp_path, *args, "resume=auto", "hydra.run.dir=run")  # the default ckpt_dir again: still finished
    assert again.returncode == 0 and "already finished" in again.stdout and "step 4" in again.stdout

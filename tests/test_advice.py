"""Our advice works when followed: each user-facing line that says what to do (docs/errors.md lists them all) is
produced here, then the advice is followed to the letter, and the run reaches exit code 0 (or the next state the
advice promises). Advice that needs a GPU to produce (out of memory) is checked for its content only.

Most cases run the trainer twice in a subprocess: `slow`.
"""
from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minigpt import runlock
from minigpt.cli import reserve_dir
from minigpt.compose import compose
from minigpt.config import ConfigError
from minigpt.run import _oom_line
from minigpt.summary import RunSummary
from test_faults import TINY, _start_and_signal, cli, finished_once, finished_run, one_line_error  # noqa: F401
from test_lifecycle import UNREACHABLE, _unwritable

slow = pytest.mark.slow
WANDB = [a for a in TINY if a != "logger=none"]
NO_LOGIN = {"WANDB_API_KEY": "", "WANDB_MODE": "", "WANDB_BASE_URL": ""}  # with HOME and NETRC set per test


def ok(proc: subprocess.CompletedProcess, run_dir: Path | None = None) -> None:
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, (proc.stdout[-2000:], proc.stderr[-2000:])
    if run_dir is not None:
        assert RunSummary.read(run_dir / "summary.json").status == "ok"


def no_login(tmp_path: Path, **more: str) -> dict[str, str]:
    return {**NO_LOGIN, "HOME": str(tmp_path), "NETRC": str(tmp_path / "none"), **more}


# ------------------------------------------------------------------------------------------------
# Settings refused before the run starts (exit 2), then the advice
# ------------------------------------------------------------------------------------------------
@slow
@pytest.mark.parametrize("mode_from, advice, followed, env_followed", [
    ("config", "logger.mode=offline", ["logger.mode=offline"], {}),
    ("config", "logger=none", ["logger=none"], {}),
    ("env", "WANDB_MODE=offline", [], {"WANDB_MODE": "offline"}),  # WANDB_MODE wins over logger.mode: it is named
])
def test_no_wandb_credentials(tmp_path, mode_from, advice, followed, env_followed):
    args = [*WANDB, "max_steps=1", *(["logger.mode=online"] if mode_from == "config" else [])]
    env = no_login(tmp_path, **({"WANDB_MODE": "online"} if mode_from == "env" else {}))
    one_line_error(cli(tmp_path, *args, "hydra.run.dir=refused", env=env), 2, "no W&B credentials", advice,
                   "WANDB_API_KEY")
    ok(cli(tmp_path, *args, *followed, "hydra.run.dir=run", env={**env, **env_followed}), tmp_path / "run")


@slow
def test_no_wandb_credentials_then_a_key_reaches_the_server_check(tmp_path):
    """`set WANDB_API_KEY`: the next state is the check of the server (here unreachable: a closed port)."""
    args = [*WANDB, "max_steps=1", "logger.mode=online", "hydra.run.dir=run"]
    proc = cli(tmp_path, *args, env=no_login(tmp_path, WANDB_BASE_URL=UNREACHABLE["WANDB_BASE_URL"],
                                             WANDB_API_KEY=UNREACHABLE["WANDB_API_KEY"]))
    one_line_error(proc, 2, "cannot reach the W&B server")


@slow
@pytest.mark.parametrize("followed, env_followed", [([], {"WANDB_MODE": "offline"}), (["logger=none"], {})],
                         ids=["WANDB_MODE=offline", "logger=none"])
def test_unreachable_wandb_server(tmp_path, followed, env_followed):
    one_line_error(cli(tmp_path, *WANDB, "max_steps=1", "hydra.run.dir=run", env=UNREACHABLE), 2,
                   "cannot reach the W&B server", "WANDB_MODE=offline", "logger=none")
    ok(cli(tmp_path, *WANDB, "max_steps=1", *followed, "hydra.run.dir=run", env={**UNREACHABLE, **env_followed}),
       tmp_path / "run")


def test_the_sweep_names_its_own_switch_for_wandb(tmp_path, monkeypatch):
    from minigpt.sweep.sweep import build_parser, sweep_config

    for key, value in no_login(tmp_path, WANDB_MODE="online").items():
        monkeypatch.setenv(key, value)
    parser, errors = build_parser(), []

    def error(message):
        errors.append(message)
        raise SystemExit(2)

    parser.error = error
    with pytest.raises(SystemExit):
        sweep_config(parser, parser.parse_args(["--cpu", "--out", str(tmp_path / "o")]))
    assert "use WANDB_MODE=offline" in errors[0] and "or --logger none" in errors[0]
    sweep_config(parser, parser.parse_args(["--cpu", "--logger", "none", "--out", str(tmp_path / "o")]))  # followed
    monkeypatch.setenv("WANDB_MODE", "offline")
    sweep_config(parser, parser.parse_args(["--cpu", "--out", str(tmp_path / "o")]))  # followed


NO_INTERPRETER = {"TRITON_INTERPRET": ""}  # conftest sets it for the kernel tests; a user's shell has none


@slow
@pytest.mark.parametrize("broken, needles, followed, env", [
    (["device=cuda"], ["device=cuda", "use device=cpu or device=auto"], [["device=cpu"], ["device=auto"]], {}),
    (["dtype=float16"], ["use dtype=auto", "bfloat16"], [["dtype=auto"], ["dtype=bfloat16"]], {}),
    (["attention.sdpa_backend=cudnn"], ["use attention.sdpa_backend=auto"], [["attention.sdpa_backend=auto"]], {}),
    (["attention=flash"], ["on CPU use attention=sdpa or naive"], [["attention=sdpa"], ["attention=naive"]],
     NO_INTERPRETER),
    (["model.recompute_dtype=bfloat16"], ["set model.recompute_every=1"], [["model.recompute_every=1"]], {}),
    (["model=tinyy"], ["model=tinyy: no such option; choose one of", "tiny"], [["model=tiny"]], {}),
], ids=["device-cuda", "float16-on-cpu", "sdpa-kernel", "flash-on-cpu", "recompute-lever", "group-option"])
def test_a_refused_setting_then_its_advice(tmp_path, broken, needles, followed, env):
    if broken == ["device=cuda"] and torch.cuda.is_available():
        pytest.skip("a visible GPU: device=cuda is no error here")
    base = [a for a in TINY if a.partition("=")[0] not in {b.partition("=")[0] for b in broken}]
    one_line_error(cli(tmp_path, *base, *broken, "max_steps=1", "hydra.run.dir=refused", env=env), 2, *needles)
    assert not (tmp_path / "refused").exists()
    for i, fix in enumerate(followed):
        args = [*base, *(b for b in broken if b.partition("=")[0] not in {f.partition("=")[0] for f in fix}), *fix]
        ok(cli(tmp_path, *args, "max_steps=1", f"hydra.run.dir=run{i}", env=env), tmp_path / f"run{i}")


@slow
def test_flash_on_cpu_with_the_interpreter(tmp_path):
    """The third way out of `attention=flash` on CPU: TRITON_INTERPRET=1 (Triton's slow interpreter)."""
    pytest.importorskip("triton")
    args = [*TINY, "attention=flash", "model.n_layer=1", "max_steps=1"]
    one_line_error(cli(tmp_path, *args, "hydra.run.dir=refused", env=NO_INTERPRETER), 2, "set TRITON_INTERPRET=1")
    ok(cli(tmp_path, *args, "hydra.run.dir=run", env={"TRITON_INTERPRET": "1"}, timeout=600), tmp_path / "run")


@slow
@pytest.mark.parametrize("typed, quoted", [
    (["data.path=a b/c.txt"], """data.path="a b/c.txt\""""),  # shell-quoted, no Hydra quotes: works as is
    (["data.path=a", "b/c.txt"], """data.path="a b/c.txt\""""),  # unquoted: the shell split it
    (["data.path=ünï=,.txt"], """data.path="ünï=,.txt\""""),
], ids=["space-quoted-for-the-shell", "space-unquoted", "non-ascii-equals-comma"])
def test_quoting_advice(tmp_path, typed, quoted):
    name = "a b/c.txt" if "b/c" in quoted else "ünï=,.txt"
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text("The quick brown fox jumps over the lazy dog. " * 400)
    args = [*TINY, "data=text", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}", "max_steps=1"]
    proc = cli(tmp_path, *args, *typed, "hydra.run.dir=first")
    if proc.returncode != 0:
        one_line_error(proc, 2, f"'{quoted}'")
        proc = cli(tmp_path, *args, quoted, "hydra.run.dir=run")  # what the shell passes of '...' is inside
    ok(proc)


@slow
def test_unwritable_directory_advice(tmp_path):
    bad = _unwritable(tmp_path, "under-a-file")
    one_line_error(cli(tmp_path, *TINY, "max_steps=1", f"ckpt_dir={bad}", "hydra.run.dir=run"), 2,
                   "point ckpt_dir at a writable directory")
    ok(cli(tmp_path, *TINY, "max_steps=1", f"ckpt_dir={tmp_path / 'ckpts'}", "hydra.run.dir=run"), tmp_path / "run")
    assert list((tmp_path / "ckpts").glob("ckpt_*.pt"))


def test_ten_thousand_runs_in_one_second_advice(tmp_path):
    for k in range(10_000):
        (tmp_path / ("x" if k == 0 else f"x-{k}")).mkdir()
    with pytest.raises(ConfigError, match="choose hydra.run.dir yourself"):
        reserve_dir(tmp_path, "x")
    # followed: a named hydra.run.dir is never reserved (any run of this file with hydra.run.dir=... shows it works)


# ------------------------------------------------------------------------------------------------
# The run directory: another run, its lock, a finished run
# ------------------------------------------------------------------------------------------------
@slow
def test_a_directory_in_use_advice(tmp_path):
    run = tmp_path / "run"
    runlock.lock(run)
    try:
        one_line_error(cli(tmp_path, *TINY, "max_steps=1", "hydra.run.dir=run"), 2, "wait until it ends",
                       "choose another hydra.run.dir")
        ok(cli(tmp_path, *TINY, "max_steps=1", "hydra.run.dir=another"), tmp_path / "another")
    finally:
        runlock.unlock(run)  # it ended
    ok(cli(tmp_path, *TINY, "max_steps=1", "hydra.run.dir=run"), run)


@slow
def test_a_lock_of_another_host_advice(tmp_path):
    lock = tmp_path / "run" / runlock.LOCK_FILE
    lock.parent.mkdir()
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere." + socket.gethostname()}))
    one_line_error(cli(tmp_path, *TINY, "max_steps=1", "hydra.run.dir=run"), 2, f"remove {lock} and start again")
    lock.unlink()
    ok(cli(tmp_path, *TINY, "max_steps=1", "hydra.run.dir=run"), tmp_path / "run")


@slow
@pytest.mark.parametrize("followed", [["resume=auto"], ["hydra.run.dir=new"], ["ckpt_dir=elsewhere"]])
def test_another_runs_checkpoints_advice(finished_run, followed):
    cwd = finished_run.parent
    if followed == ["ckpt_dir=elsewhere"]:  # checkpoints outside the run directory: a new ckpt_dir is the way
        shutil.move(finished_run / "checkpoints", cwd / "shared")
        (finished_run / "summary.json").unlink()
        args = [*TINY, "max_steps=5", f"ckpt_dir={cwd / 'shared'}", "hydra.run.dir=run"]
        one_line_error(cli(cwd, *args), 2, "resume=auto", "or choose a new ckpt_dir")
        ok(cli(cwd, *TINY, "max_steps=5", f"ckpt_dir={cwd / 'elsewhere'}", "hydra.run.dir=run"))
        return
    one_line_error(cli(cwd, *TINY, "max_steps=5", "hydra.run.dir=run"), 2, "continue it with resume=auto",
                   "or choose a new hydra.run.dir")
    run_dir = "new" if followed == ["hydra.run.dir=new"] else "run"
    ok(cli(cwd, *TINY, "max_steps=5", "hydra.run.dir=run", *followed), cwd / run_dir)


@slow
@pytest.mark.parametrize("followed", [["hydra.run.dir=new"], ["resume=auto", "hydra.run.dir=run"]])
def test_another_runs_summary_advice(tmp_path, followed):
    ok(cli(tmp_path, *TINY, "max_steps=1", "save_checkpoints=false", "hydra.run.dir=run"))
    one_line_error(cli(tmp_path, *TINY, "max_steps=2", "hydra.run.dir=run"), 2, "choose a new hydra.run.dir",
                   "continue that run with resume=auto")
    ok(cli(tmp_path, *TINY, "max_steps=2", "hydra.run.dir=run", *followed))


@slow
def test_already_finished_advice(finished_run):
    proc = cli(finished_run.parent, *TINY, "max_steps=3", "resume=auto", "hydra.run.dir=run")
    assert proc.returncode == 0 and "raise max_steps to train further" in proc.stdout
    ok(cli(finished_run.parent, *TINY, "max_steps=4", "resume=auto", "hydra.run.dir=run"), finished_run)
    assert RunSummary.read(finished_run / "summary.json").steps == 4


@slow
def test_a_killed_runs_advice(tmp_path):
    """The line after SIGKILL names resume=auto (test_lifecycle.py follows it); here the other way: a new run dir."""
    proc = _start_and_signal(tmp_path, signal.SIGKILL, seq_len=128)
    proc.wait(timeout=60)
    one_line_error(cli(tmp_path, *TINY, "max_steps=2", "hydra.run.dir=run"), 2, "was killed", "choose a new "
                   "hydra.run.dir")
    ok(cli(tmp_path, *TINY, "max_steps=2", "hydra.run.dir=new"), tmp_path / "new")


# ------------------------------------------------------------------------------------------------
# Checkpoints and resume
# ------------------------------------------------------------------------------------------------
@slow
def test_no_intact_checkpoint_advice(finished_run):
    for p in (finished_run / "checkpoints").glob("*.pt"):
        p.write_bytes(b"not a checkpoint")
    one_line_error(cli(finished_run.parent, *TINY, "max_steps=5", "resume=auto", "hydra.run.dir=run"), 1,
                   "start a new run (resume=none in a new directory)")
    ok(cli(finished_run.parent, *TINY, "max_steps=5", "resume=none", "hydra.run.dir=new"), finished_run.parent / "new")


@slow
@pytest.mark.parametrize("followed", [["model.n_layer=2", "resume=auto", "hydra.run.dir=run"],
                                      ["model.n_layer=3", "resume=none", "hydra.run.dir=new"]],
                         ids=["same-model-settings", "new-run"])
def test_a_checkpoint_of_another_model_advice(finished_run, followed):
    one_line_error(cli(finished_run.parent, *TINY, "max_steps=5", "model.n_layer=3", "resume=auto",
                       "hydra.run.dir=run"), 2, "resume with the same model settings", "resume=none in a new directory")
    ok(cli(finished_run.parent, *TINY, "max_steps=5", *followed))


@slow
def test_non_finite_loss_advice(tmp_path):
    proc = cli(tmp_path, *TINY, "max_steps=3", "lr=1e30", "warmup_steps=0", "grad_clip=0", "hydra.run.dir=run")
    one_line_error(proc, 1, "non-finite", "try a lower lr or dtype=float32")
    ok(cli(tmp_path, *TINY, "max_steps=3", "lr=1e-3", "warmup_steps=0", "grad_clip=0", "hydra.run.dir=new"))


METRICS_FULL = """
import errno, pathlib, sys
real_open, seen = pathlib.Path.open, []
def full_open(self, mode="r", *a, **k):
    if self.name == "metrics.jsonl" and "a" in mode:
        seen.append(self)
        if len(seen) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
    return real_open(self, mode, *a, **k)
pathlib.Path.open = full_open
from minigpt.cli import train_main
sys.exit(train_main())
"""


@slow
def test_metrics_disk_full_advice(tmp_path):
    args = [*TINY, "max_steps=4", "ckpt_every=1", "hydra.run.dir=run"]
    proc = subprocess.run([sys.executable, "-c", METRICS_FULL, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    one_line_error(proc, 1, "metrics.jsonl", "disk full", "then continue with resume=auto")
    ok(cli(tmp_path, *TINY, "max_steps=4", "resume=auto", "hydra.run.dir=run"), tmp_path / "run")


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------
@slow
def test_too_little_text_advice(tmp_path):
    (tmp_path / "small.txt").write_text("short text. " * 400)
    args = [*TINY, "data=text", "data.path=small.txt", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'c'}",
            "max_steps=1"]
    proc = cli(tmp_path, *args, "seq_len=4096", "hydra.run.dir=run")  # `datasets` shows its progress on stderr
    assert proc.returncode == 1 and "give more text or lower seq_len" in proc.stderr.splitlines()[-1], proc.stderr
    ok(cli(tmp_path, *args, "seq_len=32", "hydra.run.dir=new"))


@slow
def test_binary_file_in_the_data_advice(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (tmp_path / "data" / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 400)
    args = [*TINY, "data=text", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'c'}", "max_steps=1"]
    one_line_error(cli(tmp_path, *args, "data.path=data", "hydra.run.dir=run"), 1, "exclude it from data.path")
    ok(cli(tmp_path, *args, "data.path=data/*.txt", "hydra.run.dir=new"))


# ------------------------------------------------------------------------------------------------
# Needs a GPU to happen: the message's content only
# ------------------------------------------------------------------------------------------------
def test_out_of_memory_advice_names_settings_that_exist(tiny_config):
    cfg = tiny_config()
    line = _oom_line(cfg, 79.5)
    assert "seq_len=128" in line and "attention=sdpa" in line and "79.5 GiB" in line
    suggested = ["attention=flash", "model.recompute_every=1", "model.loss_chunk=4096"]
    assert all(s in line for s in suggested)
    compose(["model=tiny", "device=cpu", "logger=none", *suggested[1:]])  # each is a setting that composes

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
from test_eval import pycode_run  # noqa: F401 - a tiny pycode run (minigpt-eval's loss-by-position advice)
from test_passkey_grid import run_dir  # noqa: F401 - a tiny passkey run (minigpt-eval's passkey advice)
from test_sample import passkey_run, text_run  # noqa: F401 - tiny passkey and BPE runs (minigpt-sample's advice)

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
@pytest.mark.parametrize("broken, needle, followed", [
    (["loss_by_position=true"], "use data=text, hf or pycode, or leave it null",
     [["data=text", "data.path=x"], ["data=hf", "data.dataset=x"], ["data=pycode"], ["loss_by_position=null"]]),
    (["data=pycode", "loss_by_position=true", "parallel.context=2", "attention=flash"], "leave it null",
     [["loss_by_position=null"]]),
], ids=["passkey-has-no-documents", "not-under-context-parallelism"])
def test_loss_by_position_advice(broken, needle, followed):
    """Checked where the config is (config.py, exit 2 through the CLI): each way out composes. Without this machine's
    checks (machine=False): a context-parallel run needs torchrun and GPUs, which the advice is not about."""
    with pytest.raises(ConfigError) as e:
        compose(broken, machine=False)
    assert needle in str(e.value) and "\n" not in str(e.value)
    for fix in followed:
        assert compose([*broken, *fix], machine=False).loss_by_position in (True, None)


@slow
def test_a_passkey_example_needs_a_longer_seq_len_advice(tmp_path):
    """`raise seq_len or set data.passkey_fraction=0`: the seq_len the line names builds the data, and so does no
    passkey share at the old seq_len."""
    import re

    from test_passkey_mix import text_data

    with pytest.raises(ConfigError) as e:
        text_data(tmp_path, 0.05, seq_len=40)
    line = str(e.value)
    assert "raise seq_len or set data.passkey_fraction=0" in line, line
    need = int(re.search(r"needs seq_len >= (\d+)", line).group(1))
    assert text_data(tmp_path, 0.05, seq_len=need).passkey is not None
    assert text_data(tmp_path, 0.0, seq_len=40).vocab_size > 0


@slow
def test_passkey_data_needs_a_longer_seq_len_advice(tmp_path):
    """`raise seq_len, or choose other data`: data=passkey (the default data) below its shortest seq_len is a setting
    (exit 2, one line); the seq_len the line names trains."""
    import re

    args = [a for a in TINY if not a.startswith("seq_len=")] + ["data=passkey", "max_steps=1"]
    line = one_line_error(cli(tmp_path, *args, "seq_len=64", "hydra.run.dir=short"), 2, "seq_len=64",
                          "raise seq_len, or choose other data")
    need = int(re.search(r"needs seq_len >= (\d+)", line).group(1))
    ok(cli(tmp_path, *args, f"seq_len={need}", "hydra.run.dir=long"), tmp_path / "long")


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


# ------------------------------------------------------------------------------------------------
# Data (the trainer's data=text / data=hf lines, followed through the CLI)
# ------------------------------------------------------------------------------------------------
STORY = "The quick brown fox jumps over the lazy dog. Once upon a time there was a model. "


def data_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 1, no traceback, and the last line of stderr holds each needle (`datasets` may print progress first)."""
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, (proc.stdout[-2000:], proc.stderr[-2000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and all(n in last for n in needles), last


def text_args(tmp_path: Path) -> list[str]:
    return [*TINY, "data=text", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}", "max_steps=1"]


@slow
@pytest.mark.parametrize("way", ["a-tokenizer-json", "unset"])
def test_not_a_tokenizer_file_advice(tmp_path, way):
    (tmp_path / "corpus.txt").write_text(STORY * 200)
    (tmp_path / "tok.json").write_text('{"vocab": [1, 2]}')
    args = [*text_args(tmp_path), "data.path=corpus.txt"]
    data_error(cli(tmp_path, *args, "data.tokenizer=tok.json", "hydra.run.dir=refused"), "not a tokenizer JSON file",
               "give a tokenizer.json saved by", "or unset data.tokenizer")
    if way == "unset":  # data.tokenizer left out: a BPE is trained on the data
        ok(cli(tmp_path, *args, "hydra.run.dir=run"), tmp_path / "run")
        return
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator([STORY] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(tmp_path / "tokenizer.json"))  # saved by `tokenizers` (with <|endoftext|>, which it needs)
    ok(cli(tmp_path, *args, "data.tokenizer=tokenizer.json", "hydra.run.dir=run"), tmp_path / "run")


@slow
@pytest.mark.parametrize("given", ["corpus.txt", "corpus.txt.gz"], ids=["plain", "compressed"])
def test_cannot_read_the_files_advice(tmp_path, given):
    import gzip

    (tmp_path / "latin.txt.gz").write_bytes(gzip.compress((STORY.replace("fox", "f\u00f6x") * 200).encode("latin-1")))
    args = text_args(tmp_path)
    data_error(cli(tmp_path, *args, "data.path=latin.txt.gz", "hydra.run.dir=refused"), "cannot read the files",
               "give UTF-8 text, plain or compressed")
    utf8 = (STORY.replace("fox", "f\u00f6x") * 200).encode()  # the same text, as UTF-8
    (tmp_path / given).write_bytes(gzip.compress(utf8) if given.endswith(".gz") else utf8)
    ok(cli(tmp_path, *args, f"data.path={given}", "hydra.run.dir=run"), tmp_path / "run")


def stories(root: Path, n: int = 40) -> tuple[Path, Path]:
    """A local dataset directory of data files (root/files/train.jsonl) and a save_to_disk one (root/saved) with a
    string column `text` and an integer column `n`."""
    import datasets

    rows = [{"text": f"story {i}: " + STORY * 4, "n": i} for i in range(n)]
    (root / "files").mkdir(parents=True)
    (root / "files" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).save_to_disk(str(root / "saved"))
    return root / "files", root / "saved"


def hf_args(tmp_path: Path) -> list[str]:
    return [*TINY, "seq_len=64", "data=hf", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}", "max_steps=1"]


@slow
@pytest.mark.parametrize("local", ["files", "saved"], ids=["data-files-directory", "save-to-disk-directory"])
def test_the_hub_cannot_be_used_advice(tmp_path, local):
    """Offline, a hub name is refused; the advice's local ways train. Its other way, `run once with network
    access`, needs the network: not followed here (test_data covers a hub dataset read from the cache)."""
    stories(tmp_path)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    data_error(cli(tmp_path, *hf_args(tmp_path), "data.dataset=someone/stories", "hydra.run.dir=refused", env=env),
               "the Hugging Face Hub cannot be used",
               "point data.dataset at a local dataset directory (of data files, or one save_to_disk wrote)")
    ok(cli(tmp_path, *hf_args(tmp_path), f"data.dataset={tmp_path / local}", "hydra.run.dir=run", env=env),
       tmp_path / "run")


@slow
def test_not_a_text_column_advice(tmp_path):
    _, saved = stories(tmp_path)
    args = [*hf_args(tmp_path), f"data.dataset={saved}"]
    data_error(cli(tmp_path, *args, "data.text_column=n", "hydra.run.dir=refused"), "data.text_column=n",
               "not text; choose a string column of", "(text)")
    ok(cli(tmp_path, *args, "data.text_column=text", "hydra.run.dir=run"), tmp_path / "run")


@slow
def test_too_few_held_out_documents_advice(tiny_config, tmp_path, capsys):
    """data=pycode's held-out guarantee: `lower data.min_heldout_docs` trains. The fake site root holds out one
    document in all, so no seq_len reaches two: the line does not say to lower it (it did). (`read the full corpus`
    is this interpreter's site-packages: not read in a test.)"""
    from minigpt.run import run
    from minigpt.summary import ExitCode
    from test_pycode import fake_site_overrides

    site = fake_site_overrides(tmp_path, min_docs=2)
    assert run(tiny_config(*site, "max_steps=1")) == ExitCode.BAD_SETTING
    line = [x for x in capsys.readouterr().err.splitlines() if x.strip()][-1]
    assert "holds out 0 documents" not in line and "; read the full corpus (data.subset=null), or lower " \
        "data.min_heldout_docs" in line and "lower seq_len" not in line, line
    fixed = tiny_config(*site, "max_steps=1", "data.min_heldout_docs=1")
    fixed.run_dir = fixed.ckpt_dir = str(tmp_path / "followed")
    assert run(fixed) == 0


def test_too_short_held_out_documents_advice():
    """`lower seq_len (to at most M)`: M is the longest seq_len that min_heldout_docs documents reach (M passes the
    check, M + 1 does not); the eval's `evaluate at most` alike."""
    from minigpt.data import BYTES_PER_TOKEN, _check_heldout

    sizes, manifest = [9000, 4000, 4003, 100], {"min_heldout_docs": 2}
    with pytest.raises(ConfigError) as e:
        _check_heldout(manifest, sizes, 4096)
    reach = 4003 // BYTES_PER_TOKEN - 1
    assert f"lower seq_len (to at most {reach}), read the full corpus" in str(e.value), str(e.value)
    _check_heldout(manifest, sizes, reach)
    with pytest.raises(ConfigError):
        _check_heldout(manifest, sizes, reach + 1)


# ------------------------------------------------------------------------------------------------
# The checkpoint converter
# ------------------------------------------------------------------------------------------------
@slow
def test_the_converters_backup_exists_advice(tiny_config, tmp_path, monkeypatch):
    from minigpt import checkpoint
    from minigpt.run import run
    from test_checkpoint import old_format_state, upgrade_cli

    cfg = tiny_config("max_steps=2")
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "_state", old_format_state)  # a checkpoint of an earlier minigpt
        assert run(cfg) == 0
    old = Path(cfg.ckpt_dir) / "ckpt_00000002.pt"
    backup = old.with_name(old.name + ".bak")
    backup.write_bytes(b"an earlier upgrade's backup")
    original = old.read_bytes()
    refused = upgrade_cli(str(old), "--trust")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines() == [f"error: {backup} exists (an earlier upgrade's?); move it aside, "
                                                   f"then run the upgrade again"]
    assert old.read_bytes() == original and backup.read_bytes() == b"an earlier upgrade's backup"
    backup.rename(tmp_path / "aside.bak")  # moved aside
    done = upgrade_cli(str(old), "--trust")  # run again
    assert done.returncode == 0 and f"upgraded {old}" in done.stdout, done.stderr
    assert backup.read_bytes() == original and torch.load(old, weights_only=True)["format"] == checkpoint.FORMAT


# ------------------------------------------------------------------------------------------------
# minigpt-eval's lines, followed on tiny checkpoints
# ------------------------------------------------------------------------------------------------
def evaluate(*argv: str) -> tuple[int, str]:
    """minigpt-eval ARGV in a subprocess: (exit code, stderr's last line)."""
    proc = subprocess.run([sys.executable, "-c", "import sys; from minigpt.cli import eval_main; sys.exit(eval_main())",
                           *argv], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1]


def passkey(*argv: str) -> tuple[int, str]:
    """minigpt-eval --passkey-grid alone, on a tiny grid."""
    return evaluate(*argv, "--no-loss", "--passkey-grid", "--depths", "0", "--keys", "1")


@slow
@pytest.mark.parametrize("refused, needle, followed", [
    (["--device", "cuda"], "use --device cpu", [["--device", "cpu"]]),
    (["--dtype", "float16"], "use auto (float32) or bfloat16", [["--dtype", "auto"], ["--dtype", "bfloat16"]]),
], ids=["device-cuda", "float16-on-cpu"])
def test_eval_argument_advice(run_dir, tmp_path, refused, needle, followed):
    if torch.cuda.is_available():
        pytest.skip("a visible GPU: cuda and float16 are no error here")
    args = [str(run_dir), "--passkey-lengths", "128"]
    code, line = passkey(*args, *refused, "--out", str(tmp_path / "refused"))
    assert code == 2 and needle in line, line
    for i, fix in enumerate(followed):
        assert passkey(*args, *fix, "--out", str(tmp_path / f"o{i}"))[0] == 0
        assert (tmp_path / f"o{i}" / "passkey_filler" / "passkey_grid.json").exists()


@slow
def test_eval_give_lengths_advice(pycode_run, tmp_path):
    """A checkpoint that does not say its seq_len: `give --lengths`."""
    from minigpt import checkpoint

    state = checkpoint.load_checkpoint(next((pycode_run / "checkpoints").glob("ckpt_*.pt")))
    del state["config"]["seq_len"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tokenizer.json").write_bytes((pycode_run / "tokenizer.json").read_bytes())
    ckpt = checkpoint._write(tmp_path / "run" / "ckpt_00000001.pt", state)
    code, line = evaluate(str(ckpt), "--out", str(tmp_path / "o"))
    assert code == 2 and "the checkpoint does not say its seq_len; give --lengths" in line, line
    assert evaluate(str(ckpt), "--lengths", "64", "--resamples", "20", "--out", str(tmp_path / "o"))[0] == 0


@slow
def test_eval_too_few_documents_advice(pycode_run, tmp_path):
    """Fewer held-out documents of the length than --min-docs: a shorter length, or --min-docs N, each runs."""
    args = [str(pycode_run), "--resamples", "20", "--docs", "3", "--min-docs", "4"]
    code, line = evaluate(*args, "--lengths", "64", "--out", str(tmp_path / "o"))
    assert code == 2 and "has 3 documents of at least 64 tokens, fewer than 4" in line, line
    assert "--min-docs 3" in line and "evaluate at most" not in line  # 64 is not the trouble: the count is
    assert evaluate(*args[:-1], "3", "--lengths", "64", "--out", str(tmp_path / "o"))[0] == 0


@slow
@pytest.mark.parametrize("given", ["a checkpoint", "a run directory", "its checkpoints/"])
def test_eval_no_checkpoint_there_advice(run_dir, tmp_path, given):
    (tmp_path / "empty").mkdir()
    code, line = passkey(str(tmp_path / "empty"), "--passkey-lengths", "128", "--out", str(tmp_path / "o"))
    assert code == 2
    assert "no checkpoint there (ckpt_*.pt); give a run directory that saved one" in line, line
    path = {"a checkpoint": next((run_dir / "checkpoints").glob("ckpt_*.pt")), "a run directory": run_dir,
            "its checkpoints/": run_dir / "checkpoints"}[given]
    assert passkey(str(path), "--passkey-lengths", "128", "--out", str(tmp_path / "o"))[0] == 0


@slow
def test_eval_no_loss_alone_advice(run_dir, tmp_path):
    """`--no-loss: nothing left to do; add --passkey-grid`."""
    code, line = evaluate(str(run_dir), "--no-loss", "--passkey-lengths", "128", "--out", str(tmp_path / "o"))
    assert code == 2 and "nothing left to do; add --passkey-grid" in line, line
    assert passkey(str(run_dir), "--passkey-lengths", "128", "--out", str(tmp_path / "o"))[0] == 0


@slow
def test_eval_sliding_window_advice(pycode_run, tmp_path):
    """`--sliding`: as many windows as model PATHs (`give one for all`), and a window too short to halve for its
    stride (`give --stride`)."""
    args = [str(pycode_run), "--lengths", "64", "--resamples", "20"]
    code, line = evaluate(*args, "--sliding", "16,32", "--out", str(tmp_path / "o"))
    assert code == 2 and "2 windows for 1 model PATHs; give one for all or one per model PATH" in line, line
    assert evaluate(*args, "--sliding", "16", "--out", str(tmp_path / "o"))[0] == 0
    code, line = evaluate(*args, "--sliding", "1", "--out", str(tmp_path / "o1"))
    assert code == 2 and "has no half for a stride; give --stride" in line, line
    assert evaluate(*args, "--sliding", "1", "--stride", "1", "--out", str(tmp_path / "o1"))[0] == 0


@slow
def test_eval_earlier_results_advice(pycode_run, tmp_path):
    """Earlier results drawn again: a file that is not one (`give a run directory, a checkpoint or such a file`),
    and results alone without --out (`say where (--out DIR)`)."""
    assert evaluate(str(pycode_run), "--lengths", "64", "--resamples", "20", "--out", str(tmp_path / "first"))[0] == 0
    result = tmp_path / "first" / "loss_by_position.json"
    (tmp_path / "other.json").write_text("{}")
    code, line = evaluate(str(tmp_path / "other.json"), "--out", str(tmp_path / "o"))
    assert code == 2 and "not a loss_by_position.json or passkey_grid.json of minigpt-eval" in line, line
    assert "give a run directory, a checkpoint or such a file" in line
    code, line = evaluate(str(result))
    assert code == 2 and "say where (--out DIR)" in line, line
    assert evaluate(str(result), "--out", str(tmp_path / "o"))[0] == 0
    assert (tmp_path / "o" / "loss_by_position.json").exists()


# ------------------------------------------------------------------------------------------------
# minigpt-sample's lines
# ------------------------------------------------------------------------------------------------
def sample(*argv: str) -> tuple[int, str]:
    """minigpt-sample ARGV (4 greedy tokens on the CPU unless ARGV says) in a subprocess: (exit code, stderr's
    last line)."""
    proc = subprocess.run([sys.executable, "-c", "import sys; from minigpt.cli import sample_main; "
                           "sys.exit(sample_main())", *argv, "--max-new-tokens", "4", "--temperature", "0"],
                          capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1]


@slow
def test_sample_no_such_path_advice(passkey_run, tmp_path):
    code, line = sample(str(tmp_path / "nope"))
    assert code == 2 and "no such file or directory; give a run directory or a checkpoint file" in line, line
    for path in (passkey_run, next((passkey_run / "checkpoints").glob("ckpt_*.pt"))):
        assert sample(str(path))[0] == 0


@slow
def test_sample_device_advice(passkey_run):
    if torch.cuda.is_available():
        pytest.skip("a visible GPU: --device cuda is no error here")
    code, line = sample(str(passkey_run), "--device", "cuda")
    assert code == 2 and "use --device cpu (or auto)" in line, line
    assert sample(str(passkey_run), "--device", "cpu")[0] == 0 and sample(str(passkey_run), "--device", "auto")[0] == 0


@slow
def test_sample_tokenizer_not_there_advice(text_run, tmp_path):
    """A BPE run's checkpoint away from its run directory, and the tokenizer file it names gone (another machine):
    `sample from the run directory that holds its tokenizer.json`."""
    from minigpt import checkpoint

    newest = checkpoint.list_checkpoints(text_run.parent / "elsewhere" / "ckpts")  # its ckpt_dir (test_sample)
    state = checkpoint.load_checkpoint(newest[-1])
    gone = tmp_path / "another-machine"  # the run directory the checkpoint names, and its tokenizer, elsewhere
    state["config"].update(tokenizer=str(gone / "tokenizer.json"), run_dir=str(gone))
    lone = checkpoint._write(tmp_path / "copied" / newest[-1].name, dict(state))
    code, line = sample(str(lone))
    assert code == 2 and "sample from the run directory that holds its tokenizer.json" in line, line
    run = shutil.copytree(text_run, tmp_path / "run")
    assert (run / "tokenizer.json").is_file()
    moved = run / "checkpoints" / lone.name
    moved.parent.mkdir(exist_ok=True)
    shutil.copy(lone, moved)
    shutil.copy(lone.with_suffix(".json"), moved.with_suffix(".json"))
    assert sample(str(moved))[0] == 0


# ------------------------------------------------------------------------------------------------
# A multirun (-m): the overrides parse and the sweep directory is writable before Hydra writes
# ------------------------------------------------------------------------------------------------
@slow
def test_a_multirun_is_checked_before_hydra_writes(tmp_path):
    (tmp_path / "a b").mkdir()
    (tmp_path / "a b" / "c.txt").write_text(STORY * 200)
    args = ["-m", *text_args(tmp_path), "seed=1,2"]  # a value list is a sweep under -m, not refused
    one_line_error(cli(tmp_path, *args, "data.path=a", "b/c.txt"), 2, """quote the whole override""",
                   """'data.path="a b/c.txt"'""")
    bad = _unwritable(tmp_path, "under-a-file")
    one_line_error(cli(tmp_path, *args, "data.path=x", f"hydra.sweep.dir={bad}"), 2,
                   "point hydra.sweep.dir at a writable directory")
    one_line_error(cli(tmp_path, *args, "data.path=x", f"ckpt_dir={bad}", "hydra.sweep.dir=s"), 2,  # a job's
                   "multirun job #0: ckpt_dir=", "point ckpt_dir at a writable directory")
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()  # nothing written
    assert not (tmp_path / "s").exists()
    proc = cli(tmp_path, *args, 'data.path="a b/c.txt"', f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 0 and "2 of 2 jobs ok" in proc.stdout, proc.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# A multirun's job folders (minigpt/multirun.py): checked and locked before Hydra starts
# ------------------------------------------------------------------------------------------------
def multirun(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return cli(cwd, "-m", *TINY, "max_steps=1", *args)


def jobs_ok(proc: subprocess.CompletedProcess, n: int) -> None:
    assert proc.returncode == 0 and f"{n} of {n} jobs ok" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-2000:])


@slow
def test_a_multirun_job_folder_in_use_advice(tmp_path):
    runlock.lock(tmp_path / "S" / "0")
    try:
        one_line_error(multirun(tmp_path, "hydra.sweep.dir=S", "seed=1"), 2, "S/0 (job #0 of the multirun)",
                       "wait until it ends", "or choose another hydra.sweep.dir")
        jobs_ok(multirun(tmp_path, "hydra.sweep.dir=another", "seed=1"), 1)
    finally:
        runlock.unlock(tmp_path / "S" / "0")  # it ended
    jobs_ok(multirun(tmp_path, "hydra.sweep.dir=S", "seed=1"), 1)


@slow
@pytest.mark.parametrize("followed", [["resume=auto", "hydra.sweep.dir=S"], ["hydra.sweep.dir=new"]])
def test_a_multirun_over_another_runs_checkpoints_advice(tmp_path, followed):
    jobs_ok(multirun(tmp_path, "hydra.sweep.dir=S", "seed=1"), 1)
    one_line_error(cli(tmp_path, "-m", *TINY, "max_steps=2", "hydra.sweep.dir=S", "seed=1"), 2,
                   "holds checkpoints of another run", "continue it with resume=auto, or choose a new hydra.sweep.dir")
    jobs_ok(cli(tmp_path, "-m", *TINY, "max_steps=2", "seed=1", *followed), 1)
    folder = tmp_path / followed[-1].partition("=")[2] / "0"
    assert RunSummary.read(folder / "summary.json").steps == 2


@slow
@pytest.mark.parametrize("followed", [["hydra.sweep.dir=new"], ["resume=auto", "hydra.sweep.dir=S"]])
def test_a_multirun_over_another_runs_summary_advice(tmp_path, followed):
    jobs_ok(multirun(tmp_path, "hydra.sweep.dir=S", "seed=1", "save_checkpoints=false"), 1)
    one_line_error(multirun(tmp_path, "hydra.sweep.dir=S", "seed=1"), 2, "S/0 (job #0 of the multirun): holds "
                   "another run's summary.json", "choose a new hydra.sweep.dir, or continue that run with resume=auto")
    proc = multirun(tmp_path, "seed=1", *followed)
    if followed[0] == "resume=auto":  # that run kept no checkpoint, and finished: it says so, changes nothing
        assert proc.returncode == 0 and "already finished" in proc.stdout, proc.stderr[-2000:]
    else:
        jobs_ok(proc, 1)


BY_NUMBER = "hydra.sweep.subdir=${hydra.job.num}"


@slow
@pytest.mark.parametrize("refused, needles, followed, n", [
    (["hydra.sweep.dir=S", "hydra.sweep.subdir=x", "seed=1,2"], ["jobs #0 and #1 would share the folder S/x", BY_NUMBER],
     ["hydra.sweep.dir=S", BY_NUMBER, "seed=1,2"], 2),
    (["hydra.sweep.dir=S", "hydra.sweep.subdir=${now:%H-%M-%S}", "seed=1"], ["reads the clock", BY_NUMBER],
     ["hydra.sweep.dir=S", BY_NUMBER, "seed=1"], 1),
    (["hydra.sweep.dir=S", "hydra.sweep.subdir=${hydra:job.num}", "seed=1"], ["cannot tell the jobs' folders",
     BY_NUMBER], ["hydra.sweep.dir=S", BY_NUMBER, "seed=1"], 1),
    (["hydra.sweep.dir=S", "ckpt_dir=ck", "seed=1,2"], ["ckpt_dir=ck: jobs #0 and #1 would share it",
     "leave ckpt_dir unset"], ["hydra.sweep.dir=S", "seed=1,2"], 2),
    (["hydra.sweep.dir=S${seed}", "seed=1,2"], ["a different folder for each job (S1, S2)",
     "give the multirun one directory"], ["hydra.sweep.dir=S", "seed=1,2"], 2),
    (["hydra.sweep.dir=S", "hydra/launcher=joblib", "seed=1,2"], ["hydra/launcher: ", "give the sweep as value lists"],
     ["hydra.sweep.dir=S", "seed=1,2"], 2),
], ids=["shared-folder", "clock-subdir", "runtime-subdir", "shared-ckpt-dir", "sweep-dir-per-job", "other-launcher"])
def test_multirun_folders_known_up_front_advice(tmp_path, refused, needles, followed, n):
    one_line_error(multirun(tmp_path, *refused), 2, *needles)
    assert not list(tmp_path.iterdir())  # nothing written
    jobs_ok(multirun(tmp_path, *followed), n)
    assert all((tmp_path / "S" / str(k) / "summary.json").is_file() for k in range(n))

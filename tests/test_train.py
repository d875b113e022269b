"""The training loop on CPU: learning, resume equality, failure paths, summary.json, W&B offline logging and one CLI run
(the memory levers are in test_levers.py)."""
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import RecordingLogger
from minigpt.model import GPT
from minigpt.run import run
from minigpt.summary import ExitCode
from wandb_records import offline_run

SUMMARY_FIELDS = {"status", "steps", "final_train_loss", "final_val_loss", "passkey_acc", "tokens_per_s",
                  "peak_allocated_gib", "peak_reserved_gib", "seq_len", "batch_size", "attention", "model",
                  "n_params", "device", "torch", "triton"}


def summary(cfg) -> dict:
    return json.loads((Path(cfg.run_dir) / "summary.json").read_text())


def test_tiny_model_learns(tiny_config):
    cfg = tiny_config("max_steps=40", "lr=3e-3", "eval_every=40")
    assert run(cfg) == 0
    s = summary(cfg)
    assert SUMMARY_FIELDS <= set(s)
    assert s["status"] == "ok" and s["steps"] == 40 and s["model"] == "tiny" and s["device"] == "cpu"
    # Bytes start near ln(256) = 5.55; the filler text is predictable, so 40 steps must take it well below.
    assert s["final_train_loss"] < 3.0 and s["final_val_loss"] < 3.0
    assert 0.0 <= s["passkey_acc"] <= 1.0 and s["tokens_per_s"] > 0 and s["n_params"] > 0


def _losses(cfg) -> list[float]:
    logger = RecordingLogger()
    assert run(cfg, logger=logger) == 0
    return logger.series("train/loss")


def test_resume_gives_the_same_losses(tiny_config, tmp_path):
    straight = _losses(tiny_config("max_steps=6", "lr_decay_steps=6", "eval_batches=0"))
    first = tiny_config("max_steps=3", "lr_decay_steps=6", "eval_batches=0")
    first.run_dir, first.ckpt_dir = str(tmp_path / "b"), str(tmp_path / "b" / "ckpt")
    head = _losses(first)
    second = tiny_config("max_steps=6", "lr_decay_steps=6", "eval_batches=0", "resume=auto")
    second.run_dir, second.ckpt_dir = str(tmp_path / "b2"), first.ckpt_dir
    tail = _losses(second)
    assert len(straight) == 6 and len(head) == 3 and len(tail) == 3
    assert head + tail == pytest.approx(straight, rel=1e-6, abs=1e-7)


def test_oom_gives_exit_3_and_status_oom(tiny_config, monkeypatch, capsys):
    def boom(self, idx, targets, document_ids=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
    monkeypatch.setattr(GPT, "forward", boom)
    cfg = tiny_config()
    assert run(cfg) == ExitCode.OOM
    assert summary(cfg)["status"] == "oom"
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "seq_len=128" in err[0] and "attention=sdpa" in err[0] and "try" in err[0]
    assert "summary.json" in err[0]  # the one line also says where the summary is


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tiny_config, monkeypatch):
    cfg = tiny_config("max_steps=6", "ckpt_every=2")
    real = GPT.forward
    calls = {"n": 0}

    def nan_on_fifth(self, idx, targets, document_ids=None):
        calls["n"] += 1
        loss = real(self, idx, targets, document_ids)
        return loss * float("nan") if calls["n"] == 5 else loss
    monkeypatch.setattr(GPT, "forward", nan_on_fifth)
    assert run(cfg) == 1
    s = summary(cfg)
    assert s["status"] == "error" and "non-finite" in s["error"] and s["steps"] == 4
    assert sorted(p.name for p in Path(cfg.ckpt_dir).glob("*.pt")) == ["ckpt_00000002.pt", "ckpt_00000004.pt"]


def test_wandb_offline_run_holds_the_metrics(tiny_config, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = tiny_config("logger=wandb", "max_steps=3", "eval_every=3", "logger.group=g1")
    assert run(cfg) == 0
    logged = offline_run(cfg.run_dir)
    assert {"train/loss", "train/lr", "perf/tokens_per_s", "perf/step_time_s", "memory/peak_allocated_gib",
            "memory/peak_reserved_gib", "eval/val_loss", "eval/passkey_acc"} <= logged["history"]
    assert {"status", "tokens_per_s", "final_val_loss", "n_params"} <= set(logged["summary"])
    assert json.loads(logged["summary"]["status"]) == "ok"
    assert logged["name"] == "sdpa-tiny-n128" and logged["group"] == "g1" and logged["exit_code"] == 0


def test_eval_logs_the_passkey_grid(tiny_config):
    logger = RecordingLogger()
    cfg = tiny_config("max_steps=2", "eval_every=2", "passkey_grid=2")
    assert run(cfg, logger=logger) == 0
    (evals,) = [m for _, m in logger.metrics if "eval/passkey_grid_acc" in m]
    depths = [k for k in evals if k.startswith("eval/passkey_grid_depth_")]
    assert sorted(depths) == [f"eval/passkey_grid_depth_{d}" for d in ("0.00", "0.25", "0.50", "0.75", "1.00")]
    assert 0.0 <= logger.series("eval/passkey_grid_acc")[-1] <= 1.0


def test_the_cli_trains_and_its_last_line_says_where_the_run_is(tmp_path):
    """One training run through the command line, as a user starts it (the fast tier's CLI run)."""
    import subprocess
    import sys

    run_dir = tmp_path / "cli run"
    done = subprocess.run([sys.executable, "-m", "minigpt", "model=tiny", "device=cpu", "seq_len=128", "batch_size=2",
                           "max_steps=2", "eval_batches=0", "logger=none", f"hydra.run.dir='{run_dir}'"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "ok" and s["steps"] == 2 and math.isfinite(s["final_train_loss"])
    assert str(run_dir) in done.stdout.strip().splitlines()[-1]


def test_eval_logs_loss_by_position_on_pycode_and_only_there(tiny_config, tmp_path):
    """data=pycode: each eval logs the mean loss per position bin of the 8 longest val documents, the same numbers
    position_metrics gives for the run's final model; other data logs none unless asked; refusals."""
    from minigpt.checkpoint import load_checkpoint
    from minigpt.config import ConfigError
    from minigpt.data import build_data
    from minigpt.eval.loss_by_position import bin_edges, documents_from_stream, position_metrics
    from minigpt.sample import model_from_checkpoint
    from test_eval import write_long_site

    cfg = tiny_config(*write_long_site(tmp_path), "seq_len=64", "max_steps=2", "eval_every=1")
    logger = RecordingLogger()
    assert run(cfg, logger=logger) == 0
    evals = [m for _, m in logger.metrics if "eval/val_loss" in m]
    logged = {k: v for k, v in evals[-1].items() if k.startswith("eval/loss_by_position/")}
    assert len(evals) == 2 and list(logged) == [f"eval/loss_by_position/{a}-{b}"
                                                for a, b in zip(bin_edges(64), bin_edges(64)[1:])]
    data = build_data(cfg.data, cfg.seq_len, cfg.seed)
    docs = documents_from_stream(data.val, data.eot, 8)
    model, _ = model_from_checkpoint(load_checkpoint(Path(cfg.ckpt_dir) / "ckpt_00000002.pt"), "sdpa", Path("x"))
    expected = position_metrics(model, docs, data.eot, 64, torch.device("cpu"), torch.float32)
    assert logged == pytest.approx(expected, rel=1e-5)

    passkey = tiny_config("max_steps=1")
    passkey.run_dir, passkey.ckpt_dir = str(tmp_path / "p"), str(tmp_path / "p" / "checkpoints")
    other = RecordingLogger()
    assert run(passkey, logger=other) == 0
    assert not [k for _, m in other.metrics for k in m if "loss_by_position" in k]
    with pytest.raises(ConfigError, match="data=passkey has no documents"):
        tiny_config("loss_by_position=true")
    with pytest.raises(ConfigError, match="not under context parallelism"):
        tiny_config("data=pycode", "loss_by_position=true", "parallel.context=2", "attention=flash")

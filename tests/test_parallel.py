"""Data and context parallelism on CPU: 2 and 4 processes on gloo, the flash kernel in Triton's interpreter (fp32).

Processes are started the way torchrun starts them (its environment variables, then `run`; processes.py), or
through torchrun itself for the command line. Ring attention on its own: test_ring_attention.py. Tolerance:
losses after a few AdamW steps agree with one process to a relative 1e-5 (the ring merges partial softmaxes
in another order than the single kernel sums them).
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import RecordingLogger
from minigpt.checkpoint import load_checkpoint
from minigpt.compose import compose
from minigpt.config import ConfigError
from minigpt.run import run
from minigpt.summary import RunSummary
from processes import launch

ROOT = Path(__file__).resolve().parent.parent


def tiny(tmp: Path, *overrides: str):
    """A smaller model than conftest's tiny_config (the kernel runs in Triton's interpreter), writing into tmp/run."""
    cfg = compose(["model=tiny", "model.n_embd=64", "model.n_head=2", "seq_len=128", "batch_size=2", "max_steps=3",
                   "eval_every=0", "eval_batches=1",
                   "logger=none", "device=cpu", "warmup_steps=1", "lr=3e-3", f"data.cache_dir={tmp / 'cache'}",
                   *overrides])
    cfg.run_dir, cfg.ckpt_dir = str(tmp / "run"), str(tmp / "run" / "checkpoints")
    return cfg


def _train(rank, tmp, overrides, stop_at=None):
    """One rank of a run; writes what its logger saw to tmp/rank<k>.json. `stop_at` = (rank, step): that rank
    gets SIGTERM after that step."""
    logger = RecordingLogger()
    if stop_at is not None and stop_at[0] == rank:
        log = logger.log

        def log_and_signal(metrics, step):
            log(metrics, step)
            if step == stop_at[1]:
                os.kill(os.getpid(), signal.SIGTERM)
        logger.log = log_and_signal
    code = run(tiny(Path(tmp), *overrides), logger=logger)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(
        {"code": code, "losses": logger.series("train/loss"), "val": logger.series("eval/val_loss"),
         "passkey": logger.series("eval/passkey_acc"), "metrics": [m for _, m in logger.metrics if "train/loss" in m][-1:]}))


def train_parallel(tmp: Path, world: int, *overrides: str, stop_at=None) -> list[dict]:
    launch(world, _train, str(tmp), list(overrides), stop_at)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def train_single(tmp: Path, *overrides: str) -> dict:
    logger = RecordingLogger()
    code = run(tiny(tmp, *overrides), logger=logger)
    return {"code": code, "losses": logger.series("train/loss"), "val": logger.series("eval/val_loss"),
            "passkey": logger.series("eval/passkey_acc")}


def final_weights(tmp: Path) -> dict:
    newest = sorted((tmp / "run" / "checkpoints").glob("ckpt_*.pt"))[-1]
    return load_checkpoint(newest)["model"]


def assert_same_weights(a: Path, b: Path) -> None:
    """The runs' final weights agree: all but a few elements to 1e-5, every one to 1e-4 (a thirtieth of one lr=3e-3
    step: Adam's m/√v turns fp32 rounding in a near-zero gradient into up to a whole step)."""
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        diff = (wa[name] - wb[name]).abs()
        assert diff.max() <= 1e-4 and (diff > 1e-5).float().mean() < 1e-3, (name, diff.max())


# ------------------------------------------------------------------------------------------------
# 1-2. Training under context and data parallelism equals one process
# ------------------------------------------------------------------------------------------------
def test_context_parallel_training_equals_one_process(tmp_path):
    """2 ranks split each 126-token sequence (padded to 128), with recompute + kept attention + chunked MLP and
    loss on; one process runs the plain model. Same losses, val loss and passkey accuracy."""
    levers = ["model.recompute_every=1", "model.keep_attention=true", "model.mlp_chunk=24", "model.loss_chunk=40"]
    ranks = train_parallel(tmp_path / "cp", 2, "attention=flash", "seq_len=126", "max_steps=2", "parallel.context=2",
                           *levers)
    one = train_single(tmp_path / "one", "attention=flash", "seq_len=126", "max_steps=2")
    assert [r["code"] for r in ranks] == [0, 0] and one["code"] == 0
    assert len(one["losses"]) == 2 and one["losses"][-1] < one["losses"][0] and len(one["passkey"]) == 1
    for r in ranks:  # every rank reports the global loss
        assert r["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert r["val"] == pytest.approx(one["val"], rel=1e-5) and r["passkey"] == one["passkey"]
    s = RunSummary.read(tmp_path / "cp" / "run" / "summary.json")
    assert s.world_size == 2 and s.context_parallel == 2 and s.status == "ok"
    assert s.rank_tokens_per_s_sum == pytest.approx(2 * s.rank_tokens_per_s_max, rel=0.5)


def test_data_and_context_parallel_equal_one_process_with_the_combined_batch(tmp_path):
    """4 ranks as 2 data-parallel groups of 2 context-parallel ranks, batch 1 each, 2 micro-batches per step:
    the losses and final weights of one process with batch 2."""
    common = ["attention=flash", "grad_accum=2", "max_steps=2", "seq_len=112", "eval_batches=0", "model.n_layer=1"]
    ranks = train_parallel(tmp_path / "dpcp", 4, *common, "batch_size=1", "parallel.context=2")
    one = train_single(tmp_path / "one", *common, "batch_size=2")
    assert [r["code"] for r in ranks] == [0] * 4
    assert ranks[0]["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert_same_weights(tmp_path / "dpcp", tmp_path / "one")


def test_data_parallel_equals_one_process_with_the_combined_batch(tmp_path):
    """2 data-parallel ranks with batch 2 each = one process with batch 4: losses, val loss, final weights."""
    ranks = train_parallel(tmp_path / "dp", 2, "batch_size=2", "max_steps=4")
    one = train_single(tmp_path / "one", "batch_size=4", "max_steps=4")
    assert [r["code"] for r in ranks] == [0, 0]
    assert ranks[0]["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert ranks[1]["val"] == pytest.approx(one["val"], rel=1e-5)
    assert_same_weights(tmp_path / "dp", tmp_path / "one")
    metrics = ranks[0]["metrics"][0]  # the last step's: every rank's speed and memory, and the global tokens/s
    assert metrics["perf/rank_tokens_per_s_sum"] > metrics["perf/rank_tokens_per_s_max"] > 0
    assert not (tmp_path / "dp" / "rank1").exists()


def test_resume_with_another_world_size_continues_exactly(tmp_path):
    """2 ranks (batch 2 each) train 2 steps; one process with batch 4 resumes them to 4 steps: the losses of a
    straight one-process run."""
    straight = train_single(tmp_path / "straight", "batch_size=4", "max_steps=4", "lr_decay_steps=4")
    first = train_parallel(tmp_path / "two", 2, "batch_size=2", "max_steps=2", "lr_decay_steps=4")
    resumed = train_single(tmp_path / "two", "batch_size=4", "max_steps=4", "lr_decay_steps=4", "resume=auto")
    assert first[0]["code"] == 0 and resumed["code"] == 0
    assert first[0]["losses"] + resumed["losses"] == pytest.approx(straight["losses"], rel=1e-5)


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    ranks = train_parallel(tmp_path / "sig", 2, "max_steps=5", stop_at=(1, 2))
    assert [r["code"] for r in ranks] == [128 + signal.SIGTERM] * 2
    assert [len(r["losses"]) for r in ranks] == [2, 2]
    s = RunSummary.read(tmp_path / "sig" / "run" / "summary.json")
    assert s.status == "interrupted" and s.steps == 2 and s.checkpoint.endswith("ckpt_00000002.pt")


# ------------------------------------------------------------------------------------------------
# 3. The command line under torchrun, and the settings it refuses
# ------------------------------------------------------------------------------------------------
def torchrun(cwd: Path, nproc: int, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(nproc), "-m", "minigpt", "model=tiny", "model.n_layer=1", "model.n_embd=64", "seq_len=112", "batch_size=1", "max_steps=2",
                           "eval_batches=1", "logger=none", f"data.cache_dir={cwd / 'cache'}", *overrides],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_cli_under_torchrun_writes_one_run_dir(tmp_path):
    done = torchrun(tmp_path, 2, "attention=flash", "parallel.context=2")
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((tmp_path / "outputs").iterdir())
    assert len(runs) == 1, runs
    s = RunSummary.read(runs[0] / "summary.json")
    assert (s.status, s.steps, s.world_size, s.context_parallel) == ("ok", 2, 2, 2)
    assert sorted(p.name for p in runs[0].iterdir()) == [".hydra", "checkpoints", "cli.log", "metrics.jsonl", "summary.json"]
    assert done.stdout.count("done: 2 steps") == 1  # rank 0 alone prints


def test_cli_refuses_a_context_degree_that_does_not_divide_the_processes(tmp_path):
    done = torchrun(tmp_path, 2, "attention=flash", "parallel.context=3")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: parallel.context=3: must divide the number of processes (2; torchrun "
                      "--nproc_per_node x nodes)"]
    assert "exitcode  : 2" in done.stderr  # each worker's exit code, in torchrun's report (torchrun exits 1)
    assert done.returncode != 0 and not (tmp_path / "outputs").exists()
    one = subprocess.run([sys.executable, "-m", "minigpt", "model=tiny", "logger=none", "attention=flash",
                          "parallel.context=2"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert one.returncode == 2 and one.stderr.strip().splitlines() == [
        "error: parallel.context=2: must divide the number of processes (1; torchrun --nproc_per_node x nodes)"]


@pytest.mark.parametrize("attention", ["sdpa", "naive"])
def test_context_parallelism_needs_flash(attention, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=f"^attention={attention}: context parallelism .* needs attention=flash"):
        compose(["model=tiny", "device=cpu", "logger=none", f"attention={attention}", "parallel.context=2"])


def test_nccl_settings_are_ours_where_unset_and_every_nccl_variable_is_recorded(monkeypatch):
    """The trainer and the ring benchmark set NCCL_ENV where the environment is silent, never over it, and the
    benchmark records every NCCL_* variable (transfers depend on them: NCCL_MAX_P2P_NCHANNELS caps a send's SMs)."""
    from minigpt.distributed import process

    for key in [k for k in os.environ if k.startswith("NCCL_")] + list(process.NCCL_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_MAX_P2P_NCHANNELS", "4")
    monkeypatch.setenv("TORCH_NCCL_HIGH_PRIORITY", "0")
    assert process.use_nccl_settings() == {"TORCH_NCCL_HIGH_PRIORITY": "0"}  # the environment's word wins
    monkeypatch.delenv("TORCH_NCCL_HIGH_PRIORITY")
    assert process.use_nccl_settings() == process.NCCL_ENV
    assert process.nccl_settings() == {"NCCL_MAX_P2P_NCHANNELS": "4", **process.NCCL_ENV}

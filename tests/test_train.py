"""The training loop on CPU: learning, resume equality, failure paths, summary.json and W&B offline logging."""
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import RecordingLogger
from minigpt.attention import get_attention
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
    def boom(self, idx, targets):
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

    def nan_on_fifth(self, idx, targets):
        calls["n"] += 1
        loss = real(self, idx, targets)
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


LEVERS = [  # (loss_chunk, recompute_every, recompute_dtype, mlp_chunk, offload)
    (16, 0, "float32", 0, False), (7, 1, "float32", 0, False), (0, 2, "float32", 0, False),
    (0, 0, "float32", 9, False), (0, 1, "float32", 0, True), (13, 1, "float32", 11, True),
]


@pytest.mark.parametrize("loss_chunk,every,dtype,mlp_chunk,offload", LEVERS)
def test_memory_levers_give_the_same_loss_and_gradients(tiny_config, loss_chunk, every, dtype, mlp_chunk, offload):
    cfg = tiny_config().model
    x, y = torch.randint(0, 256, (2, 50)), torch.randint(0, 256, (2, 50))

    def loss_and_grads(**levers):
        for key, value in levers.items():
            setattr(cfg, key, value)
        torch.manual_seed(0)
        model = GPT(cfg, 256, get_attention("sdpa"))
        loss = model(x, y)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    base_loss, base_grads = loss_and_grads(loss_chunk=0, recompute_every=0, recompute_dtype="float32", mlp_chunk=0, offload=False)
    loss, grads = loss_and_grads(loss_chunk=loss_chunk, recompute_every=every, recompute_dtype=dtype,
                                 mlp_chunk=mlp_chunk, offload=offload)
    assert math.isclose(loss, base_loss, rel_tol=1e-5)
    for a, b in zip(grads, base_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("every", [0, 1])
def test_chunking_gives_each_parameter_one_gradient_and_no_full_size_slice_gradients(tiny_config, every):
    """DDP's hooks must fire once per parameter and step, so the chunks' parameter gradients are summed inside
    the chunked node; and the input gradient is one buffer, not a full-size zero gradient per chunk."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = tiny_config("model.loss_chunk=16", "model.mlp_chunk=12", f"model.recompute_every={every}").model
    model = GPT(cfg, 256, get_attention("sdpa"))
    x, y = torch.randint(0, 256, (2, 50)), torch.randint(0, 256, (2, 50))
    calls = {name: 0 for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: calls.__setitem__(name, calls[name] + 1))

    class Ops(TorchDispatchMode):
        seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        model(x, y).backward()
    assert set(calls.values()) == {1}, calls
    assert "slice_backward" not in ops.seen


def test_bf16_checkpoints_round_the_stored_input_only(tiny_config):
    """bfloat16 block checkpoints: close to the fp32 model, and the gradient is exact for the rounded forward."""
    cfg = tiny_config().model
    x, y = torch.randint(0, 256, (2, 40)), torch.randint(0, 256, (2, 40))
    torch.manual_seed(0)
    model = GPT(cfg, 256, get_attention("sdpa"))
    plain = model(x, y).item()
    cfg.recompute_every, cfg.recompute_dtype = 1, "bfloat16"
    torch.manual_seed(0)
    model = GPT(cfg, 256, get_attention("sdpa"))  # the same weights, with the lever on
    loss = model(x, y)
    assert loss.item() != plain and math.isclose(loss.item(), plain, rel_tol=1e-2)
    # exact gradient of the rounded model: compare with autograd through an explicit rounding (straight-through)
    params = list(model.parameters())
    loss.backward()
    grads = [p.grad.clone() for p in params]

    def rounded_hidden(idx):
        h = model.wte(idx)
        cos, sin = model.rotary(idx.shape[1])
        for block in model.blocks:
            h = h + (h.to(torch.bfloat16).float() - h).detach()
            h = block(h, cos, sin)
        return h
    ref = model.loss(rounded_hidden(x), y)
    assert math.isclose(ref.item(), loss.item(), rel_tol=1e-6)
    for a, b in zip(grads, torch.autograd.grad(ref, params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_eval_logs_the_passkey_grid(tiny_config):
    logger = RecordingLogger()
    cfg = tiny_config("max_steps=2", "eval_every=2", "passkey_grid=2")
    assert run(cfg, logger=logger) == 0
    (evals,) = [m for _, m in logger.metrics if "eval/passkey_grid_acc" in m]
    depths = [k for k in evals if k.startswith("eval/passkey_grid_depth_")]
    assert sorted(depths) == [f"eval/passkey_grid_depth_{d}" for d in ("0.00", "0.25", "0.50", "0.75", "1.00")]
    assert 0.0 <= logger.series("eval/passkey_grid_acc")[-1] <= 1.0


@pytest.mark.parametrize("keep", [False, True])
def test_offloaded_host_memory_is_counted_and_released(tiny_config, keep):
    """HostMemory counts what offloading holds: each recomputed block's bf16 input (and with kept attention its
    output and fp32 LSE) until the backward frees it; summary.json reports the peak."""
    from minigpt.levers import HostMemory

    cfg = tiny_config("attention=flash" if keep else "attention=sdpa").model
    cfg.recompute_every, cfg.recompute_dtype, cfg.offload, cfg.keep_attention = 1, "bfloat16", True, keep
    model = GPT(cfg, 256, get_attention("flash" if keep else "sdpa"))
    B, N, C, H = 2, 48, cfg.n_embd, cfg.n_head
    x, y = torch.randint(0, 256, (B, N)), torch.randint(0, 256, (B, N))
    before = HostMemory.live
    HostMemory.reset_peak()
    loss = model(x, y)
    per_block = B * N * C * 2 + (B * N * C * 4 + B * H * N * 4 if keep else 0)  # fp32 compute: o is fp32 on CPU
    assert HostMemory.live - before == cfg.n_layer * per_block
    loss.backward()
    assert HostMemory.live == before and HostMemory.peak - before == cfg.n_layer * per_block


def test_summary_reports_the_offloaded_host_memory(tiny_config):
    cfg = tiny_config("model.recompute_every=1", "model.offload=true", "max_steps=2", "eval_batches=0")
    assert run(cfg) == 0
    summary = json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    expected = cfg.model.n_layer * cfg.batch_size * cfg.seq_len * cfg.model.n_embd * 4 / 2**30  # fp32 inputs
    assert summary["peak_host_offload_gib"] == pytest.approx(expected)


def test_a_recomputed_block_with_frozen_parameters_trains_the_others(tiny_config):
    cfg = tiny_config("model.mlp_chunk=7").model
    x, y = torch.randint(0, 256, (2, 30)), torch.randint(0, 256, (2, 30))
    grads = []
    for every in (0, 1):
        cfg.recompute_every = every
        torch.manual_seed(0)
        model = GPT(cfg, 256, get_attention("sdpa"))
        model.blocks[0].ln_1.weight.requires_grad_(False)
        model.blocks[-1].mlp.c_fc.weight.requires_grad_(False)
        model(x, y).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


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

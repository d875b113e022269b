"""The training loop: AdamW, warmup + cosine schedule, autocast, eval, checkpoints, metrics, summary.json.

`run(cfg)` trains and always leaves a summary.json in cfg.run_dir, whatever happens:

    status   exit code   when
    ok       0           all steps done
    oom      3           CUDA out of memory (one line says what to try)
    error    1           bad data, non-finite loss, anything else
    interrupted 130      Ctrl-C (a checkpoint is written first)
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from minigpt.attention import get_attention
from minigpt.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from minigpt.config import ConfigError, TrainConfig
from minigpt.data import DataError, build_data
from minigpt.loggers import Logger, NullLogger, build_logger
from minigpt.metrics import device_name, peak_memory_gib, peak_tflops, reset_peak_memory, train_step_flops
from minigpt.model import GPT

EXIT_OK, EXIT_ERROR, EXIT_OOM, EXIT_INTERRUPTED = 0, 1, 3, 130
WARMUP_STEPS_EXCLUDED = 2  # first steps (compilation, allocator growth) left out of the medians, if more ran


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss); the message says why and what to try."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda: no CUDA GPU is visible; use device=cpu or device=auto")
    return torch.device(name)


def autocast_dtype(name: str, device: torch.device) -> torch.dtype:
    """Compute dtype for autocast: bfloat16 on CUDA and float32 on CPU unless set."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.min_lr at lr_decay_steps (default max_steps)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    horizon = cfg.lr_decay_steps or cfg.max_steps
    if step >= horizon:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms), fused kernels on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")


def check_backend_available(cfg: TrainConfig, device: torch.device) -> None:
    if cfg.attention.name == "flash" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            "attention=flash: needs a CUDA GPU (Triton kernel); on CPU use attention=sdpa or naive "
            "(or set TRITON_INTERPRET=1 to run the kernel in Triton's slow interpreter)"
        )


@torch.no_grad()
def evaluate(model: GPT, data, cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Mean val loss over cfg.eval_batches fixed batches, and passkey retrieval accuracy if the data has a key."""
    model.eval()
    losses, hits, total = [], 0, 0
    for i in range(cfg.eval_batches):
        x, y = (t.to(device) for t in data.batch("val", i, cfg.batch_size))
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            h = model.hidden(x)
            losses.append(model.loss(h, y).item())
            if data.answer is not None:  # all key digits must be the argmax predictions
                pred = model.head(h[:, data.answer]).argmax(dim=-1)
                hits += (pred == y[:, data.answer]).all(dim=-1).sum().item()
                total += y.shape[0]
    model.train()
    out = {"eval/val_loss": statistics.fmean(losses)}
    if total:
        out["eval/passkey_acc"] = hits / total
    return out


def train(cfg: TrainConfig, logger: Logger, summary: dict[str, Any], config_dict: dict[str, Any]) -> None:
    """Run the training loop, recording progress into `summary` as it goes (so failures keep it)."""
    device = resolve_device(cfg.device)
    dtype = autocast_dtype(cfg.dtype, device)
    summary.update(device=device_name(device), dtype=str(dtype).removeprefix("torch."))
    check_backend_available(cfg, device)
    torch.manual_seed(cfg.seed)

    data = build_data(cfg.data, cfg.seq_len, cfg.seed)
    vocab_size = cfg.model.vocab_size or data.vocab_size
    if data.vocab_size > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size}: smaller than the tokenizer's {data.vocab_size}")
    options = {"backend": cfg.attention.sdpa_backend} if cfg.attention.name == "sdpa" else {}
    model = GPT(cfg.model, vocab_size, get_attention(cfg.attention.name, **options)).to(device)
    n_params = model.num_params()
    head_dim = cfg.model.n_embd // cfg.model.n_head
    summary.update(n_params=n_params, vocab_size=vocab_size)
    print(f"model {cfg.model.name}: {n_params / 1e6:.2f}M parameters, attention={cfg.attention.name}, "
          f"seq_len={cfg.seq_len}, batch={cfg.batch_size}x{cfg.grad_accum}, device={summary['device']}, dtype={summary['dtype']}")

    optimizer = make_optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    start = 0
    ckpt = find_checkpoint(cfg.resume, cfg.ckpt_dir)
    if ckpt is not None:
        start = load_checkpoint(ckpt, model, optimizer)
        print(f"resumed from {ckpt} at step {start}")
    elif cfg.resume == "auto":
        print(f"resume=auto: no checkpoint in {cfg.ckpt_dir}, starting fresh")
    forward = torch.compile(model) if cfg.compile else model

    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    flops_per_step = train_step_flops(n_params, cfg.model.n_layer, cfg.model.n_head, head_dim,
                                      cfg.batch_size * cfg.grad_accum, cfg.seq_len)
    peak = peak_tflops(summary["device"])
    times: list[float] = []
    step = start
    model.train()
    bar = tqdm(range(start, cfg.max_steps), initial=start, total=cfg.max_steps, desc="train", dynamic_ncols=True,
               mininterval=1.0, file=sys.stdout)
    try:
        for step in bar:
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            reset_peak_memory(device)
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                x, y = (t.to(device, non_blocking=True) for t in data.batch("train", step * cfg.grad_accum + micro, cfg.batch_size))
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    loss = forward(x, y) / cfg.grad_accum
                scaler.scale(loss).backward()
                loss_sum += loss.detach()
            loss_value = loss_sum.item()
            if not math.isfinite(loss_value):
                raise TrainingError(
                    f"non-finite loss ({loss_value}) at step {step}: stopped before the update; the last good "
                    f"checkpoint in {cfg.ckpt_dir} is kept; try a lower lr or dtype=float32"
                )
            if cfg.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            times.append(dt)

            alloc, reserved = peak_memory_gib(device)
            metrics = {
                "train/loss": loss_value,
                "train/lr": lr,
                "perf/step_time_s": dt,
                "perf/tokens_per_s": tokens_per_step / dt,
                "memory/peak_allocated_gib": alloc,
                "memory/peak_reserved_gib": reserved,
            }
            if peak:
                metrics["perf/mfu"] = flops_per_step / dt / (peak * 1e12)
            summary.update(steps=step + 1, final_train_loss=loss_value,
                           peak_allocated_gib=max(summary["peak_allocated_gib"], alloc),
                           peak_reserved_gib=max(summary["peak_reserved_gib"], reserved))
            bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tokens_per_step / dt:,.0f}", mem=f"{alloc:.1f}GiB", refresh=False)

            done = step + 1
            if cfg.eval_batches and ((cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.max_steps):
                evals = evaluate(model, data, cfg, device, dtype)
                metrics.update(evals)
                summary["final_val_loss"] = evals["eval/val_loss"]
                summary["passkey_acc"] = evals.get("eval/passkey_acc")
                tqdm.write(f"step {done}: " + ", ".join(f"{k.split('/')[1]} {v:.4f}" for k, v in evals.items()), file=sys.stdout)
            logger.log(metrics, step=done)
            if cfg.save_checkpoints and ((cfg.ckpt_every and done % cfg.ckpt_every == 0) or done == cfg.max_steps):
                save_checkpoint(cfg.ckpt_dir, done, model, optimizer, config_dict)
    except KeyboardInterrupt:
        done = summary["steps"]
        if done > start and cfg.save_checkpoints:
            path = save_checkpoint(cfg.ckpt_dir, done, model, optimizer, config_dict)
            print(f"\ninterrupted: checkpoint at step {done} written to {path}")
        raise
    finally:
        bar.close()
        steady = times[min(WARMUP_STEPS_EXCLUDED, len(times) - 1):]  # keep at least the last step
        if steady:
            step_time = statistics.median(steady)
            summary.update(step_time_s=step_time, tokens_per_s=tokens_per_step / step_time,
                           mfu=flops_per_step / step_time / (peak * 1e12) if peak else None)


def _versions() -> dict[str, str | None]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version}


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


def run(cfg: TrainConfig, config_dict: dict[str, Any] | None = None) -> int:
    """Train as configured, write summary.json into cfg.run_dir, and return the process exit code."""
    config_dict = config_dict if config_dict is not None else asdict(cfg)
    summary: dict[str, Any] = {
        "status": "running", "steps": 0, "final_train_loss": None, "final_val_loss": None, "passkey_acc": None,
        "tokens_per_s": None, "step_time_s": None, "mfu": None, "peak_allocated_gib": 0.0, "peak_reserved_gib": 0.0,
        "seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum,
        "attention": cfg.attention.name, "sdpa_backend": cfg.attention.sdpa_backend if cfg.attention.name == "sdpa" else None,
        "model": cfg.model.name, "n_layer": cfg.model.n_layer, "n_params": None,
        "checkpoint_every": cfg.model.checkpoint_every, "checkpoint_dtype": cfg.model.checkpoint_dtype,
        "offload": cfg.model.offload, "mlp_chunk": cfg.model.mlp_chunk, "loss_chunk": cfg.model.loss_chunk, "device": None, **_versions(), "error": None,
    }
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    logger: Logger = NullLogger()
    code = EXIT_OK
    t_start = time.perf_counter()
    try:
        logger = build_logger(cfg, config_dict)
        train(cfg, logger, summary, config_dict)
        summary["status"] = "ok"
    except KeyboardInterrupt:
        summary["status"], code = "interrupted", EXIT_INTERRUPTED
    except BaseException as e:  # noqa: BLE001 - every failure must still produce a summary
        if _is_oom(e):
            device = resolve_device(cfg.device)
            alloc, reserved = peak_memory_gib(device)
            summary.update(status="oom", peak_allocated_gib=max(summary["peak_allocated_gib"], alloc),
                           peak_reserved_gib=max(summary["peak_reserved_gib"], reserved), error="CUDA out of memory")
            print(f"out of memory: seq_len={cfg.seq_len} attention={cfg.attention.name} model={cfg.model.name} "
                  f"batch={cfg.batch_size} peak {alloc:.1f} GiB allocated; try attention=flash, a smaller seq_len "
                  f"or batch_size, model.checkpoint_every=1 or model.loss_chunk=8192", file=sys.stderr)
            code = EXIT_OOM
        else:
            summary.update(status="error", error=f"{type(e).__name__}: {e}")
            if isinstance(e, (ConfigError, DataError, TrainingError)):
                print(f"error: {e}", file=sys.stderr)
            else:
                traceback.print_exc()
            code = EXIT_ERROR
    finally:
        summary["wall_time_s"] = time.perf_counter() - t_start
        summary["run_dir"] = str(cfg.run_dir)
        write_summary(Path(cfg.run_dir) / "summary.json", summary)
        logger.log({"status/ok": float(summary["status"] == "ok"), "status/oom": float(summary["status"] == "oom")},
                   step=summary["steps"])
        logger.finish(summary, code)
    return code


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    os.replace(tmp, path)

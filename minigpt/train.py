"""Training: `build` makes everything a run needs from its config; `train_loop` runs the steps.

The loop is plain: AdamW with warmup + cosine, autocast, gradient accumulation and clipping, periodic eval and
checkpoints, per-step metrics to the logger and the run summary. A stop request (SIGINT/SIGTERM, see
minigpt/run.py) ends the loop after the current step with a checkpoint. The run lifecycle around it (summary,
exit codes, signals, run directory) is minigpt/run.py.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from minigpt.attention import get_attention
from minigpt.checkpoint import CheckpointError, extension, find_and_load, restore, save_checkpoint
from minigpt.config import ConfigError, TrainConfig
from minigpt.data import PasskeyData, build_data, save_manifest, save_tokenizer
from minigpt.distributed.data_parallel import TrainingForward
from minigpt.distributed.mesh import Mesh
from minigpt.distributed.reductions import agree, mean
from minigpt.distributed.ring_attention import mesh_attention
from minigpt.distributed.sharding import local_positions, shard_batch
from minigpt.eval.global_batch import key_hits, mean_loss
from minigpt.eval.loss_by_position import documents_from_stream, position_metrics
from minigpt.eval.retrieval import passkey_grid
from minigpt.files import WriteError
from minigpt.levers import HostMemory
from minigpt.loggers import Logger
from minigpt.metrics import device_name, peak_memory_gib, peak_tflops, reset_peak_memory, train_step_flops
from minigpt.model import GPT
from minigpt.rank_stats import RankStats
from minigpt.summary import RunSummary

GRID_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # key depths of the passkey grid logged at each eval (passkey_grid=k)
POSITION_DOCS = 8  # val documents (the longest) whose loss by position each eval logs (loss_by_position)
WARMUP_STEPS_EXCLUDED = 2  # first steps (compilation, allocator growth) left out of the medians, if more ran


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss); the message says why and what to try."""


class NonFiniteLoss(TrainingError):
    """A step's loss is not finite (raised before its update); train_loop says which checkpoint is kept."""

    def __init__(self, step: int, loss: float):
        super().__init__(f"non-finite loss ({loss}) at step {step}: stopped before its update, not saved")
        self.step, self.loss = step, loss


def kept(summary: RunSummary) -> str:
    """What a run stopped by a non-finite state keeps: its last good checkpoint (this attempt's, or the one it
    resumed from), or none."""
    return f"the last good checkpoint {summary.checkpoint} is kept" if summary.checkpoint else "no checkpoint was written"


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


@dataclass
class Training:
    """Everything the loop needs, made by `build`."""

    cfg: TrainConfig
    config_dict: dict[str, Any]  # the resolved config, stored in checkpoints
    device: torch.device
    dtype: torch.dtype
    data: Any  # a data source (minigpt/data.py): batch(split, index, batch_size) -> (x, y, document_ids or None)
    model: GPT  # with cfg.compile, its regions are compiled (GPT.compile_regions)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    start_step: int
    tokens_per_step: int
    flops_per_step: float
    peak_tflops: float | None
    forward: TrainingForward  # the loss to backpropagate (under torchrun: through DDP)
    mesh: Mesh = field(default_factory=Mesh)  # this process's ranks under torchrun (single by default)
    position_docs: list = field(default_factory=list)  # val documents read by position at each eval (token arrays)


def build(cfg: TrainConfig, config_dict: dict[str, Any], summary: RunSummary, mesh: Mesh | None = None
          ) -> Training:
    """Device, data, model, optimizer and the resumed state; records what it made in the summary."""
    mesh = mesh or Mesh()
    device, dtype = cfg.torch_device(), cfg.compute_dtype()
    summary.device, summary.dtype = device_name(device), str(dtype).removeprefix("torch.")
    torch.manual_seed(cfg.seed)

    data = build_data(cfg.data, cfg.seq_len, cfg.seed)
    # the tokenizer goes into the run directory, and checkpoints name it (minigpt/sample.py reads it from there)
    config_dict = {**config_dict, "tokenizer": save_tokenizer(data, cfg.run_dir,
                                                              write=mesh.is_main and cfg.save_checkpoints)}
    save_manifest(data, cfg.run_dir, write=mesh.is_main)
    vocab_size = cfg.model.vocab_size or data.vocab_size
    if data.vocab_size > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size}: smaller than the tokenizer's {data.vocab_size}")
    attention = mesh_attention(mesh, get_attention(cfg.attention.name, **cfg.attention.options()))  # ring under CP
    model = GPT(cfg.model, vocab_size, attention).to(device)
    summary.n_params, summary.vocab_size = model.num_params(), vocab_size
    print(f"model {cfg.model.name}: {summary.n_params / 1e6:.2f}M parameters, attention={cfg.attention.name}, "
          f"seq_len={cfg.seq_len}, batch={cfg.batch_size}x{cfg.grad_accum}, device={summary.device}, dtype={summary.dtype}")

    optimizer = make_optimizer(model, cfg, device)
    start = 0
    found = find_and_load(cfg.resume, cfg.ckpt_dir, run_dir=cfg.run_dir)
    if found is not None:
        path, state = found
        start = restore(state, path, model, optimizer, config_dict.get("model", {}), extend=cfg.resume_extend)
        changed = extension(state, config_dict) if cfg.resume_extend else None
        if changed:  # a length-extension stage: new RoPE settings and/or seq_len from here on
            summary.resume_extend = changed
            print("resume_extend: " + ", ".join(f"{k}={changed['from'][k]} -> {changed['to'][k]}" for k in changed["to"]))
        summary.resumed_from = summary.checkpoint = str(path)
        summary.steps = start
        elsewhere = cfg.resume == "auto" and Path(path).parent.resolve() != Path(cfg.ckpt_dir).resolve()
        print(f"resumed from {path} at step {start}" + (f" (the run's last checkpoint, recorded in its summary; new "
                                                         f"checkpoints go to ckpt_dir={cfg.ckpt_dir})" if elsewhere else ""))
    elif cfg.resume == "auto":
        print(f"resume=auto: no checkpoint in {cfg.ckpt_dir}, starting fresh")
    agree(mesh, start, "resume: the step of the checkpoint found")

    tokens = cfg.batch_size * cfg.seq_len * cfg.grad_accum * mesh.dp  # the global batch, all ranks together
    flops = train_step_flops(summary.n_params, cfg.model.n_layer, cfg.model.n_head, cfg.model.head_dim,
                             cfg.batch_size * cfg.grad_accum * mesh.dp, cfg.seq_len)
    summary.compile = cfg.compile_enabled()
    if summary.compile:
        model.compile_regions()
    forward = TrainingForward(model, mesh, local_positions(mesh, cfg.seq_len, device),
                              cfg.batch_size * mesh.dp * cfg.seq_len, device)
    peak = peak_tflops(summary.device)
    position_docs = documents_from_stream(data.val, data.eot, POSITION_DOCS) if cfg.eval_batches and \
        cfg.position_eval() else []
    return Training(cfg, config_dict, device, dtype, data, model, optimizer,
                    torch.amp.GradScaler(device.type, enabled=dtype == torch.float16), start, tokens, flops,
                    peak * mesh.world if peak else None, forward, mesh, position_docs)


def to_device(batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A batch (x, y, document ids or None) on `device`."""
    return tuple(None if b is None else b.to(device, non_blocking=True) for b in batch)


@torch.no_grad()
def evaluate(t: Training) -> dict[str, float]:
    """Mean val loss over cfg.eval_batches fixed batches, passkey retrieval accuracy if the data has a key, and the
    loss per position bin of a few val documents (cfg.position_eval(): data=pycode by default)."""
    cfg, model, data, mesh = t.cfg, t.model, t.data, t.mesh
    positions = local_positions(mesh, cfg.seq_len, t.device)
    model.eval()
    losses, hits, total = [], 0, 0
    for i in range(cfg.eval_batches):
        x, y, ids = to_device(shard_batch(mesh, data, "val", i, cfg.batch_size), t.device)  # this rank's part
        with torch.autocast(t.device.type, dtype=t.dtype, enabled=t.dtype != torch.float32):
            h = model.hidden(x, positions, ids)
            losses.append(mean_loss(mesh, model, h, y))
            if data.answer is not None:  # all key digits must be the argmax predictions
                batch_hits, batch_total = key_hits(mesh, model, h, y, data.answer, positions)
                hits, total = hits + batch_hits, total + batch_total
    model.train()
    out = {"eval/val_loss": statistics.fmean(losses)}
    if t.position_docs:  # the mean loss per position bin of a few whole val documents (loss_by_position)
        out.update(position_metrics(model, t.position_docs, data.eot, cfg.seq_len, t.device, t.dtype))
    if total:
        out["eval/passkey_acc"] = hits / total
    if cfg.passkey_grid and isinstance(data, PasskeyData) and mesh.cp == 1:  # the ring needs split sequences
        grid = passkey_grid(model, [cfg.seq_len], GRID_DEPTHS, cfg.passkey_grid, t.device, t.dtype, cfg.seed,
                            cfg.batch_size, trained_length=cfg.seq_len)
        out["eval/passkey_grid_acc"] = grid["mean_accuracy"]
        out.update({f"eval/passkey_grid_depth_{float(d):.2f}": acc for d, acc in grid["by_depth"].items()})
    return out


def check_finite(t: Training, step: int, summary: RunSummary) -> None:
    """TrainingError if a parameter or optimizer state turned non-finite (a checkpoint of it could not be resumed
    from). Every rank checks (their states are equal), so under torchrun all stop together."""
    tensors = [p for p in t.model.parameters()] + [v for s in t.optimizer.state.values() for v in s.values()
                                                   if torch.is_tensor(v) and v.is_floating_point()]
    if tensors and not torch.stack([torch.isfinite(x).all() for x in tensors]).all().item():
        raise TrainingError(f"non-finite parameters after step {step}: not saved, {kept(summary)}; try a lower lr or "
                            f"dtype=float32")


def save(t: Training, step: int, summary: RunSummary) -> Path:
    """A checkpoint at `step`; a failed write says what happened and that the previous one is intact."""
    try:
        path = save_checkpoint(t.cfg.ckpt_dir, step, t.model, t.optimizer, t.config_dict)
    except WriteError as e:
        kept = f"the previous checkpoint {summary.checkpoint} is intact" if summary.checkpoint else "no checkpoint was kept"
        raise CheckpointError(f"{e}; {kept}; free space, or set ckpt_dir=<elsewhere>; then continue with resume=auto "
                              f"hydra.run.dir={t.cfg.run_dir}") from e
    summary.checkpoint = str(path)
    return path


def train_step(t: Training, step: int) -> float:
    """One optimizer step (grad_accum micro-batches); returns the mean loss."""
    cfg = t.cfg
    for group in t.optimizer.param_groups:
        group["lr"] = lr_at(step, cfg)
    loss_sum = torch.zeros((), device=t.device)
    for micro in range(cfg.grad_accum):
        x, y, ids = to_device(shard_batch(t.mesh, t.data, "train", step * cfg.grad_accum + micro, cfg.batch_size),
                              t.device)
        with t.forward.no_sync(last=micro == cfg.grad_accum - 1):  # DDP: gradients all-reduced once per step
            with torch.autocast(t.device.type, dtype=t.dtype, enabled=t.dtype != torch.float32):
                loss = t.forward.loss(x, y, ids) / cfg.grad_accum
            t.scaler.scale(loss).backward()
        loss_sum += loss.detach()
    loss_value = mean(t.mesh, loss_sum).item()  # under torchrun: the mean over every rank's tokens
    if not math.isfinite(loss_value):
        raise NonFiniteLoss(step + 1, loss_value)  # counted as steps done are: the (step + 1)-th
    if cfg.grad_clip > 0:
        t.scaler.unscale_(t.optimizer)
        torch.nn.utils.clip_grad_norm_(t.model.parameters(), cfg.grad_clip)
    t.scaler.step(t.optimizer)
    t.scaler.update()
    t.optimizer.zero_grad(set_to_none=True)
    return loss_value


def train_loop(t: Training, logger: Logger, summary: RunSummary, stop_requested: Callable[[], bool]) -> None:
    """Steps from t.start_step to max_steps; returns early (after a checkpoint) when a stop is requested."""
    cfg = t.cfg
    times: list[float] = []
    ranks = RankStats(t.mesh, t.tokens_per_step)  # under torchrun: every rank's speed and memory
    bar = tqdm(range(t.start_step, cfg.max_steps), initial=t.start_step, total=cfg.max_steps, desc="train",
               dynamic_ncols=True, mininterval=1.0, file=sys.stdout)
    try:
        for step in bar:
            reset_peak_memory(t.device)
            HostMemory.reset_peak()
            t0 = time.perf_counter()
            try:
                loss = train_step(t, step)
            except NonFiniteLoss as e:  # the line names what is kept (the summary knows), and the advice
                raise TrainingError(f"{e}; {kept(summary)}; try a lower lr or dtype=float32") from None
            if t.device.type == "cuda":
                torch.cuda.synchronize(t.device)
            dt = time.perf_counter() - t0
            times.append(dt)
            if summary.compile and len(times) == 2:  # compilation happens in this process's first step
                summary.compile_time_s = max(0.0, times[0] - times[1])
                tqdm.write(f"compile: {summary.compile_time_s:.1f} s (the first step's time over the second's)",
                           file=sys.stdout)

            done = step + 1
            alloc, reserved = peak_memory_gib(t.device)
            metrics = {"train/loss": loss, "train/lr": lr_at(step, cfg), "perf/step_time_s": dt,
                       "perf/tokens_per_s": t.tokens_per_step / dt,
                       "memory/peak_allocated_gib": alloc, "memory/peak_reserved_gib": reserved,
                       "memory/peak_host_offload_gib": HostMemory.peak_gib()}
            if t.peak_tflops:
                metrics["perf/mfu"] = t.flops_per_step / dt / (t.peak_tflops * 1e12)
            metrics.update(ranks.step(dt, alloc, reserved))
            summary.steps, summary.final_train_loss = done, loss
            summary.peak_allocated_gib = max(summary.peak_allocated_gib, alloc)
            summary.peak_reserved_gib = max(summary.peak_reserved_gib, reserved)
            summary.peak_host_offload_gib = max(summary.peak_host_offload_gib, HostMemory.peak_gib())
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{t.tokens_per_step / dt:,.0f}", mem=f"{alloc:.1f}GiB", refresh=False)

            last = done == cfg.max_steps
            if cfg.eval_batches and ((cfg.eval_every and done % cfg.eval_every == 0) or last):
                evals = evaluate(t)
                metrics.update(evals)
                summary.final_val_loss, summary.passkey_acc = evals["eval/val_loss"], evals.get("eval/passkey_acc")
                tqdm.write(f"step {done}: " + ", ".join(f"{k.split('/')[1]} {v:.4f}" for k, v in evals.items()
                                                        if "/loss_by_position/" not in k), file=sys.stdout)
            logger.log(metrics, step=done)
            stopping = stop_requested()
            if cfg.save_checkpoints and ((cfg.ckpt_every and done % cfg.ckpt_every == 0) or last or stopping):
                check_finite(t, done, summary)  # never a checkpoint that cannot be resumed from
                if t.mesh.is_main:  # the full state is on every rank; rank 0 writes it
                    save(t, done, summary)
            if stopping:
                return
    finally:
        bar.close()
        steady = times[min(WARMUP_STEPS_EXCLUDED, len(times) - 1):]  # keep at least the last step
        if steady:
            step_time = statistics.median(steady)
            summary.step_time_s, summary.tokens_per_s = step_time, t.tokens_per_step / step_time
            summary.mfu = t.flops_per_step / step_time / (t.peak_tflops * 1e12) if t.peak_tflops else None
        ranks.fill(summary, WARMUP_STEPS_EXCLUDED)

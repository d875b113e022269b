"""Several processes: data and context parallelism under torchrun (torch.distributed; no launcher of our own).

    torchrun --nproc_per_node=N scripts/train.py ... parallel.context=K        (K divides N)

The N ranks form a 2-D DeviceMesh ("dp", "cp") of shape (N/K, K):
- data parallel (dp): each dp rank trains its own rows of the global batch, batch_size × N/K sequences,
  a function of (step, rank) so a resumed run sees the same data: dp rank d takes rows [d·B, (d+1)·B) of
  data.batch(split, index, B·N/K), so N/K ranks train exactly what one process with batch_size=B·N/K would.
- context parallel (cp): the K ranks of a dp rank split each sequence in zigzag order (ring_attention.py),
  padded at the end to a multiple of 2K (pads are ignored by the loss and, being last, seen by no real
  token); RoPE uses each token's global position and attention is ring attention over our flash kernel.
- loss and gradients: each rank's summed loss is scaled by N / (tokens of the global batch), so the average
  of all N ranks' gradients that DDP takes (over the flattened mesh: the cp ranks hold the same weights
  too) is the gradient of the mean loss over every token; the reported loss is that mean, all-reduced.

A single process (no torchrun) gets `Parallel()`, whose every method is the single-process behaviour.
Rank 0 writes everything (summary.json, checkpoints, the W&B run); the others write nothing.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import statistics
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from minigpt.attention import AttentionBackend
from minigpt.config import ConfigError
from minigpt.ring_attention import RingFlashAttention, padded_len, zigzag_positions, zigzag_shard

IGNORE = -100  # target of a padding token: F.cross_entropy's default ignore_index


# ------------------------------------------------------------------------------------------------
# The process group: torchrun's environment in, init and teardown
# ------------------------------------------------------------------------------------------------
def launched_world_size() -> int:
    """How many processes torchrun started (WORLD_SIZE), 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def start_distributed() -> bool:
    """Join torchrun's process group (its env: MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK), if launched by
    torchrun with more than one process and not joined yet. Returns True when this call joined it (the caller
    then leaves it with stop_distributed). With GPUs: NCCL for CUDA tensors and gloo for CPU ones (small control
    messages), this process on GPU LOCAL_RANK; gloo alone without. NCCL/NVLink env variables are left as they are."""
    if launched_world_size() == 1 or dist.is_initialized():
        return False
    if torch.cuda.is_available():  # (no device_id: NCCL starts lazily, and the mesh's groups get both backends)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    return True


MAIN_DONE_KEY = "minigpt/rank0-done"
MAIN_GRACE_S = 60.0  # rank 0 may still be writing a checkpoint and its W&B run


def stop_distributed(failed: bool = False) -> None:
    """Leave the process group (if joined). torchrun stops every worker as soon as one exits with an error, so a
    rank other than 0 that is leaving with one (a bad setting, a signal, ...) first waits, up to MAIN_GRACE_S, until
    rank 0 has finished too: rank 0 then always writes its summary, checkpoint and last line. (The wait is on
    torchrun's key-value store, not a collective, so it cannot be mistaken for one rank 0 is still in.)"""
    if not dist.is_initialized():
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        if dist.get_rank() == 0:
            store.set(MAIN_DONE_KEY, "1")
        elif failed:
            store.wait([MAIN_DONE_KEY], timedelta(seconds=MAIN_GRACE_S))
    except Exception:  # noqa: BLE001 - rank 0's store gone (it exited) or the wait timed out: leave anyway
        pass
    dist.destroy_process_group()


class TorchrunProcess(contextlib.AbstractContextManager):
    """The process's part in a torchrun job, for the length of a `with`: joins the process group (if torchrun
    started this process and nobody joined yet), sends stdout of ranks other than 0 to /dev/null (rank 0 speaks
    for the job; errors still go to stderr), and leaves the group at the end. Set `ok = True` when the work
    succeeded, so that a failing rank other than 0 waits for rank 0 to finish its files (stop_distributed)."""

    def __init__(self) -> None:
        self.ok, self.joined, self._quiet = False, False, contextlib.ExitStack()

    def __enter__(self) -> TorchrunProcess:
        self.joined = start_distributed()
        rank = dist.get_rank() if dist.is_initialized() else env_rank()
        if rank != 0:
            self._quiet.enter_context(contextlib.redirect_stdout(self._quiet.enter_context(open(os.devnull, "w"))))
        return self

    def __exit__(self, *exc: object) -> None:
        self._quiet.close()
        if self.joined:
            stop_distributed(failed=not self.ok)


# ------------------------------------------------------------------------------------------------
# This rank's place in the job, and the few collectives the trainer needs
# ------------------------------------------------------------------------------------------------
@dataclass
class Parallel:
    """Ranks and groups of this process; single process by default (every method then does what one process
    does, with no communication)."""

    world: int = 1
    rank: int = 0
    dp: int = 1
    dp_rank: int = 0
    cp: int = 1
    cp_rank: int = 0
    cp_group: Any = None  # dist.ProcessGroup of this rank's context-parallel ranks
    device_type: str = "cpu"
    seq_len: int = 0
    ddp: Any = None  # the DistributedDataParallel training forward (wrap)

    @classmethod
    def setup(cls, context: int, seq_len: int, device_type: str) -> Parallel:
        """The mesh of an initialized process group (`start_distributed`), else a single process."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return cls(device_type=device_type, seq_len=seq_len)
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        if world % context:
            raise ConfigError(f"parallel.context={context}: must divide the number of processes ({world})")
        mesh = init_device_mesh(device_type, (world // context, context), mesh_dim_names=("dp", "cp"))
        return cls(world=world, rank=dist.get_rank(), dp=world // context, dp_rank=mesh.get_local_rank("dp"),
                   cp=context, cp_rank=mesh.get_local_rank("cp"), cp_group=mesh.get_group("cp"),
                   device_type=device_type, seq_len=seq_len)

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes files and logs."""
        return self.rank == 0

    # -- data ----------------------------------------------------------------------------------
    def batch(self, data: Any, split: str, index: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """This rank's (x, y): its dp rows of the global batch, and its zigzag shard of each sequence."""
        if not self.active:
            return data.batch(split, index, batch_size)
        x, y = data.batch(split, index, batch_size * self.dp)
        rows = slice(self.dp_rank * batch_size, (self.dp_rank + 1) * batch_size)
        x, y = x[rows], y[rows]
        if self.cp > 1:
            x, y = zigzag_shard(x, self.cp, self.cp_rank, dim=1), zigzag_shard(y, self.cp, self.cp_rank, 1, IGNORE)
        return x, y

    def positions(self, device: torch.device) -> Tensor | None:
        """Global positions of this rank's tokens (for RoPE), None when it holds whole sequences."""
        if self.cp == 1:
            return None
        return zigzag_positions(padded_len(self.seq_len, self.cp), self.cp, self.cp_rank, device)

    # -- model ---------------------------------------------------------------------------------
    def attention(self, backend: AttentionBackend) -> AttentionBackend:
        """The model's attention: ring attention over the cp group when the sequence is split."""
        return RingFlashAttention(self.cp_group) if self.cp > 1 else backend

    def wrap(self, model: nn.Module, tokens_per_micro_batch: int, device: torch.device) -> None:
        """Set up the training forward (`loss`): under torchrun, DDP over this rank's scaled loss sum."""
        if not self.active:
            return
        from torch.nn.parallel import DistributedDataParallel as DDP

        sharded = ShardedLoss(model, self.positions(device), self.world / tokens_per_micro_batch)
        # every rank averages with every other (the cp ranks hold the same weights as well); buffers are not
        # synced at each forward (the model's only one, RoPE's inverse frequencies, is a constant)
        no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else {"broadcast_buffers": False})  # its name in older torch
        self.ddp = DDP(sharded, device_ids=[torch.cuda.current_device()] if device.type == "cuda" else None,
                       **no_buffer_sync)

    def loss(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        """The training loss to backpropagate: model(x, y) in one process; under torchrun this rank's share."""
        return model(x, y) if self.ddp is None else self.ddp(x, y)

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP's gradient all-reduce only on the last micro-batch of a step (grad_accum)."""
        return self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()

    # -- reductions ----------------------------------------------------------------------------
    def mean(self, t: Tensor) -> Tensor:
        """t averaged over all ranks (t itself in one process)."""
        if not self.active:
            return t
        t = t.detach().clone()
        dist.all_reduce(t)
        return t / self.world

    def _sum(self, values: list[float] | Tensor) -> Tensor:
        """The sum over all ranks, as a float64 CPU tensor (gloo, also beside NCCL: no GPU synchronization)."""
        t = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
        dist.all_reduce(t)
        return t

    def max_int(self, value: int) -> int:
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def agree(self, value: int, what: str) -> None:
        """Raise ConfigError unless every rank has the same value (e.g. the step a resume found)."""
        if self.active and self.max_int(value) != -self.max_int(-value):
            raise ConfigError(f"{what}: the ranks disagree (rank {self.rank} has {value}); every node must see the "
                              f"same files (put ckpt_dir on a filesystem all nodes share)")

    def on_main(self, fn: Callable[[], Any]) -> Any:
        """fn() run by rank 0 only, its result (or its ConfigError) given to every rank."""
        if not self.active:
            return fn()
        box: list[Any] = [None]
        if self.is_main:
            try:
                box[0] = ("ok", fn())
            except ConfigError as e:
                box[0] = ("error", str(e))
        dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
        kind, value = box[0]
        if kind == "error":
            raise ConfigError(value)
        return value

    # -- evaluation ----------------------------------------------------------------------------
    def mean_loss(self, model: nn.Module, h: Tensor, y: Tensor) -> float:
        """The mean loss of the global batch, from this rank's hidden states h and targets y."""
        if not self.active:
            return model.loss(h, y).item()
        total, count = self._sum([loss_sum(model, h, y).item(), (y != IGNORE).sum().item()]).tolist()
        return total / count

    def key_hits(self, model: nn.Module, h: Tensor, y: Tensor, answer: slice) -> tuple[int, int]:
        """(sequences whose key digits are all the argmax predictions, sequences) of the global batch;
        `answer` indexes the key in the (unsharded) sequence."""
        if not self.active:
            pred = model.head(h[:, answer]).argmax(dim=-1)
            return int((pred == y[:, answer]).all(dim=-1).sum().item()), y.shape[0]
        pos = self.positions(h.device)
        local = torch.arange(y.shape[1], device=h.device)
        if pos is not None:  # the key's tokens this rank holds
            local = local[(pos >= answer.start) & (pos < answer.stop)]
        else:
            local = local[answer]
        wrong = (model.head(h[:, local]).argmax(dim=-1) != y[:, local]).sum(dim=-1).float()
        if self.cp > 1:  # a sequence's key may be split over its cp ranks
            dist.all_reduce(wrong, group=self.cp_group)
        # count each sequence once: on cp rank 0 of its dp rank
        mine = [float((wrong == 0).sum()), float(y.shape[0])] if self.cp_rank == 0 else [0.0, 0.0]
        hits, total = self._sum(mine).tolist()
        return int(hits), int(total)

    # -- per-rank speed and memory -------------------------------------------------------------
    def rank_stats(self, tokens_per_step: int) -> RankStats:
        return RankStats(self, tokens_per_step)


def loss_sum(model: nn.Module, h: Tensor, y: Tensor) -> Tensor:
    """The summed cross-entropy of h against y (padding targets ignored), model.loss_chunk tokens at a time."""
    return model.summed_loss(h, y)


class ShardedLoss(nn.Module):
    """What DDP wraps: this rank's loss sum over its tokens × world / (tokens of the global micro-batch), so that
    DDP's average of the ranks' gradients is the gradient of the mean loss over all tokens."""

    def __init__(self, model: nn.Module, positions: Tensor | None, scale: float):
        super().__init__()
        self.model, self.scale = model, scale
        self.positions = positions  # a plain attribute, not a buffer: it differs between ranks

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return loss_sum(self.model, self.model.hidden(x, self.positions), y) * self.scale


class RankStats:
    """Step time, tokens/s and peak memory of every rank (one small all-reduce per step), for the metrics and the
    run summary: the max and the sum over ranks."""

    def __init__(self, parallel: Parallel, tokens_per_step: int):
        self.parallel, self.tokens_per_rank = parallel, tokens_per_step / parallel.world
        self.times: list[Tensor] = []  # per step: each rank's step time
        self.peaks = torch.zeros(parallel.world, 2, dtype=torch.float64)  # each rank's peak allocated, reserved

    def step(self, dt: float, alloc: float, reserved: float) -> dict[str, float]:
        p = self.parallel
        if not p.active:
            return {}
        mine = torch.zeros(p.world, 3, dtype=torch.float64)
        mine[p.rank] = torch.tensor([dt, alloc, reserved], dtype=torch.float64)
        every = p._sum(mine).view(p.world, 3)  # row r: rank r's values
        self.times.append(every[:, 0])
        self.peaks = torch.maximum(self.peaks, every[:, 1:])
        rate = self.tokens_per_rank / every[:, 0]
        return {"perf/rank_tokens_per_s_max": rate.max().item(), "perf/rank_tokens_per_s_sum": rate.sum().item(),
                "memory/rank_peak_allocated_gib_max": every[:, 1].max().item(),
                "memory/rank_peak_allocated_gib_sum": every[:, 1].sum().item(),
                "memory/rank_peak_reserved_gib_max": every[:, 2].max().item()}

    def fill(self, summary: Any, skip: int) -> None:
        """The summary's per-rank fields: tokens/s from each rank's median step time (after `skip` warm-up
        steps), peaks over the run. No communication (safe in a finally block)."""
        if not self.parallel.active or not self.times:
            return
        times = torch.stack(self.times[min(skip, len(self.times) - 1):])
        rate = torch.tensor([self.tokens_per_rank / statistics.median(times[:, r].tolist())
                             for r in range(times.shape[1])])
        summary.rank_tokens_per_s_max, summary.rank_tokens_per_s_sum = rate.max().item(), rate.sum().item()
        summary.rank_peak_allocated_gib_max = self.peaks[:, 0].max().item()
        summary.rank_peak_allocated_gib_sum = self.peaks[:, 0].sum().item()
        summary.rank_peak_reserved_gib_max = self.peaks[:, 1].max().item()


class AgreedStop:
    """A stop request that every rank sees at the same step: each call all-reduces the signal numbers (max), so a
    signal on any rank stops all of them after the same step. `signum` is the agreed signal, once there is one."""

    def __init__(self, parallel: Parallel, signals: Any):
        self.parallel, self.signals, self.signum = parallel, signals, None

    def __call__(self) -> bool:
        agreed = self.parallel.max_int(self.signals.signum or 0)
        if agreed:
            self.signum = agreed
        return bool(agreed)

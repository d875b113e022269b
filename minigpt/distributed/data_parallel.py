"""The training forward under torchrun: DDP over this rank's share of the loss.

Each rank's summed loss is scaled by N / (tokens of the global micro-batch), so the average of all N ranks'
gradients that DDP takes (over the flattened mesh: the cp ranks hold the same weights too) is the gradient of
the mean loss over every token.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn as nn
from torch import Tensor

from minigpt.distributed.mesh import Mesh


class ShardedLoss(nn.Module):
    """What DDP wraps: this rank's loss sum over its tokens × `scale` (world / tokens of the global micro-batch),
    so that DDP's average of the ranks' gradients is the gradient of the mean loss over all tokens."""

    def __init__(self, model: nn.Module, positions: Tensor | None, scale: float):
        super().__init__()
        self.model, self.scale = model, scale
        self.positions = positions  # a plain attribute, not a buffer: it differs between ranks

    def forward(self, x: Tensor, y: Tensor, document_ids: Tensor | None = None) -> Tensor:
        return self.model.summed_loss(self.model.hidden(x, self.positions, document_ids), y) * self.scale


class TrainingForward:
    """The loss to backpropagate: model(x, y) in one process; under torchrun this rank's share, through DDP."""

    def __init__(self, model: nn.Module, mesh: Mesh | None = None, positions: Tensor | None = None,
                 tokens_per_micro_batch: int = 1, device: torch.device | None = None):
        self.model, self.ddp = model, None
        if mesh is None or not mesh.active:
            return
        from torch.nn.parallel import DistributedDataParallel as DDP

        sharded = ShardedLoss(model, positions, mesh.world / tokens_per_micro_batch)
        # every rank averages with every other (the cp ranks hold the same weights as well); buffers are not
        # synced at each forward (the model's only one, RoPE's inverse frequencies, is a constant)
        no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else {"broadcast_buffers": False})  # its name in older torch
        on_gpu = device is not None and device.type == "cuda"
        self.ddp = DDP(sharded, device_ids=[torch.cuda.current_device()] if on_gpu else None, **no_buffer_sync)

    def loss(self, x: Tensor, y: Tensor, document_ids: Tensor | None = None) -> Tensor:
        """The loss of tokens x against targets y, attending within documents where document_ids are given."""
        return self.model(x, y, document_ids) if self.ddp is None else self.ddp(x, y, document_ids)

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP's gradient all-reduce only on the last micro-batch of a step (grad_accum)."""
        return self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()

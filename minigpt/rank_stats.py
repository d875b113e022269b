"""Run statistics of every rank under torchrun: step time, tokens/s and peak memory, for the metrics of each step
(one small all-reduce) and the run summary (the max and the sum over ranks, and each rank's peak memory). In one
process: nothing to add."""
from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import Tensor

from minigpt.distributed.mesh import Mesh
from minigpt.distributed.reductions import sum_f64


class RankStats:
    """Every rank's step times and peak memory over the run."""

    def __init__(self, mesh: Mesh, tokens_per_step: int):
        self.mesh, self.tokens_per_rank = mesh, tokens_per_step / mesh.world
        self.times: list[Tensor] = []  # per step: each rank's step time
        self.peaks = torch.zeros(mesh.world, 2, dtype=torch.float64)  # each rank's peak allocated, reserved

    def step(self, dt: float, alloc: float, reserved: float) -> dict[str, float]:
        m = self.mesh
        if not m.active:
            return {}
        mine = torch.zeros(m.world, 3, dtype=torch.float64)
        mine[m.rank] = torch.tensor([dt, alloc, reserved], dtype=torch.float64)
        every = sum_f64(mine).view(m.world, 3)  # row r: rank r's values
        self.times.append(every[:, 0])
        self.peaks = torch.maximum(self.peaks, every[:, 1:])
        rate = self.tokens_per_rank / every[:, 0]
        return {"perf/rank_tokens_per_s_max": rate.max().item(), "perf/rank_tokens_per_s_sum": rate.sum().item(),
                "memory/rank_peak_allocated_gib_max": every[:, 1].max().item(),
                "memory/rank_peak_allocated_gib_sum": every[:, 1].sum().item(),
                "memory/rank_peak_reserved_gib_max": every[:, 2].max().item()}

    def fill(self, summary: Any, skip: int) -> None:
        """The summary's per-rank fields: tokens/s from each rank's median step time (after `skip` warm-up
        steps), peaks over the run (their max and sum, and the list in rank order). No communication (safe in a
        finally block)."""
        if not self.mesh.active or not self.times:
            return
        times = torch.stack(self.times[min(skip, len(self.times) - 1):])
        rate = torch.tensor([self.tokens_per_rank / statistics.median(times[:, r].tolist())
                             for r in range(times.shape[1])])
        summary.rank_tokens_per_s_max, summary.rank_tokens_per_s_sum = rate.max().item(), rate.sum().item()
        summary.rank_peak_allocated_gib_max = self.peaks[:, 0].max().item()
        summary.rank_peak_allocated_gib_sum = self.peaks[:, 0].sum().item()
        summary.rank_peak_reserved_gib_max = self.peaks[:, 1].max().item()
        summary.rank_peak_allocated_gib = self.peaks[:, 0].tolist()
        summary.rank_peak_reserved_gib = self.peaks[:, 1].tolist()

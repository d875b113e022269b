"""Ring attention benchmark: forward+backward per GPU against our single-GPU kernel, under torchrun.

    torchrun --nproc_per_node 2 scripts/bench_ring.py --out results/ring      # K = 2 GPUs, one sequence split over both

For each head_dim and tokens-per-GPU S (the sequence is N = S·K tokens, batch 1, heads = hidden / head_dim,
causal bf16, the model's (B, N, H, D) memory layout), it times:
- ring:   ring attention over the K ranks (zigzag shards of S tokens each), forward and forward+backward;
- single: our kernel on the whole N-token sequence on one GPU (the same work), and on S tokens (one GPU's share
          if the GPUs did not share sequences);
- comm:   the K−1 key/value block transfers of a forward alone (what the compute has to hide).
Times are medians over --reps after --warmup, each rep started together on all ranks (a barrier), the slowest
rank's median reported. TFLOP/s use the causal attention FLOPs of the whole sequence (fwd = 4·N²·H·D/2,
bwd = 2.5·fwd), per GPU for the ring. `efficiency` = ring per-GPU TFLOP/s ÷ single-GPU TFLOP/s at N, `speedup` =
single-GPU time at N ÷ ring time (ideal: K). Results: a table on stdout and <out>/ring_<GPU>_x<K>.{json,md}.

Each rep times one call alone (the GPU idle until the host issues it, as after a synchronization), and, in the
"queued" columns, --queued calls issued one after another, as a model's layers issue them: the host prepares a
call while the GPU runs the one before, so its launch and posting time (about 4 ms of Python a ring forward+backward
at 8K tokens per GPU, H100) is hidden where the GPU's work is longer. The single-GPU kernel is timed both ways too.
`--cpu` runs a tiny version on CPU (gloo, Triton's interpreter, fp32) to check the script itself.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from minigpt.files import atomic_write_text, markdown_table
from minigpt.metrics import attention_flops, git_commit, versions
from minigpt.distributed.process import nccl_settings, use_nccl_settings
from minigpt.distributed.ring_attention import Ring, ring_attention, stack_kv


def _timer(device: torch.device, fn: Callable[[], object], warmup: int, reps: int, queued: int = 1) -> float:
    """Median milliseconds of fn on this rank, every rep started together on all ranks; the slowest rank's median.
    queued > 1: each rep issues fn that many times in a row and counts the time per call."""
    times = []
    for i in range(warmup + reps):
        dist.barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(queued):
                fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / queued
        else:
            t0 = time.perf_counter()
            for _ in range(queued):
                fn()
            ms = (time.perf_counter() - t0) * 1e3 / queued
        if i >= warmup:
            times.append(ms)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a CPU tensor: gloo, also beside NCCL
    return t.item()


def _local(B: int, S: int, H: int, D: int, device: torch.device, dtype: torch.dtype, grad: bool = True):
    """q, k, v as the model makes them: (B, H, S, D) views of (B, S, H, D) buffers."""
    return [torch.randn(B, S, H, D, device=device, dtype=dtype).transpose(1, 2).requires_grad_(grad)
            for _ in range(3)]


def bench_one(D: int, S: int, hidden: int, device: torch.device, dtype: torch.dtype, warmup: int, reps: int,
              queued: int = 4) -> dict:
    from minigpt_kernels.flash_attention import flash_attention

    K, H, B = dist.get_world_size(), hidden // D, 1
    N = S * K
    row = {"head_dim": D, "tokens_per_gpu": S, "seq_len": N, "heads": H, "gpus": K}

    q, k, v = _local(B, S, H, D, device, dtype)
    do = torch.randn_like(q)
    row["ring_fwd_ms"] = _timer(device, lambda: ring_attention(q.detach(), k.detach(), v.detach(), None), warmup, reps)
    ring_fwd_bwd = lambda: torch.autograd.grad(ring_attention(q, k, v, None), (q, k, v), do)  # noqa: E731
    row["ring_fwd_bwd_ms"] = _timer(device, ring_fwd_bwd, warmup, reps)
    row["ring_fwd_bwd_queued_ms"] = _timer(device, ring_fwd_bwd, warmup, reps, queued)
    ring = Ring(None)
    kv = stack_kv(k.detach(), v.detach())

    def transfers() -> None:  # the forward's K−1 block hops, no compute
        block = kv
        for _ in range(K - 1):
            block = ring.pass_on(block)()
    row["comm_fwd_ms"] = _timer(device, transfers, warmup, reps)
    del q, k, v, do, kv

    for n, key in ((N, "single_N"), (S, "single_S")):  # every rank times it on its own GPU; the slowest counts
        q, k, v = _local(B, n, H, D, device, dtype)
        do = torch.randn_like(q)
        row[f"{key}_fwd_ms"] = _timer(device, lambda: flash_attention(q.detach(), k.detach(), v.detach()), warmup, reps)
        fwd_bwd = lambda: torch.autograd.grad(flash_attention(q, k, v), (q, k, v), do)  # noqa: E731
        row[f"{key}_fwd_bwd_ms"] = _timer(device, fwd_bwd, warmup, reps)
        if key == "single_N":
            row["single_N_fwd_bwd_queued_ms"] = _timer(device, fwd_bwd, warmup, reps, queued)
        del q, k, v, do, fwd_bwd

    total = attention_flops(B, H, N, D, causal=True, pass_="fwd+bwd")
    row["ring_tflops_per_gpu"] = total / K / (row["ring_fwd_bwd_ms"] * 1e-3) / 1e12
    row["single_N_tflops"] = total / (row["single_N_fwd_bwd_ms"] * 1e-3) / 1e12
    row["single_S_tflops"] = attention_flops(B, H, S, D, True, "fwd+bwd") / (row["single_S_fwd_bwd_ms"] * 1e-3) / 1e12
    row["efficiency"] = row["ring_tflops_per_gpu"] / row["single_N_tflops"]
    row["speedup"] = row["single_N_fwd_bwd_ms"] / row["ring_fwd_bwd_ms"]
    row["queued"] = queued
    row["efficiency_queued"] = row["single_N_fwd_bwd_queued_ms"] / row["ring_fwd_bwd_queued_ms"] / K
    return row


def check(device: torch.device, dtype: torch.dtype) -> float:
    """Largest difference between ring attention (output and gradients) and our kernel on the whole sequence."""
    from minigpt.distributed.sharding import zigzag_shard, zigzag_unshard
    from minigpt_kernels.flash_attention import flash_attention

    K, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)  # the same full tensors on every rank
    full = [torch.randn(1, 256 * K, 4, 64, device=device, dtype=dtype) for _ in range(4)]  # q, k, v, do: (B, N, H, D)
    ref = [t.transpose(1, 2).detach().requires_grad_() for t in full[:3]]
    o = flash_attention(*ref)
    o.backward(full[3].transpose(1, 2))
    local = [zigzag_shard(t, K, rank).requires_grad_() for t in full[:3]]
    o_ring = ring_attention(*(t.transpose(1, 2) for t in local), None)
    o_ring.transpose(1, 2).backward(zigzag_shard(full[3], K, rank))
    worst = 0.0
    for mine, expected in zip([o_ring.transpose(1, 2), *(t.grad for t in local)],
                              [o.transpose(1, 2), *(t.grad.transpose(1, 2) for t in ref)]):
        shards = [torch.empty_like(mine) for _ in range(K)]
        dist.all_gather(shards, mine.detach().contiguous())
        worst = max(worst, (zigzag_unshard(shards) - expected).abs().max().item() / expected.abs().max().item())
    return worst


def environment(device: torch.device) -> dict:
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    nccl = nccl_settings() if device.type == "cuda" else {}
    return {"gpu": gpu, "gpus": dist.get_world_size(), "backend": dist.get_backend(), "nccl_env": nccl, **versions(),
            "python": platform.python_version(), "date": dt.date.today().isoformat(), "commit": git_commit()}


def results_table(rows: list[dict], env: dict, dtype: str) -> str:
    header = ["head_dim", "tokens/GPU", "seq", "ring fwd+bwd ms", "ring TFLOP/s/GPU", "single-GPU at seq ms",
              "single-GPU at seq TFLOP/s", "single-GPU at tokens/GPU TFLOP/s", "efficiency", "speedup",
              "ring fwd ms", "comm fwd ms", "queued: ring fwd+bwd ms", "queued: single-GPU at seq ms",
              "queued: efficiency"]
    body = [[r["head_dim"], r["tokens_per_gpu"], r["seq_len"], f"{r['ring_fwd_bwd_ms']:.2f}",
             f"{r['ring_tflops_per_gpu']:.0f}", f"{r['single_N_fwd_bwd_ms']:.2f}", f"{r['single_N_tflops']:.0f}",
             f"{r['single_S_tflops']:.0f}", f"{r['efficiency']:.2f}", f"{r['speedup']:.2f}",
             f"{r['ring_fwd_ms']:.2f}", f"{r['comm_fwd_ms']:.2f}", f"{r['ring_fwd_bwd_queued_ms']:.2f}",
             f"{r['single_N_fwd_bwd_queued_ms']:.2f}", f"{r['efficiency_queued']:.2f}"] for r in rows]
    return (f"Ring attention over {env['gpus']} × {env['gpu']} ({env['backend']}), causal {dtype}, batch 1, hidden "
            f"{rows[0]['heads'] * rows[0]['head_dim'] if rows else '?'}; TFLOP/s of the whole sequence's attention "
            f"(fwd = 4·N²·H·D/2, bwd = 2.5·fwd), per GPU for the ring; torch {env['torch']}, triton {env['triton']}, "
            f"{env['date']}, commit {env['commit']}"
            + "".join(f", {key}={value}" for key, value in env.get("nccl_env", {}).items()) + ".\n\n"
            + markdown_table(header, body))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_ring", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-per-gpu", type=int, nargs="+", default=[8192, 16384, 32768], metavar="S")
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--hidden", type=int, default=2048, help="heads = hidden / head_dim")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--queued", type=int, default=4, metavar="R",
                   help="calls issued in a row for the queued columns (default 4: a model's layers in a row)")
    p.add_argument("--out", type=Path, default=Path("runs/ring_bench"),
                   help="output directory (default: runs/ring_bench, git-ignored; publish with --out results/...)")
    p.add_argument("--cpu", action="store_true", help="a tiny run on CPU (gloo, Triton's interpreter, fp32)")
    args = p.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        p.error("run it under torchrun, e.g. torchrun --nproc_per_node 2 scripts/bench_ring.py")
    if args.cpu:
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--cpu needs TRITON_INTERPRET=1 in the environment (set before Triton is imported)")
        device, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group("gloo")
    else:
        if not torch.cuda.is_available():
            p.error("needs CUDA GPUs (or --cpu)")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
        use_nccl_settings()  # as the trainer's processes run
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    main_rank = dist.get_rank() == 0
    try:
        err = check(device, dtype)
        if main_rank:
            print(f"check: ring vs single-GPU kernel, largest difference {err:.2e} of the largest value", flush=True)
        rows = []
        for D in args.head_dim:
            for S in args.seq_per_gpu:
                row = bench_one(D, S, args.hidden, device, dtype, args.warmup, args.reps, args.queued)
                rows.append(row)
                if main_rank:
                    print(f"D={D} S={S}: ring {row['ring_fwd_bwd_ms']:.2f} ms ({row['ring_tflops_per_gpu']:.0f} "
                          f"TFLOP/s/GPU), single at N {row['single_N_fwd_bwd_ms']:.2f} ms, efficiency "
                          f"{row['efficiency']:.2f}, comm {row['comm_fwd_ms']:.2f} ms; queued: ring "
                          f"{row['ring_fwd_bwd_queued_ms']:.2f} ms, efficiency {row['efficiency_queued']:.2f}",
                          flush=True)
        if main_rank:
            env = environment(device)
            stem = f"ring_{env['gpu'].replace(' ', '_')}_x{env['gpus']}"
            atomic_write_text(args.out / f"{stem}.json", json.dumps({"env": env, "check_max_rel_diff": err,
                                                                     "rows": rows}, indent=1) + "\n")
            md = atomic_write_text(args.out / f"{stem}.md", results_table(rows, env, str(dtype).removeprefix("torch.")))
            print(md.read_text())
            print(f"results: {md.resolve()}")
    finally:
        dist.destroy_process_group()
    return 0

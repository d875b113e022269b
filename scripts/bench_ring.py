"""Ring attention (context parallelism) against our single-GPU kernel; run under torchrun.

The same as `minigpt-bench-ring` (logic in minigpt/benchmarks/ring_bench.py). Examples:
    torchrun --nproc_per_node 2 scripts/bench_ring.py                        # 8K/16K/32K tokens per GPU, D=64/128 -> runs/ring_bench
    torchrun --nproc_per_node 2 scripts/bench_ring.py --seq-per-gpu 65536 --head-dim 64
    TRITON_INTERPRET=1 torchrun --nproc_per_node 2 scripts/bench_ring.py --cpu --seq-per-gpu 64 --head-dim 16 --hidden 32 --out /tmp/ring
"""
import sys

from minigpt.cli import bench_ring_main

if __name__ == "__main__":
    sys.exit(bench_ring_main())

"""Benchmark attention kernels on the GPU: ours (flash) vs SDPA's backends (FA2, cuDNN, efficient) and naive.

The same as `minigpt-bench` (logic in minigpt/benchmarks/bench.py). Examples:
    python scripts/bench_attention.py                       # full table -> runs/bench/attention_<GPU>.{json,md}
    python scripts/bench_attention.py --out results         # the same, published
    python scripts/bench_attention.py --explore             # also time candidate tile configs of our kernels
    python scripts/bench_attention.py --explore-only --full --dtype float16 --shortlist   # re-check tiles elsewhere
    python scripts/bench_attention.py --seq 4096 --head-dim 128 --providers flash sdpa-flash
    python scripts/bench_attention.py --masks               # documents, windows, GQA: ours vs FlexAttention vs ideal
    TRITON_INTERPRET=1 python scripts/bench_attention.py --masks --tiny --out /tmp/masks   # its dry run, on CPU
    python scripts/bench_attention.py --accuracy            # long rows against float64: a truncating accumulator's bias
    python scripts/bench_attention.py --accuracy --grads    # the same for the backward's dQ, dK, dV
    TRITON_INTERPRET=1 python scripts/bench_attention.py --accuracy --tiny --keys 512 --head-dim 16 --out /tmp/acc
"""
import sys

from minigpt.cli import bench_main

if __name__ == "__main__":
    sys.exit(bench_main())

"""Benchmark attention kernels on the GPU: ours vs SDPA's backends (flash/FA2, cuDNN, efficient) and naive.

    python scripts/bench_attention.py                       # full table -> results/attention_<GPU>.{json,md}
    python scripts/bench_attention.py --explore             # also time candidate tile configs of our kernels
    python scripts/bench_attention.py --explore-only --full --dtype float16 --shortlist   # re-check tiles elsewhere
    python scripts/bench_attention.py --seq 4096 --head-dim 128 --providers minigpt sdpa-flash
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from minigpt.bench import (PROVIDERS, bench_attention, best_tiles_table, explore_tiles, write_explore,  # noqa: E402
                           write_results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--explore", action="store_true", help="time candidate tile configs of our kernels first")
    p.add_argument("--explore-only", action="store_true", help="only the tile exploration, no provider table")
    p.add_argument("--explore-seq", type=int, nargs="+", default=[2048, 8192], help="sequence lengths to explore at")
    p.add_argument("--full", action="store_true", help="explore non-causal attention (the table is always causal)")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16", help="dtype to explore in")
    p.add_argument("--shortlist", action="store_true", help="explore only the shortlisted tile shapes, TMA loads")
    p.add_argument("--out", type=Path, default=Path("results"))
    args = p.parse_args()

    explore = None
    if args.explore or args.explore_only:
        explore = explore_tiles(head_dims=args.head_dim, seq_lens=args.explore_seq, causal=not args.full,
                                dtype=getattr(torch, args.dtype), shortlist=args.shortlist,
                                progress=lambda r: print(f"tile {r['kernel']:5s} D={r['head_dim']:3d} N={r['seq_len']:5d} "
                                                         f"{r['block_m']:3d}x{r['block_n']:3d} w{r['num_warps']} s{r['num_stages']} "
                                                         f"tma={int(r['tma'])} "
                                                         f"{r['ms'] if r['ms'] is None else round(r['ms'], 4)} {r['error']}", flush=True))
        print(best_tiles_table(explore))
        if args.explore_only:
            print("wrote", write_explore(explore, args.out))
            return
    rows = bench_attention(head_dims=args.head_dim, seq_lens=args.seq, providers=args.providers,
                           progress=lambda r: print(f"{r.provider:15s} D={r.head_dim:3d} N={r.seq_len:6d} {r.mode:8s} "
                                                    f"{'' if r.ms is None else f'{r.ms:8.3f} ms {r.tflops:6.1f} TFLOP/s'} {r.note}", flush=True))
    md = write_results(rows, args.out, explore)
    print(md.read_text())


if __name__ == "__main__":
    main()

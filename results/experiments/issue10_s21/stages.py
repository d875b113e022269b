"""Ping-pong forward stage counts (H200, bf16 causal) against the Triton forward, one process.
`python3 stages.py long` (D=64 16K-256K and D=128 32K: stages_long.json) or `stages.py d128` (D=128 8K-128K and D=64 8K:
stages_d128.json). `specialized=True` was `pingpong=True` when these ran (renamed at d0ccfca)."""
import importlib, json, math, os, sys
import torch
from triton.testing import do_bench
fa = importlib.import_module("minigpt_kernels.flash_attention")
TC = fa.TileConfig
OUT = os.environ.get("OUT", "/tmp")
CF = {64: {"triton": TC(64, 128, 4, 2, tma=True), "c3s3": TC(192, 128, 4, 3, tma=True, specialized=True),
           "c3s4": TC(192, 128, 4, 4, tma=True, specialized=True), "c3s2": TC(192, 128, 4, 2, tma=True, specialized=True)},
      128: {"triton": TC(128, 64, 8, 3, tma=True), "c2s2": TC(128, 128, 4, 2, tma=True, specialized=True),
            "c2s3": TC(128, 128, 4, 3, tma=True, specialized=True)}}
R, best = [], {}
torch.manual_seed(0)
MODE = sys.argv[1]
CHECKS = {"long": [(64, 4100, 1, 2), (128, 1000, 2, 2)], "d128": [(128, 1000, 2, 2)]}[MODE]
SHAPES = {"long": [(64, 1, 32, 16384), (64, 1, 12, 131072), (64, 1, 12, 262144), (128, 1, 16, 32768)],
          "d128": [(128, 2, 16, 8192), (128, 1, 16, 16384), (128, 1, 16, 32768), (128, 1, 12, 131072),
                   (64, 2, 32, 8192)]}[MODE]
for D, N, B, H in CHECKS:  # correctness of the new stage counts
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o0, l0 = fa.launch_forward(q, k, v, True, D ** -0.5, CF[D]["triton"])
    for n, c in CF[D].items():
        o, l = fa.launch_forward(q, k, v, True, D ** -0.5, c)
        print("check", D, n, (o - o0).abs().max().item(), (l - l0).abs().max().item(), flush=True)
for p in range(2):
    for D, B, H, N in SHAPES:
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for n, c in CF[D].items():
            ms = do_bench(lambda: fa.launch_forward(q, k, v, True, D ** -0.5, c), warmup=5, rep=60, return_mode="median")
            best[(D, N, n)] = min(best.get((D, N, n), 1e9), ms)
            R.append(dict(D=D, N=N, H=H, cfg=n, pass_=p, ms=ms))
        del q, k, v
json.dump(R, open(f"{OUT}/stages_{MODE}.json", "w"), indent=1)
for D, N in sorted({(d, n) for d, n, _ in best}):
    print(D, N, "  ".join(f"{n}={best[(D, N, n)]:.3f}" for n in CF[D]))

"""kernels/NOTES.md next step 2 (head_dim 128 at 1K): the backward with dS kept in memory (launch_backward_via_ds:
the dK/dV kernel also writes its bf16 dS tiles, then dQ = dS K is one matmul per tile) against the table's
backward, at short lengths, in one process on the GPU.
1. whole backward ms (do_bench median, 3 interleaved rounds, min), table's vs dS path with dQ warps/stages variants;
   dk, dv bitwise against the seven-matmul kernels', dq's max difference;
2. fwd+bwd ms of the table's path, the dS path and cuDNN (what the kernel table compares);
3. GPU time per kernel (torch.profiler) of the dS path at head_dim 128, 1K.
Prints a table last; JSON under $OUT."""
import importlib, json, os
from collections import defaultdict

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

fa = importlib.import_module("minigpt_kernels.flash_attention")
triton.set_allocator(fa._tma_scratch)
TC = fa.TileConfig
OUT = os.environ.get("OUT", ".")
torch.manual_seed(0)
rows, res = [], {}

SHAPES = [(16, 16, 1024, 128), (8, 16, 2048, 128), (16, 32, 1024, 64), (8, 32, 2048, 64), (32, 16, 512, 128)]
for B, H, N, D in SHAPES:
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = D ** -0.5
    o, lse = fa.launch_forward(q, k, v, True, scale)
    dkdv_cfg = fa.tile_config("dkdv", D, True, torch.bfloat16, N)
    table = lambda: fa.launch_backward(do, q, k, v, o, lse, True, scale)  # noqa: E731
    seven = lambda: fa.launch_backward(do, q, k, v, o, lse, True, scale, deterministic=True)  # noqa: E731
    cands = {"table": table, "seven": seven}
    for w, s in ((4, 2), (4, 3), (4, 4), (8, 3)):
        dc = TC(dkdv_cfg.block_m, dkdv_cfg.block_n, w, s)
        cands[f"ds_w{w}s{s}"] = lambda dc=dc: fa.launch_backward_via_ds(do, q, k, v, o, lse, scale, dkdv_cfg, dc)
    ref = seven()
    check = {}
    for name, fn in cands.items():
        g = fn()
        check[name] = {"dq_max": (g[0].float() - ref[0].float()).abs().max().item(),
                       "dk_equal": bool(torch.equal(g[1], ref[1])), "dv_equal": bool(torch.equal(g[2], ref[2]))}
    ms = defaultdict(list)
    for _ in range(3):
        for name, fn in cands.items():
            ms[name].append(do_bench(fn, warmup=25, rep=150, return_mode="median"))
    bwd = {n: min(t) for n, t in ms.items()}
    best_ds = min((n for n in bwd if n.startswith("ds_")), key=bwd.get)
    best_dc = TC(dkdv_cfg.block_m, dkdv_cfg.block_n, *map(int, best_ds[4:].split("s")))  # "ds_w4s3"

    # fwd+bwd through autograd-free launches (the table's forward in both), and cuDNN's
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.autograd.grad(F.scaled_dot_product_attention(qg, kg, vg, is_causal=True), (qg, kg, vg), do)
    fwd = lambda: fa.launch_forward(q, k, v, True, scale)  # noqa: E731
    def ours(bwd_fn):
        def f():
            o_, lse_ = fwd()
            return bwd_fn(o_, lse_)
        return f
    fb = {"table": ours(lambda o_, l_: fa.launch_backward(do, q, k, v, o_, l_, True, scale)),
          "ds": ours(lambda o_, l_: fa.launch_backward_via_ds(do, q, k, v, o_, l_, scale, dkdv_cfg, best_dc)),
          "cudnn": cudnn}
    fms = defaultdict(list)
    for _ in range(3):
        for name, fn in fb.items():
            fms[name].append(do_bench(fn, warmup=25, rep=150, return_mode="median"))
    fwdbwd = {n: min(t) for n, t in fms.items()}
    res[f"{B}x{H}x{N}xD{D}"] = {"bwd_ms": bwd, "bwd_runs": dict(ms), "check": check, "fwd_bwd_ms": fwdbwd,
                                "best_ds": best_ds, "dkdv_cfg": str(dkdv_cfg)}
    rows.append((f"{B}x{H}x{N} D{D}", bwd["table"], bwd["seven"], best_ds, bwd[best_ds], fwdbwd["table"],
                 fwdbwd["ds"], fwdbwd["cudnn"], check[best_ds]))
    print(res[f"{B}x{H}x{N}xD{D}"], flush=True)
    del q, k, v, do, o, lse, ref, qg, kg, vg
    torch.cuda.empty_cache()

# 3. per-kernel GPU time of the dS path at head_dim 128, 1K
B, H, N, D = SHAPES[0]
q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
o, lse = fa.launch_forward(q, k, v, True, D ** -0.5)
fn = lambda: fa.launch_backward_via_ds(do, q, k, v, o, lse, D ** -0.5)  # noqa: E731
fn(); torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
per = {e.key[:60]: round(e.device_time_total / 20 / 1e3, 4) for e in p.key_averages() if e.device_time_total > 0}
res["profile_ds_d128_1k_ms_per_call"] = per
res["device"] = torch.cuda.get_device_name()
json.dump(res, open(os.path.join(OUT, "via_ds_ab.json"), "w"), indent=1)
print("profile", per)
print(f"{'shape':<18}{'bwd table':>10}{'seven':>8}{'best ds':>12}{'ds':>8}{'fb table':>10}{'fb ds':>8}{'cudnn':>8}  "
      f"{'tab/cud':>7}{'ds/cud':>7}  check")
for r in rows:
    print(f"{r[0]:<18}{r[1]:>10.4f}{r[2]:>8.4f}{r[3]:>12}{r[4]:>8.4f}{r[5]:>10.4f}{r[6]:>8.4f}{r[7]:>8.4f}  "
          f"{r[7] / r[5]:>7.3f}{r[7] / r[6]:>7.3f}  {r[8]}")

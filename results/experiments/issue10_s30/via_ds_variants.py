"""Follow-up to via_ds_ab.py (which found the dS path 0.579 against 0.652 ms for the whole backward at head_dim 128,
1K, but its dK/dV kernel 80 µs slower for the stores): how the dS tiles are stored and read.
Variants: dS kept [query][key] or [key][query] (dSᵀ as the dK/dV kernel holds it, read transposed by dQ); the dK/dV
kernel's stores through pointers or TMA; the dQ kernel's loads through pointers or TMA; dK/dV 2 or 3 stages.
1. whole backward ms (do_bench median, 3 interleaved rounds, min), every variant checked bitwise against the
   seven-matmul backward's dq, dk, dv;  2. fwd+bwd of the table's path, the best variant and cuDNN;
3. GPU time per kernel of the best variant at head_dim 128, 1K. Table printed last; JSON under $OUT."""
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
real_use_tma = fa._use_tma
STORE_TMA = [True]


def use_tma(cfg, *tensors):  # the dS buffer is the only 1-D tensor the launchers pass: its stores follow STORE_TMA
    if tensors[0].dim() == 1 and len(tensors) == 1:
        return STORE_TMA[0] and real_use_tma(cfg, *tensors)
    return real_use_tma(cfg, *tensors)


fa._use_tma = use_tma
torch.manual_seed(0)
rows, res = [], {}
VARIANTS = {  # name: (key_major, store through TMA, dQ loads through TMA, dK/dV stages)
    "q_ptr_ptr": (False, False, False, 2), "q_ptr_tma": (False, False, True, 2), "q_tma_tma": (False, True, True, 2),
    "k_ptr_tma": (True, False, True, 2), "k_tma_tma": (True, True, True, 2), "k_tma_tma_s3": (True, True, True, 3),
    "k_ptr_ptr": (True, False, False, 2)}
SHAPES = [(16, 16, 1024, 128), (32, 16, 512, 128), (8, 16, 2048, 128), (16, 32, 1024, 64)]
best_overall = None
for B, H, N, D in SHAPES:
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = D ** -0.5
    o, lse = fa.launch_forward(q, k, v, True, scale)
    base = fa.tile_config("dkdv", D, True, torch.bfloat16, N)

    def via(name, o_=o, lse_=lse):
        km, st, dt, stages = VARIANTS[name]
        STORE_TMA[0] = st
        c = TC(base.block_m, base.block_n, base.num_warps, stages, tma=True, maxnreg=base.maxnreg)
        return fa.launch_backward_via_ds(do, q, k, v, o_, lse_, scale, c, TC(c.block_m, c.block_n, 4, 3, tma=dt),
                                         key_major=km)
    cands = {"table": lambda: fa.launch_backward(do, q, k, v, o, lse, True, scale),
             "seven": lambda: fa.launch_backward(do, q, k, v, o, lse, True, scale, deterministic=True)}
    for name in VARIANTS:
        cands[name] = lambda name=name: via(name)
    ref = cands["seven"]()
    check = {n: all(torch.equal(a, b) for a, b in zip(fn(), ref)) for n, fn in cands.items() if n != "table"}
    ms = defaultdict(list)
    for _ in range(3):
        for name, fn in cands.items():
            ms[name].append(do_bench(fn, warmup=25, rep=150, return_mode="median"))
    bwd = {n: min(t) for n, t in ms.items()}
    best = min(VARIANTS, key=bwd.get)
    best_overall = best_overall or best
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.autograd.grad(F.scaled_dot_product_attention(qg, kg, vg, is_causal=True), (qg, kg, vg), do)

    def table_fb():
        o_, l_ = fa.launch_forward(q, k, v, True, scale)
        return fa.launch_backward(do, q, k, v, o_, l_, True, scale)

    def ds_fb():
        o_, l_ = fa.launch_forward(q, k, v, True, scale)
        return via(best, o_, l_)
    fms = defaultdict(list)
    for _ in range(3):
        for name, fn in (("table", table_fb), ("ds", ds_fb), ("cudnn", cudnn)):
            fms[name].append(do_bench(fn, warmup=25, rep=150, return_mode="median"))
    fb = {n: min(t) for n, t in fms.items()}
    key = f"{B}x{H}x{N}xD{D}"
    res[key] = {"bwd_ms": bwd, "bwd_runs": dict(ms), "bitwise_equal_to_seven": check, "fwd_bwd_ms": fb,
                "fwd_bwd_runs": dict(fms), "best": best}
    rows.append((key, bwd, best, fb, all(check.values())))
    print(key, res[key], flush=True)
    del q, k, v, do, o, lse, ref, qg, kg, vg
    torch.cuda.empty_cache()

B, H, N, D = SHAPES[0]
q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
o, lse = fa.launch_forward(q, k, v, True, D ** -0.5)
km, st, dt, stages = VARIANTS[best_overall]
STORE_TMA[0] = st
c = TC(64, 64, 4, stages, tma=True)
fn = lambda: fa.launch_backward_via_ds(do, q, k, v, o, lse, D ** -0.5, c, TC(64, 64, 4, 3, tma=dt), key_major=km)  # noqa: E731
fn(); torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
res["profile_best_d128_1k_ms_per_call"] = {e.key[:60]: round(e.device_time_total / 20 / 1e3, 4)
                                           for e in p.key_averages() if e.device_time_total > 0}
res["device"] = torch.cuda.get_device_name()
json.dump(res, open(os.path.join(OUT, "via_ds_variants.json"), "w"), indent=1)
print("profile", best_overall, res["profile_best_d128_1k_ms_per_call"])
print(f"{'shape':<16}" + "".join(f"{n:>13}" for n in ["table", "seven", *VARIANTS]))
for key, bwd, best, fb, ok in rows:
    print(f"{key:<16}" + "".join(f"{bwd[n]:>13.4f}" for n in ["table", "seven", *VARIANTS]))
for key, bwd, best, fb, ok in rows:
    print(f"{key:<16} best {best:<13} fwd+bwd table {fb['table']:.4f} ds {fb['ds']:.4f} cudnn {fb['cudnn']:.4f}  "
          f"vs cuDNN table {fb['cudnn'] / fb['table']:.3f} ds {fb['cudnn'] / fb['ds']:.3f}  bitwise {ok}")

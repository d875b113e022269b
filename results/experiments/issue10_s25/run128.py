"""Variant B of the head_dim-128 five-matmul backward (bwd128.py): float64 check, then backward ms against our
seven-matmul backward and cuDNN (H200, bf16 causal, 16K tokens, 16 heads)."""
import importlib, json, os, sys
import torch
import triton
from triton.testing import do_bench
sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, "tests")
import bwd128 as X
from attention_reference import reference_attention
from minigpt.experiments.bench import attention_fn, time_attention
fa = importlib.import_module("minigpt_kernels.flash_attention")
out = os.environ.get("OUT", "."); res = {"check": [], "ms": []}

def bwd_b(do, q, k, v, o, lse, sm_scale, stages):
    B, H, N, D = q.shape
    dq, dk, dv = fa._empty_in_layout_of(q), fa._empty_in_layout_of(k), fa._empty_in_layout_of(v)
    acc = torch.zeros(B, H, N, D, dtype=torch.float32, device=q.device)
    do_, delta = fa.launch_backward_delta(do, o, lse)
    (lse_h, sl), (delta, sd) = fa._rows_in(lse), fa._rows_in(delta)
    (lse_h, sl), (delta, sd) = fa._rows_for_tma(lse_h, sl), fa._rows_for_tma(delta, sd)
    triton.set_allocator(fa._tma_scratch)
    X._dkdvdq128b_kernel[(triton.cdiv(N, 128), B * H)](
        q, k, v, do_, lse_h, delta, dk, dv, acc, *fa._strides3(q), *fa._strides3(k), *fa._strides3(v),
        *fa._strides3(do_), *fa._strides3(dk), *fa._strides3(dv), *fa._strides3(acc), sl, sd, H, N,
        sm_scale * fa.LOG2E, sm_scale, HEAD_DIM=D, BLOCK_M=64, STAGES=stages, CONSUMER_REGS=240, PRODUCER_REGS=24,
        num_warps=4)
    dq.copy_(acc)
    return dq, dk, dv

def model_layout(B, H, N, D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, N, H, D, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2) for _ in range(4)]

for N in (1, 65, 128, 777, 1000, 4100):
    q, k, v, do = model_layout(2, 3, N, 128, N)
    s = 128 ** -0.5
    o, lse = fa.launch_forward(q, k, v, True, s)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(reference_attention(q64, k64, v64, True), (q64, k64, v64), do.double())
    seven = fa.launch_backward(do, q, k, v, o, lse, True, s, deterministic=True)
    for stages in (2, 3):
        got = bwd_b(do, q, k, v, o, lse, s, stages)
        rec = {"N": N, "stages": stages}
        for name, a, b7, r in zip("qkv", got, seven, ref):
            scale = r.abs().max().item() + 1e-12
            rec[f"d{name} err"] = (a.double() - r).abs().max().item() / scale
            rec[f"d{name} err seven"] = (b7.double() - r).abs().max().item() / scale
        res["check"].append(rec); print(rec, flush=True)

cudnn = attention_fn("sdpa-cudnn")
for N in (1024, 2048, 4096, 8192, 16384):
    B, H, D = 16384 // N, 16, 128
    q, k, v, do = model_layout(B, H, N, D, 7)
    s = D ** -0.5
    o, lse = fa.launch_forward(q, k, v, True, s)
    row = {"N": N}
    for rep in range(2):
        for name, fn in (("seven", lambda: fa.launch_backward(do, q, k, v, o, lse, True, s)),
                         ("B s2", lambda: bwd_b(do, q, k, v, o, lse, s, 2)),
                         ("B s3", lambda: bwd_b(do, q, k, v, o, lse, s, 3))):
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            row[name] = min(row.get(name, 1e9), ms)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        row["cudnn"] = min(row.get("cudnn", 1e9), time_attention(cudnn, qg, kg, vg, do, True, "bwd"))
    res["ms"].append(row); print(row, flush=True)
json.dump(res, open(f"{out}/bwd128.json", "w"), indent=1)
print("| N | seven-matmul | five-matmul B, 2 stages | 3 stages | cuDNN |")
for r in res["ms"]:
    print(f"| {r['N']} | {r['seven']:.3f} | {r['B s2']:.3f} | {r['B s3']:.3f} | {r['cudnn']:.3f} |")

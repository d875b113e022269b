"""The head_dim-128 five-matmul backward with dQ one step behind (this tree) against ed9d9df's (old_bwd.py, made by
`git show ed9d9df:kernels/flash_backward_specialized.py > old_bwd.py` beside this script):
float64 check, then backward ms next to the seven-matmul backward and cuDNN (bf16 causal, 16K tokens, 16 heads)."""
import importlib, json, os, sys
import torch
from triton.testing import do_bench
sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, "tests")
import old_bwd
from attention_reference import reference_attention
from minigpt.experiments.bench import attention_fn, time_attention
fa = importlib.import_module("minigpt_kernels.flash_attention")
new_bwd = importlib.import_module("minigpt_kernels.flash_backward_specialized")
out = os.environ.get("OUT", "."); res = {"check": [], "ms": []}

def fused(mod, stages):
    def run(do, q, k, v, o, lse, s):
        fa._GLUON_MODULES["flash_backward_specialized"] = mod
        try:
            return fa.launch_backward_fused(do, q, k, v, o, lse, s,
                                            cfg=fa.TileConfig(64, 128, 4, stages, tma=True, specialized=True))
        finally:
            fa._GLUON_MODULES["flash_backward_specialized"] = new_bwd
    return run

VARIANTS = {"old s2": fused(old_bwd, 2), "new s2": fused(new_bwd, 2), "new s3": fused(new_bwd, 3)}

def model_layout(B, H, N, D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, N, H, D, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2) for _ in range(4)]

for N in (1, 65, 128, 777, 1000, 4100):
    q, k, v, do = model_layout(2, 3, N, 128, N)
    s = 128 ** -0.5
    o, lse = fa.launch_forward(q, k, v, True, s)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(reference_attention(q64, k64, v64, True), (q64, k64, v64), do.double())
    rec = {"N": N}
    for name, fn in VARIANTS.items():
        got = fn(do, q, k, v, o, lse, s)
        for g, a, r in zip("qkv", got, ref):
            rec[f"{name} d{g}"] = (a.double() - r).abs().max().item() / (r.abs().max().item() + 1e-12)
    res["check"].append(rec); print(rec, flush=True)

cudnn = attention_fn("sdpa-cudnn")
for N in (1024, 2048, 4096, 8192, 16384):
    B, H, D = 16384 // N, 16, 128
    q, k, v, do = model_layout(B, H, N, D, 7)
    s = D ** -0.5
    o, lse = fa.launch_forward(q, k, v, True, s)
    row = {"N": N}
    fns = {"seven": lambda: fa.launch_backward(do, q, k, v, o, lse, True, s, deterministic=True)}
    fns.update({name: (lambda fn=fn: fn(do, q, k, v, o, lse, s)) for name, fn in VARIANTS.items()})
    for rep in range(2):
        for name, fn in fns.items():
            row[name] = min(row.get(name, 1e9), do_bench(fn, warmup=25, rep=100, return_mode="median"))
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        row["cudnn"] = min(row.get("cudnn", 1e9), time_attention(cudnn, qg, kg, vg, do, True, "bwd"))
    res["ms"].append(row); print(row, flush=True)
json.dump(res, open(f"{out}/bwd128p.json", "w"), indent=1)
worst = {name: max(max(r[f"{name} d{g}"] for g in "qkv") for r in res["check"]) for name in VARIANTS}
print("largest relative error against float64:", {k: f"{v:.2e}" for k, v in worst.items()})
print("| N | seven-matmul | old s2 | new s2 | new s3 | cuDNN |")
for r in res["ms"]:
    print(f"| {r['N']} | {r['seven']:.3f} | {r['old s2']:.3f} | {r['new s2']:.3f} | {r['new s3']:.3f} | {r['cudnn']:.3f} |")

"""The head_dim-128 five-matmul backward, plain against persistent (one K/V buffer), 2 and 3 stages: backward ms next
to the seven-matmul backward and cuDNN (H200, bf16 causal, 16K tokens, 16 heads, the model's layout)."""
import dataclasses, importlib, json, os, sys
import torch
from triton.testing import do_bench
sys.path.insert(0, "tests")
from minigpt.experiments.bench import attention_fn, time_attention
fa = importlib.import_module("minigpt_kernels.flash_attention")
out = os.environ.get("OUT", "."); res = []
base = fa.TileConfig(64, 128, 4, 2, tma=True, specialized=True)
VARIANTS = {"plain s2": base, "pers s2": dataclasses.replace(base, persistent=True),
            "pers s3": dataclasses.replace(base, persistent=True, num_stages=3)}
cudnn = attention_fn("sdpa-cudnn")
for N in (1024, 2048, 4096, 8192, 16384):
    B, H, D = 16384 // N, 16, 128
    g = torch.Generator(device="cuda").manual_seed(N)
    q, k, v, do = [torch.randn(B, N, H, D, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2) for _ in range(4)]
    s = D ** -0.5
    o, lse = fa.launch_forward(q, k, v, True, s)
    row = {"N": N}
    fns = {"seven": lambda: fa.launch_backward(do, q, k, v, o, lse, True, s, deterministic=True)}
    fns.update({name: (lambda c=c: fa.launch_backward_fused(do, q, k, v, o, lse, s, cfg=c)) for name, c in VARIANTS.items()})
    ref = fns["plain s2"]()
    for name in ("pers s2", "pers s3"):
        got = fns[name]()
        row[f"{name} same dk dv"] = bool(torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2]))
        row[f"{name} dq diff"] = ((got[0].float() - ref[0].float()).abs().max() / ref[0].float().abs().max()).item()
    for rep in range(2):
        for name, fn in fns.items():
            row[name] = min(row.get(name, 1e9), do_bench(fn, warmup=25, rep=100, return_mode="median"))
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        row["cudnn"] = min(row.get("cudnn", 1e9), time_attention(cudnn, qg, kg, vg, do, True, "bwd"))
    res.append(row); print(row, flush=True)
json.dump(res, open(f"{out}/bwd128q.json", "w"), indent=1)
print("| N | seven-matmul | plain s2 | persistent s2 | persistent s3 | cuDNN |")
for r in res:
    print(f"| {r['N']} | {r['seven']:.3f} | {r['plain s2']:.3f} | {r['pers s2']:.3f} | {r['pers s3']:.3f} | {r['cudnn']:.3f} |")

"""Where the head_dim-128 backward's time goes at 1K-4K tokens (16K tokens, 16 heads): per-kernel GPU time of ours
(delta, zero fill, dK/dV/dQ or dQ + dK/dV kernels, cast) and cuDNN's, from torch.profiler, 20 backward calls each."""
import importlib, os, sys, json
import torch
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, "tests")
fa = importlib.import_module("minigpt_kernels.flash_attention")
from minigpt.experiments.bench import attention_fn
out = os.environ.get("OUT", "."); res = {}
cudnn = attention_fn("sdpa-cudnn")
for N in (1024, 2048, 4096):
    B, H, D = 16384 // N, 16, 128
    g = torch.Generator(device="cuda").manual_seed(N)
    q, k, v, do = [torch.randn(B, N, H, D, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2) for _ in range(4)]
    s = D ** -0.5
    o, lse = fa.launch_forward(q, k, v, True, s)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    oc = cudnn(qg, kg, vg, causal=True)
    runs = {"seven": lambda: fa.launch_backward(do, q, k, v, o, lse, True, s, deterministic=True),
            "five": lambda: fa.launch_backward_fused(do, q, k, v, o, lse, s,
                                                     cfg=fa.TileConfig(64, 128, 4, 2, tma=True, specialized=True)),
            "cudnn": lambda: torch.autograd.grad(oc, (qg, kg, vg), do, retain_graph=True)}
    for name, fn in runs.items():
        for _ in range(5): fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20): fn()
            torch.cuda.synchronize()
        rows = {}
        for e in prof.key_averages():
            if e.device_time_total > 0:
                rows[e.key[:70]] = e.device_time_total / 20 / 1000
        res[f"{name} {N}"] = rows
        print(f"== {name} N={N}: total {sum(rows.values()):.3f} ms/call", flush=True)
        for kname, ms in sorted(rows.items(), key=lambda x: -x[1]):
            print(f"   {ms:.4f}  {kname}")
json.dump(res, open(f"{out}/prof128.json", "w"), indent=1)

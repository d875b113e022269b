"""Why is fwd+bwd at 1K (D=64) slower than fwd + bwd? Host vs GPU time, persistent vs Triton forward."""
import importlib, math, time, torch
from triton.testing import do_bench
fa = importlib.import_module("minigpt_kernels.flash_attention")
from minigpt_kernels import flash_attention as flash
B, H, N, D = 16, 32, 1024, 64
q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(4))
def fb():
    return torch.autograd.grad(flash(q, k, v, causal=True), (q, k, v), do)
def host_time(f, n=50):
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): f()
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    return (t1 - t) / n * 1e3, (t2 - t) / n * 1e3
for label in ("table", "triton-fwd"):
    if label == "triton-fwd":
        orig = fa._SPECIALIZED_FROM_SEQ[("fwd", 64)]
        fa._SPECIALIZED_FROM_SEQ[("fwd", 64)] = orig[2:]
    ms = do_bench(fb, warmup=25, rep=100, return_mode="median")
    fwd = do_bench(lambda: flash(q, k, v, causal=True), warmup=25, rep=100, return_mode="median")
    print(label, f"fwd+bwd {ms:.3f} ms, fwd {fwd:.3f}; host per call (enqueue, total) {host_time(fb)}", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5): fb()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))

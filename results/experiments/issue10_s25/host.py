"""Host (Python) cost of one attention fwd+bwd: enqueue time while the GPU is busy, and a cProfile of it."""
import cProfile, io, json, os, pstats, sys, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from minigpt_kernels.flash_attention import flash_attention

out = os.environ.get("OUT", ".")
res = {}
def make(B, H, N, D):
    t = [torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in range(3)]
    return t

def step_flash(q, k, v, do):
    o = flash_attention(q, k, v, causal=True)
    o.backward(do)

def step_sdpa(q, k, v, do):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.backward(do)

def enqueue_ms(fn, args, iters=20):
    for _ in range(3): fn(*args)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000 // 1000 * 200)  # keep the GPU busy (~0.2 s)
    t0 = time.perf_counter()
    for _ in range(iters): fn(*args)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e3

def gpu_ms(fn, args, iters=20):
    for _ in range(3): fn(*args)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters): fn(*args)
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters

for D, H in ((128, 16), (64, 32)):
    for N in (1024, 2048):
        B = 16384 // N
        q, k, v = make(B, H, N, D)
        do = torch.randn_like(q)
        args = (q, k, v, do)
        for name, fn in (("flash", step_flash), ("cudnn", step_sdpa)):
            for a in (q, k, v): a.grad = None
            res[f"{name} D={D} N={N} enqueue_ms"] = enqueue_ms(fn, args)
            res[f"{name} D={D} N={N} loop_ms"] = gpu_ms(fn, args)
        if N == 1024:
            pr = cProfile.Profile()
            for _ in range(3): step_flash(*args)
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000_000 // 1000 * 500)
            pr.enable()
            for _ in range(50): step_flash(*args)
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
            open(f"{out}/profile_D{D}.txt", "w").write(s.getvalue())
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60)
            open(f"{out}/profile_cum_D{D}.txt", "w").write(s.getvalue())
# RoPE in the trainer's shape (8K, batch 4, 12 heads of 64): eager and compiled fwd+bwd of q and k
from minigpt.model import apply_rotary, Rotary
B, N, H, D = 4, 8192, 12, 64
qkv = torch.randn(B, N, 3, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
cos, sin = Rotary(D).cuda()(N)
g = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
def rope_step(fn):
    q, k = fn(qkv[:, :, 0], cos, sin), fn(qkv[:, :, 1], cos, sin)
    torch.autograd.backward((q, k), (g, g))
cfn = torch.compile(apply_rotary)
for name, fn in (("rope eager", apply_rotary), ("rope compiled", cfn)):
    res[f"{name} 8K b4 fwd+bwd ms"] = gpu_ms(rope_step, (fn,))
q, k, v = make(B, H, N, D); do = torch.randn_like(q)
res["flash 8K b4 fwd+bwd ms"] = gpu_ms(step_flash, (q, k, v, do))
res["cudnn 8K b4 fwd+bwd ms"] = gpu_ms(step_sdpa, (q, k, v, do))
json.dump(res, open(f"{out}/host.json", "w"), indent=1)
for k_, v_ in res.items(): print(f"{k_:40s} {v_:.3f}")

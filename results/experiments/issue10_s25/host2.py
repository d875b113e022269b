"""Host time of attention fwd+bwd (eager launches vs the custom-op dispatch), and the qkv split + RoPE in the
trainer's shape (PyTorch eager, compiled, the Triton kernel). H200, bf16."""
import json, os, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from minigpt_kernels.flash_attention import flash_attention
from minigpt_kernels.rotary import qkv_rotary
from minigpt.model import apply_rotary, Rotary

out = os.environ.get("OUT", ".")
res = {}

class ViaOps(torch.autograd.Function):  # the dispatch as it was at e30cb83: every call through the custom ops
    @staticmethod
    def forward(ctx, q, k, v):
        o, lse = torch.ops.minigpt.flash_attn_fwd(q, k, v, True, q.shape[-1] ** -0.5)
        ctx.save_for_backward(q, k, v, o, lse)
        return o
    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return torch.ops.minigpt.flash_attn_bwd(do, q, k, v, o, lse, True, q.shape[-1] ** -0.5, False)

def step_flash(q, k, v, do):
    flash_attention(q, k, v, causal=True).backward(do)
def step_ops(q, k, v, do):
    ViaOps.apply(q, k, v).backward(do)
def step_sdpa(q, k, v, do):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.backward(do)

def enqueue_once(fn, args, iters=30):
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    t0 = time.perf_counter()
    for _ in range(iters): fn(*args)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e3

def gpu_ms(fn, args, iters=20, reps=3):
    best = 1e9
    for _ in range(reps):
        for _ in range(2): fn(*args)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters): fn(*args)
        e1.record(); torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) / iters)
    return best

for D, H in ((128, 16), (64, 32)):
    for N in (1024, 2048):
        B = 16384 // N
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in range(3))
        do = torch.randn_like(q)
        variants = (("flash", step_flash), ("flash via custom ops", step_ops), ("cudnn", step_sdpa))
        for name, fn in variants:
            for _ in range(3): fn(q, k, v, do)
        times = {name: [] for name, _ in variants}
        for _ in range(7):  # interleaved, min of 7: the host's timing drifts between and within runs
            for name, fn in variants:
                times[name].append(enqueue_once(fn, (q, k, v, do)))
        for name, fn in variants:
            res[f"D={D} N={N} {name}: enqueue ms (min of 7)"] = min(times[name])
            res[f"D={D} N={N} {name}: enqueue ms (median of 7)"] = sorted(times[name])[3]
            res[f"D={D} N={N} {name}: loop ms"] = gpu_ms(fn, (q, k, v, do))

if os.environ.get("ROPE", "1") == "1":
    B, N, H, D = 4, 8192, 12, 64
    qkv = torch.randn(B, N, 3, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = Rotary(D).cuda()(N)
    g = [torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    def torch_heads(qkv, cos, sin):
        return apply_rotary(qkv[:, :, 0], cos, sin), apply_rotary(qkv[:, :, 1], cos, sin), qkv[:, :, 2].contiguous()
    compiled_heads = torch.compile(torch_heads)
    for name, fn in (("PyTorch eager", torch_heads), ("PyTorch compiled", compiled_heads), ("Triton kernel", qkv_rotary)):
        def rope_step(fn=fn):
            torch.autograd.backward(fn(qkv, cos, sin), g)
        res[f"qkv split + RoPE fwd+bwd, 8K x 4, 12 heads: {name} ms"] = gpu_ms(rope_step, ())
json.dump(res, open(f"{out}/host2.json", "w"), indent=1)
for k_, v_ in res.items(): print(f"{k_:72s} {v_:.3f}")

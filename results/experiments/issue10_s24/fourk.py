"""4K tokens at head_dim 64 (B=4, H=32): persistent forward stages / consumers, backward variants, next to cuDNN."""
import importlib, json, math, os, torch, triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench
fa = importlib.import_module("minigpt_kernels.flash_attention")
pp = fa._gluon_module("flash_forward_pingpong")
triton.set_allocator(fa._tma_scratch)
B, H, N, D = 4, 32, 4096, 64
sm = D ** -0.5
q, k, v, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
o, lse = fa.launch_forward(q, k, v, True, sm)
T = fa.TileConfig
best = {}
def timed(name, f):
    ms = do_bench(f, warmup=10, rep=100, return_mode="median"); best[name] = min(best.get(name, 1e9), ms)
for p in range(3):
    for C, S in ((2, 2), (2, 3), (2, 4), (3, 3)):
        timed(f"fwd ps C{C} S{S}", lambda: fa.launch_forward(q, k, v, True, sm, T(64 * C, 128, 4, S, tma=True, specialized=True, persistent=True)))
    timed("fwd ps C2 S3 BN64", lambda: fa.launch_forward(q, k, v, True, sm, T(128, 64, 4, 3, tma=True, specialized=True, persistent=True)))
    timed("fwd triton", lambda: fa.launch_forward(q, k, v, True, sm, fa.tile_config("fwd", D, True, q.dtype, N)))
    timed("bwd seven", lambda: fa.launch_backward(do, q, k, v, o, lse, True, sm, deterministic=True))
    timed("bwd five", lambda: fa.launch_backward_fused(do, q, k, v, o, lse, sm))
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        timed("fwd cudnn", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        out = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
    timed("bwd cudnn", lambda: torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True))
json.dump(best, open(os.path.join(os.environ.get("OUT", "/tmp"), "fourk.json"), "w"), indent=1)
for name, ms in sorted(best.items()):
    print(f"{name:22s} {ms:.3f}")

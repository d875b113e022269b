"""Issue 10, session 23: where do 1K-4K tokens at head_dim 64 lose to cuDNN? Forward tiles (Triton and the ping-pong
kernel) and backward tile pairs, timed next to cuDNN in one process (bf16 causal, B·N = 16K, 32 heads)."""
import importlib, json, math, os
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

fa = importlib.import_module("minigpt_kernels.flash_attention")
T = fa.TileConfig
OUT = os.environ.get("OUT", "/tmp")
R = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("MINIGPT_COMMIT")},
     "times": []}
FWD = {"default": None, "t64x128s2": T(64, 128, 4, 2, tma=True), "t128x64w8": T(128, 64, 8, 3, tma=True),
       "t128x128w8s2": T(128, 128, 8, 2, tma=True), "t64x64s4": T(64, 64, 4, 4, tma=True),
       "pp2_n128_s3": T(128, 128, 4, 3, tma=True, specialized=True), "pp2_n64_s3": T(128, 64, 4, 3, tma=True, specialized=True),
       "pp2_n128_s2": T(128, 128, 4, 2, tma=True, specialized=True), "pp3_n128_s3": T(192, 128, 4, 3, tma=True, specialized=True),
       "pp3_n64_s4": T(192, 64, 4, 4, tma=True, specialized=True)}
DQ = {"default": None, "dq64x64": T(64, 64, 4, 3, tma=True), "dq128x128w8s2": T(128, 128, 8, 2, tma=True),
      "dq64x32": T(64, 32, 4, 3, tma=True), "dq128x64w4": T(128, 64, 4, 3, tma=True)}
DKDV = {"default": None, "kv32x64": T(32, 64, 4, 3, tma=True, maxnreg=168), "kv64x128w8": T(64, 128, 8, 2, tma=True),
        "kv32x128": T(32, 128, 4, 3, tma=True), "kv64x64nocap": T(64, 64, 4, 3, tma=True)}
best = {}


def timed(key, f):
    try:
        ms = do_bench(f, warmup=10, rep=100, return_mode="median")
    except Exception as e:  # a config that does not fit
        print(key, "failed:", str(e).splitlines()[0][:120], flush=True)
        return
    best[key] = min(best.get(key, float("inf")), ms)
    R["times"].append(dict(key=list(key), ms=ms))


for p in range(2):
    for N in (1024, 2048, 4096):
        B, H, D = 16384 // N, 32, 64
        sm = 1 / math.sqrt(D)
        q, k, v, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
        for name, cfg in FWD.items():
            timed((N, "fwd", name), lambda: fa.launch_forward(q, k, v, True, sm, cfg))
        o, lse = fa.launch_forward(q, k, v, True, sm)
        for name, cfg in DQ.items():
            timed((N, "bwd", "dq:" + name), lambda: fa.launch_backward(do, q, k, v, o, lse, True, sm, dq_cfg=cfg,
                                                                     dkdv_cfg=fa.tile_config("dkdv", D, True, q.dtype, N)))
        for name, cfg in DKDV.items():
            timed((N, "bwd", "dkdv:" + name), lambda: fa.launch_backward(do, q, k, v, o, lse, True, sm,
                                                                       dq_cfg=fa.tile_config("dq", D, True, q.dtype, N),
                                                                       dkdv_cfg=cfg))
        qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            timed((N, "fwd", "cudnn"), lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
            out = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
        timed((N, "bwd", "cudnn"), lambda: torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True))
        json.dump(R, open(f"{OUT}/short.json", "w"), indent=1)

print("\nms, min of 2 passes (D=64, bf16 causal, 16K tokens, 32 heads)")
for N in (1024, 2048, 4096):
    for kind in ("fwd", "bwd"):
        items = sorted(((ms, name) for (n, kd, name), ms in best.items() if n == N and kd == kind))
        print(N, kind, "  ".join(f"{name}={ms:.3f}" for ms, name in items))

"""GPU: fwd+bwd through flash_attention (autograd) with the tile tables before 7cac271 and after, interleaved passes."""
import json, math, os
import torch, triton
import importlib; fa = importlib.import_module("minigpt_kernels.flash_attention")
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as F
TC = fa.TileConfig
NEW = (dict(fa._GPU_CONFIGS), dict(fa._GPU_CONFIGS_UP_TO_SEQ))
OLD = ({**fa._GPU_CONFIGS, ("dkdv", 128): TC(64, 128, 8, 2, tma=True)},
       {("fwd", 128): (2048, TC(64, 64, 4, 3, tma=True)), ("dkdv", 128): (1024, TC(64, 64, 4, 2, tma=True))})
def use(t): fa._GPU_CONFIGS, fa._GPU_CONFIGS_UP_TO_SEQ = t
def t_ms(fn, warm=5, reps=30):
    for _ in range(warm): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True); s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts) // 2]
res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__, "commit": os.environ.get("MINIGPT_COMMIT"), "rows": []}
for D in (64, 128):
    for N in (1024, 2048, 4096, 8192, 16384, 32768):
        B, H = max(1, 16384 // N), 2048 // D
        q, k, v, do = [torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4)]
        qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
        fb = lambda: torch.autograd.grad(fa.flash_attention(qr, kr, vr, causal=True), (qr, kr, vr), do)
        use(OLD); g_old = fb(); use(NEW); g_new = fb()
        row = {"D": D, "N": N, "B": B, "max_grad_diff": max((a.float() - b.float()).abs().max().item() for a, b in zip(g_old, g_new))}
        for p in range(3):
            for name, t in (("old", OLD), ("new", NEW)):
                use(t); row.setdefault(name, []).append(t_ms(fb))
        use(NEW)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            row["cudnn"] = t_ms(lambda: torch.autograd.grad(F.scaled_dot_product_attention(qr, kr, vr, is_causal=True), (qr, kr, vr), do))
        fl = 3.5 * 4 * B * H * N * N * D / 2
        row["tflops"] = {k_: fl / (min(row[k_]) if isinstance(row[k_], list) else row[k_]) / 1e9 for k_ in ("old", "new", "cudnn")}
        res["rows"].append(row); print(json.dumps(row), flush=True)
        del q, k, v, do, qr, kr, vr; torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "abtables.json"), "w"), indent=1)
print("D N | fwd+bwd ms old / new (min of 3) | TFLOP/s old / new / cuDNN | new/old speed | new/cuDNN")
for r in res["rows"]:
    o, n = min(r["old"]), min(r["new"]); t = r["tflops"]
    print(f"{r['D']} {r['N']} | {o:.3f} / {n:.3f} | {t['old']:.0f} / {t['new']:.0f} / {t['cudnn']:.0f} | {o / n:.3f} | {t['new'] / t['cudnn']:.2f}")

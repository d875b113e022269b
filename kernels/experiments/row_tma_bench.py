"""GPU: LSE/delta rows through TMA in the dK/dV kernel (working tree) vs the previous kernel (.scratch/fa_prev.py,
HEAD): float64 checks on odd shapes, dK/dV alone per tile config, whole backward and fwd+bwd, cuDNN alongside."""
import json, math, os, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import importlib; new = importlib.import_module("minigpt_kernels.flash_attention")
import fa_prev as old
def t_ms(fn, warm=3, reps=15):
    for _ in range(warm): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True); s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts) // 2]
res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__, "commit": os.environ.get("MINIGPT_COMMIT"), "checks": [], "rows": []}
err = lambda a, r: (a.double() - r).abs().max().item() / r.abs().max().item()
for (B, N, H, D, causal) in [(2, 1000, 3, 64, True), (2, 777, 3, 64, True), (1, 1000, 2, 128, False), (1, 4100, 2, 64, True), (2, 1000, 2, 128, True), (1, 4100, 2, 128, False)]:
    q, k, v, do = [torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4)]
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) / math.sqrt(D)
    if causal: s = s.masked_fill(torch.ones(N, N, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.autograd.grad(s.softmax(-1) @ v64, (q64, k64, v64), do.double())
    row = {"shape": [B, N, H, D, causal]}
    for name, m in (("old", old), ("new", new)):
        qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
        g = torch.autograd.grad(m.flash_attention(qr, kr, vr, causal=causal), (qr, kr, vr), do)
        row[name] = [round(err(a, r), 6) for a, r in zip(g, ref)]
        row[name + "_grads"] = g
    row["equal"] = all(torch.equal(a, b) for a, b in zip(row.pop("old_grads"), row.pop("new_grads")))
    res["checks"].append(row); print("check", json.dumps(row), flush=True)
TC = new.TileConfig
CFG = {64: [(32, 128, 4, 3, None), (64, 64, 4, 3, 168), (64, 64, 4, 2, 168), (32, 64, 4, 3, 168), (64, 128, 8, 2, None)],
       128: [(64, 64, 4, 2, None), (64, 128, 8, 2, None), (32, 64, 4, 2, None)]}
for D, N, B, H in [(64, 1024, 16, 32), (64, 4096, 4, 32), (64, 16384, 1, 32), (64, 32768, 1, 32), (64, 16384, 1, 12), (64, 32768, 1, 12), (64, 131072, 1, 12),
                   (128, 4096, 4, 16), (128, 16384, 1, 16), (128, 32768, 1, 16)]:
    q, k, v, do = [torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4)]
    sc = 1 / math.sqrt(D)
    o, lse = new.launch_forward(q, k, v, True, sc); do_, delta = new.launch_backward_delta(do, o, lse)
    reps = 4 if N > 32768 else 15
    row = {"D": D, "N": N, "B": B, "H": H}
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    for p in range(2):
        for c in CFG[D]:
            for name, m in (("old", old), ("new", new)):
                cfg = m.TileConfig(*c[:4], tma=True, maxnreg=c[4])
                row.setdefault(f"{name} dkdv {c}", []).append(t_ms(lambda: m.launch_backward_dkdv(do_, q, k, v, lse, delta, True, sc, cfg), reps=reps))
        for name, m in (("old", old), ("new", new)):
            row.setdefault(f"{name} bwd", []).append(t_ms(lambda: m.launch_backward(do, q, k, v, o, lse, True, sc), reps=reps))
            row.setdefault(f"{name} fwd+bwd", []).append(t_ms(lambda: torch.autograd.grad(m.flash_attention(qr, kr, vr, causal=True), (qr, kr, vr), do), reps=reps))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        fw = t_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps=reps)
        fb = t_ms(lambda: torch.autograd.grad(F.scaled_dot_product_attention(qr, kr, vr, is_causal=True), (qr, kr, vr), do), reps=reps)
    row["cudnn fwd"], row["cudnn fwd+bwd"] = fw, fb
    res["rows"].append(row); print(json.dumps(row), flush=True)
    del q, k, v, do, o, lse, do_, delta, qr, kr, vr; torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "rowtma.json"), "w"), indent=1)
print("\nchecks (max rel err old vs new, grads equal):")
for c in res["checks"]: print("  ", c["shape"], max(c["old"]), max(c["new"]), c["equal"])
for r in res["rows"]:
    m = {k_: min(v_) for k_, v_ in r.items() if isinstance(v_, list)}
    dk = " ".join(f"{k_[9:]}:{m['old dkdv ' + k_[9:]]:.3f}->{m[k_]:.3f}" for k_ in m if k_.startswith("new dkdv"))
    print(f"D{r['D']} N{r['N']} B{r['B']} H{r['H']} | {dk} | bwd {m['old bwd']:.3f}->{m['new bwd']:.3f} | fwd+bwd {m['old fwd+bwd']:.3f}->{m['new fwd+bwd']:.3f} cuDNN {r['cudnn fwd+bwd']:.3f} ({r['cudnn fwd+bwd'] / m['old fwd+bwd']:.3f} -> {r['cudnn fwd+bwd'] / m['new fwd+bwd']:.3f})")

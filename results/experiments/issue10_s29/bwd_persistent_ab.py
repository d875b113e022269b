"""kernels/NOTES.md next step 3: the persistent five-matmul backward at head_dim 64 from 16K tokens, against the plain
kernel the table runs there (T measured the persistent one 2% slower at 16K and 32K, 3988083). The model's strides;
dK and dV compared bitwise, dQ within the reduce-add order's rounding; whole backward ms, interleaved, min of 3 medians.
Then where the host's 0.67 ms per forward+backward goes at head_dim 128, 1K tokens (cProfile, 100 calls).
JSON under $OUT, a table last."""
import cProfile, importlib, io, json, math, os, pstats

import torch
import triton
from triton.testing import do_bench

from minigpt.attention import get_attention

fa = importlib.import_module("minigpt_kernels.flash_attention")
triton.set_allocator(fa._tma_scratch)
SHAPES = [(2, 12, 16384), (1, 32, 16384), (1, 12, 32768), (1, 12, 65536)]  # (B, H, N), D = 64
rows = []
for B, H, N in SHAPES:
    torch.manual_seed(N + H)
    qkv = torch.randn(B, N, 3, H, 64, device="cuda", dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    do = torch.randn_like(q)
    scale = 1 / math.sqrt(64)
    o, lse = fa.launch_forward(q, k, v, True, scale)
    cfgs = {p: fa.TileConfig(64, 128, 4, 3, tma=True, specialized=True, persistent=p) for p in (False, True)}
    runs = {p: (lambda c=c: fa.launch_backward_fused(do, q, k, v, o, lse, scale, c)) for p, c in cfgs.items()}
    (dq0, dk0, dv0), (dq1, dk1, dv1) = runs[False](), runs[True]()
    same_dkdv = torch.equal(dk0, dk1) and torch.equal(dv0, dv1)
    dq_diff = float((dq0.float() - dq1.float()).abs().max())
    ms = {"plain": [], "persistent": []}
    for _ in range(3):
        for p, name in ((False, "plain"), (True, "persistent")):
            ms[name].append(do_bench(runs[p], warmup=25, rep=200, return_mode="median"))
    rows.append({"B": B, "H": H, "N": N, "dkdv_bitwise": same_dkdv, "dq_max_diff": dq_diff, "ms": ms})
    print(rows[-1], flush=True)
    del qkv, q, k, v, do, o, lse, dq0, dk0, dv0, dq1, dk1, dv1
    torch.cuda.empty_cache()

# host time at head_dim 128, 1K tokens (the bench's 16 × 16 heads)
q, k, v = (torch.randn(16, 16, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn(16, 16, 1024, 128, device="cuda", dtype=torch.bfloat16)
flash = get_attention("flash")
step = lambda: torch.autograd.grad(flash(q, k, v, causal=True), (q, k, v), do)  # noqa: E731
for _ in range(20):
    step()
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(100):
    step()
prof.disable()
torch.cuda.synchronize()
buf = io.StringIO()
pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
host = buf.getvalue()
json.dump({"rows": rows, "host_profile_d128_1k": host}, open(os.path.join(os.environ.get("OUT", "."), "bwd_persistent_ab.json"), "w"), indent=1)
print("\n".join(host.splitlines()[:45]))
print("\n| B, H, N (D=64) | dK/dV bitwise | dQ max diff | plain ms | persistent ms | plain / persistent |")
for r in rows:
    p, s = min(r["ms"]["plain"]), min(r["ms"]["persistent"])
    print(f"| {r['B']}, {r['H']}, {r['N']} | {r['dkdv_bitwise']} | {r['dq_max_diff']:.2e} | {p:.3f} | {s:.3f} | {p / s:.3f} |")

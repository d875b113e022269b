"""GPU: why J's dK/dV gain (kernel alone) hardly shows in the whole backward: time dK/dV alone, dQ alone and the whole
backward (delta + dK/dV + dQ) with the old and new dK/dV tiles, interleaved; gpt2-small's 12 heads at long N too."""
import json, math, os
import torch, triton
import importlib; fa = importlib.import_module("minigpt_kernels.flash_attention")
TC = fa.TileConfig
def t_ms(fn, warm=3, reps=15):
    for _ in range(warm): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True); s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts) // 2]
OLD = {64: TC(32, 128, 4, 3, True), 128: TC(64, 128, 8, 2, True)}
NEW = {64: TC(64, 64, 4, 3, True, maxnreg=168), 128: TC(64, 64, 4, 2, True)}
res = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("MINIGPT_COMMIT"), "rows": []}
for D, N, B, H in [(64, 4096, 4, 32), (64, 16384, 1, 32), (64, 16384, 1, 12), (64, 32768, 1, 12), (64, 131072, 1, 12), (128, 8192, 2, 16), (128, 16384, 1, 16)]:
    q, k, v, do = [torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4)]
    sc = 1 / math.sqrt(D)
    o, lse = fa.launch_forward(q, k, v, True, sc); do_, delta = fa.launch_backward_delta(do, o, lse)
    row = {"D": D, "N": N, "B": B, "H": H}
    reps = 5 if N > 32768 else 15
    for p in range(3):
        for name, c in (("old", OLD[D]), ("new", NEW[D])):
            row.setdefault(f"{name} dkdv", []).append(t_ms(lambda: fa.launch_backward_dkdv(do_, q, k, v, lse, delta, True, sc, c), reps=reps))
            row.setdefault(f"{name} bwd", []).append(t_ms(lambda: fa.launch_backward(do, q, k, v, o, lse, True, sc, dkdv_cfg=c), reps=reps))
        row.setdefault("dq", []).append(t_ms(lambda: fa.launch_backward_dq(do_, q, k, v, lse, delta, True, sc), reps=reps))
        row.setdefault("delta", []).append(t_ms(lambda: fa.launch_backward_delta(do, o, lse), reps=reps))
    res["rows"].append(row); print(json.dumps(row), flush=True)
    del q, k, v, do, o, lse, do_, delta; torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "passdiag.json"), "w"), indent=1)
print("D N B H | dkdv old/new | bwd old/new | dq | delta | old dkdv+dq+delta vs bwd")
for r in res["rows"]:
    m = {k_: min(v_) for k_, v_ in r.items() if isinstance(v_, list)}
    print(f"{r['D']} {r['N']} {r['B']} {r['H']} | {m['old dkdv']:.3f}/{m['new dkdv']:.3f} ({m['old dkdv']/m['new dkdv']:.3f}) | {m['old bwd']:.3f}/{m['new bwd']:.3f} ({m['old bwd']/m['new bwd']:.3f}) | {m['dq']:.3f} | {m['delta']:.3f} | {m['old dkdv']+m['dq']+m['delta']:.3f} vs {m['old bwd']:.3f}")

"""GPU (H200, torch 2.11, triton 3.6): the Gluon dK/dV kernel (gluon_dkdv.py beside this file: experiment D with LSE
and delta rows through 1-D TMA, and its LEAN schedule) against the Triton dK/dV kernel (minigpt_kernels).

Run from the repo root: `python3 .scratch/s20/gluon/gluon_bench.py`. Writes $OUT/gluon.json (OUT default /tmp).
(a) correctness, bf16, B=2, H=4, D=64/128, N=777/1000/4096, causal and not, q/k/v as the model makes them
    ((B, N, 3, H, D) qkv split and transposed to (B, H, N, D)): max |error| of dK, dV against float64 autograd, for
    the Triton kernel and Gluon variants, and the max |Gluon − Triton|.
(b) dK/dV kernel time (triton.testing.do_bench median, ms), causal, contiguous (B, H, N, D) bf16, 3 interleaved passes,
    min over passes. Variant names: schedule (D = experiment D's, lean = LEAN), block_m×block_n (queries×keys), warps,
    stages, register cap.
"""
import importlib, json, math, os, sys, time, traceback

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gluon_dkdv as G  # noqa: E402

fa = importlib.import_module("minigpt_kernels.flash_attention")
OUT = os.environ.get("OUT", "/tmp")
dev = "cuda"
T0 = time.time()
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
       "checks": [], "timing": []}


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def gluon(block_m, block_n, warps, stages, maxnreg=None, lean=False):
    def run(do, q, k, v, lse, delta, causal, scale):
        return G.gluon_dkdv(do, q, k, v, lse, delta, causal, scale, block_m, block_n, warps, stages, maxnreg, lean)
    return run


def triton_dkdv(do, q, k, v, lse, delta, causal, scale):
    return fa.launch_backward_dkdv(do, q, k, v, lse, delta, causal, scale)


V64 = {  # D=64 timing variants
    "D 64x64 w4 s2": gluon(64, 64, 4, 2), "D 64x64 w4 s2 r168": gluon(64, 64, 4, 2, 168),
    "D 64x64 w4 s3": gluon(64, 64, 4, 3), "D 64x64 w4 s3 r168": gluon(64, 64, 4, 3, 168),
    "lean 64x64 w4 s2": gluon(64, 64, 4, 2, lean=True), "lean 64x64 w4 s3": gluon(64, 64, 4, 3, lean=True),
    "lean 32x64 w4 s2 r128": gluon(32, 64, 4, 2, 128, lean=True),
}
V128 = {  # D=128
    "D 64x64 w4 s2": gluon(64, 64, 4, 2), "D 64x64 w4 s3": gluon(64, 64, 4, 3),
    "lean 64x64 w4 s2": gluon(64, 64, 4, 2, lean=True), "lean 64x64 w4 s3": gluon(64, 64, 4, 3, lean=True),
}
# checked for correctness (maxnreg changes registers, not the code): both schedules, a 3-deep ring, and 32-row query
# tiles (two diagonal tiles per key tile)
CHECK = {64: ["D 64x64 w4 s2", "D 64x64 w4 s3", "lean 64x64 w4 s2", "lean 32x64 w4 s2 r128"],
         128: ["D 64x64 w4 s2", "lean 64x64 w4 s3"]}


# ---- (a) correctness against float64 ----
def reference(q, k, v, do, causal, scale):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) * scale
    if causal:
        N = q.shape[2]
        s = s.masked_fill(torch.ones(N, N, device=dev, dtype=torch.bool).triu(1), float("-inf"))
    o64 = s.softmax(-1) @ v64
    _, dk, dv = torch.autograd.grad(o64, (q64, k64, v64), do.double())
    return dk, dv


torch.manual_seed(0)
for D in (64, 128):
    for N in (777, 1000, 4096):
        for causal in (True, False):
            B, H = 2, 4
            row = {"D": D, "N": N, "causal": causal, "B": B, "H": H,
                   # 1-D TMA needs every head's LSE/delta row 16-byte aligned: N % 4 != 0 is copied to padded rows
                   "lse_rows_padded_copy": N % 4 != 0}
            try:
                qkv = torch.randn(B, N, 3, H, D, device=dev, dtype=torch.bfloat16)
                q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
                do = torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
                scale = 1 / math.sqrt(D)
                o, lse = fa.launch_forward(q, k, v, causal, scale)
                do_, delta = fa.launch_backward_delta(do, o, lse)
                dk_ref, dv_ref = reference(q, k, v, do_, causal, scale)
                row["ref_max"] = {"dk": dk_ref.abs().max().item(), "dv": dv_ref.abs().max().item()}
                dk_t, dv_t = triton_dkdv(do_, q, k, v, lse, delta, causal, scale)
                row["triton"] = {"dk_err": (dk_t.double() - dk_ref).abs().max().item(),
                                 "dv_err": (dv_t.double() - dv_ref).abs().max().item()}
                for name in CHECK[D]:
                    try:
                        dk_g, dv_g = (V64 if D == 64 else V128)[name](do_, q, k, v, lse, delta, causal, scale)
                        torch.cuda.synchronize()
                        row[name] = {"dk_err": (dk_g.double() - dk_ref).abs().max().item(),
                                     "dv_err": (dv_g.double() - dv_ref).abs().max().item(),
                                     "dk_vs_triton": (dk_g.float() - dk_t.float()).abs().max().item(),
                                     "dv_vs_triton": (dv_g.float() - dv_t.float()).abs().max().item(),
                                     # laid out as Triton's (B, N, H, D) rows, like the model's k, v
                                     "layout_like_triton": dk_g.stride() == dk_t.stride() and
                                     dv_g.stride() == dv_t.stride()}
                    except Exception as e:  # record and go on
                        row[name] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
                        traceback.print_exc()
                del q, k, v, qkv, do, o, lse, do_, delta, dk_ref, dv_ref
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
                traceback.print_exc()
            res["checks"].append(row)
            log("check", json.dumps(row))
torch.cuda.empty_cache()


# ---- (b) timing: causal, contiguous (B, H, N, D) ----
def bench_ms(fn):
    return triton.testing.do_bench(fn, return_mode="median")


SHAPES = [(64, 4, 32, 4096), (64, 1, 32, 16384), (64, 1, 12, 131072), (128, 4, 16, 4096), (128, 1, 16, 16384)]
for D, B, H, N in SHAPES:
    entry = {"D": D, "B": B, "H": H, "N": N, "triton_cfg": str(fa.tile_config("dkdv", D, True, torch.bfloat16, N)),
             "passes": {}, "errors": {}, "max_diff_vs_triton": {}}
    try:
        q, k, v, do = (torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
        scale = 1 / math.sqrt(D)
        o, lse = fa.launch_forward(q, k, v, True, scale)
        do_, delta = fa.launch_backward_delta(do, o, lse)
        variants = {"triton": triton_dkdv, **(V64 if D == 64 else V128)}
        dk_t, dv_t = triton_dkdv(do_, q, k, v, lse, delta, True, scale)
        for name, fn in variants.items():  # first call: compile, and compare with Triton's result
            try:
                dk_g, dv_g = fn(do_, q, k, v, lse, delta, True, scale)
                torch.cuda.synchronize()
                entry["max_diff_vs_triton"][name] = max((dk_g.float() - dk_t.float()).abs().max().item(),
                                                        (dv_g.float() - dv_t.float()).abs().max().item())
                entry["passes"][name] = []
            except Exception as e:
                entry["errors"][name] = f"{type(e).__name__}: {str(e)[:600]}"
                log("FAIL", D, B, H, N, name, entry["errors"][name][:300])
        del dk_t, dv_t
        for p in range(3):  # interleaved passes
            for name in list(entry["passes"]):
                fn = variants[name]
                try:
                    entry["passes"][name].append(bench_ms(lambda: fn(do_, q, k, v, lse, delta, True, scale)))
                except Exception as e:
                    entry["errors"][name] = f"{type(e).__name__}: {str(e)[:600]}"
                    del entry["passes"][name]
        entry["ms"] = {name: min(ts) for name, ts in entry["passes"].items() if ts}
        q = k = v = do = o = lse = do_ = delta = None
        torch.cuda.empty_cache()
    except Exception as e:
        entry["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        traceback.print_exc()
    res["timing"].append(entry)
    log("time", json.dumps({k_: entry.get(k_) for k_ in ("D", "B", "H", "N", "ms", "errors")}))

res["elapsed_s"] = time.time() - T0
with open(os.path.join(OUT, "gluon.json"), "w") as f:
    json.dump(res, f, indent=1)

# ---- compact tables ----
print("\ncorrectness: max |err| vs float64 (dK / dV), and max |Gluon - Triton| (dK / dV)")
for r in res["checks"]:
    head = f"D={r['D']:3d} N={r['N']:5d} {'causal' if r['causal'] else 'full  '}"
    if "error" in r:
        print(head, "ERROR", r["error"][:200]); continue
    parts = [f"triton {r['triton']['dk_err']:.2e}/{r['triton']['dv_err']:.2e}"]
    for name in CHECK[r["D"]]:
        x = r.get(name, {})
        parts.append(f"{name}: " + (f"ERROR {x['error'][:80]}" if "error" in x else
                                    f"{x['dk_err']:.2e}/{x['dv_err']:.2e} diff {x['dk_vs_triton']:.1e}/"
                                    f"{x['dv_vs_triton']:.1e}{'' if x['layout_like_triton'] else ' LAYOUT!'}"))
    print(head, " | ".join(parts))
print("\ndK/dV ms (causal, bf16; min of 3 passes of do_bench medians; ratio = Triton / variant)")
for e in res["timing"]:
    print(f"D={e['D']} B={e['B']} H={e['H']} N={e['N']}  (triton cfg {e['triton_cfg']})")
    if "error" in e:
        print("   ERROR", e["error"][:200]); continue
    tt = e["ms"].get("triton")
    for name, ms in e["ms"].items():
        ratio = f"{tt / ms:.3f}" if tt else "-"
        print(f"   {name:24s} {ms:9.3f}  {ratio}  (max diff vs Triton {e['max_diff_vs_triton'].get(name, float('nan')):.1e})")
    for name, err in e["errors"].items():
        print(f"   {name:24s} ERROR {err[:150]}")
print(f"\nwrote {os.path.join(OUT, 'gluon.json')} in {res['elapsed_s']:.0f} s")

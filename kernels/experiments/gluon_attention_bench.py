"""GPU: the Gluon backward kernels (.scratch/gluon_bwd.py) against our Triton ones and cuDNN: correctness, then
per-kernel times and backward TFLOP/s at B·N = 16K, H·D = 2048, bf16 causal, the model's (B, N, H, D) layout."""
import json, math, os, sys, time
import torch
import torch.nn.functional as F
import triton
sys.path.insert(0, os.path.dirname(__file__))
import gluon_bwd as G
import fa_head as fa

OUT = os.environ.get("OUT", "/tmp")
dev = "cuda"
res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__, "rows": [],
       "checks": []}


def qkv(B, N, H, D, dtype=torch.bfloat16):
    return [torch.randn(B, N, H, D, device=dev, dtype=dtype).transpose(1, 2) for _ in range(4)]


def bench(fn, reps=30):
    return triton.testing.do_bench(fn, warmup=10, rep=reps * 5) if False else _t(fn)


def _t(fn, warm=5, reps=20):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); fn(); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


# ---- correctness against the Triton kernels and float64 ----
for (B, N, H, D, causal) in [(2, 1000, 3, 64, True), (2, 777, 2, 64, False)]:
    try:
        q, k, v, do = qkv(B, N, H, D)
        scale = 1 / math.sqrt(D)
        o, lse = fa.launch_forward(q, k, v, causal, scale)
        do_, delta = fa.launch_backward_delta(do, o, lse)
        dk_t, dv_t = fa.launch_backward_dkdv(do_, q, k, v, lse, delta, causal, scale)
        dq_t = fa.launch_backward_dq(do_, q, k, v, lse, delta, causal, scale)
        dk_g, dv_g = G.gluon_dkdv(do_, q, k, v, lse, delta, causal, scale)
        dq_g = G.gluon_dq(do_, q, k, v, lse, delta, causal, scale)
        torch.cuda.synchronize()
        # float64 reference
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        s = q64 @ k64.transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(torch.ones(N, N, device=dev, dtype=torch.bool).triu(1), float("-inf"))
        o64 = s.softmax(-1) @ v64
        g = torch.autograd.grad(o64, (q64, k64, v64), do.double())
        row = {"shape": [B, N, H, D, causal]}
        for name, mine, trit, ref in (("dq", dq_g, dq_t, g[0]), ("dk", dk_g, dk_t, g[1]), ("dv", dv_g, dv_t, g[2])):
            den = ref.abs().max().item()
            row[name] = {"gluon": (mine.double() - ref).abs().max().item() / den,
                         "triton": (trit.double() - ref).abs().max().item() / den}
        res["checks"].append(row)
        print("check", row, flush=True)
    except Exception as e:  # report and go on
        print("check FAIL", (B, N, H, D, causal), type(e).__name__, str(e)[:800], flush=True)
        res["checks"].append({"shape": [B, N, H, D, causal], "error": str(e)[:800]})

# ---- speed ----
DK_CFGS = [(64, 64, 4, 2), (32, 64, 4, 2), (32, 64, 4, 3), (32, 64, 4, 4), (64, 64, 4, 2, 168), (64, 64, 4, 2, 200), (32, 64, 4, 3, 168)]
DQ_CFGS = [(64, 64, 4, 2)]
for D in (64,):
    for N in (1024, 4096, 8192, 16384):
        B, H = 16384 // N, 2048 // D
        q, k, v, do = qkv(B, N, H, D)
        scale = 1 / math.sqrt(D)
        flops_bwd = 2.5 * 4 * B * H * N * N * D / 2
        o, lse = fa.launch_forward(q, k, v, True, scale)
        do_, delta = fa.launch_backward_delta(do, o, lse)
        row = {"D": D, "N": N}
        row["delta_ms"] = _t(lambda: fa.launch_backward_delta(do, o, lse))
        row["triton_dkdv_ms"] = _t(lambda: fa.launch_backward_dkdv(do_, q, k, v, lse, delta, True, scale))
        row["triton_dq_ms"] = _t(lambda: fa.launch_backward_dq(do_, q, k, v, lse, delta, True, scale))
        for c in DK_CFGS:
            try:
                row[f"gluon_dkdv_{c}"] = _t(lambda: G.gluon_dkdv(do_, q, k, v, lse, delta, True, scale, *c))
            except Exception as e:
                row[f"gluon_dkdv_{c}"] = None; print("dkdv fail", c, str(e)[:300])
        for c in DQ_CFGS:
            try:
                row[f"gluon_dq_{c}"] = _t(lambda: G.gluon_dq(do_, q, k, v, lse, delta, True, scale, *c))
            except Exception as e:
                row[f"gluon_dq_{c}"] = None; print("dq fail", c, str(e)[:300])
        # cuDNN: fwd+bwd minus fwd (autograd), same layout
        qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
        from torch.nn.attention import sdpa_kernel, SDPBackend
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            fwd = _t(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            fb = _t(lambda: torch.autograd.grad(F.scaled_dot_product_attention(qr, kr, vr, is_causal=True), (qr, kr, vr), do))
        row["cudnn_bwd_ms"] = fb - fwd
        ours_fwd = _t(lambda: fa.launch_forward(q, k, v, True, scale))
        row["ours_fwd_ms"], row["cudnn_fwd_ms"] = ours_fwd, fwd
        best_dk = min(v_ for k_, v_ in row.items() if k_.startswith("gluon_dkdv") and v_)
        best_dq = min(v_ for k_, v_ in row.items() if k_.startswith("gluon_dq") and v_)
        tri = row["delta_ms"] + row["triton_dkdv_ms"] + row["triton_dq_ms"]
        glu = row["delta_ms"] + best_dk + best_dq
        row["bwd_tflops"] = {"triton": flops_bwd / tri / 1e9, "gluon": flops_bwd / glu / 1e9,
                             "cudnn": flops_bwd / row["cudnn_bwd_ms"] / 1e9}
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, do, qr, kr, vr

json.dump(res, open(os.path.join(OUT, "gbench.json"), "w"), indent=1)
print("\nD N | bwd TFLOP/s triton / gluon / cudnn | dkdv ms triton / best gluon | dq ms triton / best gluon")
for r in res["rows"]:
    bd = min(v_ for k_, v_ in r.items() if k_.startswith("gluon_dkdv") and v_)
    bq = min(v_ for k_, v_ in r.items() if k_.startswith("gluon_dq") and v_)
    t = r["bwd_tflops"]
    print(f"{r['D']} {r['N']} | {t['triton']:.0f} / {t['gluon']:.0f} / {t['cudnn']:.0f} | "
          f"{r['triton_dkdv_ms']:.3f} / {bd:.3f} | {r['triton_dq_ms']:.3f} / {bq:.3f}")

# ---- the forward (gfwd.py) ----
# """GPU: the Gluon forward (.scratch/gluon_bwd.py) against our Triton forward and cuDNN (bf16 causal, B·N = 16K)."""
# import json, math, os, sys
# import torch, triton
# import torch.nn.functional as F
# sys.path.insert(0, os.path.dirname(__file__))
# import gluon_bwd as G
# import fa_head as fa
# from gbench_util import t_ms
# dev = "cuda"
# out = {"rows": [], "checks": []}
# for (B, N, H, D, causal) in [(2, 1000, 3, 64, True), (1, 4096, 4, 64, True), (2, 777, 2, 64, False), (1, 333, 2, 64, True)]:
#     q, k, v = [torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
#     sc = 1 / math.sqrt(D)
#     o_g, l_g = G.gluon_fwd(q, k, v, causal, sc)
#     o_t, l_t = fa.launch_forward(q, k, v, causal, sc)
#     ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
#     r = {"shape": [B, N, H, D, causal], "o_gluon": ((o_g.double() - ref).abs().max() / ref.abs().max()).item(),
#          "o_triton": ((o_t.double() - ref).abs().max() / ref.abs().max()).item(),
#          "lse_diff": (l_g - l_t).abs().max().item()}
#     out["checks"].append(r); print("check", r, flush=True)
# CFGS = [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2)]
# from torch.nn.attention import sdpa_kernel, SDPBackend
# for N in (1024, 4096, 8192, 16384):
#     B, H, D = 16384 // N, 32, 64
#     q, k, v = [torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
#     sc = 1 / math.sqrt(D)
#     fl = 4 * B * H * N * N * D / 2
#     row = {"N": N, "triton": t_ms(lambda: fa.launch_forward(q, k, v, True, sc))}
#     for c in CFGS:
#         try:
#             row[str(c)] = t_ms(lambda: G.gluon_fwd(q, k, v, True, sc, *c))
#         except Exception as e:
#             print("fail", c, str(e)[:300]); row[str(c)] = None
#     with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
#         row["cudnn"] = t_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
#     best = min(x for kk, x in row.items() if kk.startswith("(") and x)
#     row["tflops"] = {"triton": fl / row["triton"] / 1e9, "gluon": fl / best / 1e9, "cudnn": fl / row["cudnn"] / 1e9}
#     out["rows"].append(row); print(json.dumps(row), flush=True)
# json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "gfwd.json"), "w"), indent=1)
# print("N | fwd TFLOP/s triton / gluon / cudnn")
# for r in out["rows"]:
#     t = r["tflops"]; print(f"{r['N']} | {t['triton']:.0f} / {t['gluon']:.0f} / {t['cudnn']:.0f}")

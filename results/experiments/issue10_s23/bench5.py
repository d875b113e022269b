"""Issue 10, session 23: the fused 5-matmul backward (fused5.py) against float64, against our current backward, and
timed next to it and cuDNN's backward (bf16, causal, D=64). `check` | `time [long]`."""
import importlib, importlib.util, json, math, os, sys
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

fa = importlib.import_module("minigpt_kernels.flash_attention")

spec = importlib.util.spec_from_file_location("fused5", os.path.join(os.path.dirname(__file__), "fused5.py"))
F5 = importlib.util.module_from_spec(spec); spec.loader.exec_module(F5)
MODE = sys.argv[1]
OUT = os.environ.get("OUT", "/tmp")
R = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("MINIGPT_COMMIT")},
     "checks": [], "times": []}
B208 = dict(cregs=208, dqregs=88)
VARIANTS = {"f208": B208, "f208_pipe": dict(B208, pipe=True), "f208_q3": dict(B208, dq_bufs=3),
            "f208_pipe_q3": dict(B208, pipe=True, dq_bufs=3), "f208_ds3_q3": dict(B208, ds_bufs=3, dq_bufs=3),
            "f208_s4_pipe": dict(B208, stages=4, pipe=True), "f208_noreduce": dict(B208, reduce=False)}
ONLY = os.environ.get("ONLY")
if ONLY:
    VARIANTS = {n: v for n, v in VARIANTS.items() if n in ONLY.split(",")}


def inputs(B, H, N, D, dtype, model_layout):
    if model_layout:
        return [torch.randn(B, N, H, D, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(4)]
    return [torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(4)]


def ours(do, q, k, v, o, lse, sm):
    return fa.launch_backward(do, q, k, v, o, lse, True, sm)


def ours_spec_dkdv(do, q, k, v, o, lse, sm):  # the current backward with P's dK/dV kernel forced (bitwise reference)
    cfg = fa._SPECIALIZED_FROM_SEQ[("dkdv", 64)][1]
    return fa.launch_backward(do, q, k, v, o, lse, True, sm, dkdv_cfg=cfg)


if MODE == "check":
    torch.manual_seed(0)
    for B, H, N, dtype, ml in [(1, 1, 65, torch.bfloat16, False), (2, 3, 1000, torch.bfloat16, True),
                               (1, 2, 777, torch.float16, False), (1, 2, 4100, torch.bfloat16, False),
                               (1, 2, 1999, torch.float16, True), (1, 1, 1, torch.bfloat16, False),
                               (2, 2, 3000, torch.bfloat16, True), (1, 4, 8192, torch.bfloat16, True),
                               (1, 1, 128, torch.bfloat16, False), (1, 1, 193, torch.bfloat16, True)]:
        D = 64
        q, k, v, do = inputs(B, H, N, D, dtype, ml)
        sm = 1 / math.sqrt(D)
        o, lse = fa.launch_forward(q, k, v, True, sm)
        dq_r, dk_r, dv_r = ours_spec_dkdv(do, q, k, v, o, lse, sm)
        base = dict(B=B, H=H, N=N, dtype=str(dtype), model_layout=ml)
        if N <= 4100:
            qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
            s = (qd @ kd.transpose(-1, -2)) * sm
            s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool, device="cuda").tril(), float("-inf"))
            (torch.softmax(s, -1) @ vd).backward(do.double())
            ref = (qd.grad, kd.grad, vd.grad)
            base.update(ours_err=[(x.double() - r).abs().max().item() for x, r in zip((dq_r, dk_r, dv_r), ref)])
        for name, kw in VARIANTS.items():
            if not kw.get("reduce", True):
                continue
            dq, dk, dv = F5.backward5(do, q, k, v, o, lse, sm, **kw)
            torch.cuda.synchronize()
            e = dict(base, variant=name, dq_vs_ours=(dq.float() - dq_r.float()).abs().max().item(),
                     dk_vs_ours=(dk.float() - dk_r.float()).abs().max().item(),
                     dv_vs_ours=(dv.float() - dv_r.float()).abs().max().item())
            if N <= 4100:
                e["err"] = [(x.double() - r).abs().max().item() for x, r in zip((dq, dk, dv), ref)]
            R["checks"].append(e); print(e, flush=True)
        del q, k, v, do
    json.dump(R, open(f"{OUT}/fused5_check.json", "w"), indent=1)
    sys.exit()

SHAPES = [(16, 32, 1024), (8, 32, 2048), (4, 32, 4096), (2, 32, 8192), (1, 32, 16384)]
if sys.argv[2:] == ["long"]:
    SHAPES = [(1, 12, 32768), (1, 12, 131072)]
best = {}
for p in range(2):
    for B, H, N in SHAPES:
        D = 64
        q, k, v, do = inputs(B, H, N, D, torch.bfloat16, True)
        sm = 1 / math.sqrt(D)
        o, lse = fa.launch_forward(q, k, v, True, sm)
        fns = {"ours": lambda: ours(do, q, k, v, o, lse, sm)}
        for name, kw in VARIANTS.items():
            fns[name] = (lambda kw=kw: F5.backward5(do, q, k, v, o, lse, sm, **kw))
        if N <= 16384:
            qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
            fns["cudnn"] = lambda: torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)
        for name, f in fns.items():
            ms = do_bench(f, warmup=10, rep=100, return_mode="median")
            best[(N, name)] = min(best.get((N, name), float("inf")), ms)
            R["times"].append(dict(N=N, B=B, H=H, variant=name, pass_=p, ms=ms))
        del q, k, v, do, o, lse, fns
        json.dump(R, open(f"{OUT}/fused5_time{'_long' if sys.argv[2:] else ''}.json", "w"), indent=1)

print("\nbackward ms (D=64, bf16 causal), min of 2 passes")
for B, H, N in SHAPES:
    names = [n for (m, n) in best if m == N]
    print(N, B, H, "  ".join(f"{n}={best[(N, n)]:.3f}" for n in names))

"""Issue 10, session 22: the ping-pong dQ kernel (gluon_backward_ws.py here; kernels/flash_backward_specialized.py now) against float64 and the Triton
dQ kernel (both also write delta), then timed next to it (bf16, causal). `check` | `time [long|short]`; `short`: D=128 at
1K-4K, a second machine (dq_time_short_d128.json)."""
import importlib, importlib.util, json, math, os, sys
import torch
from triton.testing import do_bench
import triton

fa = importlib.import_module("minigpt_kernels.flash_attention")
_spec = importlib.util.spec_from_file_location(
    "gluon_backward_ws", os.path.join(os.path.dirname(os.path.abspath(__file__)), "gluon_backward_ws.py"))
bp = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(bp)  # the kernels as they ran (TURNS, OVERLAP)
MODE = sys.argv[1]
OUT = os.environ.get("OUT", "/tmp")
R = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("MINIGPT_COMMIT")},
     "checks": [], "times": []}
# (consumers, block_n, stages, turns, overlap)
CFGS = {64: {"c2n128s3_ov": (2, 128, 3, 1, 1), "c2n128s3_free_ov": (2, 128, 3, 0, 1), "c2n64s3_ov": (2, 64, 3, 1, 1),
             "c3n64s3_free_ov": (3, 64, 3, 0, 1)},
        128: {"c2n64s3_ov": (2, 64, 3, 1, 1), "c2n64s3_free_ov": (2, 64, 3, 0, 1)}}


def pp_dq(do, q, k, v, o, lse, cfg):
    c, bn, st, turns, ov = cfg
    D = q.shape[-1]
    dq = fa._empty_in_layout_of(q)
    delta = torch.empty_like(lse)
    triton.set_allocator(fa._tma_scratch)
    bp.launch_dq_pingpong(do, q, k, v, o, lse, lse.stride(1), delta, delta.stride(1), dq, 1 / math.sqrt(D),
                          fa.LOG2E / math.sqrt(D), c, bn, st, turns=bool(turns), overlap=bool(ov))
    return dq, delta


def inputs(B, H, N, D, dtype, model_layout=False):
    if model_layout:
        return [torch.randn(B, N, H, D, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(4)]
    return [torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(4)]


if MODE == "check":
    torch.manual_seed(0)
    for B, H, N, D, dtype, ml in [(1, 1, 65, 64, torch.bfloat16, False), (1, 1, 128, 128, torch.bfloat16, False),
                                  (2, 3, 1000, 64, torch.bfloat16, True), (1, 2, 777, 128, torch.float16, False),
                                  (1, 2, 4100, 64, torch.bfloat16, False), (2, 2, 2048, 128, torch.bfloat16, True),
                                  (1, 2, 1999, 64, torch.float16, True), (1, 1, 1, 64, torch.bfloat16, False),
                                  (1, 2, 4096, 128, torch.bfloat16, False), (2, 2, 3000, 64, torch.bfloat16, True)]:
        q, k, v, do = inputs(B, H, N, D, dtype, ml)
        sm = 1 / math.sqrt(D)
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        s = (qd @ kd.transpose(-1, -2)) * sm
        s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool, device="cuda").tril(), float("-inf"))
        (torch.softmax(s, -1) @ vd).backward(do.double())
        o, lse = fa.launch_forward(q, k, v, True, sm)
        do_c = do.contiguous() if do.stride(-1) != 1 else do
        delta_t = torch.empty_like(lse)
        dq_t = fa.launch_backward_dq(do_c, q, k, v, lse, delta_t, True, sm, o=o)
        base = dict(B=B, H=H, N=N, D=D, dtype=str(dtype), model_layout=ml,
                    triton_dq_err=(dq_t.double() - qd.grad).abs().max().item())
        for name, cfg in CFGS[D].items():
            dq, delta = pp_dq(do_c, q, k, v, o, lse, cfg)
            torch.cuda.synchronize()
            e = dict(base, cfg=name, dq_err=(dq.double() - qd.grad).abs().max().item(),
                     dq_vs_triton=(dq - dq_t).abs().max().item(), delta_vs_triton=(delta - delta_t).abs().max().item())
            R["checks"].append(e); print(e, flush=True)
    json.dump(R, open(f"{OUT}/dq_check.json", "w"), indent=1)
    sys.exit()

SHAPES = {64: [(16, 32, 1024), (4, 32, 4096), (2, 32, 8192), (1, 32, 16384)], 128: [(4, 16, 4096), (1, 16, 16384)]}
if sys.argv[2:] == ["long"]:
    SHAPES = {64: [(1, 12, 131072)], 128: [(1, 16, 32768)]}
if sys.argv[2:] == ["short"]:
    SHAPES = {64: [], 128: [(16, 16, 1024), (8, 16, 2048), (4, 16, 4096)]}
    CFGS[128] = {"c2n64s3_free_ov": (2, 64, 3, 0, 1), "c2n64s2_free_ov": (2, 64, 2, 0, 1)}
best = {}
for p in range(2):
    for D, shapes in SHAPES.items():
        for B, H, N in shapes:
            q, k, v, do = inputs(B, H, N, D, torch.bfloat16, True)
            sm = 1 / math.sqrt(D)
            o, lse = fa.launch_forward(q, k, v, True, sm)
            do_c = do.contiguous()
            delta_t = torch.empty_like(lse)
            for name in ["triton"] + list(CFGS[D]):
                if name == "triton":
                    f = lambda: fa.launch_backward_dq(do_c, q, k, v, lse, delta_t, True, sm, o=o)
                else:
                    f = lambda: pp_dq(do_c, q, k, v, o, lse, CFGS[D][name])
                ms = do_bench(f, warmup=10, rep=100, return_mode="median")
                best[(D, N, name)] = min(best.get((D, N, name), float("inf")), ms)
                R["times"].append(dict(D=D, N=N, B=B, H=H, cfg=name, pass_=p, ms=ms))
            del q, k, v, do, o, lse, do_c
            json.dump(R, open(f"{OUT}/dq_time{'_' + sys.argv[2] if sys.argv[2:] else ''}.json", "w"), indent=1)

print("\ndQ kernel ms, min of 2 passes")
for D, shapes in SHAPES.items():
    for B, H, N in shapes:
        print(D, N, B, H, "  ".join(f"{n}={best[(D, N, n)]:.3f}" for n in ["triton"] + list(CFGS[D])))

"""Issue 10, session 22: the warp-specialized dK/dV kernel (gluon_backward_ws.py here; kernels/flash_backward_specialized.py
now) against float64 and the Triton dK/dV kernel, then timed next to it (bf16, causal).
`check [ss]`: correctness only (run under `timeout`); `time [long] [ss]`. The configurations below are the third run's
(dkdv_*_run2.json); runs 0 and 1 timed the variants with turns and without overlap (their JSON names them).
`ss`: the variant with Pᵀ/dSᵀ through shared memory (smem_operands/; first `patch -o smem_operands/ws6.py
gluon_backward_ws.py smem_operands/ws6.patch`) next to the register version."""
import importlib, importlib.util, json, math, os, sys
import torch
from triton.testing import do_bench
import triton

fa = importlib.import_module("minigpt_kernels.flash_attention")
HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m


SS = "ss" in sys.argv[2:]
MODS = {"rs": _load("gluon_backward_ws", os.path.join(HERE, "gluon_backward_ws.py"))}  # as they ran (TURNS, OVERLAP)
if SS:
    MODS["ss"] = _load("ws6", os.path.join(HERE, "smem_operands", "ws6.py"))
MODE = sys.argv[1]
OUT = os.environ.get("OUT", "/tmp")
R = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("MINIGPT_COMMIT")},
     "checks": [], "times": []}
# name: (module, consumers, query tile, stages, turns, overlap)
CFGS = {64: {"c2m64s3_free_ov": ("rs", 2, 64, 3, 0, 1), "c2m64s4_free_ov": ("rs", 2, 64, 4, 0, 1),
             "c3m32s3_free_ov": ("rs", 3, 32, 3, 0, 1), "c3m32s4_free_ov": ("rs", 3, 32, 4, 0, 1),
             "c3m32s4_ov": ("rs", 3, 32, 4, 1, 1)},
        128: {"c2m32s3_free_ov": ("rs", 2, 32, 3, 0, 1), "c2m32s4_free_ov": ("rs", 2, 32, 4, 0, 1)}}
if SS:  # smem_operands/*.json
    CFGS = {64: {"rs_c2m64s3": ("rs", 2, 64, 3, 0, 1), "ss_c2m64s3": ("ss", 2, 64, 3, 0, 1),
                 "ss_c3m64s2": ("ss", 3, 64, 2, 0, 1), "ss_c3m64s3": ("ss", 3, 64, 3, 0, 1)},
            128: {"rs_c2m32s3": ("rs", 2, 32, 3, 0, 1), "ss_c2m64s2": ("ss", 2, 64, 2, 0, 1)}}
CFGS = {d: {n: c for n, c in v.items() if not os.environ.get("ONLY") or n in os.environ["ONLY"].split(",")}
        for d, v in CFGS.items()}


def pp_dkdv(do, q, k, v, lse, delta, cfg):
    mod, c, bm, st, turns, ov = cfg
    bp = MODS[mod]
    D = q.shape[-1]
    dk, dv = fa._empty_in_layout_of(k), fa._empty_in_layout_of(v)
    (lse, sl), (delta, sd) = fa._rows_for_tma(lse, lse.stride(1)), fa._rows_for_tma(delta, delta.stride(1))
    triton.set_allocator(fa._tma_scratch)
    bp.launch_dkdv_pingpong(do, q, k, v, lse, sl, delta, sd, dk, dv, 1 / math.sqrt(D), fa.LOG2E / math.sqrt(D), c, bm,
                            st, turns=bool(turns), overlap=bool(ov))
    return dk, dv


def inputs(B, H, N, D, dtype, model_layout=False):
    if model_layout:  # (B, N, H, D) rows, as the model's q/k/v views
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
        do_c, delta = fa.launch_backward_delta(do, o, lse)
        dk_t, dv_t = fa.launch_backward_dkdv(do_c, q, k, v, lse, delta, True, sm)
        base = dict(B=B, H=H, N=N, D=D, dtype=str(dtype), model_layout=ml,
                    triton_dk_err=(dk_t.double() - kd.grad).abs().max().item(),
                    triton_dv_err=(dv_t.double() - vd.grad).abs().max().item())
        for name, cfg in CFGS[D].items():
            dk, dv = pp_dkdv(do_c, q, k, v, lse, delta, cfg)
            torch.cuda.synchronize()
            e = dict(base, cfg=name, dk_err=(dk.double() - kd.grad).abs().max().item(),
                     dv_err=(dv.double() - vd.grad).abs().max().item(),
                     dk_vs_triton=(dk - dk_t).abs().max().item(), dv_vs_triton=(dv - dv_t).abs().max().item())
            R["checks"].append(e); print(e, flush=True)
    json.dump(R, open(f"{OUT}/dkdv_check.json", "w"), indent=1)
    sys.exit()

SHAPES = {64: [(16, 32, 1024), (4, 32, 4096), (2, 32, 8192), (1, 32, 16384)],
          128: [(8, 16, 2048)] * SS + [(4, 16, 4096), (1, 16, 16384)]}
if "long" in sys.argv[2:]:
    SHAPES = {64: [(1, 12, 131072)], 128: [(1, 16, 32768)]}
best = {}
for p in range(2):
    for D, shapes in SHAPES.items():
        for B, H, N in shapes:
            q, k, v, do = inputs(B, H, N, D, torch.bfloat16, True)
            sm = 1 / math.sqrt(D)
            o, lse = fa.launch_forward(q, k, v, True, sm)
            do_c, delta = fa.launch_backward_delta(do, o, lse)
            fl = 2.5 * 4 * B * H * N * N * D / 2 * (4 / 7)  # the dK/dV kernel's 4 of the backward's 7 matmuls... by convention
            for name in ["triton"] + list(CFGS[D]):
                if name == "triton":
                    f = lambda: fa.launch_backward_dkdv(do_c, q, k, v, lse, delta, True, sm)
                else:
                    f = lambda: pp_dkdv(do_c, q, k, v, lse, delta, CFGS[D][name])
                ms = do_bench(f, warmup=10, rep=100, return_mode="median")
                best[(D, N, name)] = min(best.get((D, N, name), float("inf")), ms)
                R["times"].append(dict(D=D, N=N, B=B, H=H, cfg=name, pass_=p, ms=ms))
            del q, k, v, do, o, lse, do_c, delta
            json.dump(R, open(f"{OUT}/dkdv_time{'_long' if 'long' in sys.argv[2:] else ''}.json", "w"), indent=1)

print("\ndK/dV kernel ms, min of 2 passes")
for D, shapes in SHAPES.items():
    for B, H, N in shapes:
        names = ["triton"] + list(CFGS[D])
        print(D, N, B, H, "  ".join(f"{n}={best[(D, N, n)]:.3f}" for n in names))

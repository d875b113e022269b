"""Issue 10, session 21, experiment O on the GPU: the ping-pong Gluon forward (gluon_pingpong.py) against float64 and
the Triton forward, then timed next to the Triton forward and cuDNN in one process (bf16, causal, B·N = 16K).
`check` mode: correctness only (run under `timeout`: a barrier protocol bug hangs). Writes $OUT/pingpong_<mode>.json."""
import importlib, importlib.util, json, math, os, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("gluon_pingpong", os.path.join(here, "gluon_pingpong.py"))
pp = importlib.util.module_from_spec(spec); sys.modules["gluon_pingpong"] = pp; spec.loader.exec_module(pp)
fa = importlib.import_module("minigpt_kernels.flash_attention")
MODE = sys.argv[1]
OUT = os.environ.get("OUT", "/tmp")
R = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("MINIGPT_COMMIT")},
     "checks": [], "times": []}
# name: (consumers, block_n, stages, consumer_regs, producer_regs)
CFGS = {64: {"c2n128s2": (2, 128, 2, 232, 24), "c2n128s3": (2, 128, 3, 232, 24), "c3n128s2": (3, 128, 2, 160, 24),
             "c2n128s2ov": (2, 128, 2, 232, 24, True), "c3n128s3": (3, 128, 3, 160, 24)},
        128: {"c2n128s2": (2, 128, 2, 232, 24), "c2n64s3": (2, 64, 3, 232, 24), "c2n64s3ov": (2, 64, 3, 232, 24, True)}}


def run(name, D, q, k, v):
    c, bn, st, cr, pr, *ov = CFGS[D][name]
    return pp.pingpong_fwd(q, k, v, 1 / math.sqrt(D), consumers=c, block_n=bn, stages=st, consumer_regs=cr,
                           producer_regs=pr, overlap=bool(ov))


if MODE == "check":
    torch.manual_seed(0)
    for B, H, N, D in [(1, 1, 65, 64), (1, 1, 128, 128), (2, 3, 1000, 64), (1, 2, 777, 128), (1, 2, 4100, 64),
                       (2, 2, 2048, 128), (1, 2, 1999, 64)]:
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
        s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool, device="cuda").tril(), float("-inf"))
        o_ref, l_ref = torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1) / math.log(2)
        o_t, l_t = fa.launch_forward(q, k, v, True, 1 / math.sqrt(D))
        base = dict(B=B, H=H, N=N, D=D, triton_o_err=(o_t.double() - o_ref).abs().max().item())
        for name in CFGS[D]:
            o, l = run(name, D, q, k, v)
            torch.cuda.synchronize()
            e = dict(base, cfg=name, o_err=(o.double() - o_ref).abs().max().item(),
                     o_mean=(o.double() - o_ref).abs().mean().item(),
                     lse_err=(l.double() - l_ref).abs().max().item(), vs_triton=(o - o_t).abs().max().item())
            R["checks"].append(e); print(e, flush=True)
    json.dump(R, open(f"{OUT}/pingpong_check.json", "w"), indent=1)
    sys.exit()

SHAPES = {64: [(16, 32, 1024), (8, 32, 2048), (4, 32, 4096), (2, 32, 8192), (1, 32, 16384)],
          128: [(16, 16, 1024), (8, 16, 2048), (4, 16, 4096), (2, 16, 8192), (1, 16, 16384)]}
if MODE == "long":
    SHAPES = {64: [(2, 32, 8192), (1, 12, 131072)], 128: [(2, 16, 8192), (1, 16, 32768)]}
best = {}
for p in range(2):
    for D, shapes in SHAPES.items():
        for B, H, N in shapes:
            q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            fl = 4 * B * H * N * N * D / 2
            for name in ["triton", "cudnn"] + list(CFGS[D]):
                if name == "cudnn":
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), warmup=10,
                                      rep=100, return_mode="median")
                elif name == "triton":
                    ms = do_bench(lambda: fa.launch_forward(q, k, v, True, 1 / math.sqrt(D)), warmup=10, rep=100,
                                  return_mode="median")
                else:
                    ms = do_bench(lambda: run(name, D, q, k, v), warmup=10, rep=100, return_mode="median")
                best[(D, N, name)] = min(best.get((D, N, name), float("inf")), ms)
                R["times"].append(dict(D=D, N=N, B=B, H=H, cfg=name, pass_=p, ms=ms, tflops=fl / ms * 1e-9))
            del q, k, v
            json.dump(R, open(f"{OUT}/pingpong_{MODE}.json", "w"), indent=1)

print("\nforward, min of 2 passes: ms (TFLOP/s)")
for D, shapes in SHAPES.items():
    for B, H, N in shapes:
        fl = 4 * B * H * N * N * D / 2
        names = ["triton", "cudnn"] + list(CFGS[D])
        print(D, N, "  ".join(f"{n}={best[(D, N, n)]:.3f}({fl / best[(D, N, n)] * 1e-9:.0f})" for n in names))

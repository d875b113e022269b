"""kernels/NOTES.md next step 2: head_dim 128 at 1K tokens (bench shape: 16 × 16 heads × 1024, bf16, causal), where
forward+backward sits at 0.85-0.86× cuDNN. Where does the gap live, and does a tile choice made for 1K close it?
1. fwd+bwd ms for ours and cuDNN (do_bench, 3 interleaved rounds), and the host's enqueue time per call;
2. GPU time per kernel (torch.profiler) of one fwd+bwd, ours and cuDNN;
3. forward candidates (Gluon persistent / plain, Triton tiles), whole-backward candidates (seven-matmul with other
   dK/dV and dQ tiles, the Gluon dQ kernel, the five-matmul split kernel), each checked against the default's output.
Prints a table last; JSON under $OUT."""
import importlib, json, os, time
from collections import defaultdict

import torch
import triton
from triton.testing import do_bench

from minigpt.attention import get_attention
fa = importlib.import_module("minigpt_kernels.flash_attention")

triton.set_allocator(fa._tma_scratch)
B, H, N, D = 16, 16, 1024, 128
TC = fa.TileConfig
torch.manual_seed(0)
q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
flash, cudnn = get_attention("flash"), get_attention("sdpa", sdpa_backend="cudnn")
res = {"shape": [B, H, N, D]}


def fwd_bwd(fn):
    return lambda: torch.autograd.grad(fn(q, k, v, causal=True), (q, k, v), do)


# 1. whole fwd+bwd, and host time per call (enqueue 200 calls without syncing; the GPU may lag behind)
ms = defaultdict(list)
for _ in range(3):
    for name, fn in (("flash", flash), ("cudnn", cudnn)):
        ms[name].append(do_bench(fwd_bwd(fn), warmup=25, rep=200, return_mode="median"))
res["fwd_bwd_ms"] = dict(ms)
host = {}
for name, fn in (("flash", flash), ("cudnn", cudnn)):
    f = fwd_bwd(fn)
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    host[name] = {"enqueue_ms": (t1 - t0) / 200 * 1e3, "wall_ms": (t2 - t0) / 200 * 1e3}
res["host"] = host
print(res, flush=True)

# 2. GPU time per kernel, 20 calls each
prof = {}
for name, fn in (("flash", flash), ("cudnn", cudnn)):
    f = fwd_bwd(fn)
    f()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(20):
            f()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for e in p.key_averages():
        if e.device_time_total > 0:
            per[e.key[:70]] += e.device_time_total / 20 / 1e3  # ms per call
    prof[name] = dict(sorted(per.items(), key=lambda kv: -kv[1]))
    print(name, {k_: round(v_, 4) for k_, v_ in prof[name].items()}, flush=True)
res["profile_ms_per_call"] = prof

# 3. candidates, each against the default launch's result
scale = D ** -0.5
qd, kd, vd = q.detach(), k.detach(), v.detach()
o_ref, lse_ref = fa.launch_forward(qd, kd, vd, True, scale)
grads_ref = fa.launch_backward(do, qd, kd, vd, o_ref, lse_ref, True, scale)
cands = []


def add(kind, label, fn, check):
    try:
        out = fn()
        err = check(out)
        t = min(do_bench(fn, warmup=25, rep=200, return_mode="median") for _ in range(2))
    except Exception as e:  # noqa: BLE001 - shared memory etc.: record and go on
        t, err = None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    cands.append({"kind": kind, "label": label, "ms": t, "check": err})
    print(cands[-1], flush=True)


def fwd_check(out):
    return float((out[0].float() - o_ref.float()).abs().max())


def bwd_check(out):
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(out, grads_ref))


fwd_cfgs = {
    "default": None,
    "gluon persistent 128x128 s3": TC(128, 128, 4, 3, tma=True, specialized=True, persistent=True),
    "gluon persistent 128x128 s2": TC(128, 128, 4, 2, tma=True, specialized=True, persistent=True),
    "gluon persistent 128x64 s3": TC(128, 64, 4, 3, tma=True, specialized=True, persistent=True),
    "gluon plain 128x128 s3": TC(128, 128, 4, 3, tma=True, specialized=True),
    "triton 64x64/4 s3": TC(64, 64, 4, 3, tma=True),
    "triton 128x64/8 s3": TC(128, 64, 8, 3, tma=True),
}
for label, c in fwd_cfgs.items():
    add("fwd", label, lambda c=c: fa.launch_forward(qd, kd, vd, True, scale, cfg=c), fwd_check)

bwd = lambda **kw: (lambda: fa.launch_backward(do, qd, kd, vd, o_ref, lse_ref, True, scale, **kw))  # noqa: E731
add("bwd", "default (seven-matmul: dkdv 64x64/4 s2, dq 128x64/8 s4)", bwd(), bwd_check)
for shape in [(64, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 2), (32, 128, 4, 3), (64, 128, 4, 2),
              (128, 128, 8, 2)]:
    add("bwd", f"dkdv {shape}", bwd(dkdv_cfg=TC(*shape, tma=True)), bwd_check)
for cap in (128, 168):
    add("bwd", f"dkdv (64,64,4,2) maxnreg {cap}", bwd(dkdv_cfg=TC(64, 64, 4, 2, tma=True, maxnreg=cap)), bwd_check)
for shape in [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (128, 32, 8, 3), (64, 32, 4, 3), (128, 128, 8, 2)]:
    add("bwd", f"dq {shape}", bwd(dq_cfg=TC(*shape, tma=True)), bwd_check)
add("bwd", "dq gluon 128x64 s3", bwd(dq_cfg=TC(128, 64, 4, 3, tma=True, specialized=True)), bwd_check)
for st, pers in ((2, False), (3, True)):
    cfg = TC(64, 128, 4, st, tma=True, specialized=True, persistent=pers)
    add("bwd", f"five-matmul split s{st}{' persistent' if pers else ''}",
        lambda cfg=cfg: fa.launch_backward_fused(do, qd, kd, vd, o_ref, lse_ref, scale, cfg), bwd_check)
res["candidates"] = cands
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "d128_1k.json"), "w"), indent=1)

print(f"\nfwd+bwd ms (min of 3): flash {min(ms['flash']):.3f}  cudnn {min(ms['cudnn']):.3f}  "
      f"ratio {min(ms['cudnn']) / min(ms['flash']):.3f}")
print("host enqueue / wall ms per call:", {k_: (round(v_['enqueue_ms'], 3), round(v_['wall_ms'], 3)) for k_, v_ in host.items()})
print("| kind | candidate | ms | max |diff| vs default |")
for c in cands:
    print(f"| {c['kind']} | {c['label']} | {c['ms'] and round(c['ms'], 4)} | {c['check']} |")

"""P packed by hand at three consumers (kernels/NOTES.md Z): the forward kernels with _p_operand's cvt.rn.bf16x2 against
the same kernels as of e4ca52f, whose third consumers compiled 32 PRMT per key tile more (persistent: all three).
The old file rides along as _old_pingpong.py (`git show e4ca52f:kernels/flash_forward_pingpong.py`, not committed).
Checks: outputs and LSE bitwise equal (same rounding, so they must be); then forward ms, interleaved, min of 3 medians."""
import importlib.util, json, math, os, sys
import torch
import triton
from triton.testing import do_bench
fa = importlib.import_module("minigpt_kernels.flash_attention")
from minigpt_kernels import flash_forward_pingpong as new

spec = importlib.util.spec_from_file_location("old_pingpong", os.path.join(os.path.dirname(__file__), "_old_pingpong.py"))
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
triton.set_allocator(fa._tma_scratch)
LOG2E = 1.4426950408889634

# (B, H, N, D, dtype, kernel): the persistent kernel runs 3 consumers at D=64 from 8K tokens, the plain one from 16K
CASES = [(4, 12, 8192, 64, torch.bfloat16, "persistent"), (2, 32, 8192, 64, torch.bfloat16, "persistent"),
         (1, 32, 16384, 64, torch.bfloat16, "plain"), (1, 12, 32768, 64, torch.bfloat16, "plain"),
         (3, 5, 8000, 64, torch.bfloat16, "persistent"), (2, 3, 4100, 64, torch.float16, "persistent"),
         (1, 7, 1999, 64, torch.bfloat16, "plain")]


def run(mod, kind, q, k, v, scale):
    B, H, N, D = q.shape
    o, lse = torch.empty_like(q), torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    if kind == "persistent":
        mod.launch_forward_persistent(q, k, v, o, lse, scale * LOG2E, consumers=3, block_n=128, stages=3)
    else:
        mod.launch_forward_pingpong(q, k, v, o, lse, scale * LOG2E, consumers=3, block_n=128, stages=3)
    return o, lse


rows = []
for B, H, N, D, dtype, kind in CASES:
    torch.manual_seed(N)
    qkv = torch.randn(B, N, 3, H, D, device="cuda", dtype=dtype)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # the model's strides
    scale = 1 / math.sqrt(D)
    o_new, lse_new = run(new, kind, q, k, v, scale)
    o_old, lse_old = run(old, kind, q, k, v, scale)
    same = bool(torch.equal(o_new, o_old) and torch.equal(lse_new, lse_old))
    t = {"new": [], "old": []}
    if N >= 8192:
        for _ in range(3):
            for name, mod in (("old", old), ("new", new)):
                t[name].append(do_bench(lambda: run(mod, kind, q, k, v, scale), warmup=25, rep=100))
    row = {"B": B, "H": H, "N": N, "D": D, "dtype": str(dtype).removeprefix("torch."), "kernel": kind,
           "bitwise_equal": same, "old_ms": min(t["old"]) if t["old"] else None,
           "new_ms": min(t["new"]) if t["new"] else None, "all_ms": t}
    rows.append(row)
    print(row, flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "pack_ab.json"), "w"), indent=1)
print("\n| B, H, N, D, dtype | kernel | bitwise | old ms | new ms | old / new |")
for r in rows:
    ratio = f"{r['old_ms'] / r['new_ms']:.3f}" if r["new_ms"] else "-"
    old_ms = f"{r['old_ms']:.3f}" if r["old_ms"] else "-"
    new_ms = f"{r['new_ms']:.3f}" if r["new_ms"] else "-"
    print(f"| {r['B']}, {r['H']}, {r['N']}, {r['D']}, {r['dtype']} | {r['kernel']} | {r['bitwise_equal']} | {old_ms} | {new_ms} | {ratio} |")

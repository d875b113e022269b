"""RoPE's backward folded into flash's (kernels/flash_attention_qkv.py) against the pair it replaces (qkv_rotary, then
flash_attention) and against qkv_rotary + SDPA-cuDNN, at the trainer's shapes (gpt2-small: 12 heads of 64): one
layer's attention with its RoPE, forward + backward from the qkv projection, and the backward alone; ms, interleaved,
min of 3 do_bench medians. Also the largest difference of the fused path's dqkv from the pair's."""
import json, os
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench
from minigpt.model import Rotary
from minigpt_kernels import flash_attention
from minigpt_kernels.flash_attention_qkv import flash_attention_qkv
from minigpt_kernels.rotary import qkv_rotary

def pair(qkv, cos, sin):
    q, k, v = (t.transpose(1, 2) for t in qkv_rotary(qkv, cos, sin))
    return flash_attention(q, k, v)

def cudnn(qkv, cos, sin):
    q, k, v = (t.transpose(1, 2) for t in qkv_rotary(qkv, cos, sin))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

VARIANTS = {"fused": flash_attention_qkv, "pair": pair, "sdpa-cudnn": cudnn}
out = os.environ.get("OUT", "."); res = []
for B, H, N, D in ((4, 12, 8192, 64), (1, 12, 32768, 64), (1, 12, 131072, 64), (4, 16, 4096, 128)):
    g = torch.Generator(device="cuda").manual_seed(N)
    qkv = torch.randn(B, N, 3, H, D, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    do = torch.randn(B, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
    cos, sin = Rotary(D).cuda()(N)
    row = {"B": B, "H": H, "N": N, "D": D}
    grads = {n: torch.autograd.grad(f(qkv, cos, sin), qkv, do)[0] for n, f in VARIANTS.items()}
    for i, part in enumerate("qkv"):
        row[f"max |fused - pair| d{part}"] = (grads["fused"][:, :, i].float() - grads["pair"][:, :, i].float()).abs().max().item()
        row[f"max |pair| d{part}"] = grads["pair"][:, :, i].float().abs().max().item()
    rep = 60 if N < 100000 else 300
    for _ in range(3):
        for n, f in VARIANTS.items():
            ms = do_bench(lambda: torch.autograd.grad(f(qkv, cos, sin), qkv, do), warmup=10, rep=rep, return_mode="median")
            row[f"{n} fwd+bwd"] = min(row.get(f"{n} fwd+bwd", 1e9), ms)
            o = f(qkv, cos, sin)
            ms = do_bench(lambda: torch.autograd.grad(o, qkv, do, retain_graph=True), warmup=10, rep=rep, return_mode="median")
            row[f"{n} bwd"] = min(row.get(f"{n} bwd", 1e9), ms)
            del o
    res.append(row); print(row, flush=True)
    del qkv, do, grads
json.dump({"commit": os.environ.get("MINIGPT_COMMIT"), "gpu": torch.cuda.get_device_name(), "rows": res},
          open(f"{out}/qkv_rope.json", "w"), indent=1)
print("| B, H, N, D | fused fwd+bwd | pair fwd+bwd | cuDNN fwd+bwd | fused bwd | pair bwd | cuDNN bwd |")
for r in res:
    print(f"| {r['B']}, {r['H']}, {r['N']}, {r['D']} | " + " | ".join(
        f"{r[f'{n} {p}']:.3f}" for p in ("fwd+bwd", "bwd") for n in VARIANTS) + " |")

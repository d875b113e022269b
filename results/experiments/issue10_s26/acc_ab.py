"""The five-matmul backward with its fp32 dQ accumulator in q's memory order (the model's (B, N, H, D) rows; a straight
cast) against (B, H, N, D) (a transposing cast), at the trainer's shapes (gpt2-small: 12 heads of 64) and head_dim 128:
whole backward ms, interleaved, min of 3 do_bench medians."""
import importlib, json, os
import torch
from triton.testing import do_bench
fa = importlib.import_module("minigpt_kernels.flash_attention")
model_order = fa._in_layout_of
def contiguous_order(t, flat, heads):
    B, _, N, D = t.shape
    return flat.view(B, heads, N, D)
out = os.environ.get("OUT", "."); res = []
for B, H, N, D in ((4, 12, 8192, 64), (1, 12, 32768, 64), (1, 12, 131072, 64), (4, 16, 4096, 128), (1, 16, 16384, 128)):
    g = torch.Generator(device="cuda").manual_seed(N)
    q, k, v, do = [torch.randn(B, N, H, D, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2) for _ in range(4)]
    s = D ** -0.5
    o, lse = fa.launch_forward(q, k, v, True, s)
    row = {"B": B, "H": H, "N": N, "D": D}
    for rep in range(3):
        for name, fn in (("model order", model_order), ("(B,H,N,D)", contiguous_order)):
            fa._in_layout_of = fn
            ms = do_bench(lambda: fa.launch_backward(do, q, k, v, o, lse, True, s), warmup=10, rep=60 if N < 100000 else 300,
                          return_mode="median")
            row[name] = min(row.get(name, 1e9), ms)
    fa._in_layout_of = model_order
    res.append(row); print(row, flush=True)
json.dump(res, open(f"{out}/acc_ab.json", "w"), indent=1)
print("| B, H, N, D | accumulator in q's order | (B, H, N, D) |")
for r in res:
    print(f"| {r['B']}, {r['H']}, {r['N']}, {r['D']} | {r['model order']:.3f} | {r['(B,H,N,D)']:.3f} |")

"""qkv_rotary's forward and rotate_back_into at the trainer's 8K x 4 x 12 x 64, by tokens per program; a copy of the
same bytes as the bandwidth reference."""
import importlib, json, os
import torch
from triton.testing import do_bench
from minigpt.model import Rotary
rot = importlib.import_module("minigpt_kernels.rotary")
B, N, H, D = 4, 8192, 12, 64
qkv = torch.randn(B, N, 3, H, D, device="cuda", dtype=torch.bfloat16)
cos, sin = (t.reshape(N, D // 2) for t in Rotary(D).cuda()(N))
acc = torch.randn(B, N, H, D, device="cuda")
dqkv = torch.randn_like(qkv)
res = {"copy qkv (300 MB moved)": do_bench(lambda: torch.empty_like(qkv).copy_(qkv), rep=200, return_mode="median")}
for bt in (16, 32, 64, 128):
    rot.BLOCK_TOKENS = bt
    res[f"fwd BLOCK={bt}"] = do_bench(lambda: rot.qkv_rotary_forward(qkv, cos, sin), rep=200, return_mode="median")
    res[f"back BLOCK={bt}"] = do_bench(lambda: rot.rotate_back_into(dqkv, acc, dqkv[:, :, 1], cos, sin), rep=200,
                                       return_mode="median")
for k, v in res.items():
    print(f"{k}: {v * 1000:.1f} us")
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "rot_sweep.json"), "w"), indent=1)

"""A/B of the compiled region for attention=sdpa: RoPE alone (e690553: block.attn.rotate) against the qkv projection +
RoPE (before: block.attn.heads), gpt2-small 8K x 4, compile=true, 20 steps; interleaved, 2 reps. Also flash eager."""
import json, os, sys, tempfile
import torch
from minigpt.config import compose
from minigpt.run import run
from minigpt import model as M

new_forward, new_regions = M.CausalSelfAttention.forward, M.GPT.compile_regions

def old_forward(self, x, cos, sin):
    return self.attend_heads(*self.heads(x, cos, sin))

def old_regions(self, backend="inductor"):
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 32))
    for block in self.blocks:
        block.attn.heads = torch.compile(block.attn.heads, backend=backend, dynamic=False)
        block.norm_mlp = torch.compile(block.norm_mlp, backend=backend, dynamic=False)
    self.loss_sum = torch.compile(self.loss_sum, backend=backend, dynamic=False)

res = []
for rep in range(2):
    for name, fwd, reg, att, comp in (("sdpa compiled, region RoPE (new)", new_forward, new_regions, "sdpa", "true"),
                                     ("sdpa compiled, region qkv+RoPE (old)", old_forward, old_regions, "sdpa", "true"),
                                     ("flash eager, projection path (new)", new_forward, new_regions, "flash", "false"),
                                     ("flash eager, rotary + flash (old)", old_forward, new_regions, "flash", "false")):
        M.CausalSelfAttention.forward, M.GPT.compile_regions = fwd, reg
        torch._dynamo.reset()
        d = tempfile.mkdtemp()
        cfg = compose([f"attention={att}", "model=gpt2-small", "seq_len=8192", "batch_size=4", f"compile={comp}",
                       "max_steps=20", "eval_every=20", "logger=none", "save_checkpoints=false"], run_dir=d)
        rc = run(cfg)
        s = json.load(open(os.path.join(d, "summary.json")))
        res.append({"variant": name, "rep": rep, "rc": rc, "tokens_per_s": s.get("tokens_per_s")})
        print(res[-1], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "region_ab.json"), "w"), indent=1)
for r in res:
    print(f"| {r['variant']} | {r['rep']} | {r['tokens_per_s']:,.0f} |")

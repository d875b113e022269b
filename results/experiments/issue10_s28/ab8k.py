"""The trainer's 8K x 4 row re-checked: attention=sdpa and attention=flash interleaved in one process, 20 steps each
(median step after 2 warm-up steps, as in results/training_NVIDIA_H200.md), three eager pairs and one compiled pair,
since one step_profile.py sample read flash eager 122.6 ms against sdpa 121.7 ms of wall time per step."""
import json, os, tempfile
import torch
from minigpt.config import compose
from minigpt.run import run

plan = [("sdpa", "false"), ("flash", "false")] * 3 + [("sdpa", "true"), ("flash", "true")]
res = []
for attention, compiled in plan:
    torch._dynamo.reset()
    d = tempfile.mkdtemp()
    cfg = compose([f"attention={attention}", "model=gpt2-small", "seq_len=8192", "batch_size=4", f"compile={compiled}",
                   "max_steps=20", "eval_every=20", "logger=none", "save_checkpoints=false"], run_dir=d)
    rc = run(cfg)
    s = json.load(open(os.path.join(d, "summary.json")))
    res.append({"attention": attention, "compile": compiled, "rc": rc, "tokens_per_s": s.get("tokens_per_s")})
    print(res[-1], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "ab8k.json"), "w"), indent=1)
print("| pair | compile | sdpa tok/s | flash tok/s | flash / sdpa |")
for i in range(0, len(res), 2):
    a, b = res[i], res[i + 1]
    print(f"| {i // 2} | {a['compile']} | {a['tokens_per_s']:,.0f} | {b['tokens_per_s']:,.0f} | {b['tokens_per_s'] / a['tokens_per_s']:.3f} |")

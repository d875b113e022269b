"""Where one gpt2-small training step at 8K x 4 goes, attention=flash against attention=sdpa, eager and compiled:
GPU kernel time per step by kind (torch.profiler, steps 6-8 after 5 warm-up steps), and the step's wall time.
Shows how much of the step the attention is, so what the kernel must gain for a given flash/sdpa ratio."""
import json, os, sys, tempfile, time
from collections import defaultdict
import torch
from torch.profiler import ProfilerActivity, profile
from minigpt.config import compose
from minigpt.run import new_summary
from minigpt.train import build, train_step

CUDA = torch.cuda.is_available()  # on a CPU only a smoke run of the script: tiny model, CPU op times
sync = torch.cuda.synchronize if CUDA else (lambda: None)

KINDS = (  # first match wins; names as the H200 profile prints them
    ("attention", ("flash", "_attn", "_dkdv", "_dq", "_fwd_", "_bwd", "fmha", "cudnn", "sdpa", "_delta", "pingpong",
                   "specialized", "cutlass3x_sm90_fmha", "attention")),
    ("rotary", ("rotary", "rotate")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "cublas")),
    ("loss", ("log_softmax", "nll", "softmax", "cross_entropy")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "clip", "norm_")),
    ("layernorm", ("layer_norm", "layernorm")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other (elementwise, copies)"


def measure(attention: str, compiled: bool, steps: int = 3, warmup: int = 5) -> dict:
    torch._dynamo.reset()
    shape = ["model=gpt2-small", "seq_len=8192", "batch_size=4"] if CUDA else ["model=tiny", "seq_len=256", "batch_size=2"]
    cfg = compose([f"attention={attention}", *shape,
                   f"compile={str(compiled).lower()}", "max_steps=100", "logger=none", "save_checkpoints=false"],
                  run_dir=tempfile.mkdtemp())
    t = build(cfg, {}, new_summary(cfg))
    for s in range(warmup):
        train_step(t, s)
    sync()
    t0 = time.perf_counter()
    for s in range(warmup, warmup + steps):
        train_step(t, s)
    sync()
    wall = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CUDA if CUDA else ProfilerActivity.CPU]) as prof:
        for s in range(warmup + steps, warmup + 2 * steps):
            train_step(t, s)
        sync()
    per_kind, per_name = defaultdict(float), defaultdict(float)
    for e in prof.key_averages():
        us = e.device_time_total if CUDA else e.self_cpu_time_total
        if us <= 0 or e.key.startswith("ProfilerStep"):
            continue
        per_kind[kind_of(e.key)] += us / steps / 1e3
        per_name[e.key] += us / steps / 1e3
    del t
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:25]
    return {"attention": attention, "compiled": compiled, "wall_ms": wall, "gpu_ms": sum(per_kind.values()),
            "by_kind_ms": dict(per_kind), "top_kernels_ms": top}


if __name__ == "__main__":
    out = os.environ.get("OUT", ".")
    rows = []
    for compiled in ((False, True) if CUDA else (False,)):
        for attention in ("sdpa", "flash"):
            rows.append(measure(attention, compiled))
            r = rows[-1]
            print(f"{attention} compiled={compiled}: wall {r['wall_ms']:.1f} ms, GPU {r['gpu_ms']:.1f} ms", flush=True)
            for name, ms in r["top_kernels_ms"][:12]:
                print(f"    {ms:7.2f}  {kind_of(name)[:10]:10s} {name[:110]}")
    json.dump(rows, open(os.path.join(out, "step_profile.json"), "w"), indent=1)
    kinds = sorted({k for r in rows for k in r["by_kind_ms"]})
    print("\n| ms per step (8K x 4) | " + " | ".join(f"{r['attention']} {'comp' if r['compiled'] else 'eager'}" for r in rows) + " |")
    for k in ["wall_ms", "gpu_ms"] + kinds:
        vals = [r[k] if k in ("wall_ms", "gpu_ms") else r["by_kind_ms"].get(k, 0.0) for r in rows]
        print(f"| {k} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")

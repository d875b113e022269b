"""Attention benchmark: our Triton kernel next to SDPA's backends and naive attention, in one process.

Shapes follow the peers' measurement (../shared/GPU.md): causal, batch·seq = 16K tokens, hidden 2048
(heads = 2048 / head_dim). Times are medians of `triton.testing.do_bench`, the fastest of two passes over the
table; TFLOP/s use fwd = 4·B·H·N²·D (/2 causal), bwd = 2.5·fwd. `explore_tiles` times candidate tile configs of
each of our kernels so the table in kernels/flash_attention.py can be chosen from measurements.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from minigpt.attention import SDPA_KERNELS, attention_names, get_provider
from minigpt.benchmarks.mask_cases import GROUPS
from minigpt.config import ConfigError
from minigpt.files import atomic_write_text, markdown_table
from minigpt.metrics import attention_flops, git_commit, versions

# Providers: every registered backend by name ("flash" is ours), and sdpa pinned to each of PyTorch's fused
# kernels as "sdpa-<kernel>" (sdpa-math is the slow reference, left out).
PROVIDERS = (*(n for n in attention_names() if n != "sdpa"), *(f"sdpa-{k}" for k in SDPA_KERNELS if k != "math"))
MODES = ("fwd", "bwd", "fwd+bwd")


@dataclass
class Row:
    provider: str
    head_dim: int
    seq_len: int
    batch: int
    heads: int
    mode: str
    ms: float | None
    tflops: float | None
    note: str = ""


def _inputs(B: int, H: int, N: int, D: int, dtype: torch.dtype):
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(B, H, N, D, device="cuda", dtype=dtype)


def time_attention(fn: Callable, q, k, v, do, causal: bool, mode: str) -> float:
    """Median milliseconds of one forward, backward (from a stored forward) or forward+backward."""
    from triton.testing import do_bench

    if mode == "fwd":
        return do_bench(lambda: fn(q, k, v, causal=causal), warmup=25, rep=100, return_mode="median")
    if mode == "bwd":
        o = fn(q, k, v, causal=causal)
        return do_bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), warmup=25, rep=100,
                        return_mode="median")
    return do_bench(lambda: torch.autograd.grad(fn(q, k, v, causal=causal), (q, k, v), do), warmup=25, rep=100,
                    return_mode="median")


def bench_attention(head_dims=(64, 128), seq_lens=(1024, 2048, 4096, 8192, 16384), providers=PROVIDERS,
                    tokens: int = 16384, hidden: int = 2048, causal: bool = True,
                    dtype: torch.dtype = torch.bfloat16, passes: int = 2,
                    progress: Callable[[Row], None] = print) -> list[Row]:
    """Each (shape, provider, mode) timed once per pass, the passes one after the other over the whole table; a row
    keeps the fastest pass. With one pass the first shapes measured could read 5–40% slow on an H200, every provider
    alike (the 1K rows of the 245b33f run in kernels/NOTES.md S); the second pass runs on warm kernels."""
    best: dict[tuple, Row] = {}
    for _ in range(passes):
        for D in head_dims:
            H = hidden // D
            for N in seq_lens:
                B = max(1, tokens // N)
                for provider in providers:
                    fn = get_provider(provider)
                    for mode in MODES:
                        ms, note = None, ""
                        try:
                            q, k, v, do = _inputs(B, H, N, D, dtype)
                            ms = time_attention(fn, q, k, v, do, causal, mode)
                        except torch.OutOfMemoryError:
                            note = "OOM"
                        except RuntimeError as e:  # a pinned SDPA backend that cannot run this shape
                            note = str(e).splitlines()[0][:80]
                        finally:
                            q = k = v = do = None
                            torch.cuda.empty_cache()
                        tf = attention_flops(B, H, N, D, causal, mode) / (ms * 1e-3) / 1e12 if ms else None
                        row = Row(provider, D, N, B, H, mode, ms, tf, note)
                        progress(row)
                        key = (provider, D, N, mode)
                        if key not in best or (ms is not None and (best[key].ms is None or ms < best[key].ms)):
                            best[key] = row
    return list(best.values())


# Candidate launch configs per kernel: (block_m, block_n, num_warps, num_stages), each tried with TMA descriptor
# loads and with pointer loads.
TILE_CANDIDATES = {
    "fwd": [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
    "dkdv": [(32, 128, 4, 3), (32, 128, 4, 4), (64, 128, 8, 2), (64, 128, 8, 3), (64, 128, 4, 2),
             (32, 128, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
    "dq": [(128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 64, 4, 3), (128, 32, 4, 3),
           (64, 64, 4, 3), (128, 128, 8, 2)],
}
# The shapes that won or came within a few percent in the full exploration on the H200 (TMA only): enough to
# check whether another dtype or non-causal attention wants a different choice, at a fraction of the cost.
TILE_SHORTLIST = {
    "fwd": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
    "dkdv": [(32, 128, 4, 3), (32, 128, 4, 4), (64, 128, 8, 2)],
    "dq": [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
}


def explore_tiles(head_dims=(64, 128), seq_lens=(2048, 8192), tokens: int = 16384, hidden: int = 2048,
                  causal: bool = True, dtype: torch.dtype = torch.bfloat16, shortlist: bool = False,
                  progress: Callable = print) -> list[dict]:
    """Time each candidate TileConfig of our forward, dK/dV and dQ kernels; returns one dict per (kernel, config, shape).

    shortlist=True times only TILE_SHORTLIST's shapes with TMA loads (a quick re-check for another dtype or causality).
    """
    from triton.testing import do_bench

    from minigpt_kernels import launch as fa  # the launchers and TileConfig (the package exports the function)

    TC = fa.TileConfig
    shapes, tma_options = (TILE_SHORTLIST, (True,)) if shortlist else (TILE_CANDIDATES, (False, True))
    candidates = {kernel: [TC(*shape, tma=tma) for shape in shape_list for tma in tma_options]
                  for kernel, shape_list in shapes.items()}
    out = []
    for D in head_dims:
        H = hidden // D
        for N in seq_lens:
            B = max(1, tokens // N)
            q, k, v, do = _inputs(B, H, N, D, dtype)
            scale = D ** -0.5
            o, lse = fa.launch_forward(q, k, v, causal, scale)
            for kernel, configs in candidates.items():
                for c in configs:
                    if kernel == "fwd":
                        fn = lambda c=c: fa.launch_forward(q, k, v, causal, scale, cfg=c)  # noqa: E731
                    elif kernel == "dkdv":
                        fn = lambda c=c: fa.launch_backward(do, q, k, v, o, lse, causal, scale, dkdv_cfg=c)  # noqa: E731
                    else:
                        fn = lambda c=c: fa.launch_backward(do, q, k, v, o, lse, causal, scale, dq_cfg=c)  # noqa: E731
                    try:
                        ms = do_bench(fn, warmup=10, rep=40, return_mode="median")
                    except Exception as e:  # noqa: BLE001 - out of shared memory etc.: record and go on
                        ms, err = None, f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
                    else:
                        err = ""
                    rec = {"kernel": kernel, "head_dim": D, "seq_len": N, "causal": causal,
                           "dtype": str(dtype).removeprefix("torch."), **asdict(c), "ms": ms, "error": err}
                    out.append(rec)
                    progress(rec)
            del q, k, v, do, o, lse
            torch.cuda.empty_cache()
    return out


def best_tiles_table(explore: list[dict], top: int = 3) -> str:
    """The fastest `top` configs of each kernel per (head_dim, seq_len), as text."""
    def key_of(r: dict) -> tuple:
        return r.get("dtype", "bfloat16"), r.get("causal", True), r["kernel"], r["head_dim"], r["seq_len"]

    lines = []
    for key in sorted({key_of(r) for r in explore}):
        ok = sorted((r for r in explore if key_of(r) == key and r["ms"]), key=lambda r: r["ms"])
        best = ", ".join(f"{r['block_m']}x{r['block_n']}/w{r['num_warps']}/s{r['num_stages']}"
                         f"{'+tma' if r.get('tma') else ''}={r['ms']:.3f}ms"
                         for r in ok[:top])
        dtype, causal, kernel, D, N = key
        lines.append(f"{dtype} {'causal' if causal else 'full  '} {kernel:5s} D={D:3d} N={N:5d}: {best}")
    return "\n".join(lines)


def environment() -> dict:
    return {"gpu": torch.cuda.get_device_name(), **versions(), "python": platform.python_version(),
            "date": dt.date.today().isoformat(), "commit": git_commit()}


def results_table(rows: list[Row], env: dict) -> str:
    """One line per (head_dim, seq): fwd+bwd TFLOP/s per provider, then ours/FA2 for fwd, bwd, fwd+bwd, and ours/cuDNN."""
    tflops = {(r.provider, r.head_dim, r.seq_len, r.mode): r.tflops for r in rows}

    def ratio(a: float | None, b: float | None) -> str | None:
        return f"{a / b:.2f}" if a and b else None

    providers = [p for p in PROVIDERS if any(r.provider == p for r in rows)]
    header = ["head_dim", "seq", *[f"{p} fwd+bwd" for p in providers], "ours/FA2 fwd", "ours/FA2 bwd",
              "ours/FA2 fwd+bwd", "ours/cuDNN fwd+bwd"]
    table = []
    for D in sorted({r.head_dim for r in rows}):
        for N in sorted({r.seq_len for r in rows}):
            cells: list[object] = [D, N]
            cells += [None if tflops.get((p, D, N, "fwd+bwd")) is None else f"{tflops[(p, D, N, 'fwd+bwd')]:.0f}"
                      for p in providers]
            cells += [ratio(tflops.get(("flash", D, N, m)), tflops.get(("sdpa-flash", D, N, m))) for m in MODES]
            cells.append(ratio(tflops.get(("flash", D, N, "fwd+bwd")), tflops.get(("sdpa-cudnn", D, N, "fwd+bwd"))))
            table.append(cells)
    return (f"Causal bf16, batch·seq = 16K tokens, hidden 2048; TFLOP/s (fwd = 4·B·H·N²·D/2, bwd = 2.5·fwd). "
            f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}, commit {env['commit']}.\n\n"
            + markdown_table(header, table))


def write_results(rows: list[Row], out_dir: Path, explore: list[dict] | None = None) -> Path:
    env = environment()
    stem = "attention_" + env["gpu"].replace(" ", "_")
    atomic_write_text(out_dir / f"{stem}.json", json.dumps({"env": env, "rows": [asdict(r) for r in rows],
                                                            "explore": explore or []}, indent=1) + "\n")
    return atomic_write_text(out_dir / f"{stem}.md", results_table(rows, env))


def write_explore(explore: list[dict], out_dir: Path) -> Path:
    """A tile exploration alone, as explore_<GPU>_<dtype>_<causal|full>.json."""
    env = environment()
    first = explore[0] if explore else {}
    mode = "causal" if first.get("causal", True) else "full"
    path = out_dir / f"explore_{env['gpu'].replace(' ', '_')}_{first.get('dtype', 'bfloat16')}_{mode}.json"
    return atomic_write_text(path, json.dumps({"env": env, "explore": explore}, indent=1) + "\n")


def without_out(argv: list[str]) -> list[str]:
    """The command line as a results file records it: without --out and its folder (a machine path, not what was
    measured)."""
    kept, skip = [], False
    for a in argv:
        if skip or a.startswith("--out="):
            skip = False
            continue
        skip = a == "--out"
        if not skip:
            kept.append(a)
    return kept


def main(argv: list[str] | None = None) -> int:
    """`minigpt-bench` / scripts/bench_attention.py: parse the arguments, run, print the table."""
    p = argparse.ArgumentParser(prog="bench_attention", description="Attention kernels on the GPU: ours (flash) vs "
                                "SDPA's backends and naive, in one process; <out>/attention_<GPU>.{json,md} (default "
                                "runs/bench, git-ignored; publish with --out results).")
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq", type=int, nargs="+", help="sequence lengths (default 1024 2048 4096 8192 16384; with "
                   "--step 1024 2048 4096 8192)")
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--explore", action="store_true", help="time candidate tile configs of our kernels first")
    p.add_argument("--explore-only", action="store_true", help="only the tile exploration, no provider table")
    p.add_argument("--explore-seq", type=int, nargs="+", default=[2048, 8192], help="sequence lengths to explore at")
    p.add_argument("--full", action="store_true", help="explore non-causal attention (the table is always causal)")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16", help="dtype to explore in")
    p.add_argument("--shortlist", action="store_true", help="explore only the shortlisted tile shapes, TMA loads")
    p.add_argument("--masks", action="store_true", help="instead of the table: the mask suite (issue 33; documents, "
                   "windows, GQA), ours vs FlexAttention against the ideal -> <out>/masks_<GPU>.{json,md} "
                   "(minigpt/benchmarks/mask_bench.py; --head-dim picks the documents' and windows' head dims)")
    p.add_argument("--tiny", action="store_true", help="with --masks or --accuracy: a dry run of the code in fp32 "
                   "(the mask cases at tiny sizes, one rep; 512 keys of 2 heads), on CPU with TRITON_INTERPRET=1")
    p.add_argument("--mask-groups", nargs="+", choices=GROUPS, default=list(GROUPS), help="with --masks: these "
                   "sections only (with the dense references they need), to run the suite in parts")
    p.add_argument("--time-limit", type=float, default=510.0, help="with --masks: seconds after which the cases "
                   "not yet started are recorded as skipped (the table is still written)")
    p.add_argument("--accuracy", action="store_true", help="instead of the table: each kernel against float64 over "
                   "long rows of periodic and random inputs, where a truncating accumulator shows as a bias; "
                   "gpt2-small's heads at the first --head-dim -> <out>/accuracy_<GPU>.{json,md} "
                   "(minigpt/benchmarks/accuracy.py)")
    p.add_argument("--grads", action="store_true", help="with --accuracy: the backward's dQ, dK, dV instead of o, "
                   "L queries over L keys of periodic inputs against an exact float64 reference -> "
                   "<out>/grad_accuracy_<GPU>.{json,md} (minigpt/benchmarks/grad_accuracy.py)")
    p.add_argument("--keys", type=int, nargs="+", help="with --accuracy: the keys every row sees (default 65536 "
                   "262144 1048576; 512 with --tiny)")
    p.add_argument("--step", action="store_true", help="instead of the table: the trainer's step per attention "
                   "backend (--step-backends), gpt2-small at 16K tokens per step, in rounds alternating between the "
                   "backends in one process -> <out>/step_<GPU>.{json,md} (minigpt/benchmarks/step_bench.py; --seq "
                   "default 1024 2048 4096 8192)")
    p.add_argument("--step-backends", nargs="+", default=["flash", "sdpa"], choices=attention_names())
    p.add_argument("--step-model", default="gpt2-small", help="with --step: the model config (configs/model)")
    p.add_argument("--step-rounds", type=int, default=12, help="with --step: rounds per sequence length")
    p.add_argument("--step-steps", type=int, default=15, help="with --step: steps per round")
    p.add_argument("--step-tokens", type=int, default=16384, help="with --step: tokens per step (batch = tokens "
                   "// seq)")
    p.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = p.parse_args(argv)
    if args.step:
        from minigpt.benchmarks.step_bench import step_bench, write_step_results

        try:
            rows = step_bench(args.seq or [1024, 2048, 4096, 8192], args.step_backends, tokens=args.step_tokens,
                              model=args.step_model, rounds=args.step_rounds, steps=args.step_steps,
                              progress=lambda line: print(line, flush=True))
        except ConfigError as e:  # a setting the trainer refuses: its one line
            p.error(f"--step: {e}")
        command = "python scripts/bench_attention.py " + " ".join(without_out(sys.argv[1:] if argv is None else argv))
        print(write_step_results(rows, args.out, args.step_model, args.step_tokens, command).read_text())
        return 0
    suite = "--accuracy" if args.accuracy else "--masks" if args.masks else None
    if suite and not torch.cuda.is_available() and not (args.tiny and os.environ.get("TRITON_INTERPRET") == "1"):
        p.error(f"{suite} needs a CUDA GPU; to dry-run the code on CPU: TRITON_INTERPRET=1 ... {suite} --tiny")
    if args.grads and not args.accuracy:
        p.error("--grads goes with --accuracy: python scripts/bench_attention.py --accuracy --grads")
    if args.accuracy:
        from minigpt.benchmarks.accuracy import check_keys, run_accuracy
        from minigpt.benchmarks.grad_accuracy import run_grad_accuracy

        keys = args.keys or ([512] if args.tiny else [65536, 262144, 1048576])
        try:
            check_keys(keys)
        except ValueError as e:
            p.error(f"--keys: {e}")
        run = run_grad_accuracy if args.grads else run_accuracy
        _, md = run(keys, head_dim=args.head_dim[0], heads=2 if args.tiny else None, out=args.out, tiny=args.tiny,
                    progress=lambda line: print(line, flush=True))
        print(md.read_text())
        return 0
    if args.masks:
        from minigpt.benchmarks.mask_bench import run_masks

        run_masks(head_dims=args.head_dim, groups=args.mask_groups, out=args.out, tiny=args.tiny,
                  time_limit_s=args.time_limit, progress=lambda line: print(line, flush=True))
        return 0
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (it times GPU kernels); without one, test the kernels in Triton's interpreter: "
                "python -m pytest tests/test_flash_attention.py")

    explore = None
    if args.explore or args.explore_only:
        explore = explore_tiles(head_dims=args.head_dim, seq_lens=args.explore_seq, causal=not args.full,
                                dtype=getattr(torch, args.dtype), shortlist=args.shortlist,
                                progress=lambda r: print(f"tile {r['kernel']:5s} D={r['head_dim']:3d} N={r['seq_len']:5d} "
                                                         f"{r['block_m']:3d}x{r['block_n']:3d} w{r['num_warps']} "
                                                         f"s{r['num_stages']} tma={int(r['tma'])} {r['ms']} {r['error']}",
                                                         flush=True))
        print(best_tiles_table(explore))
        if args.explore_only:
            print("wrote", write_explore(explore, args.out))
            return 0
    rows = bench_attention(head_dims=args.head_dim, seq_lens=args.seq or [1024, 2048, 4096, 8192, 16384],
                           providers=args.providers,
                           progress=lambda r: print(f"{r.provider:15s} D={r.head_dim:3d} N={r.seq_len:6d} {r.mode:8s} "
                                                    f"{'' if r.ms is None else f'{r.ms:8.3f} ms {r.tflops:6.1f} TFLOP/s'} "
                                                    f"{r.note}", flush=True))
    md = write_results(rows, args.out, explore)
    print(md.read_text())
    print(f"results: {md.resolve()}")
    return 0

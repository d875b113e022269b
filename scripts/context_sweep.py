"""Find the longest context each attention backend can train at batch 1, then report table, plots and W&B.

    python scripts/context_sweep.py                                         # naive, sdpa, flash; gpt2-small
    python scripts/context_sweep.py --variants sdpa flash flash+levers --start flash+levers=262144
    python scripts/context_sweep.py --variants flash+levers --no-search --probe-seq-lens 2097152   # derive 2M from 1-/2-layer probes
    python scripts/context_sweep.py --cpu                                   # tiny model on CPU (smoke test)
    python scripts/context_sweep.py --combine results/sweeps/* --out results --name context_scaling_H200

Variants are <backend>[+lever...]: levers ckpt, bf16ckpt, losschunk, mlpchunk, offload, keepattn (flash only),
and levers (= bf16ckpt + losschunk + mlpchunk). Results go to --out (trials.jsonl, results.{json,csv,md}, *.png); re-running with
the same --out resumes.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minigpt.sweep import SweepConfig, combine, run_sweep  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["naive", "sdpa", "flash"])
    p.add_argument("--out", type=Path, default=Path("results/sweeps") / time.strftime("%Y%m%d-%H%M%S"))
    p.add_argument("--start", nargs="*", default=[], metavar="VARIANT=N", help="start seq_len per variant")
    p.add_argument("--default-start", type=int, default=4096)
    p.add_argument("--granularity", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--steps", type=int, default=2, help="training steps per trial")
    p.add_argument("--trial-time-limit", type=float, default=600.0, help="seconds per trial")
    p.add_argument("--budget", type=float, default=3600.0, help="seconds for the whole sweep")
    p.add_argument("--logger", choices=["wandb", "none"], default="wandb")
    p.add_argument("--probe-seq-lens", type=int, nargs="*", default=[])
    p.add_argument("--probe-layers", type=int, nargs=2, default=[1, 2])
    p.add_argument("--no-search", action="store_true", help="skip the search, run only the probes")
    p.add_argument("--cpu", action="store_true", help="tiny model on CPU, small lengths (smoke test)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra trainer overrides")
    p.add_argument("--combine", type=Path, nargs="*", help="merge these finished sweep dirs into one report in --out")
    p.add_argument("--name", default="context_scaling", help="file stem of a --combine report")
    p.add_argument("--header", default="Context-length scaling, gpt2-small, batch 1.", help="first line of a --combine report")
    args = p.parse_args()

    if args.combine:
        print(combine(args.combine, args.out, args.name, args.header).read_text())
        return

    base = ["model=tiny", "device=cpu"] if args.cpu else ["model=gpt2-small"]
    cfg = SweepConfig(
        variants=args.variants, out_dir=args.out, base_overrides=base + args.set,
        start={k: int(v) for k, v in (s.split("=") for s in args.start)},
        default_start=128 if args.cpu else args.default_start, granularity=64 if args.cpu else args.granularity,
        max_seq_len=args.max_seq_len or (512 if args.cpu else None), steps=args.steps,
        trial_time_limit_s=args.trial_time_limit, budget_s=args.budget, logger=args.logger,
        probe_seq_lens=args.probe_seq_lens, probe_layers=tuple(args.probe_layers), search=not args.no_search)
    md = run_sweep(cfg)
    print(md.read_text())


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# What we run on the GPU machine (../shared/GPU.md): GPU tests, kernel benchmark, training runs, a 1M-token step.
#   source scripts/gpu_env.sh; bash scripts/gpu_checks.sh tests|explore|tiles|bench|train|long ...
# Logs and results go under $OUT (default ./gpu_out); the last lines printed are a short table.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
for step in "$@"; do
  case $step in
    tests)   python3 -m pytest -p no:cacheprovider -m gpu -q -rA tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    explore) minigpt-bench --explore-only --out "$OUT" > "$OUT/explore.log" 2>&1; tail -12 "$OUT/explore.log" ;;
    tiles)   # quick re-check of the tile choice for non-causal and fp16 (bf16 causal as the noise reference)
      for opts in "" "--full" "--dtype float16"; do
        minigpt-bench --explore-only --shortlist --explore-seq 8192 $opts --out "$OUT" \
          > "$OUT/tiles${opts// /_}.log" 2>&1; grep -E "^(bfloat16|float16) " "$OUT/tiles${opts// /_}.log"
      done ;;
    long)    # one 1M-token training step of gpt2-small with every lever (the README's long-context recipe)
      minigpt-sweep --variants flash+levers+offload+keepattn --default-start 1048576 \
        --max-seq-len 1048576 --steps 1 --out "${LONG_OUT:-results/sweeps/long}" > "$OUT/long.log" 2>&1
      tail -6 "$OUT/long.log" ;;
    bench)   minigpt-bench --out results 2>&1 | tee "$OUT/bench.log" | tail -16; cp results/attention_* "$OUT/" ;;
    train)
      for spec in "sdpa 8192" "flash 8192" "naive 4096"; do
        set -- $spec
        minigpt-train attention=$1 seq_len=$2 max_steps=20 eval_every=20 hydra.run.dir=runs/gpu_$1_$2 \
          > "$OUT/train_$1_$2.log" 2>&1; echo "train $1 $2 exit $?"
      done
      python3 - <<'PY'
import glob
from minigpt.summary import RunSummary
for f in sorted(glob.glob("runs/gpu_*/summary.json")):
    s = RunSummary.read(f)
    print(f"{s.attention:6s} seq={s.seq_len:6d} batch={s.batch_size} status={s.status:5s} "
          f"tok/s={s.tokens_per_s or 0:10.0f} step={s.step_time_s or 0:.3f}s peak_alloc={s.peak_allocated_gib:.1f}GiB "
          f"reserved={s.peak_reserved_gib:.1f}GiB mfu={s.mfu or 0:.3f} loss={s.final_train_loss} {s.device}")
PY
      tar czf "$OUT/train_runs.tgz" runs/gpu_*/summary.json runs/gpu_*/wandb 2>/dev/null ;;
  esac
done

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
    train)   # flash next to sdpa, eager and compiled, back to back in one job: "attention seq_len batch compile steps"
      SPECS=${TRAIN_SPECS:-"sdpa 8192 4 false 20;flash 8192 4 false 20;sdpa 8192 4 true 20;flash 8192 4 true 20;sdpa 32768 1 false 20;flash 32768 1 false 20;sdpa 32768 1 true 20;flash 32768 1 true 20;sdpa 131072 1 false 8;flash 131072 1 false 8;sdpa 131072 1 true 8;flash 131072 1 true 8"}
      IFS=';' read -ra specs <<< "$SPECS"
      for spec in "${specs[@]}"; do
        set -- $spec
        dir=runs/gpu_$1_$2_b$3_c$4
        minigpt-train attention=$1 seq_len=$2 batch_size=$3 compile=$4 max_steps=$5 eval_every=$5 logger=none \
          hydra.run.dir=$dir > "$OUT/train_$1_$2_c$4.log" 2>&1; echo "train $1 $2 compile=$4 exit $?"
      done
      python3 -m minigpt.experiments.training_table runs/gpu_* | tee "$OUT/training.md"
      tar czf "$OUT/train_runs.tgz" runs/gpu_*/summary.json runs/gpu_*/.hydra 2>/dev/null ;;
  esac
done

#!/usr/bin/env bash
# What we run on the GPU machine (../shared/GPU.md): GPU tests, kernel benchmark, training runs, a 1M-token step.
# Needs the project installed where this runs (pip install -e . or pip install .: the minigpt-* commands).
#   bash scripts/gpu_checks.sh tests|explore|tiles|bench|masks|train|long|memory|frontier|compile|scaling|ring|probe4 ...
# Logs and results go under $OUT (default ./gpu_out, git-ignored), runs under runs/; the last lines printed are a
# short table. Publishing into results/ is a separate, explicit step.
set -uo pipefail
export WANDB_MODE=${WANDB_MODE:-offline} PYTHONUNBUFFERED=1
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
        --max-seq-len 1048576 --steps 1 --out "${LONG_OUT:-runs/sweeps/long}" > "$OUT/long.log" 2>&1
      tail -6 "$OUT/long.log" ;;
    memory)  # where a 1M step's memory goes (eager profile), then the README's 1M recipe for real (2 steps, compiled)
      L="attention=flash batch_size=1 model.recompute_every=1 model.recompute_dtype=bfloat16 model.loss_chunk=4096 model.mlp_chunk=65536 model.offload=true model.keep_attention=true"
      minigpt-memory --warmup-tokens 65536 --out "$OUT/memory_1m" -- $L seq_len=1048576 compile=false > "$OUT/memory_1m.log" 2>&1
      minigpt-train $L seq_len=${LONG_SEQ:-1048576} max_steps=2 eval_batches=0 logger=none \
        save_checkpoints=false hydra.run.dir=runs/gpu_long_${LONG_SEQ:-1048576} > "$OUT/long.log" 2>&1; echo "long exit $?"
      grep -A14 "At the step" "$OUT/memory_1m/memory_profile.md"
      python3 -m minigpt.benchmarks.training_table runs/gpu_long_* | tee "$OUT/long.md" ;;
    frontier) # the one-GPU frontier: 1- and 2-layer probes at 4M tokens, the 12-layer model derived (~14 min)
      minigpt-sweep --variants flash+levers+offload+keepattn --no-search --probe-seq-lens 4194304 --steps 1 \
        --trial-time-limit 1200 --out "${FRONTIER_OUT:-runs/probe4m}" > "$OUT/frontier.log" 2>&1; tail -4 "$OUT/frontier.log" ;;
    compile) # the sweep's +compile rows (the eager rows are the default sweep's)
      minigpt-sweep --variants naive+compile --default-start 8192 --granularity 2048 --out runs/sweep_compile > "$OUT/compile.log" 2>&1
      minigpt-sweep --variants sdpa+compile flash+compile --default-start 262144 --granularity 131072 --max-seq-len 524288 \
        --out runs/sweep_compile >> "$OUT/compile.log" 2>&1; tail -8 "$OUT/compile.log" ;;
    scaling) # one sequence over 1, 2, 4 GPUs (context parallel) with every lever: "GPUS seq_len" pairs, 2 steps each
      L="attention=flash batch_size=1 model.recompute_every=1 model.recompute_dtype=bfloat16 model.loss_chunk=4096 model.mlp_chunk=65536 model.offload=true model.keep_attention=true"
      for spec in ${SCALING:-"1:1048576 2:1048576 4:1048576 4:2097152"}; do
        n=${spec%%:*}; len=${spec##*:}; dir=runs/gpu_scale_n${n}_$len
        torchrun --standalone --nproc_per_node=$n -m minigpt $L parallel.context=$n seq_len=$len max_steps=2 eval_batches=0 \
          logger=none save_checkpoints=false hydra.run.dir=$dir > "$OUT/scale_n${n}_$len.log" 2>&1; echo "scale $n GPUs $len exit $?"
      done
      python3 -m minigpt.benchmarks.training_table runs/gpu_scale_* | tee "$OUT/scaling.md" ;;
    ring)    # ring attention against the single-GPU kernel, NGPU GPUs (set NCCL_NVLS_ENABLE=0 etc., ../shared/GPU.md)
      torchrun --standalone --nproc_per_node=${NGPU:-4} scripts/bench_ring.py --out "$OUT" > "$OUT/ring.log" 2>&1
      tail -10 "$OUT/ring.log" ;;
    probe4)  # 4M tokens over 4 GPUs (context 4) by the probe method: 1- and 2-layer models, 12 layers derived
      minigpt-sweep --variants flash+levers+offload+keepattn --no-search --probe-seq-lens 4194304 --steps 1 \
        --nproc 4 --context 4 --trial-time-limit 1200 --out runs/probe4m_x4 > "$OUT/probe4.log" 2>&1; tail -4 "$OUT/probe4.log" ;;
    bench)   minigpt-bench --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -16 ;;
    masks)   minigpt-bench --masks --out "$OUT" 2>&1 | tee "$OUT/masks.log" | tail -42 ;;   # documents, windows, GQA vs flex
    train)   # flash next to sdpa, eager and compiled, back to back in one job: "attention seq_len batch compile steps"
      SPECS=${TRAIN_SPECS:-"sdpa 8192 4 false 20;flash 8192 4 false 20;sdpa 8192 4 true 20;flash 8192 4 true 20;sdpa 32768 1 false 20;flash 32768 1 false 20;sdpa 32768 1 true 20;flash 32768 1 true 20;sdpa 131072 1 false 8;flash 131072 1 false 8;sdpa 131072 1 true 8;flash 131072 1 true 8"}
      IFS=';' read -ra specs <<< "$SPECS"
      for spec in "${specs[@]}"; do
        set -- $spec
        dir=runs/gpu_$1_$2_b$3_c$4
        minigpt-train attention=$1 seq_len=$2 batch_size=$3 compile=$4 max_steps=$5 eval_every=$5 logger=none \
          hydra.run.dir=$dir > "$OUT/train_$1_$2_c$4.log" 2>&1; echo "train $1 $2 compile=$4 exit $?"
      done
      python3 -m minigpt.benchmarks.training_table runs/gpu_* | tee "$OUT/training.md"
      tar czf "$OUT/train_runs.tgz" runs/gpu_*/summary.json runs/gpu_*/.hydra 2>/dev/null ;;
  esac
done

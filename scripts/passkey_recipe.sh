#!/usr/bin/env bash
# The passkey recipe (docs/long-context.md, "Passkey retrieval"): small-6l with attention=flash, trained in stages of growing
# length, each resuming the previous stage's checkpoint on one cosine schedule; then the depth x length grid of
# the 8K and the 32K checkpoints, and the training curve. A stage that finished is skipped, an interrupted one
# continues (resume=auto), so the script can be run again after a stop.
#   bash scripts/passkey_recipe.sh            # RUNS=runs/passkey RESULTS=runs/passkey/results STAGES="512 2k 8k 32k"
#   RESULTS=results/passkey bash scripts/passkey_recipe.sh      # the same, publishing the curve and grids
set -uo pipefail
RUNS=${RUNS:-runs/passkey}; RESULTS=${RESULTS:-$RUNS/results}; STAGES=${STAGES:-"512 2k 8k 32k"}
mkdir -p "$RUNS" "$RESULTS"
A="+recipe=passkey"   # configs/recipe/passkey.yaml: small-6l, attention=flash, lr and schedule, passkey grid
prev=""
#        name  seq_len batch max_steps
for stage in "512 512 128 1500" "2k 2048 32 2500" "8k 8192 16 4000" "32k 32768 4 4500"; do
  set -- $stage
  [[ " $STAGES " == *" $1 "* ]] || continue
  dir=$RUNS/$1
  if grep -qs '"status": "ok"' "$dir/summary.json"; then echo "stage $1: done before"; prev=$dir; continue; fi
  if [ -d "$dir/checkpoints" ]; then from=auto; elif [ -n "$prev" ]; then from=$prev/checkpoints; else from=none; fi
  echo "stage $1: seq_len=$2 batch=$3 to step $4 (resume=$from)"
  minigpt-train $A seq_len=$2 batch_size=$3 max_steps=$4 resume=$from hydra.run.dir=$dir 2>&1 | tee "$RUNS/$1.log" \
    | grep --line-buffered -E "^(step|done|error)"
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "stage $1 failed: see $RUNS/$1.log"; exit 1; }
  prev=$dir
done
rc=0  # the curve and the grids all run; the script's code says whether one failed
python3 -m minigpt.sweep.curves $(for s in $STAGES; do echo "$RUNS/$s"; done) --out "$RESULTS/passkey_curve" \
  --metrics eval/passkey_acc eval/passkey_grid_acc eval/val_loss --title "small-6l passkey recipe (attention=flash)" || rc=1
if [[ " $STAGES " == *" 8k "* ]]; then
  minigpt-eval "$RUNS/8k" --no-loss --passkey-grid --passkey-lengths 2K,4K,8K,16K,32K --out "$RESULTS/grid_8k" \
    --wandb || rc=1
fi
if [[ " $STAGES " == *" 32k "* ]]; then
  minigpt-eval "$RUNS/32k" --no-loss --passkey-grid --passkey-lengths 8K,16K,32K,64K,128K --out "$RESULTS/grid_32k" \
    --wandb || rc=1
fi
exit $rc

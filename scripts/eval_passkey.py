"""Passkey retrieval of a checkpoint over context lengths x key depths: table, heatmap, optionally W&B.

The same as `minigpt-eval-passkey` (logic in minigpt/eval/passkey_eval.py). Examples:
    python scripts/eval_passkey.py --checkpoint outputs/<run>                    # newest intact checkpoint
    python scripts/eval_passkey.py --checkpoint outputs/<run> --lengths 2048 4096 8192 16384 --wandb
Results: passkey_grid.{json,md} and passkey_heatmap.png in --out (default: passkey/ in the run directory).
"""
import sys

from minigpt.cli import eval_passkey_main

if __name__ == "__main__":
    sys.exit(eval_passkey_main())

"""Loss by position on held-out pycode, and the passkey grid, of a run or checkpoint (or several, side by side).

The same as `minigpt-eval` (logic in minigpt/eval/, the command line in minigpt/eval/cli.py). Examples:
    python scripts/eval.py runs/final --lengths 32K
    python scripts/eval.py runs/final runs/base2k --lengths 32K --sliding none,2K --out runs/compare --wandb
    python scripts/eval.py runs/passkey/8k --no-loss --passkey-grid --passkey-lengths 2K,4K,8K,16K
Results: loss_by_position.{json,png} and passkey_<haystack>/ in --out (default: eval/ in the run directory).
"""
import sys

from minigpt.cli import eval_main

if __name__ == "__main__":
    sys.exit(eval_main())

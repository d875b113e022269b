"""Sample text from a trained run or checkpoint. Usage: python scripts/sample.py PATH [--prompt TEXT] [options]

The same as the `minigpt-sample` command (logic in minigpt/sample.py). Examples:
    python scripts/sample.py runs/quickstart --prompt "The pass key is" --max-new-tokens 64
    python scripts/sample.py runs/quickstart --temperature 0                       # greedy
    python scripts/sample.py outputs/<run>/checkpoints/ckpt_00000300.pt --num-samples 3 --seed 1
"""
import sys

from minigpt.cli import sample_main

if __name__ == "__main__":
    sys.exit(sample_main())

"""Train a GPT with the chosen attention backend. Usage: python scripts/train.py [key=value ...]

The same as the `minigpt-train` command or `python -m minigpt`. Examples:
    python scripts/train.py model=tiny seq_len=256 batch_size=8 max_steps=300      # CPU, about a minute
    python scripts/train.py attention=flash seq_len=8192 max_steps=20              # GPU
Every setting, its default and its meaning: minigpt/config.py.
"""
import sys

from minigpt.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main())

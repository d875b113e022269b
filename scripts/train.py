"""Train a GPT with the chosen attention backend. Usage: python scripts/train.py [key=value ...]

Examples:
    python scripts/train.py model=tiny seq_len=256 batch_size=8 max_steps=300      # CPU, a few minutes
    python scripts/train.py attention=flash seq_len=8192 max_steps=20              # GPU
See configs/train.yaml for every setting.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from minigpt.cli import train_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_main())

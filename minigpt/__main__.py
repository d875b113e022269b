"""`python -m minigpt [overrides]`: the trainer, runnable from any directory (the sweep starts trials this way)."""
import sys

from minigpt.cli import train_main

sys.exit(train_main())

"""`python -m minigpt.eval PATH ...` = `minigpt-eval` (minigpt/eval/cli.py), runnable from any directory."""
import sys

from minigpt.eval.cli import main

sys.exit(main())

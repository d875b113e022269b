"""Find the longest context each attention backend can train at batch 1 (`--help` says how).

The same command as `minigpt-sweep` and `python -m minigpt.sweep.sweep`; it runs from any directory.
"""
import sys

from minigpt.cli import sweep_main

if __name__ == "__main__":
    sys.exit(sweep_main())

"""The long-context recipe: small-6l trained 2K -> 8K -> 32K -> 64K on pycode (with passkey examples), a 2K baseline on
the same tokens, then loss by position against it and the passkey grid; in segments of a time budget each.

The same as `minigpt-long-context` (logic in minigpt/recipe/, the command line in minigpt/recipe/cli.py). Examples:
    python scripts/long_context_recipe.py --dry-run       # the plan: stages, segments, commands, estimated minutes
    python scripts/long_context_recipe.py                 # the next segment (<= 8.5 min); run again to continue
    python scripts/long_context_recipe.py --import handoff --export handoff      # across fresh machines
    python scripts/long_context_recipe.py --tiny          # all of it on a CPU in a minute or two
Results: runs/long_context/ (recipe_state.json, recipe.log, logs/, the runs, eval/).
"""
import sys

from minigpt.cli import long_context_main

if __name__ == "__main__":
    sys.exit(long_context_main())

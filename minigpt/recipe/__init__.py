"""The long-context recipe (`python scripts/long_context_recipe.py`): one model trained in stages to 64K tokens, a 2K
baseline of the same tokens, and the evaluations, run as segments of a time budget each, resumable anywhere.

    plan.py     the runs (from the presets configs/recipe/long_context_*.yaml), the evaluations, the estimates, and
                how they fall into segments
    state.py    recipe_state.json in the output directory: what is done, what each segment did
    handoff.py  --export / --import: the recipe's small files and one model's weights in bf16, for a fresh machine
    runner.py   one invocation: the next items until the budget, each command logged
    cli.py      the command line
"""

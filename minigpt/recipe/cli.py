"""`python scripts/long_context_recipe.py` (= `minigpt-long-context`): the long-context recipe, a segment at a time.

    python scripts/long_context_recipe.py --dry-run         # the plan: runs, evaluations, segments, commands, minutes
    python scripts/long_context_recipe.py                   # the next segment (<= --budget-minutes); again to go on
    python scripts/long_context_recipe.py --import H --export H    # on a fresh machine each time (handoff.py)
    python scripts/long_context_recipe.py --tiny            # the whole recipe on a CPU in a minute or two
    python scripts/long_context_recipe.py --publish-wandb results/long_context   # the final model's W&B offline run

small-6l is trained 2K -> 8K (RoPE base 10K -> 1M) -> 32K -> 64K on pycode with 10% passkey examples, and a 2K
baseline on the same tokens (configs/recipe/long_context*.yaml); then minigpt-eval reads the final model at every
position to 64K against the baseline's sliding 2K windows (the goal figures) and scores its passkey grid at
16K-128K in both haystacks (20 keys a cell, in parts that each fit a segment, merged into one grid per haystack).
Everything lands in --out (default runs/long_context): recipe_state.json (what is done), recipe.log (every command,
its exit code and seconds), logs/, each run's directory, eval/; with the trainer's W&B logger (not --tiny's
logger=none) each trainer and minigpt-eval command's W&B offline run in wandb/ of its directory.
--publish-wandb DIR copies the final model's newest W&B offline run into DIR/wandb_offline/ for results/ (machine
paths made relative to --out or dropped; minigpt/wandb_offline.py) and runs nothing else.

Each invocation does what its budget allows and stops: a run late for the budget is stopped (it writes a
checkpoint) and resumed by the next invocation. Overrides after `--` go to every trainer command, e.g.
`-- data.cache_dir=/scratch/minigpt`. Exit codes: 0 this segment went well (the last line says whether the recipe is
done); 1 a command failed or a file is damaged; 2 a bad argument or setting, or an --out started by another plan;
3 a run out of GPU memory; 128 + signal when stopped by one.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from minigpt.config import ConfigError
from minigpt.data import DataError
from minigpt.eval.passkey_grid import length_label
from minigpt.files import WriteError
from minigpt.recipe.handoff import export, import_handoff
from minigpt.recipe.plan import FINAL, FULL, TINY, Evaluation, Item, Plan, Prepare, Train, build_plan, shown
from minigpt.recipe.runner import CommandFailed, Invocation, check_budget
from minigpt.recipe.state import STATE_FILE, RecipeError, RecipeState, machine_id
from minigpt.signals import Interrupted, StopSignals
from minigpt.summary import ExitCode
from minigpt.wandb_offline import PublishError, newest_run, publish_run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="long_context_recipe.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help=f"the recipe's directory (default {FULL.out}; with --tiny {TINY.out})")
    p.add_argument("--tiny", action="store_true", help="a tiny model at tiny lengths on the CPU (tests)")
    p.add_argument("--budget-minutes", type=float, help=f"this invocation's time (default {FULL.budget_minutes}; "
                   f"with --tiny {TINY.budget_minutes}): a GPU command may run 10")
    p.add_argument("--dry-run", action="store_true", help="print the plan of what is left, run nothing")
    p.add_argument("--import", dest="import_dir", type=Path, metavar="DIR",
                   help="first bring in the export in DIR (if newer than --out's state)")
    p.add_argument("--export", type=Path, metavar="DIR", help="at the end, export into DIR: the state, the small "
                   "files and W&B offline runs, and the live model's bf16 weights (parts of <= 15 MiB)")
    p.add_argument("--publish-wandb", type=Path, metavar="DIR", help="copy the final model's newest W&B offline "
                   "run into DIR/wandb_offline/ (DIR: results/<subject>; machine paths dropped), after --import "
                   "if given; run nothing else")
    p.add_argument("overrides", nargs="*", help="after --: overrides for every trainer command")
    return p


# --------------------------------------------------------------------------------------------
# the plan, as --dry-run prints it
# --------------------------------------------------------------------------------------------
def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _tokens(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n >= 10**7 else f"{n:,}"


def describe_item(item: Item, seconds: float) -> str:
    if isinstance(item, Prepare):
        return f"prepare the data (~{_minutes(seconds)})"
    if isinstance(item, Train):
        return f"{item.name} steps {item.first} -> {item.last} (~{_minutes(seconds)})"
    return f"{item.name}: {item.what} (~{_minutes(seconds)})"


def describe(plan: Plan, state: RecipeState, machine: str, budget_s: float) -> str:
    v = plan.variant
    lines = [f"long-context recipe ({v.name}), planned for {v.hardware}: {plan.runs[-1].what}",
             f"output: {plan.out} ({'revision ' + str(state.revision) if state.revision else 'new'}, "
             f"{len(state.segments)} segment(s) so far)", "runs:"]
    for r in plan.runs:
        start = f"from {r.after}'s last checkpoint, resume_extend=true" if r.after else "from scratch"
        before = plan.run(r.after).rope if r.after else r.rope
        changed = ", ".join(f"model.{k}={before[k]:g} -> {r.rope[k]:g}" for k in r.rope if before[k] != r.rope[k])
        step = state.step(r)
        status = "done" if step >= r.end else f"at step {step}" if step > r.start else "to do"
        lines.append(f"  {r.name:<9} {length_label(r.seq_len):>4} x {r.batch_size:<3} steps {r.start:>5} -> "
                     f"{r.end:<5} {start}{': ' + changed if changed else ''} "
                     f"(configs/recipe/{r.preset}.yaml; {_tokens(r.tokens_per_step * (r.end - r.start))} tokens) "
                     f"[{status}]")
    lines.append("evaluations:")
    width = max(len(e.name) for e in plan.evaluations)
    lines += [f"  {e.name:<{width}} {e.what} [{'done' if state.done(e.name, plan) else 'to do'}]"
              for e in plan.evaluations]
    rates = ", ".join(f"{length_label(n)} {state.measured.get(str(n), r):,.0f}" +
                      (" measured" if str(n) in state.measured else "") for n, r in v.tokens_per_s.items())
    todo = state.todo(plan, machine)
    if not todo:
        return "\n".join(lines + ["nothing left: the recipe is done"])
    segments = plan.segments(todo, state.measured, budget_s)
    lines.append(f"what is left, in segments of <= {_minutes(budget_s)} (estimates; tokens/s {rates}; "
                 f"+{v.start_s:.0f} s per trainer start):")
    started: set[str] = set()
    for n, segment in enumerate(segments, len(state.segments) + 1):
        lines.append(f"  segment {n}, ~{_minutes(sum(s for _, s in segment))}:")
        for item, seconds in segment:
            lines.append(f"    {describe_item(item, seconds)}")
            if isinstance(item, Train):
                own = item.first > item.run.start or item.name in started
                started.add(item.name)
                commands = [plan.train_command(item, plan.resume_of(item, own))]
            elif isinstance(item, Evaluation):
                commands = plan.eval_commands(item)
            else:
                commands = []
            lines += [f"      $ {shown(c)}" for c in commands]
    training = sum(s for seg in segments for i, s in seg if isinstance(i, Train))
    lines.append(f"total: ~{_minutes(sum(s for seg in segments for _, s in seg))} in {len(segments)} segment(s), "
                 f"~{_minutes(training)} of it training runs")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    variant = TINY if args.tiny else FULL
    budget_s = 60 * (args.budget_minutes if args.budget_minutes is not None else variant.budget_minutes)
    out = args.out or Path(variant.out)
    try:
        check_budget(budget_s / 60, variant.reserve_s)
        plan = build_plan(variant, out, tuple(args.overrides))
        existing = RecipeState.read(plan.out / STATE_FILE)
        if existing is not None:
            existing.check(plan, plan.out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.BAD_SETTING
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.publish_wandb:
        return publish_wandb(plan, args.publish_wandb, args.import_dir)
    machine = machine_id()
    if args.dry_run:
        if args.import_dir or args.export:
            print("--dry-run: --import and --export are left out (nothing is read or written)")
        print(describe(plan, existing or RecipeState(plan.fingerprint()), machine, budget_s))
        return 0
    return run(plan, args.import_dir, args.export, machine, budget_s, exiting=True)


def publish_wandb(plan: Plan, dest: Path, import_dir: Path | None) -> int:
    """--publish-wandb (after --import, if given): the final model's newest W&B offline run (its last piece) into
    dest/wandb_offline/."""
    try:
        if import_dir is not None:
            import_handoff(import_dir, plan.out, plan)
        source = newest_run(plan.out / plan.run(FINAL).folder)
        published = publish_run(source, dest, plan.out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.BAD_SETTING
    except (RecipeError, PublishError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in published.rglob("*") if p.is_file())
    print(f"published {source.relative_to(plan.out)} as {published} ({size:,} bytes); `wandb sync {published}` "
          f"uploads it")
    return 0


def run(plan: Plan, import_dir: Path | None, export_dir: Path | None, machine: str, budget_s: float,
        exiting: bool = False) -> int:
    """One invocation: import, the segment, export; returns the exit code (module docstring). exiting: the command's
    outermost context (signals.StopSignals), as main passes it; the Python API leaves the handlers as it found them."""
    began = time.monotonic()
    code, ended, line = 0, "failed", ""
    with StopSignals(exiting=exiting) as stop:
        try:
            plan.out.mkdir(parents=True, exist_ok=True)
            if import_dir is not None:
                import_handoff(import_dir, plan.out, plan)
            state = RecipeState.read(plan.out / STATE_FILE) or RecipeState(plan.fingerprint())
            state.check(plan, plan.out)
            invocation = Invocation(plan, state, machine, budget_s - (time.monotonic() - began))
            try:
                ended = invocation.run()
            except Interrupted as e:
                code, ended = ExitCode.SIGNAL_BASE + e.signum, "interrupted"
                line = f"stopped by {signal.Signals(e.signum).name}"
            except CommandFailed as e:
                code, line = e.code, str(e)
            except ConfigError as e:
                code, line = ExitCode.BAD_SETTING, str(e)
            except (RecipeError, DataError) as e:
                code, line = 1, str(e)
            stop.immediate = False  # from here a signal waits: the state and the export are written
            if invocation.did or ended != "done":
                invocation.record(ended, time.monotonic() - began)
            if export_dir is not None:
                export(plan.out, export_dir, state, plan)
        except Interrupted as e:
            print(f"stopped by {signal.Signals(e.signum).name} before the segment began", file=sys.stderr)
            return ExitCode.SIGNAL_BASE + e.signum
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return ExitCode.BAD_SETTING
        except (RecipeError, DataError, OSError, WriteError) as e:  # WriteError: a full disk, said in one line
            print(f"error: {e}", file=sys.stderr)
            return 1
    print(closing_line(plan, state, machine, budget_s, ended, line, time.monotonic() - began),
          file=sys.stderr if code else sys.stdout)
    return code


def closing_line(plan: Plan, state: RecipeState, machine: str, budget_s: float, ended: str, line: str,
                 seconds: float) -> str:
    """The last line: what happened, and what to do next."""
    n = state.segments[-1]["number"] if state.segments else 0
    if ended == "failed":
        return f"error: {line} (segment {n}, {_minutes(seconds)}; state {plan.out / STATE_FILE})"
    if ended == "interrupted":
        return f"segment {n} {line} after {_minutes(seconds)}: its progress is kept; run the recipe again to continue"
    todo = state.todo(plan, machine)
    if not todo:
        return f"recipe done: results in {plan.out / 'eval'} ({len(state.segments)} segment(s); every command in " \
               f"{plan.out / 'recipe.log'})"
    left = plan.segments(todo, state.measured, budget_s)
    return f"segment {n} done in {_minutes(seconds)}; next: {describe_item(*left[0][0])}; " \
           f"~{len(left)} segment(s) left: run the same command again to continue"

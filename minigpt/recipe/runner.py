"""One invocation of the recipe: the next items, in order, until the time budget is spent.

Each item is the first one not done (state.todo): the data (in this process), a run's next steps (the trainer in a
process of its own, `python -m minigpt`), an evaluation (`python -m minigpt.eval`). A run gets the steps the time
left allows by the plan's estimates; if it runs late anyway, it is sent SIGTERM `reserve` seconds before the
budget ends, and then, as on any stop, it finishes its step, writes a checkpoint and exits: the next invocation
resumes it. An evaluation starts only if its estimate fits what is left (or nothing else ran yet); one stopped at
the budget is done again, whole, by the next invocation.

Every command goes into recipe.log in the output directory, with its exit code and seconds, and its output into
logs/<segment>-<item>.log; the lines that matter (the trainer's evals and last line, the evaluations' goal figures
and accuracies) are echoed here. The state is written after each item; a signal to the recipe is passed on to the
command running (which stops as above), then the state is written and the recipe exits with 128 + signal.
"""
from __future__ import annotations

import datetime as dt
import json
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from minigpt.checkpoint import list_checkpoints, step_of
from minigpt.config import ConfigError
from minigpt.files import atomic_write_text
from minigpt.recipe.plan import FINAL, Evaluation, Item, Plan, Prepare, Run, Train, quoted, shown
from minigpt.recipe.state import RecipeError, RecipeState
from minigpt.signals import Interrupted, own_group, stop_group
from minigpt.summary import SUMMARY_FILE, ExitCode

LOG_FILE = "recipe.log"
STOP_GRACE_S = 45.0  # a trainer sent SIGTERM: its step, its checkpoint, its summary
KEY_LINES = re.compile(r"^(model |resumed|resume_extend|step \d+:|done:|error|warning|interrupted|results:|"
                       r"--import|held-out)|: loss |mean accuracy")


class CommandFailed(RecipeError):
    """A command of the recipe failed: `code` is the recipe's exit code for it (the trainer's 2 and 3 kept)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclass
class Invocation:
    """This run of the recipe: its plan and state, its deadline, what it has done."""

    plan: Plan
    state: RecipeState
    machine: str
    budget_s: float
    say: Callable[[str], None] = print
    started: float = field(default_factory=time.monotonic)
    number: int = 0  # this segment's number
    did: list[str] = field(default_factory=list)

    @property
    def out(self) -> Path:
        return self.plan.out

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def log(self, line: str, echo: bool = True) -> None:
        stamp = dt.datetime.now().isoformat(timespec="seconds")
        with open(self.out / LOG_FILE, "a") as f:
            f.write(f"{stamp} [segment {self.number}] {line}\n")
        if echo:
            self.say(line)

    # ---------------------------------------------------------------------------------------------
    # the loop
    # ---------------------------------------------------------------------------------------------
    def run(self) -> str:
        """Items until the budget or the end; returns why it ended: "done", "budget" or "stopped" (a command was
        stopped at the budget)."""
        self.number = len(self.state.segments) + 1
        self.sync()
        self.log(f"segment {self.number} on {self.machine}: budget {self.budget_s / 60:.1f} min")
        while True:
            todo = self.state.todo(self.plan, self.machine)
            if not todo:
                return "done"
            left = self.left() - self.plan.variant.reserve_s
            piece, _ = self.plan.first_piece(todo[0], left, self.state.measured, alone=not self.did)
            if piece is None:
                return "budget"
            if not self.do(piece):
                return "stopped"

    def do(self, item: Item) -> bool:
        """Do one item; False when its command was stopped at the budget."""
        if isinstance(item, Prepare):
            self.prepare()
            return True
        if isinstance(item, Train):
            return self.train(item)
        return self.evaluate(item)

    def sync(self) -> None:
        """Each run's step from its checkpoints (a stopped or killed command may have left newer ones than the
        state says)."""
        for run in self.plan.runs:
            steps = [step_of(p) for p in list_checkpoints(self.out / run.folder / "checkpoints") if p.is_file()]
            if steps and max(steps) > self.state.step(run):
                self.state.runs[run.name] = max(steps)

    def record(self, ended: str, seconds: float) -> None:
        self.sync()
        self.state.segments.append({"number": self.number, "machine": self.machine,
                                    "finished": dt.datetime.now().isoformat(timespec="seconds"),
                                    "seconds": round(seconds, 1), "did": self.did, "ended": ended})
        self.state.save(self.out)

    # ---------------------------------------------------------------------------------------------
    # the items
    # ---------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """The corpus and its token streams on this machine; the recipe's tokenizer the first time (every run names
        it, so a fresh machine tokenizes with the same one). Refused settings (too few long held-out documents for
        the longest run) end the recipe here, before any training."""
        from minigpt.compose import compose
        from minigpt.data import build_data

        began = time.monotonic()
        longest = max(self.plan.runs, key=lambda r: r.seq_len)
        base = [f"+recipe={longest.preset}", *longest.overrides, *self.plan.extra]
        self.log(f"prepare: the data of {' '.join(base)} (in this process)")
        if not self.plan.tokenizer.is_file():
            cfg = compose(base, machine=False)
            atomic_write_text(self.plan.tokenizer, build_data(cfg.data, cfg.seq_len, cfg.seed).tokenizer_json)
            self.log(f"prepare: trained the recipe's tokenizer: {self.plan.tokenizer}")
        cfg = compose([*base, f"data.tokenizer={quoted(self.plan.tokenizer)}"], machine=False)
        data = build_data(cfg.data, cfg.seq_len, cfg.seed)
        self.state.prepared = [*[m for m in self.state.prepared if m != self.machine], self.machine]
        tokens = self.plan.run(FINAL).tokens_per_step * self.plan.run(FINAL).end
        self.log(f"prepare: {len(data.train):,} training tokens; the chain's {tokens:,} (and the baseline's) pass over "
                 f"them {tokens / len(data.train):.2g} times ({time.monotonic() - began:.0f} s)")
        self.did.append("prepare")
        self.state.save(self.out)

    def resume_from(self, item: Train) -> str:
        """plan.resume_of, checked: a run that starts from the previous one's checkpoint needs it here."""
        own = [p for p in list_checkpoints(self.out / item.run.folder / "checkpoints") if p.is_file()]
        resume = self.plan.resume_of(item, bool(own))
        if resume != "auto" and not list_checkpoints(resume):
            raise RecipeError(f"{item.run.name} starts from {item.run.after}'s last checkpoint, and {resume} has none "
                              f"(a fresh machine?); --import the export that holds it, or start over in a new --out")
        return resume

    def train(self, item: Train) -> bool:
        run, alone = item.run, not self.did
        argv = self.plan.train_command(item, self.resume_from(item))
        name = f"{run.name} steps {item.first} -> {item.last}"
        rc, stopped, seconds, log = self.command(argv, run.name, self.left() - self.plan.variant.reserve_s)
        steps = [step_of(p) for p in list_checkpoints(self.out / run.folder / "checkpoints") if p.is_file()]
        reached = max([*steps, self.state.step(run)])
        self.state.runs[run.name] = reached
        rate = self.measured_rate(run) if reached - item.first >= 5 else None
        if rate:
            self.state.measured[str(run.seq_len)] = rate
        stopped = stopped and reached < item.last  # a run that reached its last step is done, however it ended
        self.did.append(f"{run.name} {item.first} -> {reached}" + (" (stopped at the budget)" if stopped else ""))
        self.state.save(self.out)
        planned = self.plan.variant.tokens_per_s.get(run.seq_len)
        speed = (f"; {rate:,.0f} tokens/s" + (f" (planned {planned:,.0f})" if planned else "")) if rate else ""
        if stopped:  # whatever its exit code (one stopped while it starts dies of SIGTERM): its checkpoints count
            if reached == item.first and alone:
                raise CommandFailed(f"{name}: no step done within the budget ({seconds:.0f} s); raise "
                                    f"--budget-minutes", 1)
            self.log(f"{name}: stopped at the budget at step {reached}{speed}")
            return False
        if rc != 0 and reached < item.last:
            raise CommandFailed(f"{name} failed (exit {rc}): see {log}; fix what it says, then run the recipe again "
                                f"to continue", _exit_code(rc))
        self.log(f"{name}: done in {seconds:.0f} s{speed}")
        return True

    def measured_rate(self, run: Run) -> float | None:
        """The tokens/s the run's last command measured (its summary's median step)."""
        try:
            summary = json.loads((self.out / run.folder / SUMMARY_FILE).read_text())
        except (OSError, ValueError):
            return None
        return summary.get("tokens_per_s")

    def evaluate(self, item: Evaluation) -> bool:
        """Its commands; False when one was stopped at the budget (the next invocation does it again, whole)."""
        reads = self.out / self.plan.run(item.reads).folder / "checkpoints" if item.reads else None
        if reads and not list_checkpoints(reads):
            raise RecipeError(f"{item.name} reads {item.reads}'s model, and {reads} has no checkpoint (a fresh "
                              f"machine?); --import the export that holds it, or start over in a new --out")
        began = time.monotonic()
        for argv in self.plan.eval_commands(item):
            alone = not self.did
            rc, stopped, seconds, log = self.command(argv, item.name, self.left() - self.plan.variant.reserve_s)
            if stopped and alone:
                raise CommandFailed(f"{item.name}: stopped at the budget after {seconds:.0f} s, before it finished; "
                                    f"raise --budget-minutes", 1)
            if stopped:
                self.log(f"{item.name}: stopped at the budget before it finished; the next segment does it again")
                return False
            if rc != 0:
                raise CommandFailed(f"{item.name} failed (exit {rc}): see {log}; fix what it says, then run the recipe "
                                    f"again to continue", _exit_code(rc))
        seconds = time.monotonic() - began
        self.state.evaluations[item.name] = {"seconds": round(seconds, 1)}
        self.did.append(item.name)
        self.state.save(self.out)
        self.log(f"{item.name}: done in {seconds:.0f} s")
        return True

    # ---------------------------------------------------------------------------------------------
    # a command
    # ---------------------------------------------------------------------------------------------
    def command(self, argv: list[str], name: str, limit_s: float) -> tuple[int, bool, float, Path]:
        """Run argv, its output into logs/; SIGTERM at limit_s. (exit code, stopped at the limit, seconds, its log)."""
        log_path = self.out / "logs" / f"{self.number:02d}-{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        offset = log_path.stat().st_size if log_path.is_file() else 0
        self.log(f"$ {shown(argv)}")
        began, stopped = time.monotonic(), False
        with open(log_path, "a") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    **own_group())
            try:
                try:
                    rc = proc.wait(timeout=max(limit_s, 1.0))
                except subprocess.TimeoutExpired:
                    stopped = True
                    rc = stop_group(proc, signal.SIGTERM, STOP_GRACE_S)
            except Interrupted as e:  # the recipe is stopping (also mid-way through the budget's stop): so does the
                stop_group(proc, e.signum, STOP_GRACE_S)  # command, and it has ended before anything is recorded
                raise
        seconds = time.monotonic() - began
        self.log(f"exit {rc} after {seconds:.0f} s{' (stopped at the budget)' if stopped else ''}; output: "
                 f"{log_path.relative_to(self.out)}", echo=False)
        with open(log_path, "rb") as f:
            f.seek(offset)
            output = f.read().decode(errors="replace")
        for line in re.split(r"[\r\n]+", output):
            if KEY_LINES.search(line.strip()):
                self.say(f"  {line.strip()}")
        return rc, stopped, seconds, log_path


def _exit_code(rc: int) -> int:
    """The recipe's exit code for a failed command's: a bad setting (2) and out of memory (3) kept, else 1."""
    return rc if rc in (ExitCode.BAD_SETTING, ExitCode.OOM) else 1


def check_budget(budget_minutes: float, reserve_s: float) -> None:
    if budget_minutes * 60 <= reserve_s:
        raise ConfigError(f"--budget-minutes {budget_minutes}: must leave more than the {reserve_s:.0f} s kept for "
                          f"a stop and the export")

"""recipe_state.json in the recipe's output directory: what is done, so that running the recipe again continues.

    {"plan": {"variant": "full", "extra": [], "runs": [["baseline", 2048, 64, 0, 2000], ...]},
     "revision": 7,                                   # one more at every write
     "runs": {"baseline": 2000, "2k": 450},           # the step each run's checkpoints reached
     "evaluations": {"baseline-sliding": {"seconds": 41.0}},      # those done (each passkey part on its own)
     "prepared": ["<machine>"],                       # machines whose data cache holds the recipe's token streams
     "measured": {"2048": 1250000.0},                 # tokens/s by seq_len, from the runs' summaries
     "segments": [{"number": 1, "machine": "...", "finished": "...", "seconds": 497.2, "did": [...],
                   "ended": "budget"}]}

It is written after every item, atomically, so an invocation that is killed loses at most the item it was in (and
that run's checkpoints still say how far it got). `revision` orders states: --import takes a handoff only when it is
newer than the directory's own. A machine is the kernel's boot id (a fresh machine is a new one), else the host name.
A key the recipe no longer writes (RETIRED) is dropped on reading, so a directory of an earlier minigpt continues.
"""
from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from minigpt.config import ConfigError
from minigpt.files import atomic_write_text
from minigpt.recipe.plan import ORDER, Item, Plan, Prepare, Run, Train

STATE_FILE = "recipe_state.json"
RETIRED = ("tokens",)  # the token streams' lengths, never read (recipe.log's prepare line says them)


class RecipeError(RuntimeError):
    """The recipe cannot go on (a command failed, a file is damaged); the message says what to do."""


def machine_id() -> str:
    """This machine until it reboots: the kernel's boot id where there is one, else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


@dataclass
class RecipeState:
    plan: dict[str, Any]  # Plan.fingerprint() of the plan that started the directory
    revision: int = 0
    runs: dict[str, int] = field(default_factory=dict)
    evaluations: dict[str, dict[str, Any]] = field(default_factory=dict)
    prepared: list[str] = field(default_factory=list)
    measured: dict[str, float] = field(default_factory=dict)
    segments: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> RecipeState | None:
        """The state in `path` (a recipe_state.json), None if there is none; RecipeError if it is damaged."""
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            return cls(**{k: v for k, v in data.items() if k not in RETIRED})
        except (OSError, ValueError, TypeError) as e:
            raise RecipeError(f"{path} is unreadable ({type(e).__name__}: {e}); restore it, or start over in a new "
                              f"--out") from e

    def save(self, out: Path) -> None:
        self.revision += 1
        atomic_write_text(out / STATE_FILE, json.dumps(asdict(self), indent=1) + "\n")

    def check(self, plan: Plan, out: Path) -> None:
        """ConfigError (exit 2) if the directory was started by another plan (the variant, the overrides or a run)
        and has trained or evaluated something; one with nothing done yet takes the new plan."""
        theirs, ours = self.plan, plan.fingerprint()
        if theirs == ours:
            return
        if not self.runs and not self.evaluations:
            self.plan = ours
            return
        what = next(k for k in ours if theirs.get(k) != ours.get(k))
        hint = {"variant": "--tiny as it was started, or not", "extra": f"the overrides {theirs.get('extra')}",
                "runs": "the presets as they were"}[what]
        raise ConfigError(f"--out {out}: started by another plan (its {what}: {theirs.get(what)}, now: "
                          f"{ours.get(what)}); continue it with {hint}, or start over in a new --out")

    def step(self, run: Run) -> int:
        """The step `run` has reached (its first step until it has a checkpoint of its own)."""
        return max(self.runs.get(run.name, run.start), run.start)

    def done(self, name: str, plan: Plan) -> bool:
        """A run trained to its end; an evaluation recorded as done whose output is still there (one whose files
        were lost is done again, before anything that reads them)."""
        runs, evals = {r.name: r for r in plan.runs}, {e.name: e for e in plan.evaluations}
        if name in evals:
            output = evals[name].output
            return name in self.evaluations and (output is None or output.is_file())
        return name in runs and self.step(runs[name]) >= runs[name].end

    def todo(self, plan: Plan, machine: str) -> list[Item]:
        """What is left, in ORDER: the data (on a machine that has not prepared it, while a run is left), each run
        from the step it reached, each evaluation not done (a passkey grid's parts, then their merge)."""
        runs = {r.name: r for r in plan.runs}
        training = [Train(r, self.step(r), r.end) for r in plan.runs if self.step(r) < r.end]
        items: list[Item] = []
        for name in ORDER:
            if name == "prepare":
                if training and (machine not in self.prepared or not plan.tokenizer.is_file()):
                    items.append(Prepare(plan.variant.prepare_s))
            elif name in runs:
                items += [t for t in training if t.run.name == name]
            else:
                items += [e for e in plan.evaluations if e.place == name and not self.done(e.name, plan)]
        return items

    def live(self, plan: Plan) -> Run | None:
        """The run whose model is still to be trained or read: the last in order that has a checkpoint of its own.
        The only model a handoff carries."""
        started = [r for r in plan.runs if self.step(r) > r.start]
        return started[-1] if started else None


"""The long-context recipe's plan: its runs, its evaluations, how long each should take, and the segments.

The runs are the stage presets, composed as the trainer composes them (configs/recipe/long_context_*.yaml give each
run's seq_len, batch_size and last step, max_steps; the presets are the one place those numbers live):

    baseline   long_context_baseline   2K tokens, from scratch to the chain's last step (the same tokens)
    2k         long_context_2k         2K tokens, from scratch
    8k         long_context_8k         8K, from 2k's last checkpoint, resume_extend=true (the RoPE base changes)
    32k        long_context_32k        32K, from 8k's
    64k        long_context_64k        64K, from 32k's: the recipe's final model

Everything happens in one order (ORDER): the data is prepared, the baseline trained and read by sliding windows,
the chain trained, then the final model read at every position against the baseline's curve and its passkey grid
scored in both haystacks. The next thing to do is always the first one not done.

Estimates. A step takes its tokens over the tokens/s of its length (Variant.tokens_per_s, whose arithmetic is in
configs/recipe/long_context.yaml; once a segment has run a length, its measured rate), times STEP_OVERHEAD for the
periodic evals and checkpoints; a trainer process adds start_s (start, data, compile, first kernels). Segments
fill the budget less a reserve (a trainer stopped at the budget finishes its step and writes a checkpoint, then the
export) with the items in order, splitting a run at the step where the budget ends; the runner makes the same choice
from the time actually left, and stops a trainer that runs late at the budget.
"""
from __future__ import annotations

import math
import re
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Union

from minigpt.config import ROPE_KEYS, ConfigError, TrainConfig
from minigpt.eval.passkey_grid import length_label

STEP_OVERHEAD = 1.05  # periodic evals and checkpoints, over the steps themselves
MIN_PIECE_STEPS = 10  # a run is not split into a piece shorter than this (unless nothing else fits a segment)
TOKENIZER_FILE = "tokenizer.json"  # the recipe's tokenizer, trained once, named by every run (data.tokenizer)

# (name, preset, folder under the output directory, the run it resumes from at its start)
RUNS = (("baseline", "long_context_baseline", "baseline", None),
        ("2k", "long_context_2k", "stages/2k", None),
        ("8k", "long_context_8k", "stages/8k", "2k"),
        ("32k", "long_context_32k", "stages/32k", "8k"),
        ("64k", "long_context_64k", "stages/64k", "32k"))
ORDER = ("prepare", "baseline", "baseline-sliding", "2k", "8k", "32k", "64k", "final-loss", "passkey-filler",
         "passkey-pycode")
FINAL, BASELINE = "64k", "baseline"


@dataclass(frozen=True)
class Variant:
    """What differs between the recipe on its GPU and the tiny one that tests it on a CPU."""

    name: str
    out: str  # the default output directory
    hardware: str
    overrides: tuple[str, ...]  # added to every trainer command, after the preset
    run_overrides: dict[str, tuple[str, ...]]  # per run, after those
    tokens_per_s: dict[int, float]  # by seq_len: the estimates segments are planned with
    start_s: float  # a trainer process: start, data, compile, first kernels, last checkpoint
    prepare_s: float  # the data: corpus, tokenizer, token streams (on a machine that has none cached)
    reserve_s: float  # kept free at the end of a budget: a stopped trainer's last step and checkpoint, the export
    budget_minutes: float  # the default budget of one invocation
    eval_seconds: dict[str, float]  # each evaluation's estimate
    length: int  # loss by position up to this position
    sliding: int  # the baseline's window
    goal_far: tuple[int, int]  # the goal figures' far positions, near ones, and the second far span
    goal_near: tuple[int, int]
    goal_far_second: tuple[int, int]
    passkey_lengths: tuple[int, ...]
    keys: int  # passkey keys per cell
    depths: tuple[float, ...] | None = None  # None: minigpt-eval's 11
    resamples: int | None = None  # None: minigpt-eval's 1000
    min_docs: int | None = None  # None: the corpus's guarantee


FULL = Variant(
    name="full", out="runs/long_context", hardware="one H100 80GB", overrides=(), run_overrides={},
    tokens_per_s={2048: 1.2e6, 8192: 0.95e6, 32768: 4.0e5, 65536: 2.3e5},
    start_s=45.0, prepare_s=90.0, reserve_s=60.0, budget_minutes=8.5,
    # loss by position reads ~2M held-out tokens in seconds, the rest is start and tokenizing the documents; a
    # passkey grid is 5 keys x 11 depths x 6 greedy forwards at each length: 81M tokens, ~3 minutes
    eval_seconds={"baseline-sliding": 60.0, "final-loss": 75.0, "passkey-filler": 210.0, "passkey-pycode": 210.0},
    length=65536, sliding=2048, goal_far=(32768, 65536), goal_near=(1024, 2048), goal_far_second=(16384, 32768),
    passkey_lengths=(16384, 32768, 65536, 131072), keys=5,
    # the corpus guarantees 20 held-out documents of >= 256 KiB, 64K tokens only at <= 4 bytes a token
    min_docs=10)

# The same recipe at 1/16 to 1/64 of the lengths and 1/64 of the tokens per step, a 0.5M-parameter model on the quickstart
# corpus: every run, resume, extension, evaluation and file of the real one, on a CPU in a minute or two.
TINY = Variant(
    name="tiny", out="runs/long_context_tiny", hardware="a CPU",
    overrides=("model=tiny", "attention=sdpa", "device=cpu", "compile=false", "logger=none", "data.subset=quickstart",
               "data.vocab_size=512", "warmup_steps=2", "lr_decay_steps=20", "eval_every=4", "eval_batches=1",
               "ckpt_every=0"),
    run_overrides={"baseline": ("seq_len=128", "batch_size=16", "max_steps=20"),
                   "2k": ("seq_len=128", "batch_size=16", "max_steps=8"),
                   "8k": ("seq_len=256", "batch_size=8", "max_steps=12"),
                   "32k": ("seq_len=512", "batch_size=4", "max_steps=16"),
                   "64k": ("seq_len=1024", "batch_size=2", "max_steps=20")},
    tokens_per_s={128: 1e4, 256: 1e4, 512: 1e4, 1024: 1e4},
    start_s=15.0, prepare_s=20.0, reserve_s=5.0, budget_minutes=10.0,
    eval_seconds={"baseline-sliding": 15.0, "final-loss": 30.0, "passkey-filler": 20.0, "passkey-pycode": 20.0},
    length=1024, sliding=128, goal_far=(512, 1024), goal_near=(64, 128), goal_far_second=(256, 512),
    passkey_lengths=(256, 512, 1024, 2048), keys=1, depths=(0.0, 0.5, 1.0), resamples=200)
VARIANTS = {v.name: v for v in (FULL, TINY)}


@dataclass(frozen=True)
class Run:
    """One training run of the recipe, as its preset (and the variant's overrides) compose."""

    name: str
    preset: str
    folder: str  # its run directory, under the output directory
    after: str | None  # the run whose last checkpoint it starts from (None: from scratch)
    seq_len: int
    batch_size: int
    start: int  # its first step: the end of `after`, or 0
    end: int  # its last step (max_steps)
    rope: dict  # model.rope_* as composed
    overrides: tuple[str, ...]  # the variant's, then its own
    what: str  # model, attention and data, for the plan's description

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size


@dataclass(frozen=True)
class Evaluation:
    """One evaluation: minigpt-eval commands (their arguments), reading `reads`'s model."""

    name: str
    reads: str
    argvs: tuple[tuple[str, ...], ...]
    seconds: float
    what: str


@dataclass(frozen=True)
class Prepare:
    """The data, once per machine: corpus, the recipe's tokenizer (trained the first time), token streams."""

    seconds: float
    name: str = "prepare"


@dataclass(frozen=True)
class Train:
    """Steps first -> last of a run."""

    run: Run
    first: int
    last: int

    @property
    def name(self) -> str:
        return self.run.name

    @property
    def steps(self) -> int:
        return self.last - self.first


Item = Union[Prepare, Train, Evaluation]


@dataclass
class Plan:
    variant: Variant
    out: Path  # absolute
    runs: list[Run]
    extra: tuple[str, ...] = ()  # the user's overrides, after everything else
    evaluations: list[Evaluation] = field(default_factory=list)

    def run(self, name: str) -> Run:
        """The run of this name; KeyError if the plan has none."""
        for r in self.runs:
            if r.name == name:
                return r
        raise KeyError(f"no run {name!r} in this plan")

    @property
    def tokenizer(self) -> Path:
        return self.out / TOKENIZER_FILE

    def fingerprint(self) -> dict:
        """What a recipe's output directory must have been started with to be continued by this plan."""
        return {"variant": self.variant.name, "extra": list(self.extra),
                "runs": [[r.name, r.seq_len, r.batch_size, r.start, r.end] for r in self.runs]}

    # ---------------------------------------------------------------------------------------------
    # estimates
    # ---------------------------------------------------------------------------------------------
    def step_seconds(self, run: Run, measured: dict[str, float]) -> float:
        """A step's estimated seconds: its tokens over the measured tokens/s of its length, else the variant's (of
        the nearest length it has), times STEP_OVERHEAD."""
        rate = measured.get(str(run.seq_len))
        if rate is None:
            table = self.variant.tokens_per_s
            rate = table[min(table, key=lambda n: abs(math.log2(n / run.seq_len)))]
        return run.tokens_per_step / rate * STEP_OVERHEAD

    def seconds(self, item: Item, measured: dict[str, float]) -> float:
        if isinstance(item, Train):
            return self.variant.start_s + item.steps * self.step_seconds(item.run, measured)
        return item.seconds

    def first_piece(self, item: Item, left_s: float, measured: dict[str, float], alone: bool
                    ) -> tuple[Item | None, Item | None]:
        """(what of `item` to do in the `left_s` seconds left of a segment, what remains of it): a run is split at
        the step the time reaches (a multiple of 10 from 100 steps on), anything else goes whole or not at all.
        `alone`: nothing else is in the segment, so something is done however little time is left."""
        if not isinstance(item, Train):
            return (item, None) if alone or self.seconds(item, measured) <= left_s else (None, item)
        fit = math.floor((left_s - self.variant.start_s) / self.step_seconds(item.run, measured))
        if fit >= item.steps:
            return item, None
        if fit >= 100:
            fit -= fit % 10
        if fit < MIN_PIECE_STEPS:
            if not alone:
                return None, item
            fit = min(item.steps, MIN_PIECE_STEPS)
            if fit == item.steps:
                return item, None
        cut = item.first + fit
        return replace(item, last=cut), replace(item, first=cut)

    def segments(self, items: list[Item], measured: dict[str, float], budget_s: float
                 ) -> list[list[tuple[Item, float]]]:
        """The items in segments of at most budget_s (less the reserve) by the estimates, each (piece, seconds)."""
        out: list[list[tuple[Item, float]]] = []
        current: list[tuple[Item, float]] = []
        left = budget_s - self.variant.reserve_s
        queue = list(items)
        while queue:
            piece, rest = self.first_piece(queue[0], left, measured, alone=not current)
            if piece is None:
                out.append(current)
                current, left = [], budget_s - self.variant.reserve_s
                continue
            seconds = self.seconds(piece, measured)
            current.append((piece, seconds))
            left -= seconds
            queue = ([rest] if rest is not None else []) + queue[1:]
        if current:
            out.append(current)
        return out

    # ---------------------------------------------------------------------------------------------
    # commands
    # ---------------------------------------------------------------------------------------------
    def train_command(self, item: Train, resume: str) -> list[str]:
        """The trainer's command for steps item.first -> item.last, resuming from `resume` (auto, or the previous
        run's checkpoints)."""
        run = item.run
        extend = ["resume_extend=true"] if run.after else []
        return [sys.executable, "-m", "minigpt", f"+recipe={run.preset}", *run.overrides, *self.extra,
                f"data.tokenizer={quoted(self.tokenizer)}", f"max_steps={item.last}",
                f"resume={resume if resume == 'auto' else quoted(resume)}", *extend,
                f"hydra.run.dir={quoted(self.out / run.folder)}"]

    def resume_of(self, item: Train, own_checkpoints: bool) -> str:
        """What a piece of a run resumes from: auto (its own checkpoints, or none for a first run), else the
        previous run's checkpoints."""
        run = item.run
        if own_checkpoints or run.after is None:
            return "auto"
        return str(self.out / self.run(run.after).folder / "checkpoints")

    def eval_commands(self, evaluation: Evaluation) -> list[list[str]]:
        return [[sys.executable, "-m", "minigpt.eval", *argv] for argv in evaluation.argvs]


def quoted(path: str | Path) -> str:
    """A path as a Hydra override value: as it is when plain, else in Hydra's single quotes (so that `=`, `,` or
    spaces in it stay the path's)."""
    text = str(path)
    if re.fullmatch(r"[\w./-]+", text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def shown(argv: list[str]) -> str:
    """A command as a shell line, `python` for this interpreter's path."""
    return shlex.join(["python" if argv[0] == sys.executable else argv[0], *argv[1:]])


def compose_run(name: str, preset: str, folder: str, after: str | None, variant: Variant, extra: tuple[str, ...],
                start: int) -> Run:
    """The run as its preset composes with the variant's and the user's overrides (the checks that need no GPU:
    a plan is made anywhere). ConfigError for a bad override."""
    from minigpt.compose import compose

    overrides = (*variant.overrides, *variant.run_overrides.get(name, ()))
    cfg: TrainConfig = compose([f"+recipe={preset}", *overrides, *extra], machine=False)
    what = f"model={cfg.model.name} attention={cfg.attention.name} data={cfg.data.name}" + \
        (f" data.passkey_fraction={cfg.data.passkey_fraction:g}" if cfg.data.passkey_fraction else "")
    return Run(name, preset, folder, after, cfg.seq_len, cfg.batch_size, start, cfg.max_steps,
               {k: getattr(cfg.model, k) for k in ROPE_KEYS}, overrides, what)


def evaluations(variant: Variant, out: Path) -> list[Evaluation]:
    """The minigpt-eval commands of the recipe, in ORDER."""
    v, k = variant, length_label
    final, baseline = str(out / dict((n, f) for n, _, f, _ in RUNS)[FINAL]), str(out / "baseline")
    sliding_out, final_out = out / "eval" / "baseline_sliding", out / "eval" / "final"
    common = [*(["--resamples", str(v.resamples)] if v.resamples else []),
              *(["--min-docs", str(v.min_docs)] if v.min_docs else [])]
    span = lambda s: f"{k(s[0])},{k(s[1])}"  # noqa: E731
    goals = ["--goal-near", span(v.goal_near)]
    grid = ["--no-loss", "--passkey-grid", "--passkey-lengths", ",".join(k(n) for n in v.passkey_lengths),
            "--keys", str(v.keys), *(["--depths", *map(str, v.depths)] if v.depths else []),
            "--out", str(out / "eval" / "passkey")]
    return [
        Evaluation("baseline-sliding", BASELINE, (
            (baseline, "--lengths", k(v.length), "--sliding", k(v.sliding), *common, "--out", str(sliding_out)),),
            v.eval_seconds["baseline-sliding"], f"the baseline at every position to {k(v.length)} through sliding "
                                               f"{k(v.sliding)} windows"),
        Evaluation("final-loss", FINAL, (
            (final, str(sliding_out / "loss_by_position.json"), "--lengths", k(v.length), "--goal-far",
             span(v.goal_far), *goals, *common, "--out", str(final_out)),
            (str(final_out / "loss_by_position.json"), "--goal-far", span(v.goal_far_second), *goals,
             *(["--resamples", str(v.resamples)] if v.resamples else []),
             "--out", str(out / "eval" / f"final_{k(v.goal_far_second[0])}_{k(v.goal_far_second[1])}"))),
            v.eval_seconds["final-loss"], f"the final model at every position to {k(v.length)} against the "
                                          f"baseline's curve: the goal figures"),
        Evaluation("passkey-filler", FINAL, ((final, *grid, "--haystack", "filler"),),
                   v.eval_seconds["passkey-filler"], "the final model's passkey grid in the filler"),
        Evaluation("passkey-pycode", FINAL, ((final, *grid, "--haystack", "pycode"),),
                   v.eval_seconds["passkey-pycode"], "the final model's passkey grid in held-out pycode"),
    ]


def build_plan(variant: Variant, out: str | Path, extra: tuple[str, ...] = ()) -> Plan:
    """The recipe's plan for this variant and output directory, the runs composed from their presets."""
    out = Path(out).expanduser().absolute()
    runs: list[Run] = []
    for name, preset, folder, after in RUNS:
        start = next(r.end for r in runs if r.name == after) if after else 0
        run = compose_run(name, preset, folder, after, variant, extra, start)
        if run.end <= start:
            raise ConfigError(f"configs/recipe/{preset}.yaml: max_steps={run.end} must come after {after}'s last "
                              f"step, {start}")
        runs.append(run)
    return Plan(variant, out, runs, extra, evaluations(variant, out))

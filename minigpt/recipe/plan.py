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

The passkey grid (Variant.keys keys in every cell of depths x passkey_lengths) is too long for one segment: each
haystack's grid runs as parts (grid_parts: whole lengths together, a length too long for one part split into runs of
depths), each a minigpt-eval command into its own folder under eval/passkey/parts/, then one command merges them into
eval/passkey/passkey_<haystack>/, the files one command over every cell writes. Each part is an item of its own, so a
stopped part is done again alone and a finished one is never done twice.

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
from minigpt.eval.passkey_grid import HAYSTACKS, length_label
from minigpt.eval.retrieval import DEFAULT_DEPTHS

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
    eval_seconds: dict[str, float]  # each evaluation's estimate (a passkey grid's: its parts', below)
    length: int  # loss by position up to this position
    sliding: int  # the baseline's window
    goal_far: tuple[int, int]  # the goal figures' far positions, near ones, and the second far span
    goal_near: tuple[int, int]
    goal_far_second: tuple[int, int]
    passkey_lengths: tuple[int, ...]
    keys: int  # passkey keys per cell
    passkey_key_s: dict[int, float]  # by length: one key's seconds (its greedy forwards), to plan the grid's parts
    passkey_start_s: dict[str, float]  # by haystack: a part's command before its first key (pycode: the documents)
    passkey_part_s: float  # the most seconds of keys one part holds
    depths: tuple[float, ...] | None = None  # None: minigpt-eval's 11
    resamples: int | None = None  # None: minigpt-eval's 1000
    min_docs: int | None = None  # None: the corpus's guarantee


FULL = Variant(
    name="full", out="runs/long_context", hardware="one H100 80GB", overrides=(), run_overrides={},
    tokens_per_s={2048: 1.2e6, 8192: 0.95e6, 32768: 4.0e5, 65536: 2.3e5},
    start_s=45.0, prepare_s=90.0, reserve_s=60.0, budget_minutes=8.5,
    # loss by position reads ~2M held-out tokens in seconds, the rest is start and tokenizing the documents
    eval_seconds={"baseline-sliding": 60.0, "final-loss": 75.0, "passkey-merge": 10.0},
    length=65536, sliding=2048, goal_far=(32768, 65536), goal_near=(1024, 2048), goal_far_second=(16384, 32768),
    # A key costs 6 greedy forwards of its length. On the H200 (results/long_context/recipe.log) the grid of 5 keys x
    # 11 depths at 16K-128K took 107 s in the filler, 119 in pycode; less ~15 s to start (27 with pycode's held-out
    # documents tokenized), 92 s of keys, shared by forward FLOPs per key, 6 L (37.8M + 6144 L): 1.5, 5.2, 19.3 and
    # 73.9% (536 TFLOP/s), then / 0.95 for an H100 (long_context.yaml). 20 keys x 11 depths: 6, 20, 75 and 286 s.
    # Parts of at most 4 minutes of keys: 16K-64K in one part, 128K in two (depths 0-0.5, 0.6-1), 2-3 minutes each
    # with the start, so an estimate 2x short still fits a segment.
    passkey_lengths=(16384, 32768, 65536, 131072), keys=20,
    passkey_key_s={16384: 0.027, 32768: 0.092, 65536: 0.34, 131072: 1.30},
    passkey_start_s={"filler": 15.0, "pycode": 27.0}, passkey_part_s=240.0,
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
    eval_seconds={"baseline-sliding": 15.0, "final-loss": 30.0, "passkey-merge": 5.0},
    length=1024, sliding=128, goal_far=(512, 1024), goal_near=(64, 128), goal_far_second=(256, 512),
    # two parts a haystack: 256-1K, 2K
    passkey_lengths=(256, 512, 1024, 2048), keys=1, passkey_key_s={256: 0.05, 512: 0.1, 1024: 0.25, 2048: 0.6},
    passkey_start_s={"filler": 8.0, "pycode": 10.0}, passkey_part_s=2.0, depths=(0.0, 0.5, 1.0), resamples=200)
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
    logger: str = "none"  # logger.name as composed: with wandb, the evaluations log to W&B too

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size


@dataclass(frozen=True)
class Evaluation:
    """One evaluation: minigpt-eval commands (their arguments), reading `reads`'s model (None: earlier results)."""

    name: str
    reads: str | None
    argvs: tuple[tuple[str, ...], ...]
    seconds: float
    what: str
    slot: str | None = None  # its place in ORDER (None: its name)
    output: Path | None = None  # the file its last command writes: it is done only while that is there

    @property
    def place(self) -> str:
        return self.slot or self.name


@dataclass(frozen=True)
class GridPart:
    """Some cells of a haystack's passkey grid: these lengths at these depths, `keys` keys each."""

    haystack: str
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    keys: int
    split: bool  # one length's run of depths, not all of them

    @property
    def name(self) -> str:
        lengths = "-".join(length_label(n) for n in self.lengths)
        depths = f"-depths-{self.depths[0]:g}-{self.depths[-1]:g}" if self.split else ""
        return f"passkey-{self.haystack}-{lengths}{depths}"


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
               {k: getattr(cfg.model, k) for k in ROPE_KEYS}, overrides, what, cfg.logger.name)


def grid_parts(variant: Variant, haystack: str) -> list[GridPart]:
    """The haystack's passkey grid in parts of at most variant.passkey_part_s seconds of keys (by passkey_key_s):
    lengths in order, together while they fit, and a length that does not fit alone in the fewest runs of
    consecutive depths that do (as even as they divide, the first ones longer; a depth alone may not fit)."""
    v = variant
    depths = tuple(sorted(set(v.depths or DEFAULT_DEPTHS)))
    parts: list[GridPart] = []
    group: list[int] = []
    group_s = 0.0
    for n in sorted(set(v.passkey_lengths)):
        seconds = len(depths) * v.keys * v.passkey_key_s[n]
        if group and group_s + seconds > v.passkey_part_s:
            parts.append(GridPart(haystack, tuple(group), depths, v.keys, False))
            group, group_s = [], 0.0
        if seconds <= v.passkey_part_s:
            group.append(n)
            group_s += seconds
            continue
        fit = max(1, math.floor(v.passkey_part_s / (v.keys * v.passkey_key_s[n])))  # depths a part holds
        runs = math.ceil(len(depths) / fit)
        size, longer = divmod(len(depths), runs)
        at = 0
        for i in range(runs):
            take = size + (i < longer)
            parts.append(GridPart(haystack, (n,), depths[at : at + take], v.keys, runs > 1))
            at += take
    if group:
        parts.append(GridPart(haystack, tuple(group), depths, v.keys, False))
    return parts


def part_seconds(variant: Variant, part: GridPart) -> float:
    return variant.passkey_start_s[part.haystack] + \
        part.keys * len(part.depths) * sum(variant.passkey_key_s[n] for n in part.lengths)


def passkey_evaluations(variant: Variant, out: Path, final: str, wandb: bool = False) -> list[Evaluation]:
    """Each haystack's grid: its parts (grid_parts), each into eval/passkey/parts/<part>/, then their merge into
    eval/passkey/passkey_<haystack>/; `wandb`: each command logs a W&B run too."""
    k = length_label
    logs = ["--wandb"] if wandb else []
    items: list[Evaluation] = []
    for haystack in HAYSTACKS:
        folder = f"passkey_{haystack}"
        parts = grid_parts(variant, haystack)
        files = [out / "eval" / "passkey" / "parts" / p.name.removeprefix("passkey-") / folder / "passkey_grid.json"
                 for p in parts]
        for part, file in zip(parts, files):
            depths = f"depths {part.depths[0]:g}-{part.depths[-1]:g}" if part.split else f"{len(part.depths)} depths"
            items.append(Evaluation(
                part.name, FINAL, ((final, "--no-loss", "--passkey-grid", "--passkey-lengths",
                                    ",".join(k(n) for n in part.lengths), "--depths", *map(str, part.depths),
                                    "--keys", str(part.keys), "--haystack", haystack, *logs,
                                    "--out", str(file.parent.parent)),),
                part_seconds(variant, part), f"the final model's passkey grid in {haystack} at "
                                             f"{', '.join(k(n) for n in part.lengths)}, {depths} x {part.keys} keys",
                slot=f"passkey-{haystack}", output=file))
        merged = out / "eval" / "passkey"
        items.append(Evaluation(
            f"passkey-{haystack}-merge", None, ((*map(str, files), *logs, "--out", str(merged)),),
            variant.eval_seconds["passkey-merge"], f"the {len(parts)} parts into one {haystack} grid, "
                                                   f"eval/passkey/{folder}/",
            slot=f"passkey-{haystack}", output=merged / folder / "passkey_grid.json"))
    return items


def evaluations(variant: Variant, out: Path, wandb: bool = False) -> list[Evaluation]:
    """The minigpt-eval commands of the recipe, in ORDER; `wandb`: each also logs a W&B run (minigpt-eval --wandb),
    into wandb/ of its --out, where the export finds it."""
    v, k = variant, length_label
    final, baseline = str(out / dict((n, f) for n, _, f, _ in RUNS)[FINAL]), str(out / "baseline")
    sliding_out, final_out = out / "eval" / "baseline_sliding", out / "eval" / "final"
    logs = ["--wandb"] if wandb else []
    common = [*(["--resamples", str(v.resamples)] if v.resamples else []),
              *(["--min-docs", str(v.min_docs)] if v.min_docs else []), *logs]
    span = lambda s: f"{k(s[0])},{k(s[1])}"  # noqa: E731
    goals = ["--goal-near", span(v.goal_near)]
    second = out / "eval" / f"final_{k(v.goal_far_second[0])}_{k(v.goal_far_second[1])}"
    return [
        Evaluation("baseline-sliding", BASELINE, (
            (baseline, "--lengths", k(v.length), "--sliding", k(v.sliding), *common, "--out", str(sliding_out)),),
            v.eval_seconds["baseline-sliding"], f"the baseline at every position to {k(v.length)} through sliding "
                                               f"{k(v.sliding)} windows", output=sliding_out / "loss_by_position.json"),
        Evaluation("final-loss", FINAL, (
            (final, str(sliding_out / "loss_by_position.json"), "--lengths", k(v.length), "--goal-far",
             span(v.goal_far), *goals, *common, "--out", str(final_out)),
            (str(final_out / "loss_by_position.json"), "--goal-far", span(v.goal_far_second), *goals,
             *(["--resamples", str(v.resamples)] if v.resamples else []), *logs, "--out", str(second))),
            v.eval_seconds["final-loss"], f"the final model at every position to {k(v.length)} against the "
                                          f"baseline's curve: the goal figures",
            output=second / "loss_by_position.json"),
        *passkey_evaluations(v, out, final, wandb),
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
    return Plan(variant, out, runs, extra, evaluations(variant, out, wandb=runs[-1].logger == "wandb"))

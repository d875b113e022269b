"""Find the longest context each attention backend can train at batch 1, then report table, plots and W&B.

    minigpt-sweep                                  # naive, sdpa, flash, flex, each eager and +compile; gpt2-small
    minigpt-sweep --variants sdpa flash flash+levers --start flash+levers=262144
    minigpt-sweep --variants flash+levers --no-search --probe-seq-lens 2097152   # 2M derived from 1-/2-layer probes
    minigpt-sweep --cpu                                            # tiny model on CPU (smoke test)
    (on a machine without a GPU a GPU-sized sweep is refused with exit code 2; --allow-cpu runs it anyway)
    minigpt-sweep --variants flash+levers --nproc 2 --context 2    # each trial under torchrun, sequence split over 2
    minigpt-sweep --grid --variants naive sdpa flash --out runs/grid   # the figures' grid: 1K, 2K, 4K, ... to the OOM
    minigpt-sweep --combine runs/sweeps/* --out results --name context_scaling_H200   # publish a combined table

(or `python scripts/context_sweep.py ...`, `python -m minigpt.sweep.sweep ...`, from any directory.)
Variants are <backend>[+lever...] (`--help` lists both; levers=bf16ckpt+losschunk+mlpchunk, keepattn only
with a backend that returns its log-sum-exp). Each trial is the trainer in a fresh process; its files are in
--out/trials/<variant>-n<seq_len>/ (summary.json, trainer.log). An error trial (a bad setting, a crash) is
not a memory limit: it ends that variant's search and is listed under the table.

Results go to --out (default runs/sweeps/<date>-<time>, git-ignored; publishing is an explicit --out results/...,
and every path the sweep records is relative): trials.jsonl (every trial, appended as it ends) and results.{json,csv,md} and *.png,
built from every trial in trials.jsonl (also of variants run there before). Re-running with the same --out
resumes: ok and oom trials are reused, a timeout is reused unless --trial-time-limit grew, error trials
run again.

Exit code: 0 when every requested variant has a result (a longest length, or "none fits"), 1 when a variant
had only error trials or the budget ran out before it ran, 2 for bad arguments, 128 + signal when interrupted
(SIGINT, SIGTERM, SIGHUP: the running trial gets the same signal and, after a grace period, SIGKILL; the report
of the trials that finished is written; the same command resumes).
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from minigpt.attention import attention_names
from minigpt.sweep.report import (by_variant, combine, derive_all, log_summary_to_wandb, only_errors, plot,
                                        write_reports)
from minigpt.sweep.runner import TRIALS_FILE, SubprocessRunner, TrialStore
from minigpt.sweep.search import (LEVERS, Trial, TrialRunner, best, is_probe, judge_fit, probe_variant,
                                        search_max_seq_len, variant_overrides)
from minigpt.figures import GRID_START  # --grid's default first length: the figures' x axis
from minigpt.files import WriteError
from minigpt.signals import Interrupted, StopSignals

# Each backend eager and compiled, so the table shows what compile alone buys in context length.
DEFAULT_VARIANTS = [v for name in attention_names() for v in (name, f"{name}+compile")]
# What --cpu and a GPU sweep use for the settings the user did not give.
DEFAULTS = {
    "gpu": {"variants": DEFAULT_VARIANTS, "base": ["model=gpt2-small"], "default_start": 4096, "granularity": 128,
            "max_seq_len": None, "full_layers": 12},
    "cpu": {"variants": ["naive", "sdpa"], "base": ["model=tiny", "device=cpu"], "default_start": 128,
            "granularity": 64, "max_seq_len": 512, "full_layers": 2},
}


@dataclass
class SweepConfig:
    variants: list[str]
    out_dir: Path
    base_overrides: list[str] = field(default_factory=lambda: ["model=gpt2-small"])
    start: dict[str, int] = field(default_factory=dict)  # per-variant start seq_len
    default_start: int = 4096
    granularity: int = 128
    max_seq_len: int | None = None
    steps: int = 2
    trial_time_limit_s: float = 600.0
    budget_s: float = 3600.0
    logger: str = "wandb"
    project: str = "minigpt"
    probe_seq_lens: list[int] = field(default_factory=list)  # probe mode: these lengths with fewer layers
    probe_layers: tuple[int, ...] = (1, 2)
    full_n_layer: int = 12  # the layers of the model the probes stand for
    search: bool = True  # False: only the probes
    bisect: bool = True  # False: the doubling alone, start·2^k up to the first OOM (--grid)
    nproc: int = 1  # processes per trial (torchrun); global batch = nproc / context sequences
    context: int = 1  # parallel.context of each trial
    gpu_memory_gib: float | None = None  # what a derived figure must fit per GPU (None: this GPU's, if any)
    host_memory_gib: float | None = None  # what its offloaded activations must fit on the host (None: not judged)


def _this_gpu_gib() -> float | None:
    """This machine's GPU memory (the first device's), or None without CUDA."""
    import torch
    return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else None


@dataclass
class SweepResult:
    report: Path  # results.md
    no_result: list[str]  # requested variants with only error trials, or none run before the budget ran out
    signum: int | None = None  # the signal that stopped the sweep

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum else 1 if self.no_result else 0


def trial_line(t: Trial, reused: bool = False) -> str:
    """One progress line per trial."""
    peak = f"{t.peak_allocated_gib:6.1f} GiB" if t.peak_allocated_gib is not None else ""
    kb = f"{t.kb_per_token:7.1f} KB/token" if t.kb_per_token else ""
    speed = f"{t.tokens_per_s:,.0f} tok/s" if t.tokens_per_s else ""
    took = "(from trials.jsonl)" if reused else f"({t.wall_s or 0:.0f} s)"
    return " ".join(x for x in (f"  {t.variant:24s} n={t.seq_len:>9,d}  {t.status:7s}", peak, kb, speed, took,
                                t.error or "") if x)


def _outcome(variant: str, trials: list[Trial]) -> str:
    b = best(trials)
    if b:
        return f"{variant}: max seq_len {b.seq_len:,}"
    if only_errors(trials):
        return f"{variant}: no result, every trial failed with an error: {trials[-1].error}"
    return f"{variant}: no length trained" if trials else f"{variant}: not run (sweep budget spent)"


def recorded(run: TrialRunner, store: TrialStore, time_limit_s: float, log: Callable[[str], None]) -> TrialRunner:
    """`run`, but a trial with a reusable record in the store is not run again, and each new one is recorded."""
    def trial(variant: str, seq_len: int) -> Trial:
        t = store.reusable(variant, seq_len, time_limit_s)
        if t is not None:
            log(trial_line(t, reused=True))
            return t
        t = run(variant, seq_len)
        store.add(t)
        log(trial_line(t))
        return t

    return trial


def run_sweep(cfg: SweepConfig, runner: TrialRunner | None = None, log: Callable[[str], None] = print) -> SweepResult:
    """Search every variant (and run the probes), then report every trial of cfg.out_dir."""
    out_dir = cfg.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep_id = f"sweep-{out_dir.name}"
    store = TrialStore(out_dir / TRIALS_FILE, log)
    run = recorded(runner or SubprocessRunner(out_dir, cfg.base_overrides, sweep_id, cfg.steps, cfg.trial_time_limit_s,
                                              cfg.logger, nproc=cfg.nproc, context=cfg.context),
                   store, cfg.trial_time_limit_s, log)
    deadline = time.perf_counter() + cfg.budget_s

    def out_of_time() -> bool:
        return time.perf_counter() > deadline

    ran: dict[str, list[Trial]] = {v: [] for v in cfg.variants}
    signum = None
    try:
        for variant in cfg.variants if cfg.search else []:
            start = cfg.start.get(variant, cfg.default_start)
            log(f"{variant}: {'searching' if cfg.bisect else 'doubling (the grid)'} from {start:,}")
            ran[variant] += search_max_seq_len(run, variant, start, cfg.granularity, cfg.max_seq_len, out_of_time,
                                               cfg.bisect)
            log(_outcome(variant, ran[variant]))
        for n in cfg.probe_seq_lens:
            for variant in cfg.variants:
                ran[variant] += [run(probe_variant(variant, layers), n) for layers in cfg.probe_layers
                                 if not out_of_time()]
    except Interrupted as e:  # the running trial was stopped with the same signal (runner.py); report what ran
        signum = e.signum
        log(f"{signal.Signals(signum).name}: the running trial was stopped; reporting the trials that finished")
    if out_of_time():
        log(f"sweep budget of {cfg.budget_s:.0f} s spent; reporting what ran")

    trials = store.latest()
    gpu_gib = cfg.gpu_memory_gib or _this_gpu_gib()
    derived = [judge_fit(d, gpu_gib, cfg.host_memory_gib) for d in derive_all(trials, cfg.full_n_layer)]
    for d in derived:
        host = f", {d['host_offload_gib']:.1f} GiB on the host" if d.get("host_offload_gib") else ""
        log(f"{d['variant']} at {d['seq_len']:,}: derived {d['peak_allocated_gib']:.1f} GiB "
            f"({d['kb_per_token']:.1f} KB/token){host}, {d['step_time_s']:.1f} s/step for {d['n_layer']} layers: "
            f"{d['limit']}")
    no_result = [v for v, ts in ran.items() if not ts or only_errors(ts)]
    ranks = f" per data-parallel rank, torchrun {cfg.nproc} processes, context parallel {cfg.context}" \
        if cfg.nproc > 1 else ""
    header = (f"Context-length sweep `{sweep_id}`: batch 1{ranks}, {cfg.steps} training steps per trial, "
              f"overrides (of the latest run) {' '.join(cfg.base_overrides)}. Peak = torch.cuda.max_memory_allocated.")
    plots = plot(by_variant(trials), out_dir, derived)
    md = write_reports(trials, derived, out_dir, header)
    result = SweepResult(md, no_result, signum)
    if cfg.logger == "wandb":
        log_summary_to_wandb(trials, derived, plots, sweep_id, cfg.project, out_dir, result.exit_code)
    return result


# ------------------------------------------------------------------------------------------------
# Command line: every argument is checked here, so a bad one ends with usage, one line and exit code 2
# ------------------------------------------------------------------------------------------------
def _positive(parse: Callable[[str], float], what: str) -> Callable[[str], float]:
    """An argparse type: `parse` the text and require a value > 0."""
    def check(text: str) -> float:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {what}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return check


positive_int = _positive(int, "whole number")
positive_float = _positive(float, "number")


def variant_arg(text: str) -> str:
    if is_probe(text):
        raise argparse.ArgumentTypeError(f"{text}: probes come from --probe-seq-lens and --probe-layers")
    try:
        variant_overrides(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def start_arg(text: str) -> tuple[str, int]:
    variant, eq, n = text.partition("=")
    if not eq:
        raise argparse.ArgumentTypeError(f"{text!r}: expected VARIANT=SEQ_LEN, e.g. flash=65536")
    try:
        return variant_arg(variant), positive_int(n)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text}: {e}") from None


def override_arg(text: str) -> str:
    if "=" not in text and not text.startswith("~"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, a trainer override (e.g. model.n_layer=4)")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [--variants VARIANT ...] [--out DIR] [options] | "
                                      "%(prog)s --combine DIR ... --out DIR")
    p.add_argument("--variants", nargs="+", type=variant_arg, default=None, metavar="VARIANT",
                   help=f"<backend>[+lever...]; backends: {', '.join(attention_names())}; levers: {', '.join(LEVERS)} "
                        f"(default: each backend eager and +compile; --cpu: naive sdpa)")
    p.add_argument("--out", type=Path, metavar="DIR", default=Path("runs/sweeps") / time.strftime("%Y%m%d-%H%M%S"),
                   help="sweep directory (default: runs/sweeps/<date>-<time>, git-ignored; publish with --out "
                        "results/...); an existing one resumes")
    p.add_argument("--start", nargs="*", type=start_arg, default=[], metavar="VARIANT=N",
                   help="start seq_len of a variant")
    p.add_argument("--default-start", metavar="N", type=positive_int,
                   help="start seq_len of the others (4096; --cpu: 128)")
    p.add_argument("--granularity", metavar="N", type=positive_int, help="bisection step (128; --cpu: 64)")
    p.add_argument("--max-seq-len", metavar="N", type=positive_int, help="longest seq_len tried (none; --cpu: 512)")
    p.add_argument("--steps", metavar="N", type=positive_int, default=2, help="training steps per trial")
    p.add_argument("--trial-time-limit", metavar="SECONDS", type=positive_float, default=600.0,
                   help="seconds per trial")
    p.add_argument("--budget", metavar="SECONDS", type=positive_float, default=3600.0,
                   help="seconds for the whole sweep")
    p.add_argument("--logger", choices=["wandb", "none"], default="wandb")
    p.add_argument("--project", default="minigpt", help="W&B project")
    p.add_argument("--probe-seq-lens", type=positive_int, nargs="*", default=[], metavar="N",
                   help="probe these lengths with models of --probe-layers layers, to derive the full model's")
    p.add_argument("--probe-layers", type=positive_int, nargs="+", default=[1, 2], metavar="L",
                   help="layer counts of the probes (1 2). A derivation needs two depths: one call may run one depth "
                        "and another call into the same --out the other (e.g. two GPUs at once)")
    p.add_argument("--full-layers", metavar="N", type=positive_int,
                   help="layers of the model the probes stand for (12, gpt2-small; --cpu: 2, tiny)")
    p.add_argument("--gpu-memory-gib", metavar="GIB", type=positive_float,
                   help="GPU memory a derived figure must fit, per GPU (this GPU's total)")
    p.add_argument("--host-memory-gib", metavar="GIB", type=positive_float,
                   help="host memory the derived figure's offloaded activations must fit, all ranks of one "
                        "host together (not judged unless given: give the machine's stated RAM, as MemTotal may "
                        "start low)")
    p.add_argument("--no-search", action="store_true", help="skip the search, run only the probes")
    p.add_argument("--grid", action="store_true",
                   help="the figures' grid instead of the search: each variant at its start (--default-start: 1024 "
                        "here), doubled up to its first failure (out of memory or a timeout), no bisection; starts "
                        "and --max-seq-len powers of two")
    p.add_argument("--nproc", metavar="N", type=positive_int, default=1,
                   help="processes per trial: each trial runs under torchrun --standalone --nproc_per_node N (one node)")
    p.add_argument("--context", metavar="K", type=positive_int, default=1,
                   help="context-parallel degree of each trial (parallel.context=K; divides --nproc; attention=flash)")
    p.add_argument("--cpu", action="store_true",
                   help="tiny model on CPU; supplies the defaults of the settings not given (smoke test)")
    p.add_argument("--allow-cpu", action="store_true",
                   help="run a GPU-sized sweep (a model other than tiny or small-6l, or seq_len > 2048) on a machine "
                        "without a GPU anyway (refused otherwise)")
    p.add_argument("--set", nargs="*", type=override_arg, default=[], metavar="KEY=VALUE",
                   help="extra trainer overrides")
    p.add_argument("--combine", type=Path, nargs="+", metavar="DIR",
                   help="merge these finished sweep dirs into one report in --out")
    p.add_argument("--name", default="context_scaling", help="file stem of a --combine report")
    p.add_argument("--header", default="Context-length scaling, gpt2-small, batch 1.",
                   help="first line of a --combine report")
    return p


def gpu_sized_on_cpu(overrides: list[str], variants: list[str], start: dict[str, int], default_start: int,
                     probe_seq_lens: list[int]) -> str | None:
    """Why this sweep is too big for this machine: it has no GPU (the trials would run on the CPU, where nothing
    runs out of memory) and the model or a start length is GPU-sized (config.gpu_sized); None otherwise."""
    import torch

    from minigpt.config import gpu_sized

    if torch.cuda.is_available() or any(o.lstrip("+") == "device=cuda" for o in overrides):
        return None  # (device=cuda without a GPU: every trial ends with the trainer's own one line)
    model = next((o.partition("=")[2] for o in reversed(overrides) if o.lstrip("+").partition("=")[0] == "model"),
                 None)
    longest = max([start.get(v, default_start) for v in variants] + probe_seq_lens)
    return gpu_sized(model, longest)


def sweep_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SweepConfig:
    """The SweepConfig of parsed arguments; the checks that span arguments end in parser.error."""
    defaults = DEFAULTS["cpu" if args.cpu else "gpu"]

    def given(name: str):
        return defaults[name] if getattr(args, name) is None else getattr(args, name)

    if args.grid and args.default_start is None and not args.cpu:
        args.default_start = GRID_START
    variants = list(dict.fromkeys(given("variants")))
    start = dict(args.start)
    for variant, n in start.items():
        if variant not in variants:
            parser.error(f"argument --start: {variant}={n}: {variant} is not one of --variants ({' '.join(variants)})")
    if args.max_seq_len is not None and not args.no_search:  # a start above a --cpu default cap is simply tried
        for variant in variants:
            n, name = (start[variant], "--start") if variant in start else (given("default_start"), "--default-start")
            if n > args.max_seq_len:
                parser.error(f"argument {name}: {variant} would start at {n}, above --max-seq-len {args.max_seq_len}")
    if len(set(args.probe_layers)) < len(args.probe_layers):
        parser.error(f"argument --probe-layers: each layer count once, got {args.probe_layers}")
    if args.nproc % args.context:
        parser.error(f"argument --context: {args.context} must divide --nproc {args.nproc}")
    if args.no_search and not args.probe_seq_lens:
        parser.error("argument --no-search: needs --probe-seq-lens (nothing would run)")
    if args.grid and args.no_search:
        parser.error("argument --grid: not with --no-search (the grid is what runs instead of the search)")
    if args.grid:
        for variant in variants:
            n = start.get(variant, given("default_start"))
            if n & (n - 1):
                parser.error(f"argument --grid: {variant} would start at {n}, not a power of two (the figures' grid)")
        if args.max_seq_len is not None and args.max_seq_len & (args.max_seq_len - 1):
            parser.error(f"argument --grid: --max-seq-len {args.max_seq_len} is not a power of two (the figures' "
                         f"grid would end off it)")
    if args.logger == "wandb":  # an online W&B run without credentials would fail every trial, then the summary
        from minigpt.config import ConfigError, LoggerConfig
        from minigpt.loggers import check_wandb

        try:
            check_wandb(LoggerConfig(name="wandb"), none="--logger none")
        except ConfigError as e:
            parser.error(f"argument --logger: {e}")
    if not args.allow_cpu and (why := gpu_sized_on_cpu(defaults["base"] + args.set, variants, start,
                                                       given("default_start"), args.probe_seq_lens)):
        parser.error(f"no GPU, and this sweep is GPU-sized ({why}); for a CPU smoke test run --cpu, or add --allow-cpu "
                     f"to run it here anyway")
    out = args.out.expanduser().resolve()
    if out.exists() and not out.is_dir():
        parser.error(f"argument --out: {out} is a file, not a sweep directory")
    return SweepConfig(
        variants=variants, out_dir=out, base_overrides=defaults["base"] + args.set, start=start,
        default_start=given("default_start"), granularity=given("granularity"), max_seq_len=given("max_seq_len"),
        steps=args.steps, trial_time_limit_s=args.trial_time_limit, budget_s=args.budget, logger=args.logger,
        project=args.project, probe_seq_lens=args.probe_seq_lens, probe_layers=tuple(args.probe_layers),
        full_n_layer=given("full_layers"), search=not args.no_search, bisect=not args.grid, nproc=args.nproc,
        context=args.context, gpu_memory_gib=args.gpu_memory_gib, host_memory_gib=args.host_memory_gib)


def _progress(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    """The sweep's command line; returns the exit code (0 results, 1 a variant without one, 2 bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    with StopSignals(again="already stopping (the running trial, then the report); please wait", exiting=True):
        return _main(parser, args)


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        if args.combine:
            missing = [str(d) for d in args.combine if not (d / "results.json").is_file()]
            if missing:
                parser.error(f"argument --combine: no results.json in {', '.join(missing)} (not a finished sweep)")
            md = combine(args.combine, args.out.expanduser().resolve(), args.name, args.header)
            print(md.read_text())
            print(f"results: {md}")
            return 0
        result = run_sweep(sweep_config(parser, args), log=_progress)
    except Interrupted as e:  # before the trials, or while reporting them
        print(f"{e}: the finished trials are in trials.jsonl; the same command resumes", file=sys.stderr)
        return 128 + e.signum
    except WriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(result.report.read_text())
    if result.signum:
        print(f"interrupted by {signal.Signals(result.signum).name}: the running trial was stopped; the finished "
              f"trials are in trials.jsonl, the report in {result.report}; the same command resumes", file=sys.stderr,
              flush=True)
        return result.exit_code
    if result.no_result:
        print(f"no result for {', '.join(result.no_result)}: see its lines above and results.md", file=sys.stderr,
              flush=True)
    print(f"results: {result.report}")
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())

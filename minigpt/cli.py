"""Command-line entry points (console scripts in pyproject.toml; scripts/*.py call the same functions).

`minigpt-train` / `python scripts/train.py [overrides]` is a Hydra app with three things added in front:
- the overrides are composed and validated once before Hydra runs, so a wrong key, type or value ends with
  one line and exit code 2 instead of Hydra's multi-line report;
- each run gets a directory of its own (`outputs/<date>_<time>_<attention>_<model>_n<seq_len>`, with `-1`,
  `-2`, ... when two runs start in the same second), unless `hydra.run.dir` is given;
- with no GPU and no model chosen, CPU-sized defaults (config.CPU_DEFAULTS) replace the gpt2-small run, and a
  GPU-sized job asked for on the CPU is said to be one (one line), then runs;
- `--help` lists the config groups and every setting (minigpt/usage.py), and `--cfg job` prints the config as it
  will run on this machine (CPU defaults, device, dtype and compile resolved); Hydra's own help is `--hydra-help`;
- before Hydra writes anything: an override it cannot parse is refused with the quoting that works, the
  directories the run writes must be writable, and the run directory's lock is taken (minigpt/runlock.py); under
  `-m` each job is checked so and its folder locked (minigpt/multirun.py), as Hydra writes into it before the job;
- SIGINT, SIGTERM, SIGHUP before the run started end it with one line and 128 + signal.
A multirun (`-m`) exits with the first failing job's code.

Under torchrun (`torchrun --nproc_per_node=N -m minigpt ...`) every rank runs this: rank 0 reserves the run
directory and tells the others its name over torchrun's process group, rank 0 alone prints and writes Hydra's
record there, and a bad setting ends every rank with exit code 2 (torchrun itself then exits 1, naming the
workers' codes in its report).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from minigpt.compose import CONFIG_NAME, compose, config_dir, register_schema, to_train_config
from minigpt.config import CPU_DEFAULTS, ConfigError, TrainConfig
from minigpt.distributed.process import TorchrunProcess, env_rank
from minigpt.summary import ExitCode
from minigpt.usage import cpu_warning

if TYPE_CHECKING:
    from minigpt.multirun import Job

HYDRA_KEYS = ("hydra.", "+hydra.", "++hydra.")


def reserve_dir(parent: str | Path, name: str) -> Path:
    """Create parent/name, or parent/name-1, -2, ... if taken: the directory is this run's alone."""
    Path(parent).mkdir(parents=True, exist_ok=True)
    for k in range(10_000):
        path = Path(parent) / (name if k == 0 else f"{name}-{k}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise ConfigError(f"hydra.run.dir: {parent} has 10,000 runs named {name}; choose hydra.run.dir yourself")


def reserve_shared_dir(parent: str | Path, name: str) -> Path:
    """reserve_dir for all of torchrun's ranks: rank 0 reserves it and broadcasts its name over the process group
    (joined by train_main); one process reserves its own."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return reserve_dir(parent, name)
    box: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = reserve_dir(parent, name)
        except ConfigError as e:
            box[0] = e
    dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
    if isinstance(box[0], ConfigError):
        raise box[0]
    return Path(box[0])


def _key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


def _with_cpu_defaults(overrides: list[str], say: Callable[[str], None] = print) -> list[str]:
    """On a machine without a GPU, a run that names no model gets CPU-sized defaults for what it did not set."""
    cfg = compose(overrides)
    if cfg.torch_device().type != "cpu" or any(_key(o) == "model" for o in overrides):
        return overrides
    given = {_key(o) for o in overrides}
    added = [d for d in CPU_DEFAULTS if _key(d) not in given]
    say(f"no GPU: using CPU-sized defaults {' '.join(added)} (name a model, e.g. model=gpt2-small, to override)")
    return [*added, *overrides]


def _run_name(cfg: TrainConfig) -> str:
    """A run directory's name: outputs/<date>_<time>_<attention>_<model>_n<seq_len>."""
    return f"{time.strftime('%Y-%m-%d_%H-%M-%S')}_{cfg.attention.name}_{cfg.model.name}_n{cfg.seq_len}"


def _job_request(argv: list[str]) -> list[str] | None:
    """The overrides of `--cfg job [--resolve] [overrides]` (printed here, resolved for this machine); None for any
    other command line (`--cfg hydra|all`, other flags: Hydra's)."""
    rest, found, i = [], False, 0
    while i < len(argv):
        if argv[i] in ("--cfg", "-c") and argv[i + 1 : i + 2] == ["job"] or argv[i] == "--cfg=job":
            found, i = True, i + (1 if "=" in argv[i] else 2)
        elif argv[i] == "--resolve":
            i += 1
        elif argv[i].startswith("-"):
            return None
        else:
            rest.append(argv[i])
            i += 1
    return rest if found else None


def _print_job(argv: list[str]) -> int:
    """`--cfg job`: the config that would run on this machine (usage.job_yaml); exit 2 for a bad setting."""
    from minigpt.usage import job_yaml

    notes: list[str] = []
    try:
        overrides = _with_cpu_defaults([a for a in argv if not a.startswith(HYDRA_KEYS)], say=notes.append)
        run_dir = next((a.partition("=")[2] for a in argv if _key(a) == "hydra.run.dir"), None)
        cfg = compose(overrides, run_dir=run_dir or ".")
        if run_dir is None:
            cfg = compose(overrides, run_dir=f"outputs/{_run_name(cfg)}")  # (created when the run starts)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.BAD_SETTING
    print(job_yaml(cfg, notes), end="")
    return ExitCode.OK


def train_main(argv: list[str] | None = None) -> int:
    """`minigpt-train [overrides]`: returns the exit code (0 ok, 1 error, 2 bad setting, 3 OOM, 128+signal)."""
    with TorchrunProcess() as process:  # under torchrun: join its group first, so the ranks can agree on things
        code = _train_main(argv)
        process.ok = code == ExitCode.OK
        return code


def _places(cfg, run_dir: str | None, argv: list[str]) -> list[tuple[str, str]]:
    """(setting, directory) of everything the run writes, to check before Hydra writes anything."""
    places = [("hydra.run.dir", run_dir or "outputs")]
    if run_dir or any(_key(a) == "ckpt_dir" for a in argv):  # else it is the new run directory's checkpoints/
        places.append(("ckpt_dir", cfg.ckpt_dir))
    if cfg.data.name in ("text", "hf", "pycode"):
        places.append(("data.cache_dir", cfg.data.cache_dir))
    if cfg.logger.name == "wandb" and os.environ.get("WANDB_DIR"):
        places.append(("WANDB_DIR", os.environ["WANDB_DIR"]))
    return places


def _train_main(argv: list[str] | None) -> int:
    from minigpt.signals import Interrupted, StopSignals

    with StopSignals(again="already stopping; please wait", exiting=True) as stop:
        try:
            return _train_hydra(argv, stop)
        except Interrupted as e:  # before the run started, or while Hydra set it up: nothing to finish
            print(f"{e} before the run started", file=sys.stderr)
            return ExitCode.SIGNAL_BASE + e.signum


def _train_hydra(argv: list[str] | None, stop) -> int:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from minigpt.compose import check_overrides
    from minigpt.run import release_run_dir, take_run_dir
    from minigpt.validate import check_writable

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):  # ours: groups, options and settings (Hydra's: --hydra-help)
        import torch

        from minigpt.usage import train_help

        print(train_help(cpu_only=not torch.cuda.is_available()))
        return ExitCode.OK
    if (job := _job_request(argv)) is not None:
        return _print_job(job)
    flags = [a for a in argv if a.startswith("-")]  # Hydra's own: --help, --cfg job, -m/--multirun, ...
    multirun = any(a in ("-m", "--multirun") for a in flags)
    jobs: list[Job] = []  # a multirun's jobs whose folders are locked (minigpt/multirun.py)
    locked = None  # the run directory's lock, taken here (rank 0) before Hydra writes its .hydra/ record there
    if not flags:
        try:
            check_overrides(argv)
            overrides = [a for a in argv if not a.startswith(HYDRA_KEYS)]
            argv = [*_with_cpu_defaults(overrides), *(a for a in argv if a.startswith(HYDRA_KEYS))]
            run_dir = next((str(OverridesParser.create().parse_override(a).value()) for a in reversed(argv)
                            if _key(a) == "hydra.run.dir"), None)  # the last one, as Hydra takes it
            cfg = compose([a for a in argv if not a.startswith(HYDRA_KEYS)], run_dir=run_dir or ".")
            if (warning := cpu_warning(cfg)) and env_rank() == 0:  # a GPU-sized job asked for on the CPU: it runs
                print(warning, file=sys.stderr)
            if env_rank() == 0:
                check_writable(_places(cfg, run_dir, argv))
            if run_dir is None:
                run_dir = str(reserve_shared_dir('outputs', _run_name(cfg)))
                argv.append(f"hydra.run.dir={run_dir}")
                if not any(_key(a) == "ckpt_dir" for a in argv):
                    cfg.ckpt_dir = str(Path(run_dir) / "checkpoints")
            cfg.run_dir = run_dir
            if env_rank() != 0:  # rank 0 keeps Hydra's record of the run; the other ranks write nothing
                argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
            elif finished := take_run_dir(cfg):  # the resumed run finished already: nothing to do
                print(finished)
                return ExitCode.OK
            else:
                locked = cfg
        except ConfigError as e:
            if env_rank() == 0:  # every rank finds the same bad setting; one line is enough
                print(f"error: {e}", file=sys.stderr)
            return ExitCode.BAD_SETTING
    elif multirun:
        try:
            argv, jobs, finished = _multirun_checks(argv)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return ExitCode.BAD_SETTING
        if finished:  # resume=auto, and every job has finished already: nothing to do
            print(finished)
            return ExitCode.OK
    try:
        return _hydra_app(argv, multirun, stop)
    finally:
        if locked is not None:
            release_run_dir(locked)
        if jobs:
            from minigpt.multirun import release
            release(jobs)


def _multirun_checks(argv: list[str]) -> tuple[list[str], list[Job], str | None]:
    """`-m`, before Hydra writes anything (ConfigError: nothing written): the overrides parse (value lists are
    sweeps), the sweep directory is writable, and each job is checked as a single run is and its folder locked
    (minigpt/multirun.py); with no hydra.sweep.dir, multirun/<date>_<time> is reserved and appended. Returns the
    argv for Hydra, the jobs whose folders are locked (release them at the end) and, when every job has finished
    already (resume=auto), their lines. Only when -m/--multirun is the one flag (another flag may take a value that
    is no override, or choose another config): then nothing is checked up front and no folder is locked."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from minigpt import multirun
    from minigpt.compose import check_overrides
    from minigpt.validate import check_writable

    only_m = all(a in ("-m", "--multirun") for a in argv if a.startswith("-"))
    if only_m:
        check_overrides([a for a in argv if not a.startswith("-")], multirun=True)
    given = next((a for a in reversed(argv) if _key(a) == "hydra.sweep.dir"), None)  # the last one, as Hydra takes it
    reserved: list[Path] = []  # what reserving made, removed again if the multirun is refused
    if given is None:
        if only_m:
            check_writable([("hydra.sweep.dir", "multirun")])
        reserved = [] if Path("multirun").exists() else [Path("multirun")]
        reserved.insert(0, reserve_dir("multirun", time.strftime("%Y-%m-%d_%H-%M-%S")))
        argv = [*argv, f"hydra.sweep.dir={reserved[0]}"]
    if not only_m:
        return argv, [], None
    try:
        sweep_dir = str(OverridesParser.create().parse_override(given).value()) if given else ""
        if given and "${" not in sweep_dir:  # one with an interpolation is checked once resolved
            check_writable([("hydra.sweep.dir", sweep_dir)])
        jobs, pin = multirun.jobs([a for a in argv if not a.startswith("-")],
                                  check=lambda cfg: check_writable(_places(cfg, cfg.run_dir, [])))
        if pin:  # Hydra is to use the sweep directory resolved and checked here
            check_writable([("hydra.sweep.dir", jobs[0].sweep)])
            argv = [*argv, pin]
        return argv, jobs, multirun.take(jobs)
    except BaseException:  # refused (or a signal): nothing is locked (take() gives back what it took)
        for made in reserved:  # empty: the refused multirun leaves nothing behind
            with contextlib.suppress(OSError):
                made.rmdir()
        raise


def _hydra_app(argv: list[str], multirun: bool, stop) -> int:
    import hydra
    from omegaconf import OmegaConf

    from minigpt.run import run
    from minigpt.validate import check_writable

    register_schema()
    codes: list[int] = []

    @hydra.main(config_path=str(config_dir()), config_name=CONFIG_NAME, version_base=None)
    def app(dict_cfg) -> None:
        if stop.signum:  # a multirun that was interrupted: no more jobs
            return
        try:
            cfg = to_train_config(dict_cfg)
            if multirun:  # a job's own directories, unchecked before Hydra ran (a single run's are: _places)
                check_writable(_places(cfg, cfg.run_dir, []))
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            codes.append(ExitCode.BAD_SETTING)
            return
        codes.append(run(cfg, config_dict=OmegaConf.to_container(dict_cfg, resolve=True)))
        stop.immediate, stop.note = False, "the run has ended; exiting"  # a signal now changes neither its line nor code

    sys.argv = [sys.argv[0], *argv]
    app()
    failed = [c for c in codes if c != ExitCode.OK]
    if multirun and codes:
        print(f"multirun: {len(codes) - len(failed)} of {len(codes)} jobs ok" +
              (f"; exit codes of the failed: {', '.join(map(str, failed))}" if failed else ""),
              file=sys.stderr if failed else sys.stdout)
    if multirun and stop.signum and not failed:
        return ExitCode.SIGNAL_BASE + stop.signum  # interrupted between jobs
    return failed[0] if failed else ExitCode.OK


def sample_main(argv: list[str] | None = None) -> int:
    """`minigpt-sample PATH [--prompt TEXT] ...`: text from a run or checkpoint (minigpt/sample.py)."""
    from minigpt.sample import main

    return main(argv)


def sweep_main(argv: list[str] | None = None) -> int:
    """`minigpt-sweep ...`: the context-length sweep (minigpt/sweep/sweep.py)."""
    from minigpt.sweep.sweep import main

    return main(argv)


def eval_main(argv: list[str] | None = None) -> int:
    """`minigpt-eval PATH ...`: loss by position on held-out pycode and the passkey grid (minigpt/eval/cli.py)."""
    from minigpt.eval.cli import main

    return main(argv)


def long_context_main(argv: list[str] | None = None) -> int:
    """`minigpt-long-context ...`: the long-context recipe, a segment at a time (minigpt/recipe/cli.py)."""
    from minigpt.recipe.cli import main

    return main(argv)


def memory_main(argv: list[str] | None = None) -> int:
    """`minigpt-memory ...`: where a training step's GPU memory goes (minigpt/benchmarks/memory_profile.py)."""
    from minigpt.benchmarks.memory_profile import main

    return main(argv)


def bench_main(argv: list[str] | None = None) -> int:
    """`minigpt-bench ...`: the attention benchmark (minigpt/benchmarks/bench.py)."""
    from minigpt.benchmarks.bench import main

    return main(argv)


def bench_ring_main(argv: list[str] | None = None) -> int:
    """`torchrun ... minigpt-bench-ring ...`: ring attention against our single-GPU kernel
    (minigpt/benchmarks/ring_bench.py)."""
    from minigpt.benchmarks.ring_bench import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(train_main())

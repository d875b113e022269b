"""A multirun's jobs (`python -m minigpt -m ...`), known, checked and locked before Hydra starts.

    jobs(overrides, check)   each job as Hydra will run it: its number, overrides, folder and TrainConfig
    take(jobs)               refuse (ConfigError) a folder in use or holding another run; else lock every folder
    release(jobs)            give the locks back when the multirun ends

Hydra's basic sweeper makes one job per combination of the overrides' value lists, numbered in that order, and its
launcher runs job k in hydra.sweep.dir/hydra.sweep.subdir (Hydra's default subdir: k). It writes multirun.yaml into
the sweep directory, and .hydra/ and cli.log into the job's folder, before our job function runs, so a job refused
there has already written into a folder that may be another run's. Here each job is composed as Hydra composes it
(the hydra overrides, then the job's, hydra.job.num and .id set) and checked as a single run is (its settings, the
directories it writes, its folder's lock, the run already there: refused unless resume=auto) before Hydra starts:
a refusal is one line and exit 2, and nothing is written. Then every job's folder stays locked until the multirun
ends (each job's run takes its lock again; runlock counts). With resume=auto and every job finished, each says so
and Hydra does not start; where only some are, Hydra runs them all and rewrites the finished ones' .hydra/ record
(they train nothing).

What cannot be known before the jobs start is refused in one line: a hydra.sweep.subdir that reads the clock
(`${now:...}`) or does not resolve outside the running job, a hydra.sweep.dir that differs between jobs, jobs that
would share a folder or a ckpt_dir, and a sweeper or launcher other than Hydra's basic ones (hydra/sweeper,
hydra/launcher, hydra.sweeper.params). A hydra.sweep.dir with an interpolation (`${now:...}`) is resolved once here
and pinned (the override jobs() returns), so that Hydra uses the folder checked here. With another Hydra flag than
-m (`--config-dir`, ...) the CLI checks nothing up front (cli.py).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable

from minigpt import runlock
from minigpt.compose import compose_sweep_job, job_train_config, one_line
from minigpt.config import ConfigError, TrainConfig
from minigpt.run import claim_run_dir

KEY = "hydra.sweep.dir"  # the setting that chooses a job's folder: the advice names it
OTHER_PLUGINS = ("hydra/sweeper", "hydra/launcher", "hydra.sweeper.params", "hydra.launcher")


@dataclass
class Job:
    num: int
    sweep: str  # hydra.sweep.dir, resolved
    folder: str  # hydra.sweep.dir/hydra.sweep.subdir, resolved (cfg.run_dir is its absolute path)
    cfg: TrainConfig

    @property
    def subject(self) -> str:
        return f"{self.folder} (job #{self.num} of the multirun)"


def _key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


def _is_hydra(override: str) -> bool:
    key = _key(override)
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def hydra_value(text: str) -> str:
    """A path as a Hydra override value: as it is when plain, else in Hydra's single quotes."""
    if re.fullmatch(r"[\w./-]+", text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def jobs(overrides: list[str], check: Callable[[TrainConfig], None] = lambda cfg: None
         ) -> tuple[list[Job], str | None]:
    """The multirun's jobs in Hydra's order, each composed and validated as it will run, `check` called on each;
    and the override that pins hydra.sweep.dir (None when it is a plain path). ConfigError (one line) for a bad
    setting of any job, or folders that cannot be known before the jobs start (module docstring)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    side = [o for o in overrides if _is_hydra(o)]
    other = next((o for o in side if _key(o).startswith(OTHER_PLUGINS) and o.partition("=")[2] != "basic"), None)
    if other:
        raise ConfigError(f"{_key(other)}: minigpt checks a multirun's jobs before Hydra starts them, which it can "
                          f"do for Hydra's basic sweeper and launcher only; give the sweep as value lists (seed=1,2)")
    task = [o for o in overrides if not _is_hydra(o)]
    try:
        combos = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(task), None)[0]
    except HydraException as e:
        raise ConfigError(f"cannot list the multirun's jobs: {one_line(e)}") from e
    out: list[Job] = []
    first, raw = None, {}
    for num, combo in enumerate(combos):
        try:
            cfg = compose_sweep_job([*side, *combo], num)
            if first is None:
                first = cfg
            else:  # as Hydra does: each job reads the clock (${now:...}) as the first did
                OmegaConf.copy_cache(from_config=first, to_config=cfg)
            raw = OmegaConf.to_container(cfg.hydra.sweep)  # unresolved
            advice = "name them by number or settings, e.g. hydra.sweep.subdir=${hydra.job.num} (Hydra's default)"
            if "now:" in str(raw["subdir"]):
                raise ConfigError(f"hydra.sweep.subdir={raw['subdir']}: reads the clock as each job starts, so the "
                                  f"jobs' folders cannot be checked before; {advice}")
            try:
                sweep, sub = str(cfg.hydra.sweep.dir), str(cfg.hydra.sweep.subdir)
            except Exception as e:  # an interpolation only the running job resolves (${hydra:runtime...})
                raise ConfigError(f"hydra.sweep.subdir={raw['subdir']}: cannot tell the jobs' folders before they "
                                  f"start ({one_line(e)}); {advice}") from e
            if out and sweep != out[0].sweep:
                raise ConfigError(f"hydra.sweep.dir={raw['dir']}: a different folder for each job ({out[0].sweep}, "
                                  f"{sweep}); give the multirun one directory")
            folder = os.path.join(sweep, sub)
            job = Job(num, sweep, folder, job_train_config(cfg, os.path.abspath(folder)))
            check(job.cfg)
        except ConfigError as e:
            raise ConfigError(f"multirun job #{num}: {e}") from e
        out.append(job)
    _refuse_shared(out, raw.get("subdir"))
    pin = f"{KEY}={hydra_value(out[0].sweep)}" if out and "${" in str(raw.get("dir")) else None
    return out, pin


def _refuse_shared(jobs: list[Job], subdir: object) -> None:
    """ConfigError if two jobs would run in one folder, or keep their checkpoints in one ckpt_dir."""
    folders: dict[str, int] = {}
    ckpts: dict[str, int] = {}
    for job in jobs:
        if (k := folders.setdefault(job.cfg.run_dir, job.num)) != job.num:
            raise ConfigError(f"hydra.sweep.subdir={subdir}: jobs #{k} and #{job.num} would share the folder "
                              f"{job.folder}; make it differ per job, e.g. hydra.sweep.subdir=${{hydra.job.num}} "
                              f"(Hydra's default)")
        if (k := ckpts.setdefault(os.path.abspath(job.cfg.ckpt_dir), job.num)) != job.num:
            raise ConfigError(f"ckpt_dir={job.cfg.ckpt_dir}: jobs #{k} and #{job.num} would share it; leave ckpt_dir "
                              f"unset, so that each job keeps its checkpoints in its own folder")


def take(jobs: list[Job]) -> str | None:
    """Refuse (ConfigError) a job's folder that a live run holds or that holds another run (unless resume=auto), all
    of them looked at before anything is written; then lock every folder until release(). Returns the lines of the
    jobs that finished already when that is all of them (then nothing is locked: there is nothing to do), else None."""
    finished = [line for job in jobs if (line := _claim(job))]
    if len(finished) == len(jobs):
        return "\n".join(finished)
    taken: list[Job] = []
    try:
        for job in jobs:
            runlock.lock(job.cfg.run_dir, KEY, job.subject)
            taken.append(job)
            claim_run_dir(job.cfg, KEY, job.subject)  # again under the lock: a run that started meanwhile
    except BaseException:
        release(taken)
        raise
    return None


def _claim(job: Job) -> str | None:
    """Reads only: ConfigError if a live run holds the job's folder, or the run there is another one."""
    runlock.check_free(job.cfg.run_dir, KEY, job.subject)
    return claim_run_dir(job.cfg, KEY, job.subject)


def release(jobs: list[Job]) -> None:
    for job in jobs:
        runlock.unlock(job.cfg.run_dir)

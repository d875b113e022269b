"""From the command line to a checked TrainConfig: Hydra composes configs/train.yaml with the overrides into the
schema of config.py, keys the schema lacks are refused, Hydra's and OmegaConf's errors become one line, and
validate.py runs every check before anything of the run is created.
"""
from __future__ import annotations

import importlib.resources
from dataclasses import fields, is_dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from minigpt.config import ConfigError, TrainConfig
from minigpt.validate import validate

CONFIG_NAME = "train"


def config_dir() -> Path:
    """configs/ of the installed package (`minigpt.configs`), so runs work from any directory."""
    try:
        return Path(str(importlib.resources.files("minigpt.configs")))
    except ModuleNotFoundError:  # a source tree on PYTHONPATH, not installed
        return Path(__file__).resolve().parent.parent / "configs"


def register_schema() -> None:
    """Make `train_schema` available to the defaults list of configs/train.yaml."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def check_known_keys(cfg: DictConfig, schema: type = TrainConfig, prefix: str = "") -> None:
    """Refuse keys the schema does not have, also those added with `+key=value` (Hydra lets them through)."""
    known = {f.name: f for f in fields(schema)}
    for key, value in cfg.items_ex(resolve=False):
        name = f"{prefix}{key}"
        if key not in known:
            parent = prefix.rstrip(".")
            raise ConfigError(f"{name}: no such setting{f' in {parent}' if parent else ''} (see minigpt/config.py)")
        section = known[key].default_factory  # sections are dataclasses built by their factory
        if isinstance(value, DictConfig) and is_dataclass(section):
            check_known_keys(value, section, f"{name}.")


def one_line(exc: BaseException) -> str:
    """Reduce a Hydra/OmegaConf composition error to 'key=value: what is wrong'."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    chain, e = [], exc
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, MissingConfigException) and e.options is not None and e.missing_cfg_file:
            group, _, option = e.missing_cfg_file.rpartition("/")
            return f"{group}={option}: no such option; choose one of {', '.join(sorted(e.options))}"
        if isinstance(e, OverrideParseException):
            return f"cannot parse override: {str(e).splitlines()[0]}"
    for e in chain:
        if isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None):
            msg = str(e).splitlines()[0]
            key = e.full_key
            if "not in struct" in msg or "Key '" in msg and "not" in msg:
                parent = key.rpartition(".")[0]
                return f"{key}: no such setting{f' in {parent}' if parent else ''} (see minigpt/config.py)"
            return f"{key}: {msg}"
    return str(exc).strip().splitlines()[0]


def _quoted(key: str, value: str) -> str:
    return f"""'{key}="{value}"'"""


def check_overrides(overrides: list[str], multirun: bool = False) -> None:
    """Each override as Hydra's parser reads it; one it cannot parse, a value list outside a multirun (a `,` in a
    value) and words the shell split off a value with spaces are refused with the quoting that works. In a
    multirun (`multirun=True`) a value list is a sweep, as Hydra reads it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException  # OverrideParseException, and the lexer's own

    parser = OverridesParser.create()
    for i, text in enumerate(overrides):
        key, eq, value = text.partition("=")
        if not eq and not text.startswith("~"):
            start = next((j for j in range(i - 1, -1, -1) if "=" in overrides[j]), None)
            if start is None:
                raise ConfigError(f"{text!r}: not an override (expected key=value)")
            key, _, value = " ".join(overrides[start:i + 1]).partition("=")
            raise ConfigError(f"{text!r}: not an override (the shell split a value with spaces?); quote the whole "
                              f"override, with Hydra's quotes around the value: {_quoted(key, value)}")
        try:
            sweep = parser.parse_override(text).is_sweep_override()
        except HydraException:
            sweep = None
        if sweep is None or (sweep and not multirun):
            raise ConfigError(f"{text}: cannot parse this value{' (a `,` makes a list)' if sweep else ''}; quote it for "
                              f"Hydra inside the shell's quotes: {_quoted(key, value)}")


def to_train_config(cfg: DictConfig, machine: bool = True) -> TrainConfig:
    """A composed DictConfig as a validated TrainConfig (validate.py; with `machine` false only the checks that need
    no knowledge of this machine, config.py's); ConfigError (one line) for anything wrong."""
    from omegaconf import OmegaConf

    check_known_keys(cfg)
    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as e:  # OmegaConf raises many types; all become one line
        raise ConfigError(one_line(e)) from e
    if machine:
        validate(obj)
    else:
        obj.validate()
    return obj


def _hydra_compose(overrides: list[str], with_hydra: bool = False) -> DictConfig:
    """configs/train.yaml with the overrides, as Hydra composes it outside a Hydra run (`with_hydra`: with its
    hydra node); ConfigError (one line) for anything Hydra refuses."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    check_overrides(overrides)
    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            return hydra_compose(config_name=CONFIG_NAME, overrides=overrides, return_hydra_config=with_hydra)
    except Exception as e:  # Hydra raises many types; all become one line
        raise ConfigError(one_line(e)) from e
    finally:
        GlobalHydra.instance().clear()


def compose(overrides: list[str], run_dir: str = ".", machine: bool = True) -> TrainConfig:
    """Compose configs/train.yaml with command-line overrides into a validated TrainConfig (outside a Hydra run,
    so `run_dir` stands in for Hydra's output directory). `machine=False` leaves out the checks that ask this machine
    (a GPU, a backend that runs here, W&B credentials): for plans made on one machine to run on another."""
    cfg = _hydra_compose(overrides)
    cfg.run_dir = run_dir  # outside a Hydra run there is no output dir to interpolate
    return to_train_config(cfg, machine)


def compose_sweep_job(overrides: list[str], num: int) -> DictConfig:
    """Job `num` of a multirun as Hydra's basic launcher composes it (the job's overrides after the hydra ones,
    hydra.job.num and .id set), its hydra node kept, so that hydra.sweep.dir and .subdir resolve as for that job.
    ConfigError (one line) for anything Hydra refuses."""
    from omegaconf import open_dict

    cfg = _hydra_compose(overrides, with_hydra=True)
    with open_dict(cfg):
        cfg.hydra.job.num, cfg.hydra.job.id = num, str(num)
    return cfg


def job_train_config(cfg: DictConfig, run_dir: str) -> TrainConfig:
    """compose_sweep_job's config as the job will get it: without its hydra node, run_dir its folder; validated."""
    from omegaconf import open_dict

    with open_dict(cfg):  # in place: resolve the job's folder before
        del cfg["hydra"]
    cfg.run_dir = run_dir
    return to_train_config(cfg)

"""What `minigpt-train --help` and `minigpt-train --cfg job` print, made from the config itself so they stay in sync.

- `train_help()`: the config groups and their options (configs/<group>/*.yaml, each option's first comment line;
  the defaults from configs/train.yaml) and every setting with its default and one line from the comment beside
  its field in minigpt/config.py.
- `job_yaml(cfg, notes)`: the composed config as it will run on this machine: device, dtype and compile resolved
  (auto -> cuda or cpu, bfloat16 or float32, on or off), the run directory as it would be named, notes first.

Both only read; the CLI (minigpt/cli.py) decides when to print them.
"""
from __future__ import annotations

import inspect
import io
import tokenize
from dataclasses import MISSING, asdict, fields, is_dataclass
from pathlib import Path
from typing import Any

from minigpt.compose import CONFIG_NAME, config_dir
from minigpt.config import CPU_DEFAULTS, CPU_MAX_SEQ_LEN, CPU_MODELS, TrainConfig, gpu_sized

DOC = "docs/configuration.md"


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment beside it in the dataclass's source (else the comment lines just above it)."""
    lines = inspect.getsource(cls).splitlines()
    comments: dict[int, str] = {}  # line index -> its comment text
    for tok in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0] - 1] = tok.string.lstrip("#").strip()
    out = {}
    names = {f.name for f in fields(cls)}
    for i, line in enumerate(lines):
        name = line.strip().partition(":")[0]
        if name not in names or name in out or not line.startswith("    ") or line.startswith("     "):
            continue
        if i in comments and not line.lstrip().startswith("#"):
            out[name] = comments[i]
            continue
        above = []
        j = i - 1
        while j >= 0 and lines[j].lstrip().startswith("#"):
            above.insert(0, comments.get(j, ""))
            j -= 1
        out[name] = " ".join(above)
    return out


def _default(f: Any) -> str:
    if f.default is not MISSING:
        value = f.default
    elif f.default_factory is not MISSING:
        value = f.default_factory()
    else:
        return "?"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return "<preset>" if value == "???" else str(value)  # MISSING: set by the group's option (model=...)


def settings(cls: type = TrainConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, one line) for every setting: the top-level ones first, then each section's."""
    comments = field_comments(cls)
    rows, sections = [], []
    for f in fields(cls):
        factory = f.default_factory
        if factory is not MISSING and is_dataclass(factory):
            sections.append((f.name, factory))
            continue
        rows.append((f"{prefix}{f.name}", _default(f), comments.get(f.name, "")))
    for name, section in sections:
        rows += settings(section, f"{prefix}{name}.")
    return rows


def _first_comment(path: Path) -> str:
    for line in path.read_text().splitlines():
        text = line.lstrip("#").strip()
        if line.startswith("#") and text and not text.startswith("@package"):
            return text
    return ""


def config_groups() -> dict[str, list[tuple[str, str]]]:
    """Group -> [(option, its first comment line)], from configs/."""
    root = config_dir()
    return {group.name: [(p.stem, _first_comment(p)) for p in sorted(group.glob("*.yaml"))]
            for group in sorted(root.iterdir()) if group.is_dir() and any(group.glob("*.yaml"))}


def group_defaults() -> dict[str, str]:
    """Group -> its default option, from the defaults list of configs/train.yaml."""
    import yaml

    data = yaml.safe_load((config_dir() / f"{CONFIG_NAME}.yaml").read_text()) or {}
    return {k: str(v) for item in data.get("defaults", []) if isinstance(item, dict) for k, v in item.items()}


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def train_help(cpu_only: bool) -> str:
    """The text of `minigpt-train --help`."""
    defaults = group_defaults()
    out = ["minigpt-train (python scripts/train.py): train a GPT, a Hydra app.",
           "Usage: python scripts/train.py [group=option ...] [key=value ...] [--cfg job] [-m]",
           "", "Config groups (group=option, * the default; recipe is added with +recipe=NAME):"]
    groups = config_groups()
    width = max(len(o) for options in groups.values() for o, _ in options) + 1
    for group, options in groups.items():
        for k, (option, comment) in enumerate(options):
            mark = "*" if defaults.get(group) == option else " "
            head = f"  {group:<10}" if k == 0 else " " * 12
            out.append(_clip(f"{head}{option + mark:<{width}}  {comment}", 118))
    out += ["", "Settings (key=value; the default; minigpt/config.py says more):"]
    rows = settings()
    width = min(40, max(len(f"{k}={d}") for k, d, _ in rows)) + 2
    out += [_clip(f"  {f'{k}={d}':<{width}}{c}", 118) for k, d, c in rows]
    out += ["", "Flags:",
            "  --cfg job      the config this command would run on this machine (CPU defaults, dtype, compile "
            "resolved)",
            "  -m             multirun: a run per combination (seq_len=512,1024); --hydra-help: Hydra's own flags",
            "", f"No GPU: a run that names no model uses {' '.join(CPU_DEFAULTS)}; a larger job (a model other than "
            f"{' or '.join(CPU_MODELS)}, seq_len > {CPU_MAX_SEQ_LEN}) is called GPU-sized in one line, then runs"
            f" as asked." + (" (This machine has no GPU.)" if cpu_only else ""),
            f"More: {DOC} (groups, data, run directories, exit codes, resume)."]
    return "\n".join(out)


def cpu_warning(cfg: TrainConfig) -> str | None:
    """One line when this run would train a GPU-sized job on the CPU (it still may: the user asked for it)."""
    why = gpu_sized(cfg.model.name, cfg.seq_len) if cfg.torch_device().type == "cpu" else None
    if why is None:
        return None
    return (f"warning: GPU-sized job on the CPU ({why}): expect hours; for a CPU run use model=tiny or small-6l and "
            f"seq_len <= {CPU_MAX_SEQ_LEN}, e.g. python scripts/train.py {' '.join(CPU_DEFAULTS)}")


def job_yaml(cfg: TrainConfig, notes: list[str]) -> str:
    """The config `cfg` as YAML, device, dtype and compile resolved for this machine, `notes` as comments on top."""
    from omegaconf import OmegaConf

    plain = asdict(cfg)
    plain["device"] = cfg.torch_device().type
    plain["dtype"] = str(cfg.compute_dtype()).removeprefix("torch.")
    plain["compile"] = cfg.compile_enabled()
    head = [f"# {n}" for n in notes]
    head.append(f"# the config this command runs on this machine (device {plain['device']}): device, dtype and "
                f"compile resolved")
    if warning := cpu_warning(cfg):
        head.append(f"# {warning}")
    return "\n".join(head) + "\n" + OmegaConf.to_yaml(OmegaConf.create(plain))

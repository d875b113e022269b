"""Where metrics go: Weights & Biases (`logger=wandb`) or nowhere but the console (`logger=none`), and always
`metrics.jsonl` in the run directory (`MetricsHistory`: one JSON line per logged step, readable without W&B).

One lifecycle for every W&B run minigpt makes (training runs, the sweep's summary run): `WandbLogger` opens
the run, `log` adds a step, `finish` writes the summary and waits until the run is on disk. Metric keys are
grouped as train/, perf/, memory/, eval/. With `mode=auto` W&B runs online when credentials exist and offline
otherwise (sync later with `wandb sync`), so a run never blocks on a login prompt or the network; an online run
whose server (`WANDB_BASE_URL`, else api.wandb.ai) does not answer a TCP connect within a few seconds is refused
before it starts.
`WANDB_MODE` and `WANDB_DIR` in the environment win over the config.
"""
from __future__ import annotations

import functools
import json
import math
import netrc
import os
import socket
import urllib.parse
from pathlib import Path
from typing import Any, Protocol

from minigpt.config import ConfigError, LoggerConfig
from minigpt.files import WriteError, os_error_reason


class Logger(Protocol):
    location: str | None  # where the run's logs are (a directory or URL), for the run's last line

    def log(self, metrics: dict[str, Any], step: int) -> None: ...
    def finish(self, summary: dict[str, Any], exit_code: int) -> None: ...


class NullLogger:
    location = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        pass


class MetricsHistory:
    """Another logger's metrics, also appended to a local JSON-lines file (one line per step, flushed at once),
    so a run's curves survive without W&B and a resumed run appends to the same file."""

    FILE = "metrics.jsonl"

    def __init__(self, inner: Logger, run_dir: str | Path):
        self.inner, self.location = inner, inner.location
        self.path = Path(run_dir) / self.FILE
        self.failed = False  # after a failed write (disk full) the file is left alone; the run stops with one line

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.inner.log(metrics, step=step)
        if self.failed:
            return
        row = {"step": step, **{k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                                for k, v in metrics.items()}}
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as e:
            self.failed = True
            raise WriteError(f"cannot write {self.path}: {os_error_reason(e)}; free space (or move that path aside), "
                             f"then continue with resume=auto") from e

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        self.inner.finish(summary, exit_code)


def read_history(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (a run directory or the file); a torn last line (a killed run) is skipped."""
    path = Path(path)
    path = path / MetricsHistory.FILE if path.is_dir() else path
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def has_wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def wandb_mode(configured: str) -> str:
    """WANDB_MODE wins; then the config; 'auto' means online only with credentials."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if configured != "auto":
        return configured
    return "online" if has_wandb_credentials() else "offline"


WANDB_CONNECT_TIMEOUT_S = 4.0


@functools.lru_cache(maxsize=None)
def _unreachable(host: str, port: int) -> str | None:
    """Why a TCP connection to host:port fails within WANDB_CONNECT_TIMEOUT_S, or None (asked once per process)."""
    try:
        socket.create_connection((host, port), timeout=WANDB_CONNECT_TIMEOUT_S).close()
    except socket.timeout:
        return f"no answer within {WANDB_CONNECT_TIMEOUT_S:.0f} s"
    except OSError as e:
        return e.strerror or str(e)
    return None


def check_wandb(cfg: LoggerConfig, none: str = "logger=none") -> None:
    """Refuse an online run without credentials, or whose W&B server does not answer, before it starts (W&B would
    prompt, or fail or hang mid-run). `none`: how the caller's command line turns W&B off."""
    if cfg.name != "wandb" or wandb_mode(cfg.mode) != "online":
        return
    env = bool(os.environ.get("WANDB_MODE"))  # it wins over logger.mode, so the advice must name it
    source, offline = ("WANDB_MODE=online", "WANDB_MODE=offline") if env else (f"logger.mode={cfg.mode}",
                                                                                "logger.mode=offline")
    if not has_wandb_credentials():
        raise ConfigError(f"{source}: no W&B credentials; set WANDB_API_KEY or run `wandb login`, "
                          f"or use {offline} (sync later) or {none}")
    url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    parts = urllib.parse.urlsplit(url)
    reason = _unreachable(parts.hostname or url, parts.port or (80 if parts.scheme == "http" else 443))
    if reason:
        raise ConfigError(f"{source}: cannot reach the W&B server {url} ({reason}); run offline with "
                          f"WANDB_MODE=offline (sync later with `wandb sync`), or use {none}")


def wandb_dir(default: str | Path) -> str:
    """WANDB_DIR if set (W&B's own convention), else `default` (the run directory)."""
    return os.environ.get("WANDB_DIR") or str(default)


class WandbLogger:
    def __init__(self, *, project: str, name: str, directory: str | Path, mode: str = "auto",
                 entity: str | None = None, group: str | None = None, tags: list[str] | tuple[str, ...] = (),
                 config: dict[str, Any] | None = None, job_type: str | None = None):
        import wandb

        for key in ("WANDB_MODE", "WANDB_BASE_URL", "WANDB_DIR"):  # empty is unset, to us and so to W&B (it fails)
            if os.environ.get(key) == "":
                del os.environ[key]
        self.mode = wandb_mode(mode)
        directory = wandb_dir(directory)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, entity=entity, group=group, name=name, tags=list(tags), config=config,
                              dir=directory, mode=self.mode, job_type=job_type,
                              settings=wandb.Settings(silent=True, init_timeout=60))
        online = self.mode == "online" and getattr(self.run, "url", None)
        self.location = self.run.url if online else str(Path(self.run.dir).parent)

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.run.log(metrics, step=step)

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        import wandb

        self.run.summary.update(summary)
        self.run.finish(exit_code=exit_code)
        # finish() returns before W&B's background service has written the offline run file (seen with
        # wandb 0.31: an empty .wandb file right after it, complete a moment later); shutting the service
        # down waits for it, so the run is on disk when this returns.
        wandb.teardown()


def build_logger(cfg: LoggerConfig, run_name: str, run_dir: str | Path, config: dict[str, Any]) -> Logger:
    if cfg.name == "none":
        return NullLogger()
    return WandbLogger(project=cfg.project, entity=cfg.entity, group=cfg.group, name=cfg.run_name or run_name,
                       tags=cfg.tags, config=config, directory=run_dir, mode=cfg.mode)

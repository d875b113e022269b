"""Where metrics go: Weights & Biases (`logger=wandb`) or nowhere but the console (`logger=none`).

Metric keys are grouped as train/, perf/, memory/, eval/. W&B runs online when credentials exist and
offline otherwise (sync later with `wandb sync`), so a run never blocks on a login prompt or the network.
"""
from __future__ import annotations

import netrc
import os
from typing import Any, Protocol

from minigpt.config import TrainConfig


class Logger(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def finish(self, summary: dict[str, Any], exit_code: int) -> None: ...


class NullLogger:
    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        pass


def _has_wandb_credentials() -> bool:
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
    return "online" if _has_wandb_credentials() else "offline"


def run_name(cfg: TrainConfig) -> str:
    return cfg.logger.run_name or f"{cfg.attention.name}-{cfg.model.name}-n{cfg.seq_len}"


class WandbLogger:
    def __init__(self, cfg: TrainConfig, config_dict: dict[str, Any]):
        import wandb

        mode = wandb_mode(cfg.logger.mode)
        self.run = wandb.init(
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            group=cfg.logger.group,
            name=run_name(cfg),
            tags=list(cfg.logger.tags),
            config=config_dict,
            dir=cfg.run_dir,
            mode=mode,
            settings=wandb.Settings(silent=True, init_timeout=60),
        )
        print(f"wandb: {mode} run '{run_name(cfg)}' in {self.run.dir}")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, summary: dict[str, Any], exit_code: int) -> None:
        import wandb

        self.run.summary.update(summary)
        self.run.finish(exit_code=exit_code)
        # finish() returns before W&B's background service has written the offline run file (seen with
        # wandb 0.31: an empty .wandb file right after it, complete a moment later); shutting the service
        # down waits for it, so the run is on disk when training returns.
        wandb.teardown()


def build_logger(cfg: TrainConfig, config_dict: dict[str, Any]) -> Logger:
    return WandbLogger(cfg, config_dict) if cfg.logger.name == "wandb" else NullLogger()

"""Command-line entry for training: Hydra app with a one-line error for any bad override.

Before Hydra runs, the overrides are composed and validated once (`minigpt.config.compose`), so a
wrong key, type or value ends with one line and exit code 2 instead of Hydra's multi-line report.
"""
from __future__ import annotations

import sys

from minigpt.config import CONFIG_DIR, CONFIG_NAME, ConfigError, compose, register_schema, validate

EXIT_BAD_CONFIG = 2


def train_main(argv: list[str] | None = None) -> int:
    """`python scripts/train.py [overrides]`: returns the exit code (0 ok, 2 bad config, 3 OOM, 1 error)."""
    import hydra
    from omegaconf import OmegaConf

    from minigpt.train import run

    argv = sys.argv[1:] if argv is None else list(argv)
    # Hydra's own flags (--help, --cfg job, -m ...) and hydra.* overrides go straight to Hydra.
    if not any(a.startswith("-") for a in argv):
        try:
            compose([a for a in argv if not a.startswith(("hydra.", "+hydra.", "++hydra."))])
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_BAD_CONFIG

    register_schema()
    exit_code = 0

    @hydra.main(config_path=str(CONFIG_DIR), config_name=CONFIG_NAME, version_base=None)
    def app(dict_cfg) -> None:
        nonlocal exit_code
        cfg = OmegaConf.to_object(dict_cfg)
        try:
            validate(cfg)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            exit_code = EXIT_BAD_CONFIG
            return
        exit_code = run(cfg, OmegaConf.to_container(dict_cfg, resolve=True))

    sys.argv = [sys.argv[0], *argv]
    app()
    return exit_code

"""Hydra composition and every bad-override path: one line naming the key, non-zero exit, no traceback."""
import subprocess
import sys

import pytest

from conftest import ROOT
from minigpt.config import ConfigError, compose


def test_defaults_compose_to_gpt2_small_sdpa_passkey():
    cfg = compose([])
    assert (cfg.model.name, cfg.model.n_layer, cfg.model.n_embd, cfg.model.vocab_size) == ("gpt2-small", 12, 768, 50304)
    assert (cfg.attention.name, cfg.data.name, cfg.logger.name) == ("sdpa", "passkey", "wandb")
    for key in ("seq_len", "batch_size", "grad_accum", "max_steps", "eval_every", "ckpt_every", "seed", "device",
                "dtype", "compile", "resume"):
        assert hasattr(cfg, key)


@pytest.mark.parametrize("group,option", [("attention", "naive"), ("attention", "flash"), ("model", "tiny"),
                                          ("model", "gpt2-medium"), ("logger", "none")])
def test_every_group_option_composes(group, option):
    cfg = compose([f"{group}={option}"])
    assert getattr(cfg, group).name == option


@pytest.mark.parametrize("override,expected", [
    ("seq_len=-5", "seq_len=-5"),
    ("attention=bogus", "attention=bogus"),
    ("batch_size=abc", "batch_size"),
    ("model.n_layer=1.5", "model.n_layer"),
    ("device=tpu", "device=tpu"),
    ("dtype=int8", "dtype=int8"),
    ("no_such_key=1", "no_such_key"),
    ("model.no_such_key=1", "model.no_such_key"),
    ("attention.sdpa_backend=fast", "attention.sdpa_backend"),
    ("data=text", "data.path"),
    ("model.n_head=5", "model.n_embd"),
    ("resume=/does/not/exist", "resume"),
    ("model.keep_attention=true", "model.keep_attention"),
    ("model.offload=true", "model.checkpoint_every"),
    ("model.checkpoint_dtype=float8", "model.checkpoint_dtype"),
])
def test_bad_override_names_the_key(override, expected):
    with pytest.raises(ConfigError) as info:
        compose([override])
    message = str(info.value)
    assert expected in message and "\n" not in message


@pytest.mark.parametrize("override,allowed", [("seq_len=-5", ">= 1"), ("attention=bogus", "flash, naive, sdpa"),
                                              ("batch_size=abc", "Integer")])
def test_cli_bad_override_is_one_line_and_nonzero(override, allowed):
    proc = subprocess.run([sys.executable, "scripts/train.py", override], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and override.split("=")[0] in lines[0] and allowed in lines[0], proc.stderr

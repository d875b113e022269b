"""Hydra composition and every bad-override path: one line naming the key, non-zero exit, no traceback."""
import subprocess
import sys

import pytest

from conftest import ROOT
from minigpt.compose import compose
from minigpt.config import ConfigError


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


def test_the_passkey_recipe_preset_sets_its_keys_and_the_command_line_wins():
    cfg = compose(["+recipe=passkey", "seq_len=2048", "batch_size=32"])  # flash: the interpreter on CPU (conftest)
    assert (cfg.model.name, cfg.attention.name, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.lr_decay_steps,
            cfg.eval_every, cfg.passkey_grid, cfg.seq_len) == ("small-6l", "flash", 1e-3, 1e-4, 100, 4000, 250, 4, 2048)
    assert compose(["+recipe=passkey", "lr=3e-4", "attention=sdpa"]).lr == 3e-4
    assert compose(["+recipe=passkey", "attention=sdpa"]).attention.name == "sdpa"


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
    ("model.keep_attention=true", "model.recompute_every"),
    ("model.offload=true", "model.recompute_every"),
    ("model.recompute_dtype=float8", "model.recompute_dtype"),
    ("+unknown_key=1", "unknown_key"),
    ("+model.foo=2", "model.foo"),
    ("attention.sdpa_backend=cudnn", "attention"),
])
def test_bad_override_names_the_key(override, expected):
    with pytest.raises(ConfigError) as info:
        compose([override])
    message = str(info.value)
    assert expected in message and "\n" not in message


@pytest.mark.parametrize("override,allowed", [("seq_len=-5", ">= 1"), ("attention=bogus", "flash, flex, naive, sdpa"),
                                              ("batch_size=abc", "Integer")])
def test_cli_bad_override_is_one_line_and_nonzero(override, allowed):
    proc = subprocess.run([sys.executable, "scripts/train.py", override], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and override.split("=")[0] in lines[0] and allowed in lines[0], proc.stderr


@pytest.mark.parametrize("overrides,expected", [
    (["attention=flash", "model=tiny", "model.n_embd=80", "model.n_head=4"], "head_dim 20"),  # 80/4: not a kernel size
    (["attention=sdpa", "model.recompute_every=1", "model.keep_attention=true"], "model.keep_attention"),
    (["attention=naive", "attention.sdpa_backend=math"], "attention.sdpa_backend"),
    (["attention=sdpa", "attention.deterministic=true"], "attention.deterministic"),
])
def test_the_backend_capability_check_drives_config_errors(overrides, expected):
    """What a backend says it cannot run (registry: unsupported(), returns_lse) refuses the run before it starts."""
    with pytest.raises(ConfigError) as info:
        compose(overrides)
    assert expected in str(info.value) and str(info.value).startswith(("attention", "model", "head_dim"))


def test_flash_needs_a_gpu_or_the_interpreter(monkeypatch):
    from minigpt.attention import get_attention
    import torch
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = get_attention("flash").unsupported(torch.device("cpu"), torch.float32, 64)
    assert reason and "CUDA" in reason
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_attention("flash").unsupported(torch.device("cpu"), torch.float32, 64) is None


def test_online_wandb_without_credentials_is_refused(monkeypatch, tmp_path):
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="logger.mode=online: no W&B credentials"):
        compose(["logger.mode=online"])

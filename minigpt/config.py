"""Typed configuration for a training run, and the checks that turn a bad setting into one clear line.

The dataclasses below are the schema Hydra composes `configs/train.yaml` into: a key that does not
exist or a value of the wrong type is caught by OmegaConf; a value of the right type that makes no
sense (`seq_len=-5`, `attention.name=bogus`) is caught by `validate`. Either way the user sees one
line that names the key and what is allowed (`check_overrides`), never a traceback.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIG_NAME = "train"

ATTENTION_NAMES = ("naive", "sdpa", "flash")
SDPA_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")
DATA_NAMES = ("passkey", "text", "hf")
LOGGER_NAMES = ("wandb", "none")
WANDB_MODES = ("auto", "online", "offline", "disabled")
DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "bfloat16", "float16", "float32")


class ConfigError(ValueError):
    """A bad setting. The message is one line: the key, the value, and what is allowed."""


@dataclass
class AttentionConfig:
    name: str = "sdpa"  # naive | sdpa | flash
    sdpa_backend: str = "auto"  # only for sdpa: pin PyTorch's kernel (auto | flash | efficient | cudnn | math)


@dataclass
class ModelConfig:
    name: str = "gpt2-small"
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: Optional[int] = None  # None: the tokenizer's size; GPT-2 presets pad to 50304
    rope_base: float = 10000.0
    # Memory levers (README "Memory levers" says what each saves and costs).
    checkpoint_every: int = 0  # keep only every k-th block's input, recompute the block in the backward; 0 = off
    checkpoint_dtype: str = "float32"  # float32 | bfloat16: dtype of those stored block inputs
    offload: bool = False  # keep the stored block inputs in pinned CPU memory instead of on the GPU
    keep_attention: bool = False  # checkpointed blocks keep attention output + LSE: no N² recompute (flash only)
    mlp_chunk: int = 0  # run LayerNorm + MLP over this many tokens at a time, recomputed in the backward; 0 = off
    loss_chunk: int = 0  # final norm + LM head + loss over this many tokens at a time (no N×vocab logits); 0 = off


@dataclass
class DataConfig:
    name: str = "passkey"  # passkey | text | hf
    # text: a file, a directory or a glob of text files (each file is one document)
    path: Optional[str] = None
    # tokenizer for text/hf: a tokenizer.json to load, or None to train a byte-level BPE on the data
    tokenizer: Optional[str] = None
    vocab_size: int = 4096  # size of the BPE trained when no tokenizer is given
    val_fraction: float = 0.05  # tail of the token stream held out for evaluation
    cache_dir: str = "~/.cache/minigpt"  # trained tokenizers and tokenized datasets
    # hf: datasets.load_dataset(dataset, dataset_config, split=split, streaming=streaming)
    dataset: Optional[str] = None
    dataset_config: Optional[str] = None
    split: str = "train"
    text_column: str = "text"
    streaming: bool = False
    max_docs: Optional[int] = None  # read at most this many documents (required with streaming)


@dataclass
class LoggerConfig:
    name: str = "wandb"  # wandb | none
    project: str = "minigpt"
    entity: Optional[str] = None
    group: Optional[str] = None
    run_name: Optional[str] = None  # None: "<attention>-<model>-n<seq_len>"
    tags: list[str] = field(default_factory=list)
    mode: str = "auto"  # auto: online when W&B credentials exist, else offline; WANDB_MODE wins


@dataclass
class TrainConfig:
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)

    seq_len: int = 1024
    batch_size: int = 4
    grad_accum: int = 1
    max_steps: int = 500
    eval_every: int = 100  # 0 = only at the end
    eval_batches: int = 4  # 0 = no evaluation
    ckpt_every: int = 0  # 0 = only at the end
    save_checkpoints: bool = True  # false: never write checkpoints (sweep trials, benchmarks)
    seed: int = 1337
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"  # autocast dtype; auto = bfloat16 on CUDA, float32 on CPU
    compile: bool = False
    resume: str = "none"  # none | auto (latest checkpoint in ckpt_dir) | path to a checkpoint file or dir

    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 20
    lr_decay_steps: Optional[int] = None  # cosine horizon; None = max_steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = off

    run_dir: str = "."  # where summary.json goes; train.yaml sets it to Hydra's output dir
    ckpt_dir: str = "${run_dir}/checkpoints"


def register_schema() -> None:
    """Make `train_schema` available to the defaults list of configs/train.yaml."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value}: must be one of {', '.join(allowed)}")


def _positive(key: str, value: Any, zero_ok: bool = False) -> None:
    low = 0 if zero_ok else 1
    if value is None or value < low:
        raise ConfigError(f"{key}={value}: must be an integer >= {low}")


def validate(cfg: TrainConfig) -> None:
    """Check what the types cannot: ranges, names and how settings fit together."""
    for key in ("seq_len", "batch_size", "grad_accum", "max_steps"):
        _positive(key, getattr(cfg, key))
    for key in ("eval_every", "eval_batches", "ckpt_every", "warmup_steps"):
        _positive(key, getattr(cfg, key), zero_ok=True)
    if cfg.lr_decay_steps is not None:
        _positive("lr_decay_steps", cfg.lr_decay_steps)
    for key in ("lr", "min_lr", "weight_decay", "grad_clip"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key}={getattr(cfg, key)}: must be >= 0")
    if cfg.lr <= 0:
        raise ConfigError(f"lr={cfg.lr}: must be > 0")
    _choice("device", cfg.device, DEVICES)
    _choice("dtype", cfg.dtype, DTYPES)
    if cfg.resume not in ("none", "auto") and not Path(cfg.resume).exists():
        raise ConfigError(f"resume={cfg.resume}: must be none, auto, or an existing checkpoint file or directory")

    _choice("attention.name", cfg.attention.name, ATTENTION_NAMES)
    _choice("attention.sdpa_backend", cfg.attention.sdpa_backend, SDPA_BACKENDS)

    m = cfg.model
    for key in ("n_layer", "n_head", "n_embd"):
        _positive(f"model.{key}", getattr(m, key))
    if m.n_embd % m.n_head:
        raise ConfigError(f"model.n_embd={m.n_embd}: must be divisible by model.n_head={m.n_head}")
    if (m.n_embd // m.n_head) % 2:
        raise ConfigError(f"model.n_embd/n_head={m.n_embd // m.n_head}: head_dim must be even for rotary embeddings")
    if m.vocab_size is not None:
        _positive("model.vocab_size", m.vocab_size)
    for key in ("checkpoint_every", "mlp_chunk", "loss_chunk"):
        _positive(f"model.{key}", getattr(m, key), zero_ok=True)
    _choice("model.checkpoint_dtype", m.checkpoint_dtype, ("float32", "bfloat16"))
    if m.keep_attention and (cfg.attention.name != "flash" or not m.checkpoint_every):
        raise ConfigError("model.keep_attention=true: needs attention=flash and model.checkpoint_every >= 1")
    if (m.offload or m.checkpoint_dtype != "float32") and not m.checkpoint_every:
        raise ConfigError("model.checkpoint_every=0: model.offload and model.checkpoint_dtype act on block "
                          "checkpoints; set model.checkpoint_every=1 (or k)")

    d = cfg.data
    _choice("data.name", d.name, DATA_NAMES)
    _positive("data.vocab_size", d.vocab_size)
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction}: must be between 0 and 1 (exclusive)")
    if d.name == "text" and not d.path:
        raise ConfigError("data.path=null: data=text needs data.path (a file, directory or glob of text files)")
    if d.name == "hf" and not d.dataset:
        raise ConfigError("data.dataset=null: data=hf needs data.dataset (a hub name or local dataset path)")
    if d.streaming and d.max_docs is None:
        raise ConfigError("data.max_docs=null: data.streaming=true needs data.max_docs (how many documents to read)")
    if d.max_docs is not None:
        _positive("data.max_docs", d.max_docs)
    if d.tokenizer is not None and not Path(os.path.expanduser(d.tokenizer)).is_file():
        raise ConfigError(f"data.tokenizer={d.tokenizer}: no such tokenizer.json file")

    _choice("logger.name", cfg.logger.name, LOGGER_NAMES)
    _choice("logger.mode", cfg.logger.mode, WANDB_MODES)


def _one_line(exc: BaseException) -> str:
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
                return f"{key}: no such setting{f' in {parent}' if parent else ''} (see configs/train.yaml)"
            return f"{key}: {msg}"
    return str(exc).strip().splitlines()[0]


def compose(overrides: list[str]) -> TrainConfig:
    """Compose configs/train.yaml with command-line overrides into a validated TrainConfig.

    Raises ConfigError with a one-line message for anything wrong.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = hydra_compose(config_name=CONFIG_NAME, overrides=overrides)
            cfg.run_dir = "."  # outside a Hydra run there is no output dir to interpolate
            obj = OmegaConf.to_object(cfg)
    except Exception as e:  # Hydra and OmegaConf raise many types; all become one line
        raise ConfigError(_one_line(e)) from e
    finally:
        GlobalHydra.instance().clear()
    validate(obj)
    return obj

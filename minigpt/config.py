"""Typed configuration for a training run, and the checks that turn a bad setting into one clear line.

The dataclasses below are the schema Hydra composes `configs/train.yaml` into, and the one home of every
default (the yaml files only pick group options and presets). A key that does not exist (also with `+key=`)
or a value of the wrong type is caught at composition; a value of the right type that makes no sense
(`seq_len=-5`, a head_dim the flash kernel cannot run) by each section's `validate`, beside its fields.
Either way the user sees one line naming the key and what is allowed, never a traceback.
"""
from __future__ import annotations

import importlib.resources
import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from minigpt.attention import BACKENDS, SDPA_BACKEND_CHOICES, attention_names, get_attention

CONFIG_NAME = "train"
DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "bfloat16", "float16", "float32")
DATA_NAMES = ("passkey", "text", "hf")
LOGGER_NAMES = ("wandb", "none")
WANDB_MODES = ("auto", "online", "offline", "disabled")
# A run with no GPU and no model chosen gets these instead of gpt2-small (a 3-hour CPU run otherwise).
CPU_DEFAULTS = ("model=tiny", "seq_len=256", "batch_size=8", "max_steps=300")


def config_dir() -> Path:
    """configs/ of the installed package (`minigpt.configs`), so runs work from any directory."""
    try:
        return Path(str(importlib.resources.files("minigpt.configs")))
    except ModuleNotFoundError:  # a source tree on PYTHONPATH, not installed
        return Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A bad setting. The message is one line: the key, the value, and what is allowed."""


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value}: must be one of {', '.join(allowed)}")


def _at_least(key: str, value: Any, low: int = 1) -> None:
    if value is None or value < low:
        raise ConfigError(f"{key}={value}: must be an integer >= {low}")


@dataclass
class AttentionConfig:
    name: str = "sdpa"  # a registered backend: naive | sdpa | flash
    sdpa_backend: str = "auto"  # sdpa only: pin PyTorch's kernel (auto | flash | efficient | cudnn | math)
    # flash only: always the bitwise-reproducible seven-matmul backward; false (default) lets H100/H200 runs take the
    # faster five-matmul backward from 4K tokens at head_dim 64, whose dQ sums in a varying order (last bits)
    deterministic: bool = False

    def validate(self) -> None:
        _choice("attention", self.name, attention_names())
        _choice("attention.sdpa_backend", self.sdpa_backend, SDPA_BACKEND_CHOICES)
        if self.name != "sdpa" and self.sdpa_backend != "auto":
            raise ConfigError(f"attention.sdpa_backend={self.sdpa_backend}: only for attention=sdpa")
        if self.name != "flash" and self.deterministic:
            raise ConfigError("attention.deterministic=true: only for attention=flash (naive and sdpa follow "
                              "torch.use_deterministic_algorithms)")

    def options(self) -> dict[str, Any]:
        """The options of the chosen backend (sdpa's kernel, flash's backward)."""
        if self.name == "sdpa":
            return {"sdpa_backend": self.sdpa_backend}
        return {"deterministic": self.deterministic} if self.name == "flash" else {}


@dataclass
class ModelConfig:
    # Architecture: set by a preset in configs/model/ (tiny, gpt2-small, gpt2-medium).
    name: str = MISSING
    n_layer: int = MISSING
    n_head: int = MISSING
    n_embd: int = MISSING
    vocab_size: Optional[int] = None  # None: the tokenizer's size; GPT-2 presets pad to 50304
    rope_base: float = 10000.0
    # Memory levers (minigpt/levers.py; README "Memory levers" says what each saves and costs).
    recompute_every: int = 0  # keep only every k-th block's input, recompute the block in the backward; 0 = off
    recompute_dtype: str = "float32"  # float32 | bfloat16: dtype of those stored block inputs
    offload: bool = False  # keep the stored block inputs in pinned CPU memory instead of on the GPU
    keep_attention: bool = False  # recomputed blocks reuse their forward's attention output + LSE (flash)
    mlp_chunk: int = 0  # LayerNorm + MLP over this many tokens at a time, recomputed in the backward (in a
    #                     recomputed block every token-local piece: LN + qkv + RoPE, c_proj + LN + MLP); 0 = off
    loss_chunk: int = 0  # final norm + LM head + loss over this many tokens at a time (no N×vocab logits); 0 = off

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def levers(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("recompute_every", "recompute_dtype", "offload", "keep_attention",
                                              "mlp_chunk", "loss_chunk")}

    def validate(self) -> None:
        for key in ("n_layer", "n_head", "n_embd"):
            _at_least(f"model.{key}", getattr(self, key))
        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_embd={self.n_embd}: must be divisible by model.n_head={self.n_head}")
        if self.head_dim % 2:
            raise ConfigError(f"model.n_embd/n_head={self.head_dim}: head_dim must be even for rotary embeddings")
        if self.vocab_size is not None:
            _at_least("model.vocab_size", self.vocab_size)
        for key in ("recompute_every", "mlp_chunk", "loss_chunk"):
            _at_least(f"model.{key}", getattr(self, key), low=0)
        _choice("model.recompute_dtype", self.recompute_dtype, ("float32", "bfloat16"))
        if (self.offload or self.keep_attention or self.recompute_dtype != "float32") and not self.recompute_every:
            raise ConfigError("model.recompute_every=0: model.offload, model.keep_attention and model.recompute_dtype "
                              "act on recomputed blocks; set model.recompute_every=1 (or k)")


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
    # hf: datasets.load_dataset(dataset, dataset_config, split=split, streaming=streaming), or a save_to_disk dir
    dataset: Optional[str] = None
    dataset_config: Optional[str] = None
    split: str = "train"
    text_column: str = "text"
    streaming: bool = False
    max_docs: Optional[int] = None  # read at most this many documents (required with streaming)

    def validate(self) -> None:
        _choice("data", self.name, DATA_NAMES)
        _at_least("data.vocab_size", self.vocab_size)
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction}: must be between 0 and 1 (exclusive)")
        if self.name == "text" and not self.path:
            raise ConfigError("data.path=null: data=text needs data.path (a file, directory or glob of text files)")
        if self.name == "hf" and not self.dataset:
            raise ConfigError("data.dataset=null: data=hf needs data.dataset (a hub name or local dataset path)")
        if self.streaming and self.max_docs is None:
            raise ConfigError("data.max_docs=null: data.streaming=true needs data.max_docs (how many documents to read)")
        if self.max_docs is not None:
            _at_least("data.max_docs", self.max_docs)
        if self.tokenizer is not None and not Path(os.path.expanduser(self.tokenizer)).is_file():
            raise ConfigError(f"data.tokenizer={self.tokenizer}: no such tokenizer.json file")


@dataclass
class ParallelConfig:
    # Several processes (torchrun --nproc_per_node=N ...; minigpt/parallel.py): the sequence is split over `context`
    # ranks (ring attention, attention=flash), and the N/context groups of them train data-parallel.
    context: int = 1  # context-parallel degree K; must divide the number of processes

    def validate(self) -> None:
        _at_least("parallel.context", self.context)
        world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; 1 without it
        if world % self.context:
            raise ConfigError(f"parallel.context={self.context}: must divide the number of processes ({world}; "
                              f"torchrun --nproc_per_node x nodes)")


@dataclass
class LoggerConfig:
    name: str = "wandb"  # wandb | none
    project: str = "minigpt"
    entity: Optional[str] = None
    group: Optional[str] = None
    run_name: Optional[str] = None  # None: "<attention>-<model>-n<seq_len>"
    tags: list[str] = field(default_factory=list)
    mode: str = "auto"  # auto: online when W&B credentials exist, else offline; WANDB_MODE wins

    def validate(self) -> None:
        from minigpt.loggers import check_wandb

        _choice("logger", self.name, LOGGER_NAMES)
        _choice("logger.mode", self.mode, WANDB_MODES)
        check_wandb(self)


@dataclass
class TrainConfig:
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    seq_len: int = 1024
    batch_size: int = 4
    grad_accum: int = 1
    max_steps: int = 500
    eval_every: int = 100  # 0 = only at the end
    eval_batches: int = 4  # 0 = no evaluation
    passkey_grid: int = 0  # passkey data: at each eval, this many keys per key depth (0, ¼, ½, ¾, 1), greedy; 0 = off
    ckpt_every: int = 0  # 0 = only at the end (and when interrupted)
    save_checkpoints: bool = True  # false: never write checkpoints (sweep trials, benchmarks)
    seed: int = 1337
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"  # autocast dtype; auto = bfloat16 on CUDA, float32 on CPU
    compile: Optional[bool] = None  # regional torch.compile; null = on with CUDA, off on CPU
    resume: str = "none"  # none | auto (latest intact checkpoint in ckpt_dir) | path to a checkpoint file or dir

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

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device=cuda: no CUDA GPU is visible; use device=cpu or device=auto")
        return torch.device(self.device)

    def compile_enabled(self) -> bool:
        return self.torch_device().type == "cuda" if self.compile is None else self.compile

    def compute_dtype(self) -> torch.dtype:
        """The autocast dtype: bfloat16 on CUDA and float32 on CPU unless set."""
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def validate(self) -> None:
        """Each section's own checks, then the ones that span sections."""
        for key in ("seq_len", "batch_size", "grad_accum", "max_steps"):
            _at_least(key, getattr(self, key))
        for key in ("eval_every", "eval_batches", "ckpt_every", "warmup_steps", "passkey_grid"):
            _at_least(key, getattr(self, key), low=0)
        if self.lr_decay_steps is not None:
            _at_least("lr_decay_steps", self.lr_decay_steps)
        for key in ("min_lr", "weight_decay", "grad_clip"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}={getattr(self, key)}: must be >= 0")
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr}: must be > 0")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"{key}={getattr(self, key)}: must be in [0, 1)")
        _choice("device", self.device, DEVICES)
        _choice("dtype", self.dtype, DTYPES)
        if self.resume not in ("none", "auto") and not Path(self.resume).exists():
            raise ConfigError(f"resume={self.resume}: must be none, auto, or an existing checkpoint file or directory")
        for section in (self.attention, self.model, self.data, self.logger, self.parallel):
            section.validate()
        self._check_attention_fits()
        if self.parallel.context > 1 and self.attention.name != "flash":
            raise ConfigError(f"attention={self.attention.name}: context parallelism (parallel.context="
                              f"{self.parallel.context}) needs attention=flash (ring attention over our kernel)")

    def _check_attention_fits(self) -> None:
        """The backend's own capability check on this run's device, dtype and head_dim."""
        device, dtype = self.torch_device(), self.compute_dtype()
        if device.type == "cpu" and dtype == torch.float16:
            raise ConfigError("dtype=float16: not on CPU; use dtype=auto (float32) or bfloat16")
        reason = get_attention(self.attention.name, **self.attention.options()).unsupported(
            device, dtype, self.model.head_dim)
        if reason:
            raise ConfigError(f"attention={self.attention.name}: {reason}")
        if self.model.keep_attention and not BACKENDS[self.attention.name].returns_lse:
            with_lse = [n for n, b in BACKENDS.items() if b.returns_lse]
            raise ConfigError(f"model.keep_attention=true: needs a backend that returns its log-sum-exp "
                              f"(attention={' or '.join(with_lse)}), not attention={self.attention.name}")


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


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """A composed DictConfig as a validated TrainConfig; ConfigError (one line) for anything wrong."""
    from omegaconf import OmegaConf

    check_known_keys(cfg)
    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as e:  # OmegaConf raises many types; all become one line
        raise ConfigError(one_line(e)) from e
    obj.validate()
    return obj


def compose(overrides: list[str], run_dir: str = ".") -> TrainConfig:
    """Compose configs/train.yaml with command-line overrides into a validated TrainConfig (outside a Hydra run,
    so `run_dir` stands in for Hydra's output directory)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            cfg = hydra_compose(config_name=CONFIG_NAME, overrides=overrides)
            cfg.run_dir = run_dir  # outside a Hydra run there is no output dir to interpolate
    except Exception as e:  # Hydra raises many types; all become one line
        raise ConfigError(one_line(e)) from e
    finally:
        GlobalHydra.instance().clear()
    return to_train_config(cfg)

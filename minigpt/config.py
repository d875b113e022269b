"""Typed configuration for a training run: the schema, every default, and the checks a value allows alone.

The dataclasses below are the schema Hydra composes `configs/train.yaml` into (minigpt/compose.py), and the one
home of every default (the yaml files only pick group options and presets). A key that does not exist (also
with `+key=`) or a value of the wrong type is caught at composition; a value of the right type that makes no
sense (`seq_len=-5`, keep_attention without recompute) by each section's `validate`, beside its fields. What
needs to know the machine or the code around it (a backend's capabilities, the GPU, W&B credentials, torchrun's
world size) is checked by minigpt/validate.py, before anything of the run is created. Either way the user sees
one line naming the key and what is allowed, never a traceback.

This module is a leaf: it imports nothing of minigpt.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import MISSING

DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "bfloat16", "float16", "float32")
DATA_NAMES = ("passkey", "text", "hf", "pycode")
PYCODE_SUBSETS = ("quickstart",)
# pycode: the installed packages read beside the stdlib, the imports minigpt's dependencies guarantee (pyproject.toml)
PYCODE_PACKAGES = ("torch", "numpy", "datasets", "huggingface_hub", "fsspec", "pyarrow", "pandas", "hydra",
                   "omegaconf", "wandb", "tqdm", "matplotlib", "triton")
LOGGER_NAMES = ("wandb", "none")
ROPE_SCALINGS = ("none", "linear", "yarn")  # RoPE length extension (minigpt/model.py: rope_inv_freq)
# What a resume with resume_extend=true may change (a length-extension stage): the model keys, and seq_len
ROPE_KEYS = ("rope_base", "rope_scaling", "rope_factor", "rope_original_len")
WANDB_MODES = ("auto", "online", "offline", "disabled")
# A run with no GPU and no model chosen gets these instead of gpt2-small (a 3-hour CPU run otherwise).
CPU_DEFAULTS = ("model=tiny", "seq_len=256", "batch_size=8", "max_steps=300")
# What a CPU runs in minutes; anything larger is a GPU-sized job (gpu_sized says why).
CPU_MODELS = ("tiny", "small-6l")
CPU_MAX_SEQ_LEN = 2048
MAX_PASSKEY_FRACTION = 0.5  # data.passkey_fraction: mixed in, not the main data
# PyTorch's allocator settings: key:value pairs joined by commas, a value maybe a bracketed list ([256:1,>:8])
_ALLOC_ITEM = r"\w+:(\[[^\]\s]*\]|[^\s,\[\]]+)"
ALLOC_CONF_FORM = rf"{_ALLOC_ITEM}(,{_ALLOC_ITEM})*"


class ConfigError(ValueError):
    """A bad setting. The message is one line: the key, the value, and what is allowed."""


def one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value}: must be one of {', '.join(allowed)}")


def at_least(key: str, value: Any, low: int = 1) -> None:
    if value is None or value < low:
        raise ConfigError(f"{key}={value}: must be an integer >= {low}")


def gpu_sized(model: str | None, seq_len: int | None) -> str | None:
    """Why a job of this model preset and seq_len is sized for a GPU ("model=gpt2-small, seq_len=8192"), or None
    when a CPU runs it (a model of CPU_MODELS, seq_len up to CPU_MAX_SEQ_LEN)."""
    too_big = [f"model={model}"] if model is not None and model not in CPU_MODELS else []
    if seq_len is not None and seq_len > CPU_MAX_SEQ_LEN:
        too_big.append(f"seq_len={seq_len}")
    return ", ".join(too_big) or None


@dataclass
class AttentionConfig:
    name: str = "sdpa"  # a registered backend: naive | sdpa | flash | flex
    sdpa_backend: str = "auto"  # sdpa only: pin PyTorch's kernel (auto | flash | efficient | cudnn | math)
    # flash only: always the bitwise-reproducible seven-matmul backward; false (default) lets H100/H200 runs take the
    # faster five-matmul backward from 4K tokens at head_dim 64, whose dQ sums in a varying order (last bits)
    deterministic: bool = False

    def validate(self) -> None:
        """(The backend's name and its options' values are the registry's: validate.py checks them.)"""
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
    name: str = MISSING  # the preset's name (tiny | small-6l | gpt2-small | gpt2-medium)
    n_layer: int = MISSING  # transformer blocks
    n_head: int = MISSING  # attention heads (head_dim = n_embd / n_head)
    n_kv_head: Optional[int] = None  # key/value heads (GQA: n_head a multiple of it); null = n_head
    window: Optional[int] = None  # tokens a query sees, itself included (sliding window); null = all
    window_pattern: Optional[str] = None  # windowed layers: S yes, L full, repeated over n_layer (SSSL); null: all
    n_embd: int = MISSING  # width of the residual stream
    vocab_size: Optional[int] = None  # None: the tokenizer's size; GPT-2 presets pad to 50304
    rope_base: float = 10000.0  # RoPE's base θ
    # RoPE length extension (docs/long-context.md): linear = position interpolation (every frequency / factor);
    # yarn = NTK-by-parts frequencies + attention temperature √t = 0.1·ln(factor) + 1 on q and k
    rope_scaling: str = "none"  # RoPE length extension: none | linear | yarn
    rope_factor: float = 1.0  # RoPE scaling factor s >= 1: how many times the trained context
    rope_original_len: Optional[int] = None  # the context the RoPE scaling extends from (required for yarn)
    # Memory levers (minigpt/levers.py; docs/memory.md says what each saves and costs).
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

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head when it is null (plain multi-head attention)."""
        return self.n_kv_head or self.n_head

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention): window_pattern repeated over the layers and cut at
        n_layer (S windowed, L full); every layer windowed when there is no pattern."""
        if self.window is None:
            return [None] * self.n_layer
        pattern = self.window_pattern or "S"
        return [self.window if pattern[i % len(pattern)] == "S" else None for i in range(self.n_layer)]

    def levers(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("recompute_every", "recompute_dtype", "offload", "keep_attention",
                                              "mlp_chunk", "loss_chunk")}

    def validate(self) -> None:
        for key in ("n_layer", "n_head", "n_embd"):
            at_least(f"model.{key}", getattr(self, key))
        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_embd={self.n_embd}: must be divisible by model.n_head={self.n_head}")
        if self.head_dim % 2:
            raise ConfigError(f"model.n_embd/n_head={self.head_dim}: head_dim must be even for rotary embeddings")
        if self.n_kv_head is not None:
            at_least("model.n_kv_head", self.n_kv_head)
            if self.n_head % self.n_kv_head:
                raise ConfigError(f"model.n_kv_head={self.n_kv_head}: must divide model.n_head={self.n_head} (each "
                                  f"key/value head serves n_head/n_kv_head query heads); use a divisor of it, or "
                                  f"null for n_head")
        if self.window is not None:
            at_least("model.window", self.window)
        if self.window_pattern is not None:
            if self.window is None:
                raise ConfigError(f"model.window_pattern={self.window_pattern}: needs model.window (the window of "
                                  f"its S layers, e.g. model.window=256)")
            if not self.window_pattern or set(self.window_pattern) - {"S", "L"}:
                raise ConfigError(f"model.window_pattern={self.window_pattern}: must be letters S (windowed) and L "
                                  f"(full), e.g. SSSL")
        if self.vocab_size is not None:
            at_least("model.vocab_size", self.vocab_size)
        one_of("model.rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        if not self.rope_factor >= 1.0:
            raise ConfigError(f"model.rope_factor={self.rope_factor}: must be >= 1 (how many times the trained context)")
        if self.rope_original_len is not None:
            at_least("model.rope_original_len", self.rope_original_len)
        if self.rope_scaling == "yarn" and self.rope_original_len is None:
            raise ConfigError("model.rope_original_len=null: model.rope_scaling=yarn needs it (the trained context "
                              "it extends from, e.g. model.rope_original_len=1024)")
        for key in ("recompute_every", "mlp_chunk", "loss_chunk"):
            at_least(f"model.{key}", getattr(self, key), low=0)
        one_of("model.recompute_dtype", self.recompute_dtype, ("float32", "bfloat16"))
        if (self.offload or self.keep_attention or self.recompute_dtype != "float32") and not self.recompute_every:
            raise ConfigError("model.recompute_every=0: model.offload, model.keep_attention and model.recompute_dtype "
                              "act on recomputed blocks; set model.recompute_every=1 (or k)")


@dataclass
class DataConfig:
    name: str = "passkey"  # passkey | text | hf | pycode
    # text: a file, a directory or a glob of text files (each file is one document)
    path: Optional[str] = None
    # tokenizer for text/hf: a tokenizer.json to load, or None to train a byte-level BPE on the data
    tokenizer: Optional[str] = None
    vocab_size: int = 4096  # size of the BPE trained when no tokenizer is given
    val_fraction: float = 0.05  # tail of the token stream held out for evaluation
    cache_dir: str = "~/.cache/minigpt"  # trained tokenizers and tokenized datasets
    # hf: datasets.load_dataset(dataset, dataset_config, split=split, streaming=streaming), or a save_to_disk dir
    dataset: Optional[str] = None
    dataset_config: Optional[str] = None  # hf: the dataset's configuration (subset) name
    split: str = "train"  # hf: the split to read
    text_column: str = "text"  # hf: the column holding the documents
    streaming: bool = False  # hf: stream the dataset instead of downloading it whole (needs max_docs)
    max_docs: Optional[int] = None  # read at most this many documents (required with streaming)
    # pycode (minigpt/pycode.py): Python source of the stdlib and these installed packages; a missing one is skipped
    packages: list[str] = field(default_factory=lambda: list(PYCODE_PACKAGES))
    subset: Optional[str] = None  # pycode: None (the full corpus) | quickstart (a few stdlib packages, ~1.8 MB)
    stdlib: Optional[str] = None  # pycode: the stdlib directory to read; None: this interpreter's (tests: a fake one)
    site_dirs: Optional[list[str]] = None  # pycode: where packages are looked up; None: this interpreter's imports
    # pycode: held-out documents at least seq_len tokens long (bytes/4) a run needs; None: 20 (quickstart: 4)
    min_heldout_docs: Optional[int] = None
    document_mask: bool = False  # attend within documents (text, hf, pycode; separators end them)
    # text, hf, pycode: this share of the training sequences are passkey examples in the run's tokens (a key at a
    # random depth of a haystack, asked for at the end; minigpt/passkey_mix.py); val batches never; 0 = off
    passkey_fraction: float = 0.0

    def validate(self) -> None:
        one_of("data", self.name, DATA_NAMES)
        at_least("data.vocab_size", self.vocab_size)
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction}: must be between 0 and 1 (exclusive)")
        if self.name == "text" and not self.path:
            raise ConfigError("data.path=null: data=text needs data.path (a file, directory or glob of text files)")
        if self.name == "hf" and not self.dataset:
            raise ConfigError("data.dataset=null: data=hf needs data.dataset (a hub name or local dataset path)")
        if self.streaming and self.max_docs is None:
            raise ConfigError("data.max_docs=null: data.streaming=true needs data.max_docs (how many documents to read)")
        if self.max_docs is not None:
            at_least("data.max_docs", self.max_docs)
        if self.subset is not None:
            one_of("data.subset", self.subset, PYCODE_SUBSETS)
        if self.min_heldout_docs is not None:
            at_least("data.min_heldout_docs", self.min_heldout_docs)
        if not 0.0 <= self.passkey_fraction <= MAX_PASSKEY_FRACTION:
            raise ConfigError(f"data.passkey_fraction={self.passkey_fraction}: must be in [0, {MAX_PASSKEY_FRACTION}] "
                              f"(the share of training sequences that are passkey examples)")
        if self.passkey_fraction and self.name == "passkey":
            raise ConfigError(f"data.passkey_fraction={self.passkey_fraction}: data=passkey is all passkey examples; "
                              f"leave it 0, or mix them into data=text, hf or pycode")
        if self.document_mask and self.name == "passkey":
            raise ConfigError("data.document_mask=true: data=passkey has no documents to keep apart (one sequence "
                              "is one text); leave it false, or use data=text, hf or pycode")
        if self.tokenizer is not None and not Path(os.path.expanduser(self.tokenizer)).is_file():
            raise ConfigError(f"data.tokenizer={self.tokenizer}: no such tokenizer.json file")


@dataclass
class ParallelConfig:
    # Several processes (torchrun --nproc_per_node=N ...; minigpt/distributed/): the sequence is split over `context`
    # ranks (ring attention over our kernel, attention=flash, with windows, document masks and GQA), and the N/context
    # groups of them train data-parallel.
    context: int = 1  # context-parallel degree K; must divide the number of processes (validate.py)

    def validate(self) -> None:
        at_least("parallel.context", self.context)


@dataclass
class LoggerConfig:
    name: str = "wandb"  # wandb | none
    project: str = "minigpt"  # W&B project
    entity: Optional[str] = None  # W&B team or user; None: your default
    group: Optional[str] = None  # W&B run group
    run_name: Optional[str] = None  # None: "<attention>-<model>-n<seq_len>"
    tags: list[str] = field(default_factory=list)  # W&B tags, e.g. logger.tags=[a,b]
    mode: str = "auto"  # auto: online when W&B credentials exist, else offline; WANDB_MODE wins

    def validate(self) -> None:
        """(Whether an online run has W&B credentials: validate.py.)"""
        one_of("logger", self.name, LOGGER_NAMES)
        one_of("logger.mode", self.mode, WANDB_MODES)


@dataclass
class TrainConfig:
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    seq_len: int = 1024  # tokens per training sequence (the context length)
    batch_size: int = 4  # sequences per micro-batch (per process under torchrun)
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int = 500  # optimizer steps
    eval_every: int = 100  # evaluate every this many steps; 0 = only at the end
    eval_batches: int = 4  # val batches per evaluation; 0 = no evaluation
    passkey_grid: int = 0  # passkey data: at each eval, this many keys per key depth (0, ¼, ½, ¾, 1), greedy; 0 = off
    # at each eval, the mean loss per position bin of a few val documents (eval/loss_by_position/<lo>-<hi>);
    # null: on for data=pycode (without context parallelism), off otherwise
    loss_by_position: Optional[bool] = None
    ckpt_every: int = 0  # checkpoint every this many steps; 0 = only at the end (and when interrupted)
    save_checkpoints: bool = True  # false: never write checkpoints (sweep trials, benchmarks)
    seed: int = 1337  # model init and data order
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"  # autocast dtype; auto = bfloat16 on CUDA, float32 on CPU
    compile: Optional[bool] = None  # regional torch.compile; null = on with CUDA, off on CPU
    resume: str = "none"  # none | auto (latest intact checkpoint in ckpt_dir) | path to a checkpoint file or dir
    resume_extend: bool = False  # a length-extension stage: this resume may change model.rope_* and seq_len

    lr: float = 6e-4  # peak learning rate (AdamW)
    min_lr: float = 6e-5  # learning rate at the end of the cosine decay
    warmup_steps: int = 20  # linear warmup from 0 to lr
    lr_decay_steps: Optional[int] = None  # cosine horizon; None = max_steps
    weight_decay: float = 0.1  # AdamW, on matrices only
    beta1: float = 0.9  # AdamW
    beta2: float = 0.95  # AdamW
    grad_clip: float = 1.0  # clip the gradient norm to this; 0 = off

    # CUDA allocator settings (PYTORCH_CUDA_ALLOC_CONF); null: keep the env's
    # (minigpt/cuda_allocator.py: set before CUDA starts; expandable segments keep reserved memory near allocated)
    cuda_alloc_conf: Optional[str] = "expandable_segments:True"

    run_dir: str = "."  # where summary.json goes; train.yaml sets it to Hydra's output dir
    ckpt_dir: str = "${run_dir}/checkpoints"  # where checkpoints go (the newest two are kept)

    def torch_device(self) -> torch.device:
        """The device: `auto` is CUDA when a GPU is visible, else the CPU (validate.py refuses cuda without one)."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def compile_enabled(self) -> bool:
        return self.torch_device().type == "cuda" if self.compile is None else self.compile

    def compute_dtype(self) -> torch.dtype:
        """The autocast dtype: bfloat16 on CUDA and float32 on CPU unless set."""
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def validate(self) -> None:
        """Each section's own checks, then the ones that span sections (validate.py adds the runtime ones)."""
        for key in ("seq_len", "batch_size", "grad_accum", "max_steps"):
            at_least(key, getattr(self, key))
        for key in ("eval_every", "eval_batches", "ckpt_every", "warmup_steps", "passkey_grid"):
            at_least(key, getattr(self, key), low=0)
        if self.lr_decay_steps is not None:
            at_least("lr_decay_steps", self.lr_decay_steps)
        for key in ("min_lr", "weight_decay", "grad_clip"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}={getattr(self, key)}: must be >= 0")
        if self.lr <= 0:
            raise ConfigError(f"lr={self.lr}: must be > 0")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"{key}={getattr(self, key)}: must be in [0, 1)")
        one_of("device", self.device, DEVICES)
        one_of("dtype", self.dtype, DTYPES)
        if self.resume not in ("none", "auto") and not Path(self.resume).exists():
            raise ConfigError(f"resume={self.resume}: must be none, auto, or an existing checkpoint file or directory")
        for section in (self.attention, self.model, self.data, self.logger, self.parallel):
            section.validate()
        if self.loss_by_position and self.data.name == "passkey":
            raise ConfigError("loss_by_position=true: data=passkey has no documents to read by position; use "
                              "data=text, hf or pycode, or leave it null")
        if self.loss_by_position and self.parallel.context > 1:
            raise ConfigError(f"loss_by_position=true: not under context parallelism (parallel.context="
                              f"{self.parallel.context}: the ring needs split sequences); leave it null")
        if self.cuda_alloc_conf is not None and not re.fullmatch(ALLOC_CONF_FORM, self.cuda_alloc_conf):
            raise ConfigError(f"cuda_alloc_conf={self.cuda_alloc_conf}: must be key:value pairs joined by commas, as "
                              f"PyTorch's PYTORCH_CUDA_ALLOC_CONF takes them (e.g. expandable_segments:True), or null "
                              f"to keep the environment's")

    def position_eval(self) -> bool:
        """Whether each eval logs loss by position (loss_by_position, null = on for pycode without CP)."""
        if self.loss_by_position is None:
            return self.data.name == "pycode" and self.parallel.context == 1
        return self.loss_by_position

    def masks(self) -> list[str]:
        """The settings that mask attention beyond causal ("model.window=64", "data.document_mask=true"), if any."""
        masks = [f"model.window={self.model.window}"] if self.model.window is not None else []
        return masks + (["data.document_mask=true"] if self.data.document_mask else [])

    def gqa(self) -> list[str]:
        """["model.n_kv_head=k"] when the keys and values have fewer heads than the queries, else []."""
        return [f"model.n_kv_head={self.model.n_kv_head}"] if self.model.kv_heads != self.model.n_head else []

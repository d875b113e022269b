"""Training data: the embedded passkey task, local text files, and any `datasets` dataset.

Every source exposes `batch(split, index, batch_size) -> (x, y)`: int64 CPU tensors of shape
(batch_size, seq_len), y = x shifted by one token. A batch is a pure function of (seed, split,
index), so the trainer's data position is just the step counter and a resumed run sees exactly
the batches a straight run would.
"""
from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from torch import Tensor

from minigpt.config import DataConfig

EOT = "<|endoftext|>"
SPLITS = ("train", "val")


class DataError(ValueError):
    """Bad or insufficient data; the message says which setting or file and what to do."""


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, SPLITS.index(split), index])


# --------------------------------------------------------------------------------------------
# passkey: generated, nothing to download
# --------------------------------------------------------------------------------------------
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass
class PasskeyData:
    """Filler text with a 5-digit pass key planted at a random depth and asked for at the very end.

    Bytes are tokens (vocab 256). To predict the key at the end the model must find it anywhere in
    the context, so long-context attention is exercised. `answer` is the slice of y holding the key.
    """

    seq_len: int
    seed: int
    vocab_size: int = 256

    NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
    QUESTION = " What is the pass key? The pass key is {key}."
    KEY_DIGITS = 5

    def __post_init__(self):
        fixed = len(self.NEEDLE.format(key="0" * self.KEY_DIGITS)) + len(self.QUESTION.format(key="0" * self.KEY_DIGITS))
        if self.seq_len + 1 < fixed + 1:
            raise DataError(f"seq_len={self.seq_len}: the passkey task needs seq_len >= {fixed} (key + question)")
        # The key sits just before the final '.', i.e. y[-1-KEY_DIGITS : -1] (y is the text shifted by one).
        self.answer = slice(self.seq_len - 1 - self.KEY_DIGITS, self.seq_len - 1)

    def sample(self, rng: np.random.Generator) -> np.ndarray:
        """One sequence of seq_len+1 byte tokens."""
        key = str(rng.integers(10 ** (self.KEY_DIGITS - 1), 10**self.KEY_DIGITS))
        needle, question = self.NEEDLE.format(key=key), self.QUESTION.format(key=key)
        n_filler = self.seq_len + 1 - len(needle) - len(question)
        offset = int(rng.integers(0, len(FILLER)))  # vary the filler phase too
        reps = (offset + n_filler) // len(FILLER) + 1
        filler = (FILLER * reps)[offset : offset + n_filler]
        depth = int(rng.integers(0, n_filler + 1))
        text = filler[:depth] + needle + filler[depth:] + question
        return np.frombuffer(text.encode("ascii"), dtype=np.uint8)

    def batch(self, split: str, index: int, batch_size: int) -> tuple[Tensor, Tensor]:
        rng = _rng(self.seed, split, index)
        tokens = torch.from_numpy(np.stack([self.sample(rng) for _ in range(batch_size)]).astype(np.int64))
        return tokens[:, :-1], tokens[:, 1:]


# --------------------------------------------------------------------------------------------
# text and hf: a BPE tokenizer over documents, then random windows of a token stream
# --------------------------------------------------------------------------------------------
@dataclass
class TokenData:
    """Random windows of seq_len+1 tokens from a train and a val token stream."""

    train: np.ndarray
    val: np.ndarray
    seq_len: int
    seed: int
    vocab_size: int
    answer: slice | None = None  # no retrieval task on free text

    def __post_init__(self):
        for split, tokens in (("train", self.train), ("val", self.val)):
            if len(tokens) < self.seq_len + 1:
                raise DataError(
                    f"data: the {split} split has {len(tokens)} tokens, fewer than one window of "
                    f"seq_len+1={self.seq_len + 1}; give more text or lower seq_len"
                )

    def batch(self, split: str, index: int, batch_size: int) -> tuple[Tensor, Tensor]:
        tokens = self.train if split == "train" else self.val
        starts = _rng(self.seed, split, index).integers(0, len(tokens) - self.seq_len, size=batch_size)
        windows = np.stack([tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        t = torch.from_numpy(windows)
        return t[:, :-1], t[:, 1:]


def _text_files(pattern: str) -> list[str]:
    path = os.path.expanduser(pattern)
    if os.path.isdir(path):
        files = sorted(str(p) for p in Path(path).rglob("*") if p.is_file())
    else:
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    if not files:
        raise DataError(f"data.path={pattern}: no file matches")
    for f in files:
        if os.path.getsize(f) == 0:
            raise DataError(f"data.path={pattern}: {f} is empty")
    return files


def _files_key(files: list[str]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def load_tokenizer(cfg: DataConfig, texts: Iterable[str], data_key: str):
    """cfg.tokenizer if given, else a byte-level BPE trained on `texts`, cached under cfg.cache_dir by data + size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if cfg.tokenizer:
        return Tokenizer.from_file(os.path.expanduser(cfg.tokenizer))
    cache = Path(os.path.expanduser(cfg.cache_dir)) / "tokenizers" / f"bpe-{cfg.vocab_size}-{data_key}.json"
    if cache.exists():
        return Tokenizer.from_file(str(cache))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, cache)
    return tok


def _token_stream(ds, column: str, tokenizer) -> np.ndarray:
    """Tokenize a datasets.Dataset (batched map, cached by datasets) into one stream, EOT between documents."""
    eot = tokenizer.token_to_id(EOT)
    if eot is None:
        raise DataError(f"data.tokenizer: has no {EOT} token to separate documents")

    def encode(batch: dict) -> dict:
        return {"ids": [e.ids + [eot] for e in tokenizer.encode_batch(batch[column])]}

    ids = ds.map(encode, batched=True, remove_columns=ds.column_names, desc="tokenizing")
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 1 << 16 else np.int32
    chunks = [np.asarray(row, dtype=dtype) for row in ids.with_format("numpy")["ids"]]
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def _split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def _documents(ds, column: str) -> Iterator[str]:
    for i in range(0, len(ds), 1000):
        yield from ds[i : i + 1000][column]


def load_text(cfg: DataConfig, seq_len: int, seed: int) -> TokenData:
    import datasets

    files = _text_files(cfg.path)
    cache_dir = os.path.expanduser(cfg.cache_dir)
    ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train", cache_dir=cache_dir)
    tokenizer = load_tokenizer(cfg, _documents(ds, "text"), _files_key(files))
    train, val = _split(_token_stream(ds, "text", tokenizer), cfg.val_fraction)
    return TokenData(train, val, seq_len, seed, tokenizer.get_vocab_size())


def load_hf(cfg: DataConfig, seq_len: int, seed: int) -> TokenData:
    import datasets

    cache_dir = os.path.expanduser(cfg.cache_dir)
    try:
        ds = datasets.load_dataset(
            cfg.dataset, cfg.dataset_config, split=cfg.split, streaming=cfg.streaming, cache_dir=cache_dir
        )
    except (FileNotFoundError, ValueError) as e:
        raise DataError(f"data.dataset={cfg.dataset}: cannot load ({str(e).splitlines()[0]})") from e
    columns = ds.column_names or []
    if cfg.text_column not in columns:
        raise DataError(f"data.text_column={cfg.text_column}: not a column of {cfg.dataset}; it has {', '.join(columns)}")
    if cfg.streaming:  # read the first max_docs documents into an in-memory dataset
        ds = datasets.Dataset.from_list([{cfg.text_column: r[cfg.text_column]} for r in ds.take(cfg.max_docs)])
    elif cfg.max_docs is not None:
        ds = ds.select(range(min(cfg.max_docs, len(ds))))
    if len(ds) == 0:
        raise DataError(f"data.dataset={cfg.dataset}: split {cfg.split} is empty")
    key = hashlib.sha256(f"{cfg.dataset}|{cfg.dataset_config}|{cfg.split}|{cfg.max_docs}|{ds._fingerprint}".encode())
    tokenizer = load_tokenizer(cfg, _documents(ds, cfg.text_column), key.hexdigest()[:16])
    train, val = _split(_token_stream(ds, cfg.text_column, tokenizer), cfg.val_fraction)
    return TokenData(train, val, seq_len, seed, tokenizer.get_vocab_size())


def build_data(cfg: DataConfig, seq_len: int, seed: int) -> PasskeyData | TokenData:
    """The data source named by cfg.name."""
    if cfg.name == "passkey":
        return PasskeyData(seq_len, seed)
    if cfg.name == "text":
        return load_text(cfg, seq_len, seed)
    if cfg.name == "hf":
        return load_hf(cfg, seq_len, seed)
    raise DataError(f"data.name={cfg.name}: choose one of passkey, text, hf")

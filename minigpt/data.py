"""Training data: the embedded passkey task, local text files, any `datasets` dataset, and the pycode corpus.

Every source exposes `batch(split, index, batch_size) -> (x, y, document_ids)`: x, y int64 CPU tensors of shape
(batch_size, seq_len), y = x shifted by one token; document_ids None, or with data.document_mask (text, hf, pycode)
int32 (batch_size, seq_len) ids of the documents the end-of-text separators delimit (`document_ids`), for
attention within documents (None again where every row is one document: plain causal attention). With
data.passkey_fraction some training rows are passkey examples in the run's tokens (minigpt/passkey_mix.py). A batch
is a pure function of (seed, split, index), so the trainer's data position is just the step counter and a resumed
run sees exactly the batches a straight run would.
"""
from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import json
import os
import socket
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from torch import Tensor

from minigpt.config import ConfigError, DataConfig
from minigpt.files import atomic_write_text
from minigpt.passkey_mix import PasskeyMix

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
    tokenizer_json: str | None = None  # bytes are tokens: no tokenizer file (a run records "bytes")

    NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
    QUESTION = " What is the pass key? The pass key is {key}."
    KEY_DIGITS = 5

    @classmethod
    def shortest(cls) -> int:
        """The shortest seq_len that holds the needle, the question and the key."""
        key = "0" * cls.KEY_DIGITS
        return len(cls.NEEDLE.format(key=key)) + len(cls.QUESTION.format(key=key))

    def __post_init__(self):
        if self.seq_len < self.shortest():
            raise DataError(f"seq_len={self.seq_len}: the passkey task needs seq_len >= {self.shortest()} "
                            f"(key + question)")
        # The key sits just before the final '.', i.e. y[-1-KEY_DIGITS : -1] (y is the text shifted by one).
        self.answer = slice(self.seq_len - 1 - self.KEY_DIGITS, self.seq_len - 1)

    def sample(self, rng: np.random.Generator, depth: float | None = None) -> np.ndarray:
        """One sequence of seq_len+1 byte tokens, the needle at a random depth (training), or at `depth`: the
        fraction of the filler before the needle (0 = first, 1 = just before the question), to the nearest byte
        (the filler is cut mid-sentence, as in training). The random draws of training are unchanged."""
        if depth is not None and not 0.0 <= depth <= 1.0:
            raise DataError(f"depth={depth}: must be a fraction of the filler in [0, 1]")
        key = str(rng.integers(10 ** (self.KEY_DIGITS - 1), 10**self.KEY_DIGITS))
        needle, question = self.NEEDLE.format(key=key), self.QUESTION.format(key=key)
        n_filler = self.seq_len + 1 - len(needle) - len(question)
        offset = int(rng.integers(0, len(FILLER)))  # vary the filler phase too
        reps = (offset + n_filler) // len(FILLER) + 1
        filler = (FILLER * reps)[offset : offset + n_filler]
        cut = int(rng.integers(0, n_filler + 1)) if depth is None else round(depth * n_filler)
        text = filler[:cut] + needle + filler[cut:] + question
        return np.frombuffer(text.encode("ascii"), dtype=np.uint8)

    def prompt(self, rng: np.random.Generator, depth: float) -> tuple[np.ndarray, np.ndarray]:
        """For generation: the seq_len - KEY_DIGITS tokens up to and including the question's "The pass key is ",
        and the key's KEY_DIGITS tokens that should follow. The prompt holds the key only in the needle."""
        tokens = self.sample(rng, depth)
        start = self.answer.start + 1  # the answer slice indexes y, the tokens shifted by one
        return tokens[:start], tokens[start : start + self.KEY_DIGITS]

    def batch(self, split: str, index: int, batch_size: int) -> tuple[Tensor, Tensor, None]:
        rng = _rng(self.seed, split, index)
        tokens = torch.from_numpy(np.stack([self.sample(rng) for _ in range(batch_size)]).astype(np.int64))
        return tokens[:, :-1], tokens[:, 1:], None  # one text per sequence: no documents to keep apart


# --------------------------------------------------------------------------------------------
# text and hf: a BPE tokenizer over documents, then random windows of a token stream
# --------------------------------------------------------------------------------------------
def document_ids(x: Tensor, eot: int) -> Tensor:
    """The document of each token of x (B, N), int32: each row counts from 0 (a window that starts mid-document
    gives that part its own id) and goes up by one after each end-of-text separator `eot`, which belongs to the
    document it ends. Non-decreasing, as the attention backends need."""
    ends = (x == eot).to(torch.int32)
    return ends.cumsum(dim=1, dtype=torch.int32) - ends  # separators strictly before each token


@dataclass
class TokenData:
    """Random windows of seq_len+1 tokens from a train and a val token stream (documents joined by `eot`); with
    `document_mask`, each batch carries the windows' document ids."""

    train: np.ndarray
    val: np.ndarray
    seq_len: int
    seed: int
    vocab_size: int
    answer: slice | None = None  # no retrieval task on free text
    tokenizer_json: str | None = None  # the tokenizer (`tokenizers` JSON), saved into the run directory
    manifest: dict | None = None  # what the corpus is (pycode), saved into the run directory as corpus.json
    eot: int | None = None  # the end-of-text separator's id
    document_mask: bool = False  # batches carry document ids (data.document_mask)
    passkey: PasskeyMix | None = None  # passkey examples in some training rows (data.passkey_fraction)

    def __post_init__(self):
        if self.document_mask and self.eot is None:
            raise DataError(f"data.document_mask=true: the tokenizer has no {EOT} token to separate documents")
        for split, tokens in (("train", self.train), ("val", self.val)):
            if len(tokens) < self.seq_len + 1:
                raise DataError(
                    f"data: the {split} split has {len(tokens)} tokens, fewer than one window of "
                    f"seq_len+1={self.seq_len + 1}; give more text or lower seq_len"
                )

    def batch(self, split: str, index: int, batch_size: int) -> tuple[Tensor, Tensor, Tensor | None]:
        tokens = self.train if split == "train" else self.val
        starts = _rng(self.seed, split, index).integers(0, len(tokens) - self.seq_len, size=batch_size)
        windows = np.stack([tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        examples = self.passkey.rows(index, batch_size) if self.passkey is not None and split == "train" else []
        for r in examples:  # these rows are passkey examples instead (the others stay as they were)
            windows[r] = self.passkey.example(self.train, self.seq_len + 1, index, r)
        t = torch.from_numpy(windows)
        x, y = t[:, :-1], t[:, 1:]  # every target is kept, also a separator's (the next document's first token)
        if not self.document_mask:
            return x, y, None
        ids = document_ids(x, self.eot)
        ids[examples] = 0  # an example is one document, whatever separators its haystack holds
        return x, y, None if one_document_per_row(ids) else ids


def one_document_per_row(ids: Tensor) -> bool:
    """Whether no row of document ids (B, N) crosses a boundary. Their mask is then plain causal attention, which
    the batch asks for by carrying no ids: every backend runs it at least as fast unmasked (flash's dense forward
    keeps three consumer warpgroups busy where the masked one runs two). Read from the CPU tensor: nothing waits."""
    return bool((ids[:, 0] == ids[:, -1]).all())


def _first_line(e: BaseException) -> str:
    """The root cause's first message line: `datasets` wraps the informative error in a generic one."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _cache_dir(cfg: DataConfig) -> str:
    """cfg.cache_dir, created; checked here so an unusable one is named instead of failing inside `datasets`."""
    path = os.path.expanduser(cfg.cache_dir)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"data.cache_dir={cfg.cache_dir}: cannot create it ({e.strerror}); point it at a writable directory"
        ) from e
    if not os.access(path, os.W_OK):
        raise DataError(f"data.cache_dir={cfg.cache_dir}: not writable; point it at a writable directory")
    return path


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


def _blocks(path: str) -> Iterator[bytes]:
    """The file's bytes, 1 MiB at a time: a corpus can be larger than memory."""
    with open(path, "rb") as fh:
        yield from iter(lambda: fh.read(1 << 20), b"")


def _is_archive(path: str) -> bool:
    """True for a compressed file or archive (gzip, zip, tar, ...): `datasets` unpacks those itself."""
    from datasets.utils.extract import Extractor

    return Extractor.infer_extractor_format(path) is not None


def _decode(decoder: codecs.IncrementalDecoder, block: bytes, offset: int, path: str, pattern: str, final=False):
    """Feed `block`, at byte `offset` of the file, to the decoder; invalid UTF-8 is a DataError naming the file."""
    pending = len(decoder.getstate()[0])  # bytes of an unfinished character carried over from the previous block
    try:
        decoder.decode(block, final)
    except UnicodeDecodeError as e:
        raise DataError(
            f"data.path={pattern}: {path} is not UTF-8 text (invalid byte 0x{e.object[e.start]:02x} at offset "
            f"{offset - pending + e.start}); convert it (iconv -f <its encoding> -t UTF-8) or exclude it from data.path"
        ) from None


def _text_blocks(path: str, pattern: str) -> Iterator[bytes]:
    """The file's bytes in blocks, checked on the way: a NUL byte (binary) or invalid UTF-8 is a DataError naming the
    file, not a traceback from `datasets`. Streamed, so a large corpus costs no memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    for block in _blocks(path):
        nul = block.find(b"\0")
        if nul >= 0:
            raise DataError(
                f"data.path={pattern}: {path} is binary (NUL byte at offset {offset + nul}), not text; "
                f"give UTF-8 text files only, or exclude it from data.path"
            )
        _decode(decoder, block, offset, path, pattern)
        offset += len(block)
        yield block
    _decode(decoder, b"", offset, path, pattern, final=True)


def _files_key(files: list[str], pattern: str) -> str:
    """Hash of the files' names and bytes (the tokenizer cache key); the same single read checks that they are text."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode())
        for block in _blocks(f) if _is_archive(f) else _text_blocks(f, pattern):
            h.update(block)
    return h.hexdigest()[:16]


def _user_tokenizer(cfg: DataConfig):
    """cfg.tokenizer, loaded; a file that is not a tokenizer JSON is a DataError, not a bare `tokenizers` Exception."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(os.path.expanduser(cfg.tokenizer))
    except Exception as e:  # tokenizers raises a bare Exception for unreadable or malformed files
        raise DataError(
            f"data.tokenizer={cfg.tokenizer}: not a tokenizer JSON file ({_first_line(e)}); give a tokenizer.json "
            f"saved by `tokenizers`, or unset data.tokenizer to train a BPE on the data"
        ) from e


def load_tokenizer(cfg: DataConfig, texts: Iterable[str], data_key: str):
    """cfg.tokenizer if given, else a byte-level BPE trained on `texts`, cached under cfg.cache_dir by data + size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if cfg.tokenizer:
        return _user_tokenizer(cfg)
    cache = Path(_cache_dir(cfg)) / "tokenizers" / f"bpe-{cfg.vocab_size}-{data_key}.json"
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
    atomic_write_text(cache, tok.to_str())
    return tok


def _token_stream(ds, column: str, tokenizer) -> np.ndarray:
    """Tokenize a datasets.Dataset (batched map, cached by datasets) into one stream, EOT between documents."""
    eot = tokenizer.token_to_id(EOT)
    if eot is None:
        raise DataError(f"data.tokenizer: has no {EOT} token to separate documents")

    def encode(batch: dict) -> dict:
        return {"ids": [e.ids + [eot] for e in tokenizer.encode_batch([t or "" for t in batch[column]])]}

    ids = ds.map(encode, batched=True, remove_columns=ds.column_names, desc="tokenizing")
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 1 << 16 else np.int32
    chunks = [np.asarray(row, dtype=dtype) for row in ids.with_format("numpy")["ids"]]
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def _documents_of(cfg: DataConfig, tokenizer, seq_len: int, seed: int) -> dict:
    """TokenData's separator, document-mask and passkey-mixing fields for this tokenizer and config."""
    return {"eot": tokenizer.token_to_id(EOT), "document_mask": cfg.document_mask,
            "passkey": passkey_mix(cfg, tokenizer, seq_len, seed)}


def passkey_mix(cfg: DataConfig, tokenizer, seq_len: int, seed: int) -> PasskeyMix | None:
    """The passkey examples of data.passkey_fraction in this tokenizer's tokens (minigpt/passkey_mix.py), or None.
    ConfigError when seq_len is too short to hold one."""
    if not cfg.passkey_fraction:
        return None
    question, _, end = PasskeyData.QUESTION.partition(" {key}")  # minigpt-eval's question, then " <key>."
    mix = PasskeyMix(cfg.passkey_fraction, seed, lambda text: tokenizer.encode(text).ids, PasskeyData.NEEDLE,
                     question, " {key}" + end, np.asarray(tokenizer.encode(FILLER * 8).ids, dtype=np.int64),
                     start=tokenizer.token_to_id(EOT))
    if seq_len + 1 < mix.min_tokens():
        raise ConfigError(f"data.passkey_fraction={cfg.passkey_fraction}: a passkey example needs seq_len >= "
                          f"{mix.min_tokens() - 1} in this tokenizer's tokens, seq_len={seq_len}; raise seq_len or "
                          f"set data.passkey_fraction=0")
    return mix


def _split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def _documents(ds, column: str) -> Iterator[str]:
    """The documents in batches; a missing one (None, e.g. a JSON row without the key) reads as empty."""
    for i in range(0, len(ds), 1000):
        yield from (t or "" for t in ds[i : i + 1000][column])


def load_text(cfg: DataConfig, seq_len: int, seed: int) -> TokenData:
    import datasets

    files = _text_files(cfg.path)
    key = _files_key(files, cfg.path)  # before `datasets` sees the files: a binary or non-UTF-8 one is named here
    try:
        ds = datasets.load_dataset(
            "text", data_files=files, sample_by="document", split="train", cache_dir=_cache_dir(cfg)
        )
    except DataError:
        raise
    except Exception as e:  # e.g. non-UTF-8 text inside an archive, which only `datasets` unpacks
        raise DataError(
            f"data.path={cfg.path}: cannot read the files ({_first_line(e)}); give UTF-8 text, plain or compressed"
        ) from e
    tokenizer = load_tokenizer(cfg, _documents(ds, "text"), key)
    train, val = _split(_token_stream(ds, "text", tokenizer), cfg.val_fraction)
    return TokenData(train, val, seq_len, seed, tokenizer.get_vocab_size(), tokenizer_json=tokenizer.to_str(),
                     **_documents_of(cfg, tokenizer, seq_len, seed))


# --------------------------------------------------------------------------------------------
# hf: a hub dataset, a local directory of data files, or a `save_to_disk` directory
# --------------------------------------------------------------------------------------------
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def _offline_reason() -> str | None:
    """Why the hub cannot be used ("HF_HUB_OFFLINE is set", "huggingface.co:443 is unreachable"), or None if it can.

    A quick TCP connect (to the HTTPS proxy, if one is set) replaces minutes of `datasets` retries on a machine
    without network."""
    from huggingface_hub import constants

    for var in OFFLINE_VARS:
        if os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE"):
            return f"{var} is set"
    endpoint = urllib.parse.urlsplit(constants.ENDPOINT)
    proxy = None if urllib.request.proxy_bypass(endpoint.hostname) else urllib.request.getproxies().get(endpoint.scheme)
    target = urllib.parse.urlsplit(proxy) if proxy else endpoint
    address = (target.hostname, target.port or (443 if target.scheme == "https" else 80))
    try:
        socket.create_connection(address, timeout=3).close()
    except OSError:
        return f"{address[0]}:{address[1]} is unreachable"
    return None


@contextlib.contextmanager
def _hub_offline():
    """Offline mode for `datasets` and `huggingface_hub` during one load: a cached copy is used, a missing one fails at
    once. Both read HF_HUB_OFFLINE when imported, so their flags are switched (and put back), not os.environ."""
    import datasets.config
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _is_saved_dataset(path: str) -> bool:
    """True for a directory written by Dataset.save_to_disk or DatasetDict.save_to_disk."""
    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(path, name))

    return has("dataset_dict.json") or (has("dataset_info.json") and has("state.json"))


def _load_from_disk(cfg: DataConfig, path: str):
    """A save_to_disk directory (from a DatasetDict, its data.split). It is read locally whether or not
    data.streaming is set: max_docs selects the same first documents a stream would."""
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if cfg.split not in ds:
            raise DataError(f"data.split={cfg.split}: not a split of {cfg.dataset}; it has {', '.join(ds)}")
        ds = ds[cfg.split]
    return ds


def _load_dataset(cfg: DataConfig):
    """datasets.load_dataset; a streamed dataset is read up to max_docs documents into memory."""
    import datasets

    ds = datasets.load_dataset(
        cfg.dataset, cfg.dataset_config, split=cfg.split, streaming=cfg.streaming, cache_dir=_cache_dir(cfg)
    )
    if not cfg.streaming:
        return ds
    rows = list(ds.take(cfg.max_docs))
    if rows and cfg.text_column not in rows[0]:
        raise _no_column(cfg, list(rows[0]))
    return datasets.Dataset.from_dict({cfg.text_column: [r[cfg.text_column] for r in rows]})


def _open_hf(cfg: DataConfig):
    """cfg.dataset as a datasets.Dataset. This is the boundary to `datasets` and the hub: whatever goes wrong there
    becomes one DataError line carrying the first line of the cause."""
    path = os.path.expanduser(cfg.dataset)
    local = os.path.exists(path)
    if not local and cfg.dataset.startswith(("/", ".", "~")):
        raise DataError(f"data.dataset={cfg.dataset}: no such file or directory; check the path")
    offline = None if local else _offline_reason()
    try:
        if _is_saved_dataset(path):
            return _load_from_disk(cfg, path)
        with _hub_offline() if offline else contextlib.nullcontext():
            return _load_dataset(cfg)
    except DataError:
        raise
    except Exception as e:
        if offline:
            raise DataError(
                f"data.dataset={cfg.dataset}: not a local path, the Hugging Face Hub cannot be used ({offline}) and no "
                f"cached copy is in data.cache_dir={cfg.cache_dir} ({_first_line(e)}); run once with network access, "
                f"or point data.dataset at a local dataset directory (of data files, or one save_to_disk wrote)"
            ) from e
        raise DataError(
            f"data.dataset={cfg.dataset}: cannot load it ({_first_line(e)}); "
            f"check data.dataset, data.dataset_config and data.split"
        ) from e


def _no_column(cfg: DataConfig, columns: list[str]) -> DataError:
    return DataError(f"data.text_column={cfg.text_column}: not a column of {cfg.dataset}; it has {', '.join(columns)}")


def _is_text(feature) -> bool:
    import datasets

    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")


def _check_text_column(ds, cfg: DataConfig) -> None:
    """The documents must be strings: anything else would fail deep inside the tokenizer."""
    if cfg.text_column not in ds.column_names:
        raise _no_column(cfg, ds.column_names)
    feature = ds.features[cfg.text_column]
    if not _is_text(feature):
        strings = ", ".join(c for c, f in ds.features.items() if _is_text(f)) or "none"
        raise DataError(
            f"data.text_column={cfg.text_column}: a {feature} column, not text; "
            f"choose a string column of {cfg.dataset} ({strings})"
        )


def load_hf(cfg: DataConfig, seq_len: int, seed: int) -> TokenData:
    ds = _open_hf(cfg)
    if cfg.max_docs is not None and len(ds) > cfg.max_docs:
        ds = ds.select(range(cfg.max_docs))
    if len(ds) == 0:
        raise DataError(f"data.dataset={cfg.dataset}: split {cfg.split} is empty")
    _check_text_column(ds, cfg)
    key = hashlib.sha256(f"{cfg.dataset}|{cfg.dataset_config}|{cfg.split}|{cfg.max_docs}|{ds._fingerprint}".encode())
    tokenizer = load_tokenizer(cfg, _documents(ds, cfg.text_column), key.hexdigest()[:16])
    train, val = _split(_token_stream(ds, cfg.text_column, tokenizer), cfg.val_fraction)
    return TokenData(train, val, seq_len, seed, tokenizer.get_vocab_size(), tokenizer_json=tokenizer.to_str(),
                     **_documents_of(cfg, tokenizer, seq_len, seed))


# --------------------------------------------------------------------------------------------
# pycode: Python source already on this machine (minigpt/pycode.py builds the corpus and its split)
# --------------------------------------------------------------------------------------------
BYTES_PER_TOKEN = 4  # how the held-out check turns seq_len into bytes (BPE on code gives fewer: it is conservative)


def _check_heldout(manifest: dict, val_sizes: list[int], seq_len: int) -> None:
    """Refuse (ConfigError, exit 2) when fewer than min_heldout_docs held-out documents reach seq_len tokens. The
    advice names the longest seq_len that many documents reach, and only where one does (with fewer held-out
    documents than that in all, no seq_len helps)."""
    need = BYTES_PER_TOKEN * (seq_len + 1)
    have, want = sum(n >= need for n in val_sizes), manifest["min_heldout_docs"]
    if have < want:
        sizes = sorted(val_sizes, reverse=True)
        reach = sizes[want - 1] // BYTES_PER_TOKEN - 1 if 0 < want <= len(sizes) else 0
        shorter = f"lower seq_len (to at most {reach}), " if reach >= 1 else ""
        raise ConfigError(
            f"data.min_heldout_docs={want}: data=pycode holds out {have} documents of at least seq_len={seq_len} "
            f"tokens (~{need} bytes at {BYTES_PER_TOKEN} bytes a token); {shorter}read the full corpus "
            f"(data.subset=null), or lower data.min_heldout_docs"
        )


def _save_array(path: Path, a: np.ndarray) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        np.save(fh, a)
    os.replace(tmp, path)


def load_pycode(cfg: DataConfig, seq_len: int, seed: int) -> TokenData:
    """The pycode corpus: a BPE trained on its training documents (cached like text), each split tokenized through
    `datasets` into one stream with EOT after every document; the token streams and the manifest cached together."""
    from minigpt.pycode import build_corpus

    corpus = build_corpus(cfg.subset, cfg.packages, cfg.stdlib, cfg.site_dirs, cfg.min_heldout_docs)
    manifest = corpus.manifest
    if not corpus.train:
        raise DataError(f"data=pycode: no training documents (data.stdlib={cfg.stdlib}, data.packages={cfg.packages})")
    _check_heldout(manifest, [d.nbytes for d in corpus.val], seq_len)
    key = hashlib.sha256(f"{manifest['corpus_hash']}|{manifest['min_heldout_docs']}".encode()).hexdigest()[:16]
    tokenizer = load_tokenizer(cfg, (d.text for d in corpus.train), key)
    tok_key = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]
    folder = Path(_cache_dir(cfg)) / "pycode" / f"{key}-{tok_key}"
    folder.mkdir(parents=True, exist_ok=True)
    streams = {}
    for split, docs in (("train", corpus.train), ("val", corpus.val)):
        path = folder / f"{split}.npy"
        if path.exists():
            streams[split] = np.load(path)
        else:
            import datasets

            ds = datasets.Dataset.from_dict({"text": [d.text for d in docs]})
            streams[split] = _token_stream(ds, "text", tokenizer)
            _save_array(path, streams[split])
    manifest = {**manifest, "tokens": {s: int(len(t)) for s, t in streams.items()}, "vocab_size": tokenizer.get_vocab_size()}
    atomic_write_text(folder / MANIFEST_FILE, json.dumps(manifest, indent=1))
    return TokenData(streams["train"], streams["val"], seq_len, seed, tokenizer.get_vocab_size(),
                     tokenizer_json=tokenizer.to_str(), manifest=manifest,
                     **_documents_of(cfg, tokenizer, seq_len, seed))


# --------------------------------------------------------------------------------------------
# the run's tokenizer (and corpus manifest), kept with the run (minigpt/sample.py reads it back)
# --------------------------------------------------------------------------------------------
TOKENIZER_FILE = "tokenizer.json"
BYTES = "bytes"  # what a run of byte tokens (passkey) records as its tokenizer
MANIFEST_FILE = "corpus.json"


def save_tokenizer(data: PasskeyData | TokenData, run_dir: str | Path, write: bool = True) -> str:
    """Write the data's tokenizer into run_dir/tokenizer.json (unless `write` is false: another rank writes it);
    returns what checkpoints record as the run's tokenizer: "bytes", or that file's absolute path."""
    if data.tokenizer_json is None:
        return BYTES
    path = Path(run_dir).resolve() / TOKENIZER_FILE
    if write:
        atomic_write_text(path, data.tokenizer_json)
    return str(path)


def save_manifest(data: PasskeyData | TokenData, run_dir: str | Path, write: bool = True) -> None:
    """Write the data's corpus manifest (pycode) into run_dir/corpus.json; nothing for the other sources."""
    manifest = getattr(data, "manifest", None)
    if manifest is not None and write:
        atomic_write_text(Path(run_dir) / MANIFEST_FILE, json.dumps(manifest, indent=1))


def build_data(cfg: DataConfig, seq_len: int, seed: int) -> PasskeyData | TokenData:
    """The data source named by cfg.name."""
    if cfg.name == "passkey":
        if seq_len < PasskeyData.shortest():  # a setting, so exit 2 (DataError is for the data's own faults)
            raise ConfigError(f"seq_len={seq_len}: data=passkey needs seq_len >= {PasskeyData.shortest()} (its "
                              f"needle, question and key); raise seq_len, or choose other data (data=text ...)")
        return PasskeyData(seq_len, seed)
    if cfg.name == "text":
        return load_text(cfg, seq_len, seed)
    if cfg.name == "hf":
        return load_hf(cfg, seq_len, seed)
    if cfg.name == "pycode":
        return load_pycode(cfg, seq_len, seed)
    raise DataError(f"data.name={cfg.name}: choose one of passkey, text, hf, pycode")

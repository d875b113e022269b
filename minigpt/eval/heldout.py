"""The held-out pycode documents of a run, in its own tokens: what loss by position and the pycode haystack read.

The corpus is rebuilt by its rules (minigpt/pycode.py) from the run's data settings (data.subset, packages, stdlib,
site_dirs, min_heldout_docs; a run on other data gets the default full corpus), and each held-out document is
tokenized on its own with the run's tokenizer. Rebuilding, rather than splitting training's cached token stream at
its separators, keeps each document's path (two models are compared document by document) and needs no cache. The
rebuilt corpus's hash is compared with the one the run recorded (corpus.json in its run directory): another
machine's package versions give another corpus, which is said in one line and recorded.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from minigpt.config import ConfigError, DataConfig
from minigpt.data import MANIFEST_FILE


class TooFewDocuments(ConfigError):
    """The held-out set has fewer long documents than the evaluation needs (a bad setting: exit 2, one line)."""


@dataclass
class HeldOut:
    """Held-out documents in one tokenizer's tokens, longest first (ties in corpus order)."""

    paths: list[str]
    tokens: list[np.ndarray]
    start: int  # the token before each document (the tokenizer's separator): what training's stream puts there
    corpus_hash: str
    run_corpus_hash: str | None  # what the run recorded, if it did
    min_docs: int  # the corpus's guarantee: held-out documents of its guarantee_bytes or more
    tokenizer: str  # "bytes", or the first 16 hex digits of the tokenizer file's sha256
    manifest: dict[str, Any] = field(default_factory=dict)

    def longest(self, n: int | None) -> "HeldOut":
        """The n longest documents (all if n is None)."""
        k = len(self.paths) if n is None else n
        return HeldOut(self.paths[:k], self.tokens[:k], self.start, self.corpus_hash, self.run_corpus_hash,
                       self.min_docs, self.tokenizer, self.manifest)

    def reaching(self, length: int) -> int:
        """How many documents have at least `length` tokens."""
        return sum(len(t) >= length for t in self.tokens)


def corpus_settings(config: dict[str, Any]) -> DataConfig:
    """The pycode settings of a run's config: its own if it trained on pycode, else the full corpus's defaults."""
    data = config.get("data") or {}
    if data.get("name") != "pycode":
        return DataConfig(name="pycode")
    keys = ("subset", "packages", "stdlib", "site_dirs", "min_heldout_docs")
    return DataConfig(name="pycode", **{k: data[k] for k in keys if k in data})


def tokenizer_id(name: str) -> str:
    """"bytes", or the sha256 (16 hex digits) of a tokenizer file: two runs compare per token only if they agree."""
    if name == "bytes":
        return name
    return hashlib.sha256(Path(name).read_bytes()).hexdigest()[:16]


def heldout_documents(settings: DataConfig, encode: Callable[[str], list[int]], start: int, tokenizer: str,
                      run_dir: Path | None = None, log: Callable[[str], None] = print) -> HeldOut:
    """The held-out documents of `settings` tokenized by `encode`, longest first."""
    from minigpt.pycode import build_corpus

    corpus = build_corpus(settings.subset, settings.packages, settings.stdlib, settings.site_dirs,
                          settings.min_heldout_docs, log=log)
    tokens = [np.asarray(encode(d.text), dtype=np.int64) for d in corpus.val]
    order = sorted(range(len(tokens)), key=lambda i: -len(tokens[i]))  # stable: ties keep corpus order
    recorded = None
    if run_dir is not None and (run_dir / MANIFEST_FILE).is_file():
        try:
            recorded = json.loads((run_dir / MANIFEST_FILE).read_text()).get("corpus_hash")
        except (OSError, ValueError, AttributeError):
            recorded = None
    m = corpus.manifest
    if recorded and recorded != m["corpus_hash"]:
        log(f"warning: the pycode corpus here (hash {m['corpus_hash'][:12]}) is not the run's ({recorded[:12]}, "
            f"{run_dir / MANIFEST_FILE}): other package versions; its held-out documents may differ")
    return HeldOut([corpus.val[i].path for i in order], [tokens[i] for i in order], start, m["corpus_hash"],
                   recorded, m["min_heldout_docs"], tokenizer, m)


def check_enough(heldout: HeldOut, length: int, min_docs: int, what: str) -> None:
    """TooFewDocuments (one line: the count, and what to do) unless min_docs documents have `length` tokens."""
    have = heldout.reaching(length)
    if have >= min_docs:
        return
    lengths = sorted((len(t) for t in heldout.tokens), reverse=True)
    longest_ok = lengths[min_docs - 1] if 0 < min_docs <= len(lengths) else 0
    fits = 1 << (longest_ok.bit_length() - 1) if longest_ok else 0
    advice = f"evaluate at most {fits:,} tokens (--lengths), " if fits else ""
    raise TooFewDocuments(
        f"{what}: the held-out set has {have} documents of at least {length:,} tokens, fewer than {min_docs} "
        f"(--min-docs; the corpus guarantees {heldout.min_docs} of {heldout.manifest.get('guarantee_bytes', 0):,} "
        f"bytes); {advice}use the full corpus (a run with data.subset=null), or give --min-docs {have} to accept "
        f"fewer")

"""The pycode corpus: real long documents that are present wherever minigpt is installed, nothing to download.

The documents are Python source: the interpreter's standard library (with its `test` package where the interpreter
ships one) and the installed packages named by data.packages (by default the imports minigpt's dependencies
guarantee). The rules, fixed so two machines with the same versions get the same corpus:

- one document per directory holding `.py` files: its files in sorted order, each headed by a line
  `# file: <path relative to its site root>` (the stdlib directory, or the site-packages directory of the package);
  sub-directories are documents of their own; `__pycache__`, `site-packages` and `dist-packages` are not read;
- a file over MAX_FILE_BYTES (1 MB = 10^6 bytes), one that is not UTF-8, or one with a NUL byte is left out; a file
  whose content (sha1) was already taken is a duplicate (vendored copies) and is kept once, where first met: the
  stdlib first, then the packages in data.packages order, directories and files in sorted order;
- the split is by document: sha1 of the document's path (its directory relative to its site root, "." for the site
  root itself); held out when the first 8 bytes, big-endian, are 0 modulo HELDOUT_MODULUS (20, i.e. ~5 %);
- the guarantee: if fewer than `min_docs` held-out documents have at least `guarantee_bytes` bytes (20 and 256 KiB
  for the full corpus), the training documents of at least `guarantee_bytes` move to held-out, the smallest of them
  first (ties: by path), until they do or none is left: the guarantee costs training as few bytes as it can.

`python -m minigpt.pycode` prints the corpus's table (documents, bytes, length distribution per split).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from minigpt.config import PYCODE_PACKAGES

MAX_FILE_BYTES = 1_000_000
HELDOUT_MODULUS = 20
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}
# The packages minigpt's dependencies guarantee (pyproject.toml: torch, triton, datasets -> huggingface_hub, fsspec,
# pyarrow, pandas; hydra-core -> omegaconf; wandb; numpy; tqdm; matplotlib). A missing one is skipped with a note.
DEFAULT_PACKAGES = PYCODE_PACKAGES


@dataclass(frozen=True)
class Subset:
    """A named part of the corpus: these stdlib directories (and everything under them), no packages."""

    stdlib: tuple[str, ...]
    min_heldout_docs: int  # the guarantee and the refusal's count, unless data.min_heldout_docs says otherwise
    guarantee_bytes: int


FULL = Subset(stdlib=(), min_heldout_docs=20, guarantee_bytes=256 * 1024)
# The README quick start: a few stdlib packages (~1.8 MB, 4 held-out documents on Python 3.11), built in seconds.
SUBSETS = {"quickstart": Subset(stdlib=("collections", "concurrent", "email", "html", "http", "importlib", "json",
                                        "logging", "re", "tomllib", "urllib", "wsgiref", "xml", "zoneinfo"),
                                min_heldout_docs=4, guarantee_bytes=32 * 1024)}


@dataclass
class Document:
    path: str  # its directory relative to its site root
    text: str
    files: list[tuple[str, str]]  # (path relative to the site root, sha1 of the content)

    @property
    def nbytes(self) -> int:
        return len(self.text.encode())


@dataclass
class Corpus:
    train: list[Document]
    val: list[Document]
    manifest: dict = field(default_factory=dict)


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _package_dir(name: str, site_dirs: list[str] | None) -> tuple[Path, Path] | None:
    """(site root, package directory) of an installed package, or None if it is missing or not a directory."""
    if site_dirs is not None:
        for d in site_dirs:
            p = Path(os.path.expanduser(d)) / name
            if p.is_dir():
                return p.parent, p
        return None
    try:
        spec = importlib.util.find_spec(name)  # finds, does not import
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0])
    return p.parent, p


def _version(name: str) -> str | None:
    dists = importlib.metadata.packages_distributions().get(name, [])
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


class _Reader:
    """Reads directories into documents, keeping counts of what it left out and the content hashes it has seen."""

    def __init__(self):
        self.seen: set[str] = set()
        self.dropped = {"duplicate": 0, "over_1mb": 0, "not_utf8": 0}

    def document(self, root: Path, directory: Path) -> Document | None:
        parts, files = [], []
        for f in sorted(p for p in directory.iterdir() if p.suffix == ".py" and p.is_file()):
            if f.stat().st_size > MAX_FILE_BYTES:
                self.dropped["over_1mb"] += 1
                continue
            data = f.read_bytes()
            digest = hashlib.sha1(data).hexdigest()
            if digest in self.seen:
                self.dropped["duplicate"] += 1
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if text is None or "\0" in text:
                self.dropped["not_utf8"] += 1
                continue
            self.seen.add(digest)
            rel = f.relative_to(root).as_posix()
            parts.append(f"# file: {rel}\n{text}" + ("" if text.endswith("\n") else "\n"))
            files.append((rel, digest))
        if not parts:
            return None
        return Document(directory.relative_to(root).as_posix(), "".join(parts), files)

    def tree(self, root: Path, top: Path, recurse_top: bool = True) -> list[Document]:
        """The documents of `top` and (unless recurse_top is false) every directory under it, in sorted order."""
        docs = []
        for dirpath, dirnames, _ in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
            doc = self.document(root, Path(dirpath))
            if doc is not None:
                docs.append(doc)
            if not recurse_top:
                break
        return docs


def is_heldout(path: str) -> bool:
    return int.from_bytes(hashlib.sha1(path.encode()).digest()[:8], "big") % HELDOUT_MODULUS == 0


def split(docs: list[Document], min_docs: int, guarantee_bytes: int) -> tuple[list[Document], list[Document], list[str]]:
    """(train, held-out, paths moved by the guarantee): the hash split, then the guarantee (module docstring)."""
    heldout = [d for d in docs if is_heldout(d.path)]
    train = [d for d in docs if not is_heldout(d.path)]
    moved = []
    have = sum(d.nbytes >= guarantee_bytes for d in heldout)
    for d in sorted((d for d in train if d.nbytes >= guarantee_bytes), key=lambda d: (d.nbytes, d.path)):
        if have >= min_docs:
            break
        moved.append(d.path)
        have += 1
    moved_set = set(moved)
    heldout = [d for d in docs if is_heldout(d.path) or d.path in moved_set]  # corpus order
    train = [d for d in train if d.path not in moved_set]
    return train, heldout, moved


def build_corpus(subset: str | None = None, packages: list[str] | tuple[str, ...] = DEFAULT_PACKAGES,
                 stdlib: str | None = None, site_dirs: list[str] | None = None, min_heldout_docs: int | None = None,
                 log=print) -> Corpus:
    """The corpus and its manifest. `stdlib` and `site_dirs` replace this interpreter's (tests build a fake one)."""
    sub = SUBSETS[subset] if subset else FULL
    min_docs = sub.min_heldout_docs if min_heldout_docs is None else min_heldout_docs
    reader, docs = _Reader(), []
    std = Path(os.path.expanduser(stdlib or stdlib_dir()))
    if sub.stdlib:
        for name in sub.stdlib:
            if (std / name).is_dir():
                docs += reader.tree(std, std / name)
            else:
                log(f"pycode: the stdlib has no {name}/ directory; the {subset} subset goes without it")
    else:
        docs += reader.tree(std, std)
    found, missing = {}, []
    taken = {d.path.split("/")[0] for d in docs}
    for name in ([] if sub.stdlib else packages):
        where = _package_dir(name, site_dirs)
        if where is None or name in taken:
            missing.append(name)
            log(f"pycode: package {name} is " + ("shadowed by the stdlib" if where else "not installed") + "; skipped")
            continue
        root, top = where
        docs += reader.tree(root, top)
        taken.add(name)
        found[name] = _version(name) if site_dirs is None else None  # a given site dir: not this interpreter's
    train, val, moved = split(docs, min_docs, sub.guarantee_bytes)
    h = hashlib.sha256()
    for d in docs:
        for rel, digest in d.files:
            h.update(f"{rel}\t{digest}\n".encode())
    manifest = {
        "source": "pycode",
        "subset": subset,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "packages": found,
        "missing_packages": missing,
        "documents": {"train": len(train), "val": len(val)},
        "bytes": {"train": sum(d.nbytes for d in train), "val": sum(d.nbytes for d in val)},
        "files": sum(len(d.files) for d in docs),
        "dropped_files": dict(reader.dropped),
        "min_heldout_docs": min_docs,
        "guarantee_bytes": sub.guarantee_bytes,
        "heldout_rule": f"sha1(path)[:8] % {HELDOUT_MODULUS} == 0, then >= {min_docs} docs of "
                        f">= {sub.guarantee_bytes} bytes",
        "moved_to_val": moved,
        "corpus_hash": h.hexdigest(),
    }
    return Corpus(train, val, manifest)


# --------------------------------------------------------------------------------------------
# the table: python -m minigpt.pycode [--subset quickstart]
# --------------------------------------------------------------------------------------------
def _kb(n: float) -> str:
    return f"{n / 1024:,.0f}"


def stats_table(corpus: Corpus) -> str:
    """Documents, bytes and the length distribution (KiB) per split, as a markdown table."""
    rows = ["| split | documents | MiB | min KiB | median KiB | p90 KiB | max KiB | ≥ 64 KiB | ≥ 256 KiB | ≥ 1 MiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, docs in (("train", corpus.train), ("val", corpus.val)):
        sizes = sorted(d.nbytes for d in docs) or [0]
        q = lambda f: sizes[min(len(sizes) - 1, int(f * len(sizes)))]  # noqa: E731
        rows.append(f"| {name} | {len(docs)} | {sum(sizes) / 2**20:,.1f} | {_kb(sizes[0])} | {_kb(q(0.5))} | "
                    f"{_kb(q(0.9))} | {_kb(sizes[-1])} | {sum(s >= 64 << 10 for s in sizes)} | "
                    f"{sum(s >= 256 << 10 for s in sizes)} | {sum(s >= 1 << 20 for s in sizes)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minigpt.pycode", description="The pycode corpus's table.")
    parser.add_argument("--subset", choices=sorted(SUBSETS), default=None, help="a subset (default: the full corpus)")
    parser.add_argument("--packages", nargs="*", default=list(DEFAULT_PACKAGES), help="the packages to read")
    args = parser.parse_args(argv)
    corpus = build_corpus(args.subset, args.packages)
    m = corpus.manifest
    versions = ", ".join(f"{k} {v}" for k, v in m["packages"].items()) or "none"
    print(f"{m['implementation']} {m['python']}; packages: {versions}; missing: {', '.join(m['missing_packages']) or 'none'}")
    print(f"files {m['files']}, left out {m['dropped_files']}, moved to val by the guarantee: {len(m['moved_to_val'])}, "
          f"corpus hash {m['corpus_hash'][:16]}")
    print(stats_table(corpus))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

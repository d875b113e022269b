"""Every data source on files the test writes, the determinism the trainer relies on, and the bad-data errors."""
import gzip
import json
import os
import re
import shutil

import numpy as np
import pytest

from minigpt.config import DataConfig
from minigpt.data import DataError, PasskeyData, build_data


def test_passkey_is_deterministic_and_plants_the_key():
    d = PasskeyData(seq_len=300, seed=7)
    x1, y1, _ = d.batch("train", 3, 4)
    x2, *_ = d.batch("train", 3, 4)
    x3, *_ = d.batch("train", 4, 4)
    assert x1.shape == (4, 300) and (x1 == x2).all() and not (x1 == x3).all()
    assert (x1[:, 1:] == y1[:, :-1]).all()
    for row in y1:
        text = bytes(row.numpy().astype(np.uint8)).decode()
        key = bytes(row[d.answer].numpy().astype(np.uint8)).decode()
        assert key.isdigit() and len(key) == 5
        assert f"The pass key is {key}. Remember it." in text and text.endswith(f"The pass key is {key}.")


def test_passkey_too_short():
    with pytest.raises(DataError, match="seq_len"):
        PasskeyData(seq_len=50, seed=0)


def write_corpus(root, n_files=3, repeat=200):
    root.mkdir(parents=True, exist_ok=True)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rng = np.random.default_rng(0)
    for i in range(n_files):
        (root / f"doc{i}.txt").write_text(" ".join(rng.choice(words, size=repeat)) + "\n")
    return root


def test_text_source_trains_and_caches_tokenizer(tmp_path, tiny_config):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = DataConfig(name="text", path=str(corpus / "*.txt"), vocab_size=300, cache_dir=str(tmp_path / "cache"))
    data = build_data(cfg, seq_len=32, seed=0)
    assert 256 < data.vocab_size <= 300 and len(data.train) > len(data.val) > 32
    x, y, _ = data.batch("val", 0, 2)
    assert x.shape == (2, 32) and int(x.max()) < data.vocab_size and (x[:, 1:] == y[:, :-1]).all()
    cached = list((tmp_path / "cache" / "tokenizers").glob("bpe-300-*.json"))
    assert len(cached) == 1
    again = build_data(cfg, seq_len=32, seed=0)
    assert (again.train == data.train).all()
    # and through the trainer, with the tokenizer file given explicitly
    from minigpt.run import run

    tc = tiny_config("data=text", f"data.path={corpus}", f"data.tokenizer={cached[0]}", "seq_len=32", "max_steps=2")
    assert run(tc) == 0


def test_hf_source_on_a_local_dataset(tmp_path):
    ds_dir = tmp_path / "ds"
    ds_dir.mkdir()
    with open(ds_dir / "train.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"body": f"story {i}: " + "once upon a time there was a model. " * 8, "id": i}) + "\n")
    base = dict(name="hf", dataset=str(ds_dir), text_column="body", vocab_size=300, cache_dir=str(tmp_path / "cache"))
    data = build_data(DataConfig(**base), seq_len=64, seed=0)
    assert len(data.train) > 64 and data.batch("train", 0, 3)[0].shape == (3, 64)
    streamed = build_data(DataConfig(**base, streaming=True, max_docs=30), seq_len=64, seed=0)
    assert 0 < len(streamed.train) < len(data.train)
    with pytest.raises(DataError, match="text_column=text.*body"):
        build_data(DataConfig(**{**base, "text_column": "text"}), seq_len=64, seed=0)


def test_bad_text_data(tmp_path):
    with pytest.raises(DataError, match="no file matches"):
        build_data(DataConfig(name="text", path=str(tmp_path / "missing*.txt")), 32, 0)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="is empty"):
        build_data(DataConfig(name="text", path=str(tmp_path / "empty.txt")), 32, 0)
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "a.txt").write_text("too short to train on")
    with pytest.raises(DataError, match="fewer than one window"):
        build_data(DataConfig(name="text", path=str(tmp_path / "short"), vocab_size=260,
                              cache_dir=str(tmp_path / "cache")), 32, 0)


def test_bad_data_through_trainer_is_one_error_line(tiny_config, tmp_path, capsys):
    from minigpt.run import run

    cfg = tiny_config("data=text", f"data.path={tmp_path / 'nothing.txt'}")
    assert run(cfg) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "data.path" in err[0]


def test_binary_and_non_utf8_text_files_are_named(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    cfg = DataConfig(name="text", path=str(corpus), vocab_size=300, cache_dir=str(tmp_path / "cache"))
    (corpus / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    with pytest.raises(DataError, match=r"logo\.png is binary \(NUL byte at offset 8\).*exclude it from data.path"):
        build_data(cfg, 32, 0)
    (corpus / "logo.png").unlink()
    (corpus / "notes.txt").write_bytes("caf\u00e9 cr\u00e8me ".encode("latin-1") * 50)
    with pytest.raises(DataError, match=r"notes\.txt is not UTF-8 text \(invalid byte 0xe9 at offset 3\).*iconv"):
        build_data(cfg, 32, 0)
    # read in blocks: a character split across blocks is fine, and the offset counts from the file's start
    (corpus / "notes.txt").write_bytes(b"a" * ((1 << 20) - 1) + "\u00e9".encode() + b"b" * 10 + b"\xff")
    with pytest.raises(DataError, match=rf"invalid byte 0xff at offset {(1 << 20) + 11}\)"):
        build_data(cfg, 32, 0)
    (corpus / "notes.txt").write_bytes("caf\u00e9 ".encode() + b"\xe2\x82")  # ends mid-character
    with pytest.raises(DataError, match=r"invalid byte 0xe2 at offset 6\)"):
        build_data(cfg, 32, 0)


def test_compressed_text_is_left_to_datasets(tmp_path):
    """`datasets` unpacks compressed files itself: gzipped UTF-8 text trains, gzipped latin-1 is one DataError."""
    text = " ".join(["alpha beta gamma delta epsilon zeta eta theta"] * 100)
    (tmp_path / "corpus.txt.gz").write_bytes(gzip.compress(text.encode()))
    base = dict(name="text", vocab_size=300, cache_dir=str(tmp_path / "cache"))
    data = build_data(DataConfig(**base, path=str(tmp_path / "corpus.txt.gz")), seq_len=16, seed=0)
    assert data.batch("train", 0, 2)[0].shape == (2, 16)
    (tmp_path / "latin.txt.gz").write_bytes(gzip.compress(text.replace("beta", "b\u00e9ta").encode("latin-1")))
    with pytest.raises(DataError, match=r"data.path=.*latin.txt.gz: cannot read the files \(UnicodeDecodeError"):
        build_data(DataConfig(**base, path=str(tmp_path / "latin.txt.gz")), 16, 0)


def save_stories(root, n=40):
    """A save_to_disk Dataset at root/one and a DatasetDict (train, validation) at root/dict."""
    import datasets

    stories = [f"story {i}: once upon a time there was a model. " * 6 for i in range(n)]
    ds = datasets.Dataset.from_dict({"text": stories, "n": list(range(n))})
    ds.save_to_disk(str(root / "one"))
    datasets.DatasetDict({"train": ds, "validation": ds.select(range(n // 4))}).save_to_disk(str(root / "dict"))
    return root / "one", root / "dict"


def test_hf_source_on_save_to_disk_directories(tmp_path):
    one, both = save_stories(tmp_path)
    base = dict(name="hf", vocab_size=300, cache_dir=str(tmp_path / "cache"))
    for path in (one, both):
        data = build_data(DataConfig(**base, dataset=str(path)), seq_len=16, seed=0)
        x, y, _ = data.batch("train", 0, 3)
        assert x.shape == (3, 16) and 256 < data.vocab_size <= 300 and int(x.max()) < data.vocab_size
        assert (x[:, 1:] == y[:, :-1]).all()
    val = build_data(DataConfig(**base, dataset=str(both), split="validation"), seq_len=16, seed=0)
    assert len(val.train) < len(data.train) / 2
    few = build_data(DataConfig(**base, dataset=str(both), streaming=True, max_docs=10), seq_len=16, seed=0)
    assert len(few.train) < len(data.train) / 2
    with pytest.raises(DataError, match="data.split=test: not a split of .*; it has train, validation"):
        build_data(DataConfig(**base, dataset=str(both), split="test"), seq_len=16, seed=0)
    with pytest.raises(DataError, match=r"data.text_column=n: a Value\('int64'\) column, not text.*\(text\)"):
        build_data(DataConfig(**base, dataset=str(one), text_column="n"), seq_len=16, seed=0)


def test_hf_rows_without_text_read_as_empty(tmp_path):
    import datasets

    stories = [None if i % 3 == 0 else f"story {i}: once upon a time. " * 6 for i in range(30)]
    datasets.Dataset.from_dict({"text": stories}).save_to_disk(str(tmp_path / "gaps"))
    data = build_data(DataConfig(name="hf", dataset=str(tmp_path / "gaps"), vocab_size=300,
                                 cache_dir=str(tmp_path / "cache")), seq_len=32, seed=0)
    assert data.batch("train", 0, 2)[0].shape == (2, 32)


def cache_as_hub_dataset(src, cache, repo_id):
    """Lay out a local dataset in `cache` the way `datasets` caches a hub download of `repo_id`."""
    import datasets

    datasets.load_dataset(str(src), split="train", cache_dir=str(cache))
    built = next(p for p in (cache / src.name).glob("*/*/*") if p.is_dir())
    name = repo_id.split("/")[1]
    target = cache / repo_id.replace("/", "___") / "default" / built.parent.name / built.name
    shutil.copytree(built, target)
    for arrow in target.glob(f"{src.name}-*.arrow"):
        arrow.rename(target / arrow.name.replace(src.name, name, 1))


def test_hub_name_offline_fails_fast_or_uses_the_cache(tmp_path, monkeypatch):
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # set after import: data.py must switch the libraries itself
    flags = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    env = dict(os.environ)
    base = dict(name="hf", vocab_size=300, cache_dir=str(tmp_path / "cache"))
    # OfflineModeIsEnabled: the load ran in offline mode (a failure, not minutes of retries)
    with pytest.raises(DataError, match=r"data.dataset=someone/stories: .*HF_HUB_OFFLINE is set.*no cached copy.*"
                                        r"OfflineModeIsEnabled.*run once with network access"):
        build_data(DataConfig(**base, dataset="someone/stories"), seq_len=64, seed=0)
    assert (datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE) == flags and dict(os.environ) == env

    src = tmp_path / "src"
    src.mkdir()
    (src / "train.jsonl").write_text("".join(json.dumps({"text": f"story {i}: " + "once upon a time. " * 8}) + "\n"
                                             for i in range(40)))
    cache_as_hub_dataset(src, tmp_path / "cache", "someone/stories")
    data = build_data(DataConfig(**base, dataset="someone/stories"), seq_len=64, seed=0)
    assert data.batch("train", 0, 2)[0].shape == (2, 64)


def test_unreachable_hub_is_detected_without_offline_variables(tmp_path, monkeypatch):
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "http_proxy", "HTTP_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(DataError, match=r"someone/stories: .*127.0.0.1:9 is unreachable.*OfflineModeIsEnabled"):
        build_data(DataConfig(name="hf", dataset="someone/stories", cache_dir=str(tmp_path / "cache")), 64, 0)


def test_bad_hf_settings(tmp_path):
    base = dict(name="hf", vocab_size=300, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match="data.dataset=./no/such/dir: no such file or directory"):
        build_data(DataConfig(**base, dataset="./no/such/dir"), 64, 0)
    one, _ = save_stories(tmp_path)
    (tmp_path / "one" / "data-00000-of-00001.arrow").write_bytes(b"not arrow")
    with pytest.raises(DataError, match=re.escape(f"data.dataset={one}: cannot load it (")):
        build_data(DataConfig(**base, dataset=str(one)), 64, 0)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DataError, match="data.cache_dir=.*afile/cache: cannot create it"):
        cache = str(tmp_path / "afile" / "cache")
        build_data(DataConfig(name="hf", dataset=str(tmp_path / "dict"), cache_dir=cache), 64, 0)


def test_bad_tokenizer_file(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    for name, content in (("tok.json", "not json at all"), ("other.json", '{"vocab": [1, 2]}')):
        (tmp_path / name).write_text(content)
        cfg = DataConfig(name="text", path=str(corpus), tokenizer=str(tmp_path / name), cache_dir=str(tmp_path / "c"))
        with pytest.raises(DataError, match=rf"data.tokenizer=.*{name}: not a tokenizer JSON file .*unset data"):
            build_data(cfg, 32, 0)


# --------------------------------------------------------------------------------------------
# pycode, on a fake stdlib and site root the test writes (minigpt/pycode.py)
# --------------------------------------------------------------------------------------------
def write_site(tmp_path):
    """A fake stdlib (json/, top-level modules, a non-UTF-8 file) and site root (pkga with a sub-package, pkgb
    holding a vendored copy of a pkga file and a file over 1 MB)."""
    std, site = tmp_path / "std", tmp_path / "site"
    (std / "json").mkdir(parents=True)
    (std / "json" / "b.py").write_text("def b():\n    return 2\n")
    (std / "json" / "a.py").write_text("def a():\n    return 1")  # no final newline
    (std / "os.py").write_text("import sys\n")
    (std / "latin.py").write_bytes(b"x = '\xe9'\n")
    (std / "site-packages" / "skipped").mkdir(parents=True)
    (std / "site-packages" / "skipped" / "s.py").write_text("never = 1\n")
    (site / "pkga" / "sub").mkdir(parents=True)
    (site / "pkga" / "__init__.py").write_text("from .core import f\n")
    (site / "pkga" / "core.py").write_text("def f(x):\n    return x * 2\n" * 50)
    (site / "pkga" / "sub" / "m.py").write_text("M = 3\n")
    (site / "pkga" / "data.txt").write_text("not python\n")
    (site / "pkgb" / "_vendor").mkdir(parents=True)
    (site / "pkgb" / "_vendor" / "core.py").write_text("def f(x):\n    return x * 2\n" * 50)  # a duplicate
    (site / "pkgb" / "big.py").write_text("# " + "x" * 1_000_001 + "\n")
    (site / "pkgb" / "small.py").write_text("S = 1\n")
    return std, site


def test_pycode_documents_headers_dedup_and_cuts(tmp_path):
    from minigpt.pycode import build_corpus

    std, site = write_site(tmp_path)
    notes = []
    c = build_corpus(None, ["pkga", "pkgb", "nopkg"], str(std), [str(site)], min_heldout_docs=0, log=notes.append)
    docs = {d.path: d for d in c.train + c.val}
    assert set(docs) == {".", "json", "pkga", "pkga/sub", "pkgb"}  # one per directory with .py files
    order = [d.path for d in c.train] + [d.path for d in c.val]
    assert sorted(order) == sorted(docs) and [p for p in order if p in {d.path for d in c.train}] == \
        [p for p in [".", "json", "pkga", "pkga/sub", "pkgb"] if p in {d.path for d in c.train}]  # corpus order
    assert docs["json"].text == "# file: json/a.py\ndef a():\n    return 1\n# file: json/b.py\ndef b():\n    return 2\n"
    assert docs["."].text == "# file: os.py\nimport sys\n"  # latin.py is not UTF-8; site-packages/ is not read
    assert docs["pkga"].text.startswith("# file: pkga/__init__.py\nfrom .core import f\n# file: pkga/core.py\n")
    assert docs["pkgb"].text == "# file: pkgb/small.py\nS = 1\n"  # the vendored copy and the > 1 MB file are out
    assert "pkgb/_vendor" not in docs
    m = c.manifest
    assert m["dropped_files"] == {"duplicate": 1, "over_1mb": 1, "not_utf8": 1}
    assert m["missing_packages"] == ["nopkg"] and any("nopkg" in n for n in notes)
    assert m["documents"]["train"] + m["documents"]["val"] == 5 and m["files"] == 7
    assert set(m) >= {"python", "packages", "bytes", "corpus_hash", "moved_to_val", "heldout_rule"}
    again = build_corpus(None, ["pkga", "pkgb", "nopkg"], str(std), [str(site)], min_heldout_docs=0, log=notes.append)
    assert again.manifest == m and [d.path for d in again.val] == [d.path for d in c.val]


def test_pycode_split_is_by_path_hash_and_the_guarantee_moves_the_smallest_long_documents():
    from minigpt.pycode import Document, is_heldout, split

    paths = [f"pkg/d{i}" for i in range(200)]
    docs = [Document(p, "x" * (100 + 10 * i), []) for i, p in enumerate(paths)]
    train, val, moved = split(docs, min_docs=0, guarantee_bytes=1000)
    assert moved == [] and [d.path for d in val] == [p for p in paths if is_heldout(p)]
    assert 2 <= len(val) <= 25 and len(train) + len(val) == 200
    n_long = sum(d.nbytes >= 1000 for d in val)
    train, val, moved = split(docs, min_docs=n_long + 3, guarantee_bytes=1000)
    # the three smallest training documents of >= 1000 bytes moved (d90 has 1000 bytes)
    expected = [d.path for d in sorted(docs, key=lambda d: d.nbytes) if d.nbytes >= 1000 and not is_heldout(d.path)][:3]
    assert moved == expected and sum(d.nbytes >= 1000 for d in val) == n_long + 3
    assert not {d.path for d in train} & {d.path for d in val}


def test_pycode_refuses_a_heldout_set_too_short_for_seq_len(tmp_path):
    from minigpt.config import ConfigError

    std, site = write_site(tmp_path)
    cfg = DataConfig(name="pycode", stdlib=str(std), site_dirs=[str(site)], packages=["pkga", "pkgb"],
                     min_heldout_docs=1, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as e:
        build_data(cfg, seq_len=4096, seed=0)
    line = str(e.value)
    assert "\n" not in line and line.startswith("data.min_heldout_docs=1:") and "seq_len=4096" in line

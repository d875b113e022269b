"""Every data source on files the test writes, the determinism the trainer relies on, and the bad-data errors."""
import json

import numpy as np
import pytest

from minigpt.config import DataConfig
from minigpt.data import DataError, PasskeyData, build_data
from minigpt.train import run


def test_passkey_is_deterministic_and_plants_the_key():
    d = PasskeyData(seq_len=300, seed=7)
    x1, y1 = d.batch("train", 3, 4)
    x2, _ = d.batch("train", 3, 4)
    x3, _ = d.batch("train", 4, 4)
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
    x, y = data.batch("val", 0, 2)
    assert x.shape == (2, 32) and int(x.max()) < data.vocab_size and (x[:, 1:] == y[:, :-1]).all()
    cached = list((tmp_path / "cache" / "tokenizers").glob("bpe-300-*.json"))
    assert len(cached) == 1
    again = build_data(cfg, seq_len=32, seed=0)
    assert (again.train == data.train).all()
    # and through the trainer, with the tokenizer file given explicitly
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
    cfg = tiny_config("data=text", f"data.path={tmp_path / 'nothing.txt'}")
    assert run(cfg) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "data.path" in err[0]

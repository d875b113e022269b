"""data=pycode end to end (slow tier): a tiny training run on a fake site root, the refusal's exit 2 through the
command line, and the quickstart subset on this interpreter's stdlib. The quick checks are in test_data.py."""
import json
import math
import subprocess
import sys

from test_data import write_site

from minigpt.config import DataConfig
from minigpt.data import build_data


def fake_site_overrides(tmp_path, min_docs=1):
    std, site = write_site(tmp_path)
    # enough text for a BPE and a few windows: pkga/core.py grows (training), and pkga/sub/ reaches 256 KiB, so the
    # held-out guarantee moves it to val
    (site / "pkga" / "core.py").write_text("def f(x):\n    return x * 2\n" * 400)
    (site / "pkga" / "sub" / "m.py").write_text("def g(y):\n    return y + 1\n" * 10000)
    return ["data=pycode", f"data.stdlib={std}", f"data.site_dirs=[{site}]", "data.packages=[pkga,pkgb]",
            f"data.min_heldout_docs={min_docs}", "data.vocab_size=300"]


def test_a_tiny_run_on_pycode_records_the_manifest(tmp_path, tiny_config):
    from minigpt.run import run

    cfg = tiny_config(*fake_site_overrides(tmp_path), "seq_len=32", "max_steps=2")
    assert cfg.data.document_mask is True  # configs/data/pycode.yaml
    assert run(cfg) == 0
    manifest = json.loads((tmp_path / "run" / "corpus.json").read_text())
    assert manifest["source"] == "pycode" and manifest["moved_to_val"] == ["pkga/sub"]
    assert manifest["tokens"]["train"] > 32 and manifest["tokens"]["val"] > 32
    cached = list((tmp_path / "cache" / "pycode").glob("*/corpus.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["corpus_hash"] == manifest["corpus_hash"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and math.isfinite(summary["final_train_loss"])


def test_too_few_long_heldout_documents_exit_2_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "minigpt", "model=tiny", "device=cpu", "seq_len=128",
                           "batch_size=1", "max_steps=1", "logger=none", f"data.cache_dir={tmp_path / 'cache'}",
                           f"hydra.run.dir='{run_dir}'", *fake_site_overrides(tmp_path, min_docs=2)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1]
    assert "data.min_heldout_docs=2: data=pycode holds out 1 documents" in last and "seq_len=128" in last


def test_the_quickstart_subset_builds_from_this_interpreters_stdlib(tmp_path):
    cfg = DataConfig(name="pycode", subset="quickstart", vocab_size=512, cache_dir=str(tmp_path / "cache"))
    data = build_data(cfg, seq_len=256, seed=0)
    m = data.manifest
    assert m["packages"] == {} and m["documents"]["val"] >= 4 and 1e6 < m["bytes"]["train"] < 3e6
    x, y, ids = data.batch("val", 0, 2)
    assert x.shape == (2, 256) and (x[:, 1:] == y[:, :-1]).all()

"""Loss by position and `minigpt-eval` (minigpt/eval/): bins and intervals on a planted model whose loss at each
position is known, the bootstrap's coverage, sliding windows (each scored token's context, each position once),
the goal figures, the refusal for too few held-out documents, out-of-memory lengths, and the command line end to end
on a tiny pycode run (JSON, PNG, W&B offline, comparison of two PATHs and of earlier results). The passkey grid's
tests are test_passkey_grid.py."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from conftest import ROOT
from minigpt.eval.bootstrap import bin_intervals, paired_difference, range_difference
from minigpt.eval.cli import LOSS_FILES, main, size, span
from minigpt.eval.heldout import HeldOut, TooFewDocuments, check_enough
from minigpt.eval.loss_by_position import (Window, bin_edges, bin_of, full_windows, position_metrics, score_windows,
                                           sliding_windows, token_losses)
from minigpt.eval.loss_report import make_curve

V = 64  # the planted model's vocabulary


class Planted(nn.Module):
    """A stand-in GPT whose loss at in-window index j is known exactly: documents count up (token i+1 follows
    token i, mod V, from the start token 0), and its logits are 0 except z(j) on the input token + 1, so a token that
    follows the pattern costs log(e^z + V - 1) - z and one that breaks it log(e^z + V - 1). It records the
    length of every window it is given."""

    vocab_size = V

    def __init__(self, z=lambda j: 0.01 * j):
        super().__init__()
        self.z, self.lengths = z, []

    def hidden(self, idx):
        self.lengths.append(idx.shape[1])
        j = torch.arange(idx.shape[1], dtype=torch.float32).expand(idx.shape)
        return torch.stack([j, idx.float()], dim=-1)

    def head(self, h):
        j, token = h[..., 0], h[..., 1].long()
        logits = torch.zeros(*h.shape[:-1], V)
        return logits.scatter(-1, ((token + 1) % V)[..., None], self.z(j)[..., None])


def hit_loss(j, z=lambda j: 0.01 * j):
    return math.log(math.exp(z(j)) + V - 1) - z(j)


def counting(n, breaks=()):
    """A document of n tokens that counts up from 1 (mod V), with the tokens at `breaks` replaced by 0."""
    d = (np.arange(n) + 1) % V
    d[list(breaks)] = 0
    return d


# ------------------------------------------------------------------------------------------------
# bins and intervals
# ------------------------------------------------------------------------------------------------
def test_bins_are_powers_of_two():
    assert bin_edges(64) == [0, 1, 2, 4, 8, 16, 32, 64] and bin_edges(65)[-1] == 128 and bin_edges(1) == [0, 1]
    assert bin_of(np.array([0, 1, 2, 3, 4, 7, 8, 1023, 1024, 32767, 32768])).tolist() == \
        [0, 1, 2, 2, 3, 3, 4, 10, 11, 15, 16]


def test_bin_means_docs_per_bin_and_an_interval_of_width_0_when_documents_agree():
    docs = [counting(n) for n in (100, 100, 100, 40, 5)]  # two shorter ones reach fewer bins
    model = Planted()
    losses = score_windows(model, docs, 0, full_windows([len(d) for d in docs], 64), torch.device("cpu"),
                           torch.float32, batch_tokens=192)
    assert [len(x) for x in losses] == [64, 64, 64, 40, 5]
    truth = np.array([hit_loss(j) for j in range(64)])  # position p is predicted at in-window index p
    for x in losses:
        np.testing.assert_allclose(x, truth[: len(x)], rtol=1e-6)
    curve = make_curve(losses, [f"d{i}" for i in range(5)], 64, resamples=200)
    edges = curve["edges"]
    for k, b in enumerate(curve["bins"]):
        lo, hi = edges[k], edges[k + 1]
        positions = [p for x in losses for p in range(len(x)) if lo <= p < hi]
        assert b["tokens"] == len(positions) and b["docs"] == sum(len(x) > lo for x in losses)
        assert b["mean"] == pytest.approx(np.mean(truth[positions]), rel=1e-6)
        if all(len(x) >= hi for x in losses if len(x) > lo):  # each document that reaches the bin fills it
            assert b["ci_high"] - b["ci_low"] == pytest.approx(0, abs=1e-9)  # ... and says the same there
        else:  # [32, 64): the pooled mean depends on how many of the 40-token document's positions are drawn
            assert b["ci_low"] <= b["mean"] <= b["ci_high"]
    assert [b["docs"] for b in curve["bins"]] == [5, 5, 5, 5, 4, 4, 4]  # the document of 5 stops in [4, 8)
    assert model.lengths == [64, 40, 5]  # the three full windows in one forward (192 tokens), then one each


def test_documents_that_differ_give_an_interval_around_the_pooled_mean():
    rng = np.random.default_rng(0)
    docs = [counting(64, rng.choice(64, size=rng.integers(0, 20), replace=False)) for _ in range(30)]
    losses = score_windows(Planted(), docs, 0, full_windows([64] * 30, 64), torch.device("cpu"), torch.float32, 1 << 12)
    curve = make_curve(losses, [str(i) for i in range(30)], 64, resamples=500)
    for k, b in enumerate(curve["bins"][3:], start=3):  # bins of 4 or more positions: the documents differ there
        lo, hi = curve["edges"][k], curve["edges"][k + 1]
        assert b["mean"] == pytest.approx(np.mean([x[lo:hi] for x in losses]), rel=1e-6)
        assert b["ci_low"] < b["mean"] < b["ci_high"]


def test_the_bootstrap_covers_the_truth_95_percent_of_the_time():
    """200 experiments of 30 documents, each document's mean loss drawn around a known truth (with documents of
    unequal token counts): the 95 % intervals hold the truth in about 95 % of them. An interval over tokens instead
    of documents would be far too narrow here, since tokens of one document share its offset."""
    rng = np.random.default_rng(1)
    truth, covered = 2.0, 0
    for i in range(200):
        counts = rng.integers(50, 200, size=(30, 1))
        offsets = rng.normal(0.0, 0.3, size=(30, 1))
        sums = (truth + offsets) * counts + rng.normal(0.0, 1.0, size=(30, 1)) * np.sqrt(counts)
        lo, hi = bin_intervals(sums, counts, resamples=1000, seed=i)
        covered += lo[0] <= truth <= hi[0]
    assert 0.88 <= covered / 200 <= 0.99, covered


# ------------------------------------------------------------------------------------------------
# sliding windows
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, length, window, stride", [(300, 300, 32, 16), (300, 200, 32, 8), (37, 64, 16, 16),
                                                       (10, 64, 32, 16), (100, 100, 20, 7)])
def test_sliding_windows_score_every_position_once_with_stride_to_window_context(n, length, window, stride):
    windows = sliding_windows([n], length, window, stride)
    scored = np.zeros(min(n, length), dtype=int)
    for w in windows:
        assert w.end - w.start <= window and w.start <= w.score_from < w.end
        scored[w.score_from : w.end] += 1
    assert (scored == 1).all()
    model = Planted(z=lambda j: -j / 16.0)
    losses = score_windows(model, [counting(n)], 0, windows, torch.device("cpu"), torch.float32, 1 << 12)[0]
    table = np.array([hit_loss(j, lambda j: -j / 16.0) for j in range(window)])
    context = np.abs(losses[:, None] - table[None, :]).argmin(axis=1) + 1  # the tokens the model saw, itself included
    np.testing.assert_allclose(losses, table[context - 1], rtol=1e-5)
    first = min(window, n, length)
    assert (context[:first] == np.arange(1, first + 1)).all()  # the first window: all it has
    assert ((context[first:] >= window - stride + 1) & (context[first:] <= window)).all()  # then stride+ to window
    assert max(model.lengths) <= window


def test_windows_that_score_a_position_twice_or_never_are_refused():
    docs = [counting(20)]
    for windows, says in (([Window(0, 0, 10, 0), Window(0, 5, 20, 5)], "twice"),
                          ([Window(0, 0, 10, 0), Window(0, 5, 20, 12)], "never")):
        with pytest.raises(RuntimeError, match=says):
            score_windows(Planted(), docs, 0, windows, torch.device("cpu"), torch.float32, 64)


def test_the_loss_is_made_in_chunks_of_positions(monkeypatch):
    """A small logits budget: the head sees a few positions at a time, and the losses are the same."""
    import minigpt.eval.loss_by_position as lbp

    model = Planted()
    seen = []
    head = model.head
    model.head = lambda h: (seen.append(h.shape[1]), head(h))[1]
    idx = torch.from_numpy(np.stack([np.arange(100), np.arange(100)])) % V
    whole = token_losses(model, idx, (idx + 1) % V)
    monkeypatch.setattr(lbp, "LOGITS_BUDGET", 2 * V * 7)
    seen.clear()
    assert torch.allclose(token_losses(model, idx, (idx + 1) % V), whole) and max(seen) == 7


# ------------------------------------------------------------------------------------------------
# the goal figures
# ------------------------------------------------------------------------------------------------
def curve_of(per_doc_bin_means, edges, tokenizer="t", label="c", paths=None):
    """A curve JSON with these per-document bin means (every bin of every document 10 tokens)."""
    means = np.asarray(per_doc_bin_means, dtype=float)
    return {"label": label, "status": "ok", "edges": edges, "tokenizer": tokenizer, "length": edges[-1],
            "documents": paths or [f"d{i}" for i in range(len(means))], "doc_sums": (means * 10).tolist(),
            "doc_tokens": np.full(means.shape, 10).tolist()}


def test_far_minus_near_and_a_paired_difference():
    edges = [0, 1, 2, 4, 8]
    rng = np.random.default_rng(2)
    a = rng.normal(3.0, 0.2, size=(40, 4))
    a[:, 3] -= 0.5  # far [4, 8) half a nat below near [2, 4)... on average
    r = range_difference(curve_of(a, edges), (4, 8), (2, 4), resamples=500)
    assert r["estimate"] == pytest.approx(a[:, 3].mean() - a[:, 2].mean()) and r["docs"] == 40
    assert r["ci_low"] < r["estimate"] < r["ci_high"] < 0
    b = a + 0.1  # the baseline: 0.1 worse on every document
    b_curve = curve_of(b[::-1], edges, paths=[f"d{i}" for i in range(40)][::-1])  # another order: paired by path
    d = paired_difference(curve_of(a, edges), b_curve, (4, 8), resamples=500)
    assert d["estimate"] == pytest.approx(-0.1) and d["ci_high"] - d["ci_low"] == pytest.approx(0, abs=1e-9)
    with pytest.raises(ValueError, match="tokenizers"):
        paired_difference(curve_of(a, edges), curve_of(b, edges, tokenizer="other"), (4, 8))
    assert range_difference(curve_of(a, edges), (8, 16), (2, 4)) is None  # past the curve's bins


# ------------------------------------------------------------------------------------------------
# the refusal, the trainer's hook
# ------------------------------------------------------------------------------------------------
def test_too_few_long_held_out_documents_are_refused_with_the_count_and_what_to_do():
    docs = HeldOut(["a", "b", "c"], [np.zeros(n) for n in (5000, 3000, 100)], 0, "h", None, 20, "t",
                   {"guarantee_bytes": 262144})
    check_enough(docs, 3000, 2, "loss by position at 3000")
    with pytest.raises(TooFewDocuments) as e:
        check_enough(docs, 4096, 2, "loss by position at 4K")
    line = str(e.value)
    assert "\n" not in line and "has 1 documents of at least 4,096 tokens, fewer than 2" in line
    assert "evaluate at most 2,048 tokens (--lengths)" in line and "--min-docs 1" in line


def test_the_trainers_hook_gives_bin_means_from_a_val_stream():
    from minigpt.eval.loss_by_position import documents_from_stream

    sep = V - 1
    stream = np.concatenate([counting(50), [sep], counting(60), [sep], counting(10), [sep]])
    docs = documents_from_stream(stream, sep, count=2)
    assert [len(d) for d in docs] == [60, 50]
    m = position_metrics(Planted(), docs, 0, 64, torch.device("cpu"), torch.float32)
    assert list(m) == [f"eval/loss_by_position/{a}-{b}" for a, b in zip(bin_edges(64), bin_edges(64)[1:])]
    assert m["eval/loss_by_position/0-1"] == pytest.approx(hit_loss(0), rel=1e-6)


# ------------------------------------------------------------------------------------------------
# the command line on a tiny pycode run
# ------------------------------------------------------------------------------------------------
def write_long_site(tmp_path, n_long=6, min_docs=4):
    """A fake stdlib and site root (test_data.write_site) plus packages lib0..lib5 of one long file each (over the
    full corpus's 256 KiB, each its own numbers): the held-out guarantee moves the min_docs smallest to val."""
    from test_data import write_site

    std, site = write_site(tmp_path)
    for i in range(n_long):
        (site / f"lib{i}").mkdir()
        lines = [f"def f{k}(x):\n    return x * {k * (i + 3) % 97} + {i}\n" for k in range(9000 + 300 * i)]
        (site / f"lib{i}" / "m.py").write_text("".join(lines))
    packages = ",".join(["pkga", "pkgb", *(f"lib{i}" for i in range(n_long))])
    return ["data=pycode", f"data.stdlib={std}", f"data.site_dirs=[{site}]", f"data.packages=[{packages}]",
            f"data.min_heldout_docs={min_docs}", "data.vocab_size=300"]


@pytest.fixture(scope="module")
def pycode_run(tmp_path_factory):
    """A 12-step tiny run on the fake pycode corpus (seq_len 64), 4 held-out documents."""
    from minigpt.compose import compose
    from minigpt.run import run

    tmp = tmp_path_factory.mktemp("pycode")
    cfg = compose(["model=tiny", "seq_len=64", "batch_size=4", "max_steps=12", "eval_batches=0", "logger=none",
                   "device=cpu", "warmup_steps=2", f"data.cache_dir={tmp / 'cache'}", *write_long_site(tmp)])
    cfg.run_dir, cfg.ckpt_dir = str(tmp / "run"), str(tmp / "run" / "checkpoints")
    assert run(cfg) == 0
    assert json.loads((tmp / "run" / "corpus.json").read_text())["documents"]["val"] >= 4
    return tmp / "run"


def test_the_cli_writes_json_and_png_for_a_run(pycode_run, tmp_path, capsys):
    import matplotlib.image

    out = tmp_path / "e"
    assert main([str(pycode_run), "--lengths", "64,256", "--goal-far", "128,256", "--goal-near", "8,16",
                 "--resamples", "200", "--out", str(out)]) == 0
    report = json.loads((out / LOSS_FILES[0]).read_text())
    assert report["command"].startswith("minigpt-eval ") and "commit" in report and len(report["curves"]) == 2
    c64, c256 = report["curves"]
    assert c64["status"] == "ok" and c64["length"] == 64 and c64["trained_length"] == 64 and c64["step"] == 12
    assert c64["rope"] == {"scaling": "none", "factor": 1.0, "original_len": None} and c64["sliding"] is None
    assert len(c64["corpus_hash"]) == 64 and c64["corpus_hash"] == c64["run_corpus_hash"]
    assert [b["lo"] for b in c256["bins"]] == [0, 1, 2, 4, 8, 16, 32, 64, 128]
    assert all(b["docs"] == 4 and b["ci_low"] <= b["mean"] <= b["ci_high"] for b in c256["bins"])
    assert [b["mean"] for b in c64["bins"]] == pytest.approx([b["mean"] for b in c256["bins"][:7]], rel=1e-4)  # causal
    assert len(c256["documents"]) == 4 and np.array(c256["doc_tokens"]).sum() == 4 * 256
    goals = report["goals"]
    assert set(goals["range_difference"]) == {c256["label"]} and goals["paired_difference"] == []
    assert "loss [128, 256) - [8, 16) = " in capsys.readouterr().out
    png = matplotlib.image.imread(out / LOSS_FILES[1])
    assert png.shape[0] > 300 and png[..., :3].std() > 0.05


def test_the_cli_compares_a_model_with_a_sliding_baseline_and_earlier_results(pycode_run, tmp_path):
    out = tmp_path / "cmp"
    assert main([str(pycode_run), str(pycode_run / "checkpoints"), "--lengths", "256", "--sliding", "none,32",
                 "--goal-far", "128,256", "--goal-near", "8,16", "--resamples", "100", "--docs", "3",
                 "--min-docs", "3", "--out", str(out)]) == 0
    report = json.loads((out / LOSS_FILES[0]).read_text())
    full, slid = report["curves"]
    assert slid["sliding"] == {"window": 32, "stride": 16} and "sliding 32/16" in slid["label"]
    assert full["source"] == 0 and slid["source"] == 1 and len(full["documents"]) == 3
    (pair,) = report["goals"]["paired_difference"]
    assert (pair["a"], pair["b"], pair["docs"]) == (full["label"], slid["label"], 3)
    first_window = slice(0, 6)  # positions below 32: the same context both ways
    assert [b["mean"] for b in full["bins"][first_window]] == pytest.approx(
        [b["mean"] for b in slid["bins"][first_window]], rel=1e-4)
    again = tmp_path / "again"  # the results, drawn and compared again without a model
    assert main([str(out / LOSS_FILES[0]), "--goal-far", "128,256", "--goal-near", "8,16", "--resamples", "100",
                 "--out", str(again)]) == 0
    redone = json.loads((again / LOSS_FILES[0]).read_text())
    assert redone["goals"]["paired_difference"][0]["estimate"] == pytest.approx(pair["estimate"])
    assert (again / LOSS_FILES[1]).stat().st_size > 10_000


def test_the_cli_refuses_too_few_documents_and_its_advice_works(pycode_run, tmp_path, capsys):
    args = [str(pycode_run), "--lengths", "256", "--resamples", "50", "--out", str(tmp_path / "o")]
    assert main([*args, "--docs", "2"]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error")]
    assert "has 2 documents of at least 256 tokens, fewer than 4" in line and "--min-docs 2" in line
    assert not (tmp_path / "o").exists()
    assert main([*args, "--docs", "2", "--min-docs", "2"]) == 0


def test_a_length_out_of_gpu_memory_is_recorded_and_the_others_go_on(pycode_run, tmp_path, monkeypatch, capsys):
    from minigpt.model import GPT

    hidden = GPT.hidden

    def small_gpu(self, idx, *a):
        if idx.numel() > 100:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return hidden(self, idx, *a)

    monkeypatch.setattr(GPT, "hidden", small_gpu)
    out = tmp_path / "oom"
    assert main([str(pycode_run), "--lengths", "64,256", "--batch-tokens", "64", "--resamples", "50",
                 "--out", str(out)]) == 0
    curves = json.loads((out / LOSS_FILES[0]).read_text())["curves"]
    assert [c["status"] for c in curves] == ["ok", "oom"] and "Tried to allocate" in curves[1]["error"]
    assert "@ 256: out of GPU memory" in capsys.readouterr().err
    assert main([str(pycode_run), "--lengths", "256", "--out", str(tmp_path / "none")]) == 3  # nothing fit


def test_the_script_logs_a_wandb_run_offline(pycode_run, tmp_path):
    from wandb_records import offline_run

    out = tmp_path / "w"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("WANDB_DIR", None)
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval.py"), str(pycode_run), "--lengths", "128",
                        "--resamples", "50", "--goal-far", "64,128", "--goal-near", "4,8", "--out", str(out),
                        "--wandb"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    run = offline_run(out)
    assert run["name"] == "eval-run-step-12" and run["exit_code"] == 0
    assert {"loss_by_position/table/_type", "loss_by_position/figure/_type"} <= run["history"]
    assert any(k.startswith("loss_by_position/plot") for k in run["history"]), run["history"]
    assert any(k.startswith("goal/") for k in run["summary"])


@pytest.mark.parametrize("argv, says", [
    (["--lengths", "2Q"], "argument --lengths"),
    (["--goal-far", "32K,16K"], "argument --goal-far"),
    (["--sliding", "none,2K,4K"], "argument --sliding: 3 windows for 1 model PATHs"),
    (["--stride", "8"], "argument --stride: only with --sliding"),
    (["--no-loss"], "argument --no-loss: nothing left to do"),
    (["--docs", "0"], "argument --docs: must be >= 1"),
    (["--depths", "1.5"], "argument --depths"),
])
def test_bad_arguments_exit_2_with_usage_and_one_line(pycode_run, tmp_path, argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(pycode_run), *argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 2 and err[0].startswith("usage: minigpt-eval") and says in err[1], err
    assert not (tmp_path / "o").exists()


def test_sizes_and_ranges_parse():
    assert [size(t) for t in ("2K", "64k", "1M", "1000")] == [2048, 65536, 1 << 20, 1000]
    assert span("16K,32K") == (16384, 32768) and span("0,1") == (0, 1)

"""The passkey grid: scoring against stand-in models that read the key, greedy decoding against step-by-step
decoding, the key's placement at the asked depth (bytes, and any tokenizer's tokens around the filler or pycode
text), the files, the W&B run, and `minigpt-eval --passkey-grid` on real tiny checkpoints (a byte-level passkey run,
and a BPE pycode run with both haystacks; bad arguments, missing, damaged and unsafe checkpoints, out of memory)."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from minigpt.attention import get_attention
from minigpt.config import ModelConfig
from minigpt.data import DataError, PasskeyData
from minigpt.eval.cli import main
from minigpt.eval.haystack import KEY_SLOTS, QUESTION, filler_haystack, pycode_haystack
from minigpt.eval.passkey_grid import FILES, accuracy_matrix, grid_table, write_outputs
from minigpt.eval.retrieval import cell_prompts, greedy_decode, passkey_grid, score_answer
from minigpt.model import GPT
from test_eval import pycode_run  # noqa: F401 - the tiny pycode run (a BPE model)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = PasskeyData.KEY_DIGITS
FIXED = len(PasskeyData.NEEDLE.format(key="0" * DIGITS)) + len(PasskeyData.QUESTION.format(key="0" * DIGITS))
NEEDLE_KEY = re.compile(rb"The pass key is (\d{5})\. Remember it\. \1 is the pass key\.")
ASKED = b" What is the pass key? The pass key is "


def answer_logits(out, text: bytes, slot: int, answer: str, slots: int) -> None:
    """One row's logits (out: (N, 256)) for an answer written from `slot` on: before its k-th character the argmax
    is that character if the k characters before are the answer's own, else 'x'."""
    for k in range(slots):
        right_so_far = text[slot : slot + k] == answer[:k].encode()
        out[slot + k - 1, ord(answer[k]) if right_so_far else ord("x")] = 1.0


class Oracle(nn.Module):
    """A stand-in GPT that reads the key (and the needle's depth) out of its input and answers `answer(key, depth)`.

    Its logits before the k-th answer slot put the argmax on the answer's k-th digit if the k tokens before are
    the answer's own (as a model conditioned on what it generated would), else on 'x': a decoder that does not feed
    its tokens back, or reads the wrong position, gets the key wrong."""

    def __init__(self, answer):
        super().__init__()
        self.answer = answer

    def hidden(self, idx):
        B, N = idx.shape
        out = torch.zeros(B, N, 256)
        for b in range(B):
            text = bytes(idx[b].tolist())
            key = NEEDLE_KEY.search(text).group(1).decode()
            depth = text.index(b" The pass key is ") / (N + 1 - FIXED)  # N = the sequence length
            answer = self.answer(key, depth)
            answer_logits(out[b], text, text.rindex(ASKED) + len(ASKED), answer, DIGITS)
        return out

    def head(self, h):
        return h


def other(key):
    return "".join(str((int(c) + 1) % 10) for c in key)


LENGTHS, DEPTHS = (128, 200), (0.0, 0.25, 0.75, 1.0)


def grid(answer, **kw):
    return passkey_grid(Oracle(answer), LENGTHS, DEPTHS, keys_per_cell=3, batch_size=5, seed=1, **kw)


def test_a_model_that_answers_the_key_scores_100():
    model = Oracle(lambda key, depth: key)
    r = passkey_grid(model, LENGTHS, DEPTHS, keys_per_cell=3, batch_size=5, seed=1)
    assert len(r["cells"]) == len(LENGTHS) * len(DEPTHS) and r["mean_accuracy"] == 1.0
    for c in r["cells"]:
        assert (c["accuracy"], c["digit_accuracy"], c["hits"], c["keys"]) == (1.0, 1.0, 3, 3)
        assert c["answers"] == c["expected"] and len(set(c["expected"])) == 3  # three different keys
    assert model.training  # left in the mode it came in


def test_another_key_or_a_wrong_digit_scores_0():
    r = grid(lambda key, depth: other(key))
    assert r["mean_accuracy"] == 0.0 and all(c["digit_accuracy"] == 0.0 for c in r["cells"])
    assert all(c["answers"] == [other(k) for k in c["expected"]] for c in r["cells"])
    r = grid(lambda key, depth: key[:-1] + other(key[-1]))  # exact match: four digits of five are not the key
    assert r["mean_accuracy"] == 0.0 and all(c["digit_accuracy"] == pytest.approx(0.8) for c in r["cells"])


def test_right_at_half_the_depths_scores_by_cell():
    r = grid(lambda key, depth: key if depth < 0.5 else other(key))
    m = accuracy_matrix(r)  # rows: depths 0, 0.25, 0.75, 1
    assert (m == np.array([[1, 1], [1, 1], [0, 0], [0, 0]])).all()
    assert r["mean_accuracy"] == 0.5 and r["by_length"] == {"128": 0.5, "200": 0.5}
    assert r["by_depth"] == {"0.0": 1.0, "0.25": 1.0, "0.75": 0.0, "1.0": 0.0}
    table = grid_table({**r, "trained_length": 128})
    assert "| depth | 128 (trained) | 200 | mean |" in table and "| 0.25 | 100% | 100% | 100% |" in table
    assert "| 0.75 | 0% | 0% | 0% |" in table and "**50.0%**" in table


def test_greedy_decoding_is_step_by_step_decoding():
    """The fixed buffer with empty slots decodes what feeding the growing sequence does (causal attention)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(name="t", n_layer=2, n_head=4, n_embd=64), 256, get_attention("naive")).eval()
    prompts = torch.from_numpy(cell_prompts(150, 0.3, 4, seed=2)[0].astype(np.int64))
    idx = prompts
    with torch.no_grad():
        for _ in range(DIGITS):
            idx = torch.cat([idx, model.head(model.hidden(idx)[:, -1]).argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy_decode(model, prompts, DIGITS), idx[:, prompts.shape[1]:])


@pytest.mark.parametrize("length", [128, 1001, 4096])
def test_the_key_is_planted_at_the_asked_depth(length):
    """The needle starts after round(depth · filler) filler tokens: within half a token of the asked depth."""
    n_filler = length + 1 - FIXED
    for depth in (0.0, 0.1, 1 / 3, 0.5, 0.9, 1.0):
        prompts, keys = cell_prompts(length, depth, 3, seed=5)
        assert prompts.shape == (3, length - DIGITS) and keys.shape == (3, DIGITS)
        for p, k in zip(prompts, keys):
            text, key = bytes(p.tolist()), bytes(k.tolist())
            start = text.index(b" The pass key is ")
            assert abs(start - depth * n_filler) <= 0.5, (depth, start, n_filler)
            assert NEEDLE_KEY.search(text).group(1) == key and text.count(key) == 2  # in the needle only
            assert text.endswith(ASKED)  # the prompt stops where the key is asked for
            assert (start == 0) == (depth == 0.0) and (text.index(ASKED) == start + FIXED - len(ASKED) - DIGITS - 1) == (depth == 1.0)


def test_placement_keeps_the_training_draws_and_keys_are_deterministic():
    d = PasskeyData(seq_len=300, seed=0)
    free, placed = d.sample(np.random.default_rng(4)), d.sample(np.random.default_rng(4), depth=0.5)
    key = NEEDLE_KEY.search(bytes(free.tolist())).group(1).decode()
    needle = PasskeyData.NEEDLE.format(key=key).encode()
    drop = lambda t: bytes(t.tolist()).replace(needle, b"")  # noqa: E731 - the same key and filler, needle moved
    assert drop(free) == drop(placed) and len(free) == len(placed) == 301 and needle in bytes(placed.tolist())
    with pytest.raises(DataError, match="depth"):
        d.sample(np.random.default_rng(0), depth=1.5)
    a, b = cell_prompts(300, 0.4, 4, seed=3), cell_prompts(300, 0.4, 4, seed=3)
    assert all((x == y).all() for x, y in zip(a, b))
    assert not (cell_prompts(300, 0.4, 4, seed=4)[1] == a[1]).all()


def test_outputs_exist_and_say_what_was_measured(tmp_path):
    import matplotlib.image

    r = grid(lambda key, depth: key if depth < 0.5 else other(key), trained_length=160)
    paths = write_outputs(r, tmp_path / "out", title="stub")
    assert [p.name for p in paths] == list(FILES)
    assert json.loads(paths[0].read_text()) == r
    md = paths[1].read_text()
    assert md.startswith("stub\n") and md.count("\n| ") == len(DEPTHS) + 2  # header, a row per depth, the means
    png = matplotlib.image.imread(paths[2])
    assert png.shape[0] > 200 and png.shape[1] > 200 and png[..., :3].std() > 0.1  # a picture, not a blank


def test_answers_are_scored_by_their_text():
    assert score_answer(" 12345.", " 12345") == (True, 5) and score_answer("12345", "12345") == (True, 5)
    assert score_answer(" 123456", " 12345") == (False, 5)  # a sixth digit: another number
    assert score_answer(" 12", " 12345") == (False, 2) and score_answer("x2345", "12345") == (False, 4)


# ------------------------------------------------------------------------------------------------
# Haystacks in any tokenizer's tokens (here bytes, so the text is plain to read)
# ------------------------------------------------------------------------------------------------
def byte_codec():
    from minigpt.sample import byte_tokenizer

    tok = byte_tokenizer()
    return tok.encode, tok.decode


PYCODE_DOCS = [np.frombuffer(t.encode(), dtype=np.uint8).astype(np.int64)
               for t in ("def f(x):\n    return x * 2\n" * 30, "import os\nprint(os.getcwd())\n" * 20)]


START = 0  # a stand-in start token (NUL: no text holds it), the end-of-text separator of a BPE


def token_haystack(kind: str):
    encode, decode = byte_codec()
    if kind == "filler":
        return filler_haystack(encode, decode, START)
    return pycode_haystack(PYCODE_DOCS, START, encode, decode)


@pytest.mark.parametrize("kind", ["filler", "pycode"])
@pytest.mark.parametrize("length", [160, 700])
def test_token_haystacks_plant_the_key_at_the_asked_depth(kind, length):
    encode, decode = byte_codec()
    hay = token_haystack(kind)
    for depth in (0.0, 0.3, 1.0):
        prompts, expected = hay.cell(length, depth, 3, seed=4)
        assert prompts.shape == (3, length - KEY_SLOTS)
        for p, e in zip(prompts, expected):
            text = decode(p.tolist())
            key = NEEDLE_KEY.search(text.encode()).group(1).decode()
            n_hay = length - KEY_SLOTS - 1 - len(PasskeyData.NEEDLE.format(key=key)) - len(QUESTION)
            assert e == " " + key and text.endswith(QUESTION) and p[0] == START  # the start token, then the haystack
            assert text.index(" The pass key is ") == 1 + round(depth * n_hay)
            if kind == "pycode":
                assert "def f(x)" in text or "import os" in text
    assert (hay.cell(length, 0.3, 3, seed=4)[0] == hay.cell(length, 0.3, 3, seed=4)[0]).all()  # the same keys again
    with pytest.raises(DataError, match="length 60"):
        hay.cell(60, 0.5, 1, seed=0)


@pytest.mark.parametrize("kind", ["filler", "pycode"])
def test_at_depth_0_the_start_token_comes_first_and_the_needle_right_after_it_as_in_training(kind):
    """Position 0 is the attention sink: a prompt starts with the tokenizer's start token (the separator before
    every document), and a training example with its needle at cut 0 starts with the same tokens."""
    from minigpt.passkey_mix import PasskeyMix

    encode, _ = byte_codec()
    prompts, expected = token_haystack(kind).cell(300, 0.0, 3, seed=4)
    for p, e in zip(prompts, expected):
        needle = encode(PasskeyData.NEEDLE.format(key=e.strip()))
        assert p[0] == START and p[1 : 1 + len(needle)].tolist() == needle
    question, _, end = PasskeyData.QUESTION.partition(" {key}")
    mix = PasskeyMix(0.5, 0, encode, PasskeyData.NEEDLE, question, " {key}" + end, np.asarray(encode("x")),
                     start=START)
    example = mix.example(np.zeros(10, dtype=np.int64), mix.min_tokens() - 3 * DIGITS, 0, 0)  # no haystack: cut 0
    needle = encode(PasskeyData.NEEDLE.format(key=NEEDLE_KEY.search(bytes(example[1:].tolist())).group(1).decode()))
    assert example[0] == START and example[1 : 1 + len(needle)].tolist() == needle


class TextOracle(nn.Module):
    """A stand-in byte model for TokenHaystack prompts: answers " <key>" (right) or " <other key>" after the
    question, each character conditioned on the ones it wrote."""

    vocab_size = 256

    def __init__(self, right: bool):
        super().__init__()
        self.right = right

    def hidden(self, idx):
        B, N = idx.shape
        out = torch.zeros(B, N, 256)
        for b in range(B):
            text = bytes(idx[b].tolist())
            key = NEEDLE_KEY.search(text).group(1).decode()
            answer = " " + (key if self.right else other(key))
            answer_logits(out[b], text, text.rindex(QUESTION.encode()) + len(QUESTION), answer, KEY_SLOTS)
        return out

    def head(self, h):
        return h


def test_a_token_haystack_grid_scores_the_key_by_its_text():
    encode, decode = byte_codec()
    hay = pycode_haystack(PYCODE_DOCS, START, encode, decode)
    right = passkey_grid(TextOracle(True), [160, 300], DEPTHS, keys_per_cell=3, batch_size=4, seed=1, haystack=hay)
    assert right["mean_accuracy"] == 1.0 and all(c["answers"] == c["expected"] for c in right["cells"])
    wrong = passkey_grid(TextOracle(False), [160], DEPTHS, keys_per_cell=3, batch_size=4, seed=1, haystack=hay)
    assert wrong["mean_accuracy"] == 0.0 and all(c["digit_accuracy"] == 0.0 for c in wrong["cells"])


# ------------------------------------------------------------------------------------------------
# `minigpt-eval --passkey-grid` on a real tiny byte-level checkpoint
# ------------------------------------------------------------------------------------------------
GRID = ["--no-loss", "--passkey-grid"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 2-step tiny run (seq_len 128) and its checkpoint."""
    from minigpt.compose import compose
    from minigpt.run import run

    tmp = tmp_path_factory.mktemp("tiny")
    cfg = compose(["model=tiny", "seq_len=128", "batch_size=2", "max_steps=2", "eval_batches=0", "logger=none",
                   "device=cpu", f"data.cache_dir={tmp / 'cache'}"])
    cfg.run_dir, cfg.ckpt_dir = str(tmp / "run"), str(tmp / "run" / "checkpoints")
    assert run(cfg) == 0
    return tmp / "run"


def test_cli_writes_the_grid_for_a_checkpoint(run_dir, tmp_path, capsys):
    out = tmp_path / "grid"
    assert main([str(run_dir), *GRID, "--passkey-lengths", "128,160", "--depths", "0", "0.5", "1", "--keys", "2",
                 "--out", str(out)]) == 0
    result = json.loads((out / "passkey_filler" / FILES[0]).read_text())
    assert result["trained_length"] == 128 and result["lengths"] == [128, 160] and len(result["cells"]) == 6
    assert result["haystack"] == "filler" and result["oom"] == [] and result["run"]["tokenizer"] == "bytes"
    assert result["run"]["attention"] == "sdpa" and result["run"]["step"] == 2
    assert result["run"]["checkpoint"].endswith("ckpt_00000002.pt") and not os.path.isabs(result["run"]["checkpoint"])
    assert all(c["keys"] == 2 and len(c["answers"][0]) == DIGITS for c in result["cells"])  # training's own task
    assert "128 (trained)" in (out / "passkey_filler" / FILES[1]).read_text()
    assert (out / "passkey_filler" / FILES[2]).stat().st_size > 10_000
    assert "passkey (filler) mean accuracy" in capsys.readouterr().out
    # into eval/ of the run by default; another attention
    assert main([str(run_dir / "checkpoints"), *GRID, "--passkey-lengths", "128,256", "--depths", "0.5", "--keys", "1",
                 "--attention", "naive"]) == 0
    result = json.loads((run_dir / "eval" / "passkey_filler" / FILES[0]).read_text())
    assert result["lengths"] == [128, 256] and result["run"]["attention"] == "naive"


def test_wandb_run_holds_the_table_and_heatmap(run_dir, tmp_path):
    """Through the script, from another directory, W&B offline: a run with the Table, the image and the mean."""
    from wandb_records import offline_run

    out = tmp_path / "w"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("WANDB_DIR", None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "eval.py"), str(run_dir), *GRID,
                        "--passkey-lengths", "128", "--depths", "0", "1", "--keys", "2", "--out", str(out), "--wandb"],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    run = offline_run(out)
    assert run["name"] == "eval-run-step-2" and run["exit_code"] == 0
    assert {"passkey_filler/grid/_type", "passkey_filler/heatmap/_type"} <= run["history"]
    grid_json = json.loads((out / "passkey_filler" / FILES[0]).read_text())
    assert json.loads(run["summary"]["passkey_filler/mean_accuracy"]) == grid_json["mean_accuracy"]


@pytest.mark.parametrize("argv, argument", [
    (["--passkey-lengths", "50"], "--passkey-lengths"),
    (["--depths", "0", "1.5"], "--depths"),
    (["--depths", "-0.1"], "--depths"),
    (["--keys", "0"], "--keys"),
    (["--batch-tokens", "0"], "--batch-tokens"),
    (["--attention", "bogus"], "--attention"),
    (["--device", "tpu"], "--device"),
    (["--haystack", "hay"], "--haystack"),
    (["--wandb"], "--wandb"),  # WANDB_MODE=online without credentials
    pytest.param(["--dtype", "float16"], "--dtype", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                                            reason="float16 is refused on CPU")),
])
def test_bad_arguments_exit_2_with_one_line(argv, argument, run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    with pytest.raises(SystemExit) as e:
        main([str(run_dir), *GRID, *argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 2 and err[0].startswith("usage:")
    assert f"error: argument {argument}:" in err[1]
    assert not (tmp_path / "o").exists()


def test_missing_or_damaged_checkpoint_ends_with_one_line(run_dir, tmp_path, capsys):
    def fails(path, code, says):
        assert main([str(path), *GRID, "--passkey-lengths", "128", "--out", str(tmp_path / "o")]) == code
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
        assert not (tmp_path / "o").exists()

    fails(tmp_path / "nope", 2, "no such file or directory")
    (tmp_path / "empty").mkdir()
    fails(tmp_path / "empty", 2, "no checkpoint there")
    damaged = tmp_path / "damaged"
    shutil.copytree(run_dir / "checkpoints", damaged)
    ckpt = next(damaged.glob("ckpt_*.pt"))
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    fails(ckpt, 1, "truncated")
    fails(damaged, 1, "no intact checkpoint")


def test_an_unsafe_checkpoint_is_refused_and_never_run(run_dir, tmp_path, capsys):
    """minigpt-eval loads through the one loader too: a planted pickle (as a file, and as the newest checkpoint of a
    run directory beside intact older ones: no silent fallback) is refused with exit 2 and never runs."""
    from test_checkpoint import plant

    run = shutil.copytree(run_dir, tmp_path / "run", ignore=shutil.ignore_patterns("eval"))
    marker = tmp_path / "ran"
    planted = plant(run / "checkpoints" / "ckpt_00000009.pt", marker)
    for path in (planted, run / "checkpoints", run):
        assert main([str(path), *GRID, "--passkey-lengths", "128", "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "ckpt_00000009.pt" in err[0] and "refused" in err[0], err
        assert f"python -m minigpt.checkpoint upgrade {planted} --trust" in err[0]
    assert not marker.exists() and not (tmp_path / "o").exists()


def test_a_length_out_of_gpu_memory_is_recorded_and_the_others_go_on(run_dir, tmp_path, monkeypatch, capsys):
    from minigpt.model import GPT

    hidden = GPT.hidden
    monkeypatch.setattr(GPT, "hidden", lambda self, idx, *a: hidden(self, idx, *a) if idx.shape[1] <= 150 else
                        (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")))
    out = tmp_path / "oom"
    assert main([str(run_dir), *GRID, "--passkey-lengths", "128,256", "--depths", "0", "1", "--keys", "2",
                 "--out", str(out)]) == 0
    result = json.loads((out / "passkey_filler" / FILES[0]).read_text())
    assert result["lengths"] == [128] and result["oom"] == [256] and len(result["cells"]) == 2
    assert "out of GPU memory at 256" in (out / "passkey_filler" / FILES[1]).read_text()
    assert "passkey filler at 256: out of GPU memory" in capsys.readouterr().err
    assert main([str(run_dir), *GRID, "--passkey-lengths", "256", "--out", str(tmp_path / "none")]) == 3


def test_script_refuses_bad_arguments_from_another_directory(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "eval.py"), "x", "--depths", "2"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    usage, error = p.stderr.strip().splitlines()
    assert usage.startswith("usage: minigpt-eval") and error.endswith("argument --depths: 2.0 is not a fraction in [0, 1]")


# ------------------------------------------------------------------------------------------------
# A BPE model (the tiny pycode run of test_eval.py): both haystacks
# ------------------------------------------------------------------------------------------------
def test_the_grid_of_a_bpe_model_in_both_haystacks(pycode_run, tmp_path):
    out = tmp_path / "both"
    assert main([str(pycode_run), *GRID, "--haystack", "both", "--passkey-lengths", "160,256", "--depths", "0",
                 "0.5", "1", "--keys", "20", "--out", str(out)]) == 0
    for haystack in ("filler", "pycode"):
        result = json.loads((out / f"passkey_{haystack}" / FILES[0]).read_text())
        assert result["haystack"] == haystack and result["lengths"] == [160, 256] and result["depths"] == [0.0, 0.5, 1.0]
        assert accuracy_matrix(result).shape == (3, 2) and len(result["cells"]) == 6
        assert all(c["keys"] == 20 and len(c["answers"]) == len(c["expected"]) == 20 for c in result["cells"])
        assert all(e.startswith(" ") and e[1:].isdigit() for c in result["cells"] for e in c["expected"])
        assert len(result["run"]["tokenizer"]) == 16 and (out / f"passkey_{haystack}" / FILES[2]).exists()


# ------------------------------------------------------------------------------------------------
# A grid in parts, merged
# ------------------------------------------------------------------------------------------------
def oracle_grid(lengths, depths, oom=()):
    """The Oracle's grid as minigpt-eval writes it (right at depths below 0.5), `oom` lengths out of memory."""
    from minigpt.eval.passkey_grid import run_grid
    from minigpt.eval.retrieval import FillerBytes

    model = Oracle(lambda key, depth: key if depth < 0.5 else other(key))
    hidden = model.hidden
    model.hidden = lambda idx: hidden(idx) if idx.shape[1] not in oom else \
        (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    result = run_grid(model, FillerBytes(), lengths, depths, 3, torch.device("cpu"), torch.float32, 1, 1000, 128)
    return {**result, "run": {"checkpoint": "a/ckpt.pt", "step": 2, "model": "tiny", "attention": "sdpa"}}


def test_parts_of_a_grid_merge_into_the_whole_grid():
    from minigpt.eval.passkey_grid import merge_grids

    whole = oracle_grid(LENGTHS, DEPTHS)
    parts = [oracle_grid([200], DEPTHS[:1]), oracle_grid([128], DEPTHS), oracle_grid([200], DEPTHS[1:])]
    assert merge_grids(parts) == whole  # in any order, split by length or by depth
    assert list(merge_grids(parts)) == list(whole)  # the same JSON, key for key
    # a length out of memory in one part is out of memory in the grid, its other cells dropped, as in one command
    oom = merge_grids([oracle_grid([128], DEPTHS), oracle_grid([200], DEPTHS[:2]), oracle_grid([200], DEPTHS[2:],
                                                                                              oom=(200,))])
    assert oom == oracle_grid(LENGTHS, DEPTHS, oom=(200,)) and oom["oom"] == [200] and oom["lengths"] == [128]


@pytest.mark.parametrize("change, says", [
    (lambda parts: parts + [parts[0]], "grid 3: length 128 at depth 0 is in another part too"),
    (lambda parts: [parts[0], {**parts[1], "cells": parts[1]["cells"][1:]}],
     "no grid has length 200 at depth 0 (1 cell(s) missing)"),
    (lambda parts: [parts[0], {**parts[1], "seed": 7}], "grid 2 has seed 7, grid 1 1: not parts of one grid"),
    (lambda parts: [parts[0], {**parts[1], "keys_per_cell": 5}], "grid 2 has keys_per_cell 5"),
    (lambda parts: [parts[0], {**parts[1], "run": {**parts[1]["run"], "step": 3}}],
     "grid 2 is of another model than grid 1 (its step 3, not 2)"),
])
def test_a_merge_refuses_shared_cells_holes_and_parts_of_other_grids(change, says):
    from minigpt.eval.passkey_grid import merge_grids

    parts = [oracle_grid([128], DEPTHS), oracle_grid([200], DEPTHS)]
    with pytest.raises(ValueError, match=re.escape(says)):
        merge_grids(change(parts))
    other_path = {**parts[1], "run": {**parts[1]["run"], "checkpoint": "b/ckpt.pt"}}  # the same model elsewhere
    assert merge_grids([parts[0], other_path])["run"] == parts[0]["run"]


def test_cli_merges_grid_files_per_haystack_and_refuses_what_is_not_one_grid(tmp_path, capsys):
    parts = [oracle_grid([200], DEPTHS), oracle_grid([128], DEPTHS)]
    files = [write_outputs(p, tmp_path / f"part{i}" / "passkey_filler")[0] for i, p in enumerate(parts)]
    out = tmp_path / "merged"
    assert main([*map(str, files), "--out", str(out)]) == 0
    assert json.loads((out / "passkey_filler" / FILES[0]).read_text()) == oracle_grid(LENGTHS, DEPTHS)
    assert "2 parts merged" in (out / "passkey_filler" / FILES[1]).read_text()
    assert (out / "passkey_filler" / FILES[2]).exists() and "passkey (filler) mean accuracy 50.0%" in \
        capsys.readouterr().out
    assert main([str(files[0]), "--out", str(tmp_path / "one")]) == 0  # one part alone: a grid of its lengths
    assert main([str(files[0]), str(files[0]), "--out", str(tmp_path / "twice")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "is in another part too" in err[-1] and not (tmp_path / "twice").exists()
    with pytest.raises(SystemExit) as e:
        main([str(files[0]), str(tmp_path), "--out", str(tmp_path / "mixed")])
    assert e.value.code == 2 and "passkey_grid.json files are merged on their own" in capsys.readouterr().err

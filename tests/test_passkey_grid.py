"""The passkey grid: scoring against stand-in models that read the key, greedy decoding against step-by-step
decoding, the key's placement at the asked depth, the files, the W&B run, and the command line on a real tiny
checkpoint (bad arguments, missing and damaged checkpoints)."""
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
from minigpt.eval.passkey_eval import FILES, accuracy_matrix, grid_table, main, write_outputs
from minigpt.eval.retrieval import cell_prompts, greedy_decode, passkey_grid
from minigpt.model import GPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = PasskeyData.KEY_DIGITS
FIXED = len(PasskeyData.NEEDLE.format(key="0" * DIGITS)) + len(PasskeyData.QUESTION.format(key="0" * DIGITS))
NEEDLE_KEY = re.compile(rb"The pass key is (\d{5})\. Remember it\. \1 is the pass key\.")
ASKED = b" What is the pass key? The pass key is "


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
            slot = text.rindex(ASKED) + len(ASKED)
            for k in range(DIGITS):
                right_so_far = text[slot : slot + k] == answer[:k].encode()
                out[b, slot + k - 1, ord(answer[k]) if right_so_far else ord("x")] = 1.0
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


# ------------------------------------------------------------------------------------------------
# The command line on a real tiny checkpoint
# ------------------------------------------------------------------------------------------------
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
    assert main(["--checkpoint", str(run_dir), "--lengths", "128", "160", "--depths", "0", "0.5", "1",
                 "--keys-per-cell", "2", "--out", str(out)]) == 0
    result = json.loads((out / FILES[0]).read_text())
    assert result["trained_length"] == 128 and result["lengths"] == [128, 160] and len(result["cells"]) == 6
    assert result["run"]["attention"] == "sdpa" and result["run"]["step"] == 2
    assert result["run"]["checkpoint"].endswith("ckpt_00000002.pt") and not os.path.isabs(result["run"]["checkpoint"])
    assert all(c["keys"] == 2 and len(c["answers"][0]) == DIGITS for c in result["cells"])
    assert "128 (trained)" in (out / FILES[1]).read_text() and (out / FILES[2]).stat().st_size > 10_000
    # defaults: the trained length x 1/4, 1/2, 1, 2 that hold the task, into passkey/ of the run
    assert main(["--checkpoint", str(run_dir / "checkpoints"), "--depths", "0.5", "--keys-per-cell", "1",
                 "--attention", "naive"]) == 0
    result = json.loads((run_dir / "passkey" / FILES[0]).read_text())
    assert result["lengths"] == [128, 256] and result["run"]["attention"] == "naive"


def test_wandb_run_holds_the_table_and_heatmap(run_dir, tmp_path):
    """Through the script, from another directory, W&B offline: a run with the Table, the image and the mean."""
    from wandb_records import offline_run

    out = tmp_path / "w"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("WANDB_DIR", None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "eval_passkey.py"), "--checkpoint",
                        str(run_dir), "--lengths", "128", "--depths", "0", "1", "--keys-per-cell", "2", "--out",
                        str(out), "--wandb"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    run = offline_run(out)
    assert run["name"] == "passkey-tiny-sdpa-step2" and run["exit_code"] == 0
    assert {"passkey/grid/_type", "passkey/heatmap/_type"} <= run["history"]
    grid_json = json.loads((out / FILES[0]).read_text())
    assert json.loads(run["summary"]["passkey/mean_accuracy"]) == grid_json["mean_accuracy"]
    assert "passkey/accuracy_n128" in run["summary"]


@pytest.mark.parametrize("argv, argument", [
    (["--lengths", "50"], "--lengths"),
    (["--depths", "0", "1.5"], "--depths"),
    (["--depths", "-0.1"], "--depths"),
    (["--keys-per-cell", "0"], "--keys-per-cell"),
    (["--batch-size", "0"], "--batch-size"),
    (["--attention", "bogus"], "--attention"),
    (["--device", "tpu"], "--device"),
    (["--trained-length", "0"], "--trained-length"),
    (["--wandb"], "--wandb"),  # WANDB_MODE=online without credentials
    pytest.param(["--dtype", "float16"], "--dtype", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                                            reason="float16 is refused on CPU")),
])
def test_bad_arguments_exit_2_with_one_line(argv, argument, run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", str(run_dir), *argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 2 and err[0].startswith("usage:")
    assert f"error: argument {argument}:" in err[1]
    assert not (tmp_path / "o").exists()


def test_missing_or_damaged_checkpoint_exits_1_with_one_line(run_dir, tmp_path, capsys):
    def fails(path, says):
        assert main(["--checkpoint", str(path), "--lengths", "128", "--out", str(tmp_path / "o")]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
        assert not (tmp_path / "o").exists()

    fails(tmp_path / "nope", "no such file or directory")
    (tmp_path / "empty").mkdir()
    fails(tmp_path / "empty", "no ckpt_*.pt")
    damaged = tmp_path / "damaged"
    shutil.copytree(run_dir / "checkpoints", damaged)
    ckpt = next(damaged.glob("ckpt_*.pt"))
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    fails(ckpt, "truncated")
    fails(damaged, "no intact checkpoint")


def test_script_refuses_bad_arguments_from_another_directory(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "eval_passkey.py"), "--checkpoint", "x",
                        "--depths", "2"], cwd=tmp_path, capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    usage, error = p.stderr.strip().splitlines()
    assert usage.startswith("usage: eval_passkey") and error.endswith("argument --depths: 2.0 is not a fraction in [0, 1]")

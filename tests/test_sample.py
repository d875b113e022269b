"""Sampling (minigpt/sample.py, `minigpt-sample`, scripts/sample.py): from a run directory or a checkpoint file, of
byte-level (passkey) and BPE (data=text) runs; greedy is the model's argmax, a seed repeats a sample, the context is
cropped to the trained seq_len, the run's tokenizer is kept in its directory; a missing path, a damaged and an
unsafe checkpoint each end with one line and their exit code."""
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import minigpt.checkpoint as checkpoint
from conftest import ROOT
from minigpt.checkpoint import list_checkpoints, load_checkpoint
from minigpt.compose import compose
from minigpt.config import ModelConfig
from minigpt.attention import get_attention
from minigpt.data import TOKENIZER_FILE
from minigpt.model import GPT
from minigpt.run import run
from minigpt.sample import SampleError, find_tokenizer, generate, load_sampler, main, sample_texts
from test_checkpoint import plant

SEQ_LEN = 128


def argmax_loop(model, ids: list[int], n: int, seq_len: int, vocab: int) -> list[int]:
    """Greedy decoding written out directly: the argmax of the model's last-position logits, n times."""
    idx = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            logits = model.head(model.hidden(idx[:, -seq_len:]))[0, -1, :vocab]
            idx = torch.cat([idx, logits.argmax().view(1, 1)], dim=1)
    return idx[0, len(ids):].tolist()


def one_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def sample_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "sample.py"), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_generate_greedy_crop_and_a_missing_path(tmp_path, capsys):
    """(Fast: an untrained model.) Greedy is the argmax; a prompt longer than seq_len is cropped to its last seq_len
    tokens for every step; a seed repeats a sample; a missing path is one line and exit code 2."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(name="t", n_layer=1, n_head=2, n_embd=32), 64, get_attention("sdpa")).eval()
    seen = []
    hidden = model.hidden
    model.hidden = lambda idx, *a, **kw: (seen.append(idx.shape[1]), hidden(idx, *a, **kw))[1]
    prompt = torch.randint(0, 64, (1, 40))
    out = generate(model, prompt, 12, seq_len=16, temperature=0)
    assert out[0, :40].tolist() == prompt[0].tolist() and max(seen) == 16  # never more than seq_len tokens
    assert out[0, 40:].tolist() == argmax_loop(model, prompt[0].tolist(), 12, 16, 64)
    draws = [generate(model, prompt, 8, 16, 1.0, 5, generator=torch.Generator().manual_seed(s)) for s in (1, 1, 2)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert generate(model, prompt, 20, 16, 1.0, None, vocab_size=10)[0, 40:].max() < 10  # the tokenizer's ids only

    assert main([str(tmp_path / "nothing")]) == 2
    assert "no such file or directory" in one_line(capsys)
    assert main([str(tmp_path)]) == 2  # a directory without checkpoints
    assert "no checkpoint there" in one_line(capsys)


# ------------------------------------------------------------------------------------------------
# trained runs (slow)
# ------------------------------------------------------------------------------------------------
def train(run_dir: Path, *overrides: str, cache: Path) -> Path:
    cfg = compose(["model=tiny", f"seq_len={SEQ_LEN}", "batch_size=2", "max_steps=4", "eval_batches=0",
                   "logger=none", "device=cpu", "warmup_steps=1", f"data.cache_dir={cache}", *overrides],
                  run_dir=str(run_dir))
    assert run(cfg) == 0
    return run_dir


@pytest.fixture(scope="module")
def passkey_run(tmp_path_factory):
    """A passkey run of 4 steps, checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("passkey")
    return train(tmp / "run", "ckpt_every=2", cache=tmp / "cache")


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A data=text run on a small local file (BPE trained on it), its checkpoints outside the run directory."""
    tmp = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(0)
    words = "the cat dog sat ran on a mat hat red blue big small house tree and then quickly slowly".split()
    text = "\n".join(" ".join(rng.choice(words, 12)).capitalize() + "." for _ in range(500))
    (tmp / "corpus.txt").write_text(text)
    return train(tmp / "run", "data=text", f"data.path={tmp / 'corpus.txt'}", "data.vocab_size=300",
                 f"ckpt_dir={tmp / 'elsewhere' / 'ckpts'}", cache=tmp / "cache")


@pytest.mark.slow
def test_passkey_run_samples_greedy_as_the_model_argmax_from_dir_and_file(passkey_run):
    state = load_checkpoint(list_checkpoints(passkey_run / "checkpoints")[-1])
    assert state["config"]["tokenizer"] == "bytes" and not (passkey_run / TOKENIZER_FILE).exists()
    s = load_sampler(passkey_run, "cpu")
    assert (s.step, s.seq_len, s.tokenizer.name, s.attention) == (4, SEQ_LEN, "bytes", "sdpa")
    prompt = "The pass key is"
    greedy = argmax_loop(s.model, list(prompt.encode()), 20, SEQ_LEN, 256)
    text = sample_texts(s, prompt, 20, temperature=0)[0]
    assert text == bytes(greedy).decode("utf-8", errors="replace")

    long_prompt = "The grass is green. " * 20  # 400 bytes > seq_len 128
    assert sample_texts(s, long_prompt, 10, temperature=0)[0] == bytes(
        argmax_loop(s.model, list(long_prompt.encode()), 10, SEQ_LEN, 256)).decode("utf-8", errors="replace")
    assert sample_texts(s, "", 5, temperature=0)[0] == bytes(argmax_loop(s.model, [10], 5, SEQ_LEN, 256)).decode(
        "utf-8", errors="replace")  # an empty prompt starts from a newline
    a, b = (sample_texts(s, prompt, 30, temperature=1.0, seed=7, num_samples=2) for _ in range(2))
    assert a == b and len(a) == 2

    by_dir = sample_cli(passkey_run, "--prompt", prompt, "--max-new-tokens", 20, "--temperature", 0)
    assert by_dir.returncode == 0 and "Traceback" not in by_dir.stderr, by_dir.stderr
    assert by_dir.stdout == prompt + text + "\n"
    seeded = sample_cli(list_checkpoints(passkey_run / "checkpoints")[-1], "--prompt", prompt, "--max-new-tokens", 30,
                        "--temperature", 1.0, "--seed", 7, "--num-samples", 2, "--device", "cpu")
    assert seeded.returncode == 0, seeded.stderr
    assert seeded.stdout == f"--- sample 1 of 2 ---\n{prompt}{a[0]}\n--- sample 2 of 2 ---\n{prompt}{a[1]}\n"


@pytest.mark.slow
def test_text_run_keeps_its_tokenizer_and_samples_from_dir_and_file(text_run):
    tokenizer = text_run / TOKENIZER_FILE
    assert tokenizer.is_file()
    assert tokenizer.read_text() in [p.read_text() for p in (text_run.parent / "cache").rglob("bpe-300-*.json")]
    ckpt = list_checkpoints(text_run.parent / "elsewhere" / "ckpts")[-1]
    assert load_checkpoint(ckpt)["config"]["tokenizer"] == str(tokenizer.resolve())
    assert not (text_run / "checkpoints").exists()

    s = load_sampler(text_run, "cpu")  # its checkpoint found through the run's summary.json
    assert s.checkpoint.resolve() == ckpt.resolve() and s.tokenizer.name == str(text_run / TOKENIZER_FILE)
    prompt = "The cat sat"
    ids = s.tokenizer.encode(prompt)
    greedy = argmax_loop(s.model, ids, 15, SEQ_LEN, s.tokenizer.vocab_size)
    text = sample_texts(s, prompt, 15, temperature=0)[0]
    assert text == s.tokenizer.decode(greedy)
    from tokenizers import Tokenizer
    eot = Tokenizer.from_file(str(tokenizer)).token_to_id("<|endoftext|>")
    assert s.tokenizer.start == eot  # an empty prompt starts from the document separator

    # the file alone (its directory holds no tokenizer): the tokenizer the checkpoint names
    p = sample_cli(ckpt, "--prompt", prompt, "--max-new-tokens", 15, "--temperature", 0)
    assert p.returncode == 0 and p.stdout == prompt + text + "\n", p.stderr
    with pytest.raises(SampleError, match="tokenizer is not there"):
        find_tokenizer({"tokenizer": str(text_run / "gone.json"), "data": {"name": "text"}}, text_run / "nowhere")


@pytest.mark.slow
def test_damaged_newest_falls_back_and_damaged_only_is_exit_1(passkey_run, tmp_path, capsys):
    run_dir = shutil.copytree(passkey_run, tmp_path / "run")
    newest, older = list_checkpoints(run_dir / "checkpoints")[::-1]
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated
    notes = []
    assert load_sampler(run_dir, "cpu", warn=notes.append).checkpoint == older
    assert len(notes) == 1 and "skipping damaged" in notes[0] and "sampling from" in notes[0]
    assert main([str(newest)]) == 1
    assert "truncated" in one_line(capsys)
    older.write_bytes(older.read_bytes()[:1000])
    assert main([str(run_dir)]) == 1
    assert "no intact checkpoint" in one_line(capsys)


@pytest.mark.slow
def test_an_unsafe_checkpoint_is_refused_and_never_run(passkey_run, tmp_path, capsys):
    ckpt_dir = tmp_path / "checkpoints"
    ckpt_dir.mkdir()
    marker = tmp_path / "ran"
    planted = plant(ckpt_dir / "ckpt_00000009.pt", marker)
    for path in (planted, ckpt_dir):
        assert main([str(path)]) == 2
        assert "refused" in one_line(capsys)
    assert not marker.exists()


@pytest.mark.slow
def test_a_flash_checkpoint_samples_with_sdpa_on_cpu(passkey_run, tmp_path):
    state = dict(load_checkpoint(list_checkpoints(passkey_run / "checkpoints")[-1]))
    state["config"] = {**state["config"], "attention": {"name": "flash", "sdpa_backend": "auto",
                                                        "deterministic": False}}
    path = checkpoint._write(tmp_path / "ckpt_00000004.pt", state)
    notes = []
    s = load_sampler(path, "cpu", warn=notes.append)
    assert s.attention == "sdpa" and len(notes) == 1 and "attention=flash" in notes[0] and "sdpa" in notes[0]
    reference = load_sampler(passkey_run, "cpu")
    assert sample_texts(s, "The pass", 10, temperature=0) == sample_texts(reference, "The pass", 10, temperature=0)

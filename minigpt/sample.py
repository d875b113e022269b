"""Text from a trained model: `minigpt-sample PATH [--prompt TEXT] [options]` (= `python scripts/sample.py`).

    python scripts/sample.py runs/quickstart --prompt "The pass key is" --max-new-tokens 64
    python scripts/sample.py runs/quickstart/checkpoints/ckpt_00000300.pt --temperature 0      # greedy
    python scripts/sample.py runs/story --prompt "Once upon a time" --num-samples 3 --seed 1

PATH is a run directory (its newest intact checkpoint, wherever the run's ckpt_dir was: its checkpoints/, the
ckpt_dir in Hydra's record .hydra/config.yaml, and the checkpoint its summary.json records), a checkpoints
directory, or a checkpoint file. A damaged newest checkpoint is skipped for the next older one, with a warning.

The tokenizer: "bytes" (a byte is a token) for byte-level data (passkey); otherwise the run's tokenizer.json,
which training saves into the run directory and checkpoints name. It is read from PATH's run directory, else
from the file the checkpoint names, else from the checkpoint's data.tokenizer.

Decoding: each new token is drawn from the model's next-token distribution at the last position, divided by
--temperature (0: greedy, the argmax) and cut to the --top-k most likely tokens (0: all); the model sees at most
the trained seq_len tokens (a longer prompt or text is cropped to its last seq_len tokens: RoPE positions
0..seq_len-1, as in training). An empty prompt starts from the tokenizer's document separator <|endoftext|>
(BPE), or from a newline (bytes); the start token is not printed. A checkpoint trained with attention=flash or flex
samples with attention=sdpa where that cannot run (no GPU, no Triton), and says so in one line.

Output: the prompt and its continuation on stdout, each of --num-samples preceded by a `--- sample i of M ---`
line when M > 1; what was loaded, and notes, on stderr.
Exit codes: 0 done; 1 a damaged checkpoint (no intact one beside it); 2 a bad argument, a missing or unusable
PATH (no checkpoint there, no tokenizer, an unknown vocabulary), or a checkpoint that would need code to load.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from minigpt.attention import AttentionBackend, attention_names, get_attention
from minigpt.checkpoint import (CheckpointError, CheckpointState, UnsafeCheckpointError, list_checkpoints,
                                load_checkpoint, newest_intact, resume_candidates, step_of)
from minigpt.config import AttentionConfig, ConfigError, ModelConfig
from minigpt.data import BYTES, EOT, TOKENIZER_FILE, document_ids

CHECKPOINTS = "checkpoints"  # a run's default ckpt_dir (configs: ${run_dir}/checkpoints)
BYTES_START = "\n"  # where an empty prompt starts with byte tokens (passkey text has no separator of its own)


class SampleError(ConfigError):
    """A path or setting sampling cannot use (exit code 2): one line naming it and what to give instead."""


# --------------------------------------------------------------------------------------------
# finding the checkpoint
# --------------------------------------------------------------------------------------------
def _hydra_ckpt_dir(run_dir: Path) -> Path | None:
    """ckpt_dir as Hydra recorded it for the run (.hydra/config.yaml), with ${run_dir} put in; None if unknown."""
    import yaml

    try:
        value = (yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text()) or {}).get("ckpt_dir")
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None
    if not isinstance(value, str):
        return None
    value = value.replace("${run_dir}", str(run_dir))
    return None if "${" in value else Path(value)


def run_checkpoints(run_dir: Path) -> list[Path]:
    """A run's checkpoints, oldest first: in its checkpoints/ and the ckpt_dir Hydra recorded, and the one its
    summary records if newer (what resume=auto chooses from: checkpoint.resume_candidates)."""
    dirs = [run_dir / CHECKPOINTS, *filter(None, [_hydra_ckpt_dir(run_dir)])]
    found = {p.resolve(): p for d in dirs for p in resume_candidates(d, run_dir)}
    return sorted(found.values(), key=step_of)


def find_checkpoint(path: Path, warn: Callable[[str], None]) -> tuple[Path, CheckpointState, Path]:
    """(checkpoint file, its state, the run directory to look for the tokenizer in) for PATH: a checkpoint file, a
    checkpoints directory or a run directory. SampleError for a path without a checkpoint, CheckpointError when
    none is intact, UnsafeCheckpointError for one that would need code to load."""
    if not path.exists():
        raise SampleError(f"{path}: no such file or directory; give a run directory or a checkpoint file")
    if path.is_file():
        run_dir = path.parent.parent if path.parent.name == CHECKPOINTS else path.parent
        return path, load_checkpoint(path), run_dir
    direct = [p for p in list_checkpoints(path) if p.is_file()]  # a checkpoints directory
    candidates = direct or run_checkpoints(path)
    if not candidates:
        raise SampleError(f"{path}: no checkpoint there (ckpt_*.pt); give a run directory that saved one (a run "
                          f"with save_checkpoints=true), its checkpoints/ or a checkpoint file")
    ckpt, state = newest_intact(candidates, warn=lambda m: warn(m.replace("resuming from", "sampling from")))
    return ckpt, state, path.parent if direct else path


# --------------------------------------------------------------------------------------------
# the tokenizer
# --------------------------------------------------------------------------------------------
@dataclass
class Tokenizer:
    """Text <-> token ids for sampling: `name` is "bytes" or the tokenizer file read; `start` is the token an empty
    prompt starts from."""

    name: str
    vocab_size: int
    start: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def byte_tokenizer() -> Tokenizer:
    return Tokenizer(BYTES, 256, ord(BYTES_START), lambda text: list(text.encode("utf-8")),
                     lambda ids: bytes(ids).decode("utf-8", errors="replace"))


def bpe_tokenizer(path: Path) -> Tokenizer:
    """A `tokenizers` JSON file (what training saves into the run directory); SampleError if it is not one."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for unreadable or malformed files
        raise SampleError(f"{path}: not a tokenizer JSON file ({str(e).strip().splitlines()[0][:100]})") from e
    eot = tok.token_to_id(EOT)
    start = eot if eot is not None else (tok.encode("\n").ids or [0])[0]
    return Tokenizer(str(path), tok.get_vocab_size(), start, lambda text: tok.encode(text).ids,
                     lambda ids: tok.decode(ids, skip_special_tokens=False))


def find_tokenizer(config: dict[str, Any], run_dir: Path) -> Tokenizer:
    """The run's tokenizer: bytes, or the first tokenizer file found of run_dir/tokenizer.json, the file the
    checkpoint names, the checkpoint's run_dir/tokenizer.json and its data.tokenizer."""
    named, data = config.get("tokenizer"), config.get("data") or {}
    if named == BYTES or (named is None and data.get("name") == "passkey"):
        return byte_tokenizer()
    places = [run_dir / TOKENIZER_FILE, named, config.get("run_dir") and Path(config["run_dir"]) / TOKENIZER_FILE,
              data.get("tokenizer")]
    for place in (Path(p).expanduser() for p in places if p):
        if place.is_file():
            return bpe_tokenizer(place)
    tried = ", ".join(dict.fromkeys(str(p) for p in places if p))
    raise SampleError(f"{run_dir}: the run's tokenizer is not there (tried {tried}); sample from the run directory "
                      f"that holds its {TOKENIZER_FILE}")


# --------------------------------------------------------------------------------------------
# the model and the decoding loop
# --------------------------------------------------------------------------------------------
@dataclass
class Sampler:
    """A checkpoint's model, ready to sample from, with its tokenizer and trained context length."""

    model: Any  # minigpt.model.GPT, in eval mode on `device`
    tokenizer: Tokenizer
    seq_len: int
    device: torch.device
    dtype: torch.dtype
    checkpoint: Path
    step: int
    attention: str
    separator: int | None = None  # trained with data.document_mask: the separator that ends a document


def model_from_checkpoint(state: dict[str, Any], attention: str | None, path: Path,
                          rope: dict[str, Any] | None = None) -> tuple[torch.nn.Module, AttentionBackend]:
    """The GPT of the checkpoint's config and weights (on CPU) with the named attention backend (default: the
    checkpoint's, with its options); vocab from the weights. `rope`: model.rope_* keys to evaluate with instead of
    the checkpoint's (a length extension at evaluation; ConfigError if they make no sense). Returns (model, backend)."""
    from minigpt.model import GPT

    config = state.get("config") or {}
    saved = config.get("model") or {}
    try:
        cfg = ModelConfig(**{f.name: saved[f.name] for f in fields(ModelConfig) if f.name in saved})
        cfg.validate()
        vocab = state["model"]["wte.weight"].shape[0]
    except (TypeError, KeyError, ConfigError, AttributeError) as e:
        raise CheckpointError(f"{path}: its model config or weights are incomplete ({type(e).__name__}: {e})") from e
    if rope:
        cfg = replace(cfg, **rope)
        cfg.validate()
    saved_attention = AttentionConfig(**(config.get("attention") or {}))
    name = attention or saved_attention.name
    backend = get_attention(name, **(saved_attention.options() if name == saved_attention.name else {}))
    model = GPT(cfg, vocab, backend)
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, KeyError) as e:
        raise CheckpointError(f"{path}: the weights do not fit its own config ({str(e).splitlines()[0][:120]})") from e
    return model, backend


def runnable_attention(config: dict[str, Any], device: torch.device, dtype: torch.dtype, path: Path,
                       warn: Callable[[str], None]) -> str:
    """The attention the checkpoint was trained with, or sdpa (the same weights and math, one line through `warn`)
    where that is flash or flex and cannot run here. SampleError for a backend this minigpt does not have."""
    trained = (config.get("attention") or {}).get("name", "sdpa")
    if trained not in attention_names():
        raise SampleError(f"{path}: trained with attention={trained}, which this minigpt does not have")
    if trained in ("flash", "flex"):
        saved = config.get("model") or {}
        head_dim = int(saved.get("n_embd", 0)) // max(1, int(saved.get("n_head", 1)))
        reason = "no GPU here" if device.type != "cuda" else get_attention(trained).unsupported(device, dtype, head_dim)
        if reason:
            warn(f"note: trained with attention={trained}, which cannot run here ({reason.split(';')[0]}); using "
                 f"attention=sdpa (the same weights and math)")
            return "sdpa"
    return trained


def load_sampler(path: str | Path, device: str = "auto", warn: Callable[[str], None] = print) -> Sampler:
    """The model of PATH's checkpoint (see the module docstring) on `device` (auto | cpu | cuda), with its tokenizer.
    A flash- or flex-trained model gets attention=sdpa where that cannot run (one line through `warn`)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SampleError("--device cuda: no CUDA GPU is visible; use --device cpu (or auto)")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ckpt, state, run_dir = find_checkpoint(Path(path), warn)
    config = state.get("config") or {}
    tokenizer = find_tokenizer(config, run_dir)
    attention = runnable_attention(config, dev, dtype, ckpt, warn)
    model, _ = model_from_checkpoint(state, attention, ckpt)
    if tokenizer.vocab_size > model.vocab_size:
        raise SampleError(f"{ckpt}: its model has {model.vocab_size} tokens, fewer than the tokenizer "
                          f"{tokenizer.name} ({tokenizer.vocab_size}): not this run's tokenizer")
    seq_len = config.get("seq_len")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise SampleError(f"{ckpt}: its config does not say the trained seq_len; not a minigpt training checkpoint")
    model.to(dev).eval()
    separator = tokenizer.start if (config.get("data") or {}).get("document_mask") else None  # <|endoftext|>
    return Sampler(model, tokenizer, seq_len, dev, dtype, ckpt, int(state["step"]), attention, separator)


def next_token_logits(model: Any, idx: Tensor, seq_len: int, dtype: torch.dtype = torch.float32,
                      separator: int | None = None) -> Tensor:
    """The model's logits (B, vocab) for the token after idx (B, N), from at most its last seq_len tokens; with a
    `separator` (a model trained with data.document_mask) each token attends within its document, as in training."""
    window = idx[:, -seq_len:]
    ids = None if separator is None else document_ids(window, separator)
    with torch.autocast(idx.device.type, dtype=dtype, enabled=dtype != torch.float32):
        return model.head(model.hidden(window, document_ids=ids)[:, -1]).float()  # the LM head at one position only


@torch.no_grad()
def generate(model: Any, idx: Tensor, max_new_tokens: int, seq_len: int, temperature: float = 0.8,
             top_k: int | None = 200, vocab_size: int | None = None, generator: torch.Generator | None = None,
             dtype: torch.dtype = torch.float32, separator: int | None = None) -> Tensor:
    """idx (B, N) with max_new_tokens tokens appended, each drawn from the next-token distribution of the last
    seq_len tokens: softmax(logits / temperature) over the top_k most likely (None or 0: all), or the argmax when
    temperature is 0. Only the first vocab_size ids (the tokenizer's) can be drawn (a padded vocabulary has more).
    `separator`: as for next_token_logits."""
    for _ in range(max_new_tokens):
        logits = next_token_logits(model, idx, seq_len, dtype, separator)[:, :vocab_size]
        if temperature == 0:
            token = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k and top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)
        idx = torch.cat([idx, token], dim=1)
    return idx


def sample_texts(s: Sampler, prompt: str = "", max_new_tokens: int = 200, temperature: float = 0.8,
                 top_k: int | None = 200, seed: int | None = None, num_samples: int = 1) -> list[str]:
    """num_samples continuations (text, without the prompt) of `prompt`; the same seed gives the same texts."""
    ids = s.tokenizer.encode(prompt) if prompt else [s.tokenizer.start]
    generator = torch.Generator(s.device)
    if seed is None:
        generator.seed()  # a fresh random seed
    else:
        generator.manual_seed(seed)
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=s.device)
    out = generate(s.model, idx, max_new_tokens, s.seq_len, temperature, top_k, s.tokenizer.vocab_size, generator,
                   s.dtype, s.separator)
    return [s.tokenizer.decode(row[len(ids):].tolist()) for row in out]


# --------------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------------
def _at_least(low: float, kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sample", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s PATH [--prompt TEXT] [--max-new-tokens N] [--temperature T] "
                                      "[--top-k K] [--seed S] [--num-samples M] [--device auto|cpu|cuda]")
    p.add_argument("path", type=Path, metavar="PATH", help="a run directory, its checkpoints/, or a ckpt_*.pt")
    p.add_argument("--prompt", default="", help="text to continue (default: empty, start from the separator)")
    p.add_argument("--max-new-tokens", type=_at_least(0, int), default=200, metavar="N")
    p.add_argument("--temperature", type=_at_least(0, float), default=0.8, metavar="T", help="0: greedy (argmax)")
    p.add_argument("--top-k", type=_at_least(0, int), default=200, metavar="K",
                   help="draw from the K most likely tokens (0: all)")
    p.add_argument("--seed", type=int, metavar="S", help="the same seed gives the same samples (default: random)")
    p.add_argument("--num-samples", type=_at_least(1, int), default=1, metavar="M")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    return p


def main(argv: list[str] | None = None) -> int:
    """`minigpt-sample` / scripts/sample.py: returns the exit code (0 ok, 1 damaged checkpoint, 2 bad path or
    argument, or an unsafe checkpoint)."""
    args = build_parser().parse_args(argv)

    def note(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        s = load_sampler(args.path, args.device, warn=note)
    except (SampleError, UnsafeCheckpointError) as e:  # a path or file refused (an unsafe one never loaded)
        note(f"error: {e}")
        return 2
    except CheckpointError as e:
        note(f"error: {e}")
        return 1
    n_prompt = len(s.tokenizer.encode(args.prompt)) if args.prompt else 0
    note(f"{s.checkpoint}: {s.model.cfg.name} step {s.step}, {s.model.num_params() / 1e6:.2f}M parameters, "
         f"attention={s.attention}, seq_len {s.seq_len}, tokenizer {s.tokenizer.name}, device {s.device.type}")
    if n_prompt > s.seq_len:
        note(f"note: the prompt is {n_prompt} tokens, longer than the trained seq_len {s.seq_len}: the model sees "
             f"its last {s.seq_len}")
    texts = sample_texts(s, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                         args.num_samples)
    for i, text in enumerate(texts, 1):
        if len(texts) > 1:
            print(f"--- sample {i} of {len(texts)} ---")
        print(args.prompt + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

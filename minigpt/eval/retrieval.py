"""Passkey retrieval over a grid of context lengths × key depths: the measure of whether a model uses its context.

A cell (length L, depth d) holds `keys_per_cell` passkey sequences of L tokens, each with its own key, the needle at
depth d: the fraction of the filler before it (0 = first thing in the context, after the start token of a haystack
in a tokenizer's tokens; 1 = just before the question), to the nearest token. Keys are a pure function of (seed, L,
d, index), so two checkpoints are scored on the same keys. The model reads the text up to and including the
question's "The pass key is " and decodes the KEY_DIGITS digits greedily (argmax, each fed back); a cell's accuracy
is the share of keys it reproduces exactly, its digit accuracy the share of digits right in place.

Decoding writes into a fixed (B, L) buffer: the prompt, then KEY_DIGITS slots. Step i reads the logits at the
position before slot i and writes their argmax into it. Attention is causal, so the slots not yet written cannot
change that position's logits: this is exactly greedy decoding, and every forward has the shape of a training
sequence of length L (one shape per length, so compiled regions are not recompiled at every step).

For exact match, greedy decoding agrees with the argmax of one teacher-forced forward at the answer positions
(what training's `eval/passkey_acc` measures): if every teacher-forced argmax is the key's digit, greedy sees the
same inputs at every step, and the converse by the same induction; only ties and rounding can tell them apart.
Greedy costs KEY_DIGITS forwards instead of one, and says what the model answered (`answers` in the JSON).

The haystack around the needle is the synthetic filler in bytes (FillerBytes, what training's passkey data is) unless
another is given: minigpt/eval/haystack.py makes haystacks of any tokenizer's tokens (the filler, or held-out pycode
text), whose answer is the key's text after the question (" 12345" for a BPE) in up to KEY_SLOTS tokens.

The trainer logs a small grid at each eval (`passkey_grid=<keys per cell>`); `minigpt-eval PATH --passkey-grid`
(minigpt/eval/passkey_grid.py) scores any checkpoint over a larger one and draws the heatmap.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from minigpt.data import PasskeyData

DEFAULT_DEPTHS = tuple(i / 10 for i in range(11))
DEFAULT_KEYS_PER_CELL = 20


def cell_rng(seed: int, length: int, depth: float, index: int) -> np.random.Generator:
    """The generator of one key: a pure function of (seed, length, depth, index); depth to a millionth."""
    return np.random.default_rng([seed, length, round(depth * 1_000_000), index])


def cell_prompts(length: int, depth: float, keys: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, length - KEY_DIGITS) prompt tokens and the (keys, KEY_DIGITS) digit tokens that should follow."""
    data = PasskeyData(seq_len=length, seed=seed)
    pairs = [data.prompt(cell_rng(seed, length, depth, i), depth) for i in range(keys)]
    return np.stack([p for p, _ in pairs]), np.stack([k for _, k in pairs])


def _text(tokens: Sequence[int]) -> str:
    return "".join(chr(t) if 32 <= t < 127 else "?" for t in tokens)


class Haystack(Protocol):
    """Where the needle hides: the prompts of a cell, and how to read tokens as text."""

    name: str
    answer_tokens: int  # tokens decoded after each prompt

    def cell(self, length: int, depth: float, keys: int, seed: int) -> tuple[np.ndarray, list[str]]:
        """(keys, length - answer_tokens) prompt tokens and the text each key's answer should start with."""
        ...

    def text(self, tokens: Sequence[int]) -> str:
        ...


class FillerBytes:
    """Training's passkey data (byte tokens, synthetic filler): the answer is the key's KEY_DIGITS digits."""

    name = "filler"
    answer_tokens = PasskeyData.KEY_DIGITS

    def cell(self, length: int, depth: float, keys: int, seed: int) -> tuple[np.ndarray, list[str]]:
        prompts, digits = cell_prompts(length, depth, keys, seed)
        return prompts, [_text(k) for k in digits]

    def text(self, tokens: Sequence[int]) -> str:
        return _text(tokens)


def score_answer(answer: str, expected: str) -> tuple[bool, int]:
    """(exact match, digits right in place): the answer starts with the expected text and no digit follows it;
    digits are compared where the expected text has one (a missing character is wrong)."""
    exact = answer.startswith(expected) and not answer[len(expected) : len(expected) + 1].isdigit()
    right = sum(i < len(answer) and answer[i] == c for i, c in enumerate(expected) if c.isdigit())
    return exact, right


@torch.no_grad()
def greedy_decode(model: torch.nn.Module, prompts: Tensor, n: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The n tokens greedy decoding appends to prompts (B, P), each forward over the fixed (B, P + n) buffer."""
    B, P = prompts.shape
    buf = torch.cat([prompts, prompts.new_zeros(B, n)], dim=1)  # slots: not seen by the positions before them
    for i in range(n):
        with torch.autocast(prompts.device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model.head(model.hidden(buf)[:, P - 1 + i])  # the LM head at one position: no N×vocab logits
        buf[:, P + i] = logits.argmax(dim=-1)
    return buf[:, P:]


def summarize(cells: list[dict[str, Any]], keys_per_cell: int, seed: int, trained_length: int | None) -> dict[str, Any]:
    """The grid's JSON from its cells: settings, cells, and the means over all cells, by length and by depth."""
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    mean = lambda rows: float(np.mean([c["accuracy"] for c in rows])) if rows else None  # noqa: E731
    return {"lengths": lengths, "depths": depths, "keys_per_cell": keys_per_cell, "seed": seed,
            "trained_length": trained_length, "cells": cells, "mean_accuracy": mean(cells),
            "by_length": {str(n): mean([c for c in cells if c["length"] == n]) for n in lengths},
            "by_depth": {str(d): mean([c for c in cells if c["depth"] == d]) for d in depths}}


def passkey_grid(model: torch.nn.Module, lengths: Sequence[int], depths: Sequence[float] = DEFAULT_DEPTHS,
                 keys_per_cell: int = DEFAULT_KEYS_PER_CELL, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0, batch_size: int = 8,
                 trained_length: int | None = None, progress: Callable[[dict], None] | None = None,
                 haystack: Haystack | None = None) -> dict[str, Any]:
    """Exact-match passkey accuracy of `model` (anything with `hidden(idx)` and `head(h)`) in every (length, depth)
    cell of `haystack` (default: FillerBytes); the model is left in the train/eval mode it came in. Returns a
    JSON-ready dict: `cells` (one per length and depth: accuracy, digit_accuracy, hits, keys, the keys and the
    answers), `mean_accuracy` (over all cells), `by_length` and `by_depth` means, and the grid's settings. Raises
    DataError for a length too short to hold the task or a depth outside [0, 1]."""
    if keys_per_cell < 1 or batch_size < 1 or not lengths or not depths:
        raise ValueError(f"passkey_grid: keys_per_cell={keys_per_cell} and batch_size={batch_size} must be >= 1, "
                         f"lengths and depths not empty")
    haystack = haystack or FillerBytes()
    lengths, depths = sorted(set(int(n) for n in lengths)), sorted(set(float(d) for d in depths))
    device = torch.device(device)
    was_training = model.training
    model.eval()
    cells = []
    try:
        for length in lengths:
            # every prompt of a length has length - answer_tokens tokens: batch them across depths
            made = [haystack.cell(length, d, keys_per_cell, seed) for d in depths]
            prompts, expected = np.concatenate([p for p, _ in made]), [e for _, keys in made for e in keys]
            answers = np.concatenate([
                greedy_decode(model, torch.from_numpy(prompts[i : i + batch_size].astype(np.int64)).to(device),
                              haystack.answer_tokens, dtype).cpu().numpy()
                for i in range(0, len(prompts), batch_size)])
            for j, depth in enumerate(depths):
                rows = range(j * keys_per_cell, (j + 1) * keys_per_cell)
                said = [haystack.text(answers[r]) for r in rows]
                scores = [score_answer(a, expected[r]) for a, r in zip(said, rows)]
                digits = sum(c.isdigit() for c in expected[rows[0]])
                hits = sum(exact for exact, _ in scores)
                cell = {"length": length, "depth": depth, "accuracy": hits / keys_per_cell,
                        "digit_accuracy": sum(right for _, right in scores) / (digits * keys_per_cell),
                        "hits": hits, "keys": keys_per_cell, "expected": [expected[r] for r in rows], "answers": said}
                cells.append(cell)
                if progress:
                    progress(cell)
    finally:
        model.train(was_training)
    return summarize(cells, keys_per_cell, seed, trained_length)

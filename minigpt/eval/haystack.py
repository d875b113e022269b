"""Haystacks of any tokenizer's tokens for the passkey grid: the synthetic filler, or held-out pycode text.

Training's passkey data is bytes (retrieval.FillerBytes); a model trained on pycode reads BPE tokens, so its grid is
built here in its own tokens. A prompt of length L is

    start + haystack[:cut] + needle + haystack[cut:] + question        (L - KEY_SLOTS tokens; passkey_tokens)

with the needle and question of data.PasskeyData, the question cut before the key: "... The pass key is", and
`start` the tokenizer's start token (the end-of-text separator before every document), as training's passkey rows
(minigpt/passkey_mix.py) begin: position 0, the attention sink, is never the needle, even at depth 0. Each piece
is tokenized on its own, so the needle and question are the same tokens at every depth and the prompt's length is
exact; cut = round(depth · haystack tokens). The answer is the key's text with its leading space (" 12345", one
pre-token of a byte-level BPE), decoded greedily in KEY_SLOTS = digits + 1 tokens (no tokenizer needs more: every
token holds at least one character); retrieval.score_answer says whether it starts with the key. Keys are the same
pure function of (seed, length, depth, index) as FillerBytes's.

The haystack text: `filler` repeats data.FILLER (tokenized as 8 repeats, tiled); `pycode` is the held-out documents
(minigpt/eval/heldout.py) joined by the tokenizer's start token, read from an offset drawn per key.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from minigpt.data import FILLER, DataError, PasskeyData
from minigpt.eval.retrieval import cell_rng
from minigpt.passkey_mix import passkey_tokens

KEY_SLOTS = PasskeyData.KEY_DIGITS + 1  # " 12345": the space and five digits, at most one token each
QUESTION = " What is the pass key? The pass key is"


class TokenHaystack:
    """Passkey prompts in a tokenizer's tokens around a haystack drawn by `source(rng, n) -> n tokens`."""

    answer_tokens = KEY_SLOTS

    def __init__(self, name: str, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 source: Callable[[np.random.Generator, int], np.ndarray], start: int):
        self.name, self.encode, self.decode, self.source = name, encode, decode, source
        self.start = start  # the first token of every prompt
        self.question = np.asarray(encode(QUESTION), dtype=np.int64)

    def cell(self, length: int, depth: float, keys: int, seed: int) -> tuple[np.ndarray, list[str]]:
        if not 0.0 <= depth <= 1.0:
            raise DataError(f"depth={depth}: must be a fraction of the haystack in [0, 1]")
        prompts, expected = [], []
        for i in range(keys):
            rng = cell_rng(seed, length, depth, i)
            key = str(rng.integers(10 ** (PasskeyData.KEY_DIGITS - 1), 10**PasskeyData.KEY_DIGITS))
            needle = np.asarray(self.encode(PasskeyData.NEEDLE.format(key=key)), dtype=np.int64)
            n_hay = length - KEY_SLOTS - 1 - len(needle) - len(self.question)  # 1: the start token
            if n_hay < 0:
                raise DataError(f"length {length}: the passkey task needs at least "
                                f"{length - n_hay} tokens here (needle, question and key)")
            hay = self.source(rng, n_hay).astype(np.int64)
            prompts.append(passkey_tokens(self.start, hay, round(depth * n_hay), needle, self.question))
            expected.append(" " + key)
        return np.stack(prompts), expected

    def text(self, tokens: Sequence[int]) -> str:
        return self.decode([int(t) for t in tokens])


def tiled(tokens: np.ndarray) -> Callable[[np.random.Generator, int], np.ndarray]:
    """A source reading n tokens of `tokens` repeated without end, from a random phase."""
    def draw(rng: np.random.Generator, n: int) -> np.ndarray:
        offset = int(rng.integers(0, len(tokens)))
        reps = (offset + n) // len(tokens) + 1
        return np.tile(tokens, reps)[offset : offset + n]
    return draw


def filler_haystack(encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], start: int
                    ) -> TokenHaystack:
    """The synthetic filler in this tokenizer's tokens, after its start token."""
    return TokenHaystack("filler", encode, decode, tiled(np.asarray(encode(FILLER * 8), dtype=np.int64)), start)


def pycode_haystack(documents: Sequence[np.ndarray], start: int, encode: Callable[[str], list[int]],
                    decode: Callable[[list[int]], str]) -> TokenHaystack:
    """Held-out pycode text: the documents' tokens, each after the start token (as training's stream has them),
    read as one stream from a random offset (wrapping around)."""
    if not documents:
        raise DataError("the pycode haystack: no held-out documents")
    stream = np.concatenate([np.concatenate([[start], d]) for d in documents]).astype(np.int64)
    return TokenHaystack("pycode", encode, decode, tiled(stream), start)

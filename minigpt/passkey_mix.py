"""Passkey examples mixed into the training batches of a token stream (`data.passkey_fraction`).

Real text seldom makes a model fetch one exact fact from far back. A small share of passkey examples, in the run's
own tokens, teaches that retrieval, so that the passkey grid of `minigpt-eval` (filler and pycode haystacks) scores
a skill the model was given; the other rows, and every val batch, stay the stream's.

Which rows. Row r of training batch `index` is the global row k = index · batch_size + r; it is an example
when ⌊(k + 1)·f⌋ > ⌊k·f⌋. Any K consecutive rows then hold ⌊K·f⌋ or ⌈K·f⌉ examples, so the share of training tokens is f
to within one sequence at every point of training and at any batch size (every row has seq_len + 1 tokens). The
other rows are exactly the batch a run without mixing gets.

An example of n tokens (n = seq_len + 1):

    start + haystack[:cut] + needle + haystack[cut:] + question + answer      (passkey_tokens)

with the needle and question of the passkey task (data.PasskeyData; the question is minigpt-eval's, cut before the
key), the answer " 12345." after it, each tokenized on its own as minigpt-eval's haystacks do (so the grid's prompts
are tokens the model trained on). The haystack is, by a coin flip, the filler (tokenized once, read from a random
phase) or a window of the training stream; `cut` is uniform over the haystack. `start` is the end-of-text separator,
the token before every document of the stream, so position 0 (the attention sink) is never the needle, even at cut
0, and minigpt-eval's prompts begin with it too. An example is one document: the trainer gives all its tokens
document id 0, so the question sees the needle whatever separators the stream window holds. The key and every draw are a pure function of (seed, index, row), as the rest of a batch is.

This module imports nothing of minigpt: data.py builds it with its texts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

KEY_DIGITS = 5
MIX_STREAM = 2  # the generator's stream id: 0 and 1 are the train and val windows (data._rng)


@dataclass
class PasskeyMix:
    """Makes and places the passkey examples of `fraction` of the training rows."""

    fraction: float
    seed: int
    encode: Callable[[str], list[int]]  # text -> token ids, the run's tokenizer
    needle: str  # with {key}, e.g. " The pass key is {key}. Remember it. {key} is the pass key. "
    question: str  # ends where the key follows, e.g. " What is the pass key? The pass key is"
    answer: str  # with {key}, e.g. " {key}."
    filler: np.ndarray  # the filler text's tokens, read as a loop
    start: int  # the end-of-text separator: every example starts with it, as a document of the stream does

    def rows(self, index: int, batch_size: int) -> list[int]:
        """The rows of training batch `index` that are passkey examples."""
        f, first = self.fraction, index * batch_size
        return [r for r in range(batch_size) if math.floor((first + r + 1) * f) > math.floor((first + r) * f)]

    def min_tokens(self) -> int:
        """The shortest sequence an example fits in (needle, question and answer, every key digit its own token)."""
        key = "0" * KEY_DIGITS
        fixed = len(self.encode(self.needle.format(key=key))) + len(self.encode(self.question)) + \
            len(self.encode(self.answer.format(key=key)))
        return 1 + fixed + 3 * KEY_DIGITS  # the start token; the key appears three times, a digit may cost a token more

    def example(self, stream: np.ndarray, n: int, index: int, row: int) -> np.ndarray:
        """n tokens (int64): the example of training batch `index`, row `row`, its haystack from `stream` or the filler.
        ValueError if n is below what the needle, question and answer take."""
        rng = np.random.default_rng([self.seed, MIX_STREAM, index, row])
        key = str(rng.integers(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS))
        pieces = [np.asarray(self.encode(text), dtype=np.int64) for text in
                  (self.needle.format(key=key), self.question, self.answer.format(key=key))]
        n_hay = n - 1 - sum(len(p) for p in pieces)  # 1: the start token
        if n_hay < 0:
            raise ValueError(f"a passkey example needs {n - n_hay} tokens, more than {n}")
        if rng.random() < 0.5:
            phase = int(rng.integers(0, len(self.filler)))
            hay = np.tile(self.filler, (phase + n_hay) // len(self.filler) + 1)[phase : phase + n_hay]
        else:
            start = int(rng.integers(0, len(stream) - n_hay + 1))
            hay = np.asarray(stream[start : start + n_hay], dtype=np.int64)
        cut = int(rng.integers(0, n_hay + 1))
        needle, question, answer = pieces
        return passkey_tokens(self.start, hay, cut, needle, question, answer)


def passkey_tokens(start: int, haystack: np.ndarray, cut: int, needle: np.ndarray, question: np.ndarray,
                   answer: np.ndarray | None = None) -> np.ndarray:
    """start + haystack[:cut] + needle + haystack[cut:] + question (+ answer), int64: training's examples (with their
    answer) and minigpt-eval's prompts (without) in one layout, so the grid asks in the tokens the model trained on.
    The separator first: at cut 0 the needle would otherwise sit on the attention sink, position 0."""
    tail = [] if answer is None else [answer]
    return np.concatenate([[start], haystack[:cut], needle, haystack[cut:], question, *tail]).astype(np.int64)

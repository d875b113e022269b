"""The mask benchmark's cases (issue 33) and how much of the score matrix each one lets through.

A masked kernel can at best skip what the mask hides, so each case is judged against the visible (i, j) pairs it
must compute: `visible_pairs` counts them exactly in closed form (no N² tensor at 128K), and the FLOPs of the
visible area are 4·pairs·D·Hq·B forward, bwd = 2.5·fwd, fwd+bwd = 3.5·fwd (bench.py's convention, with the
diagonal counted: a dense causal row has N(N+1)/2 pairs, not N²/2).

Every case is causal. Documents and windows run at batch 1, hidden 2048 (heads = 2048 / head_dim), and documents
also at gpt2-small's 12 heads of 64 (one document filling the row, and the mix), the head count the trainer runs:
a schedule can balance 32 heads and not 12 (kernels/NOTES.md, session 25); GQA runs the
issue's head counts next to multi-head attention (MHA) with the same query heads. Each (N, D, query heads) of the
list also has a dense causal MHA case, the reference whose rate gives the ideal (mask_bench.py).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

GROUPS = ("causal", "documents", "window", "GQA")  # the table's sections
# The GQA shapes: (head_dim, query heads, K/V head counts).
GQA_SHAPES = ((64, 16, (4, 1)), (128, 8, (2,)))
MIX_SEED = 0


@dataclass(frozen=True)
class Sizes:
    """The lengths the suite runs at: FULL on the GPU, TINY for the CPU dry run (the same cases, scaled down).
    Block masks for FlexAttention are made by the eager create_block_mask up to `eager_block_mask_max_n` tokens and
    by a compiled one above (the eager one holds N² intermediates: 128 GiB of index differences at 128K)."""
    doc_n: int = 32768
    window_ns: tuple[int, ...] = (32768, 131072)
    windows: tuple[int, ...] = (1024, 4096)
    gqa_ns: tuple[int, ...] = (8192, 32768)
    head_dims: tuple[int, ...] = (64, 128)
    hidden: int = 2048
    eager_block_mask_max_n: int = 32768
    trainer_hidden: int = 768  # gpt2-small's, documents at head_dim 64 only (its 12 heads)


FULL = Sizes()
TINY = Sizes(doc_n=64, window_ns=(64, 128), windows=(4, 16), gqa_ns=(16, 32), hidden=128,
             eager_block_mask_max_n=64, trainer_hidden=192)


@dataclass(frozen=True)
class MaskCase:
    name: str
    group: str  # the table's section: "causal", "documents", "window" or "GQA" (with its MHA comparison)
    seq_len: int
    head_dim: int
    q_heads: int
    kv_heads: int
    window: int | None = None
    doc_lengths: tuple[int, ...] | None = None
    batch: int = 1

    @property
    def dense(self) -> bool:
        """Dense causal MHA: the reference for every case with the same (N, D, query heads)."""
        return self.window is None and self.doc_lengths is None and self.q_heads == self.kv_heads

    @property
    def ref_key(self) -> tuple[int, int, int]:
        return self.seq_len, self.head_dim, self.q_heads

    def pairs(self) -> int:
        """Visible (query, key) pairs of one head of one sequence."""
        return visible_pairs(self.seq_len, self.window, self.doc_lengths)

    def flops(self, mode: str) -> float:
        """FLOPs of the visible area; mode "fwd" or "fwd+bwd"."""
        fwd = 4.0 * self.pairs() * self.head_dim * self.q_heads * self.batch
        return {"fwd": fwd, "fwd+bwd": 3.5 * fwd}[mode]

    def document_ids(self, device: torch.device | str) -> torch.Tensor | None:
        """(batch, N) int32 ids 0, 0, ..., 1, 1, ...: document d covers doc_lengths[d] tokens."""
        if self.doc_lengths is None:
            return None
        ids = torch.repeat_interleave(torch.arange(len(self.doc_lengths), dtype=torch.int32),
                                      torch.tensor(self.doc_lengths))
        return ids.to(device).expand(self.batch, -1).contiguous()


def causal_pairs(n: int, window: int | None = None) -> int:
    """Pairs 0 <= j <= i < n with i − j < window: row i sees min(i + 1, window) keys."""
    if window is None or window >= n:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def visible_pairs(n: int, window: int | None = None, doc_lengths: tuple[int, ...] | None = None) -> int:
    """Causal pairs of an n-token sequence, within `window` and within each document (keys of earlier documents are
    hidden, so each document is a causal sequence of its own)."""
    lengths = doc_lengths or (n,)
    if sum(lengths) != n:
        raise ValueError(f"document lengths sum to {sum(lengths)}, not the sequence's {n}")
    return sum(causal_pairs(length, window) for length in lengths)


def mixed_doc_lengths(n: int, seed: int = MIX_SEED) -> tuple[int, ...]:
    """A realistic packed sequence: lengths drawn log-uniform between n/128 and n/4 (256..8K at 32K) with
    random.Random(seed) (stable across Python versions) until they reach n; the last one is cut to make the sum n."""
    rng = random.Random(seed)
    lo, hi = math.log(max(1, n // 128)), math.log(n // 4)
    lengths: list[int] = []
    while sum(lengths) < n:
        lengths.append(round(math.exp(rng.uniform(lo, hi))))
    lengths[-1] -= sum(lengths) - n
    return tuple(lengths)


def tokens(n: int) -> str:
    """1024 -> "1K", 131072 -> "128K", 300 -> "300"."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def mask_cases(sizes: Sizes = FULL) -> list[MaskCase]:
    """The issue's cases in the table's order: dense causal at hidden 2048 (and at the trainer's hidden, head_dim 64);
    documents (equal ones and a random mix; at the trainer's heads one filling the row and the mix); windows; GQA,
    each (D, Hq, N) with its MHA case first. Every reference the others need is in the list."""
    cases = []
    trainer_heads = sizes.trainer_hidden // 64
    for D in sizes.head_dims:
        H = sizes.hidden // D
        for N in sorted({sizes.doc_n, *sizes.window_ns}):
            cases.append(MaskCase("causal", "causal", N, D, H, H))
    cases.append(MaskCase("causal", "causal", sizes.doc_n, 64, trainer_heads, trainer_heads))
    N, mix = sizes.doc_n, mixed_doc_lengths(sizes.doc_n)
    for D in sizes.head_dims:
        H = sizes.hidden // D
        for count in (32, 8):
            cases.append(MaskCase(f"docs {count}x{tokens(N // count)}", "documents", N, D, H, H,
                                  doc_lengths=(N // count,) * count))
        cases.append(MaskCase(f"docs mix of {len(mix)}", "documents", N, D, H, H, doc_lengths=mix))
    cases.append(MaskCase(f"docs 1x{tokens(N)}", "documents", N, 64, trainer_heads, trainer_heads, doc_lengths=(N,)))
    cases.append(MaskCase(f"docs mix of {len(mix)}", "documents", N, 64, trainer_heads, trainer_heads,
                          doc_lengths=mix))
    for D in sizes.head_dims:
        H = sizes.hidden // D
        for N in sizes.window_ns:
            for W in sizes.windows:
                cases.append(MaskCase(f"window {tokens(W)}", "window", N, D, H, H, window=W))
    for D, Hq, kv_heads in GQA_SHAPES:
        for N in sizes.gqa_ns:
            cases.append(MaskCase("MHA", "GQA", N, D, Hq, Hq))
            cases += [MaskCase(f"GQA {Hq}/{Hkv}", "GQA", N, D, Hq, Hkv) for Hkv in kv_heads]
    return cases


def run_order(cases: list[MaskCase]) -> list[MaskCase]:
    """The dense references first (every ideal needs one), the others after, each group in table order."""
    return sorted(cases, key=lambda c: not c.dense)


def select(cases: list[MaskCase], groups: tuple[str, ...] | list[str]) -> list[MaskCase]:
    """The cases of `groups` and the dense references they need (a long suite can be run in parts)."""
    chosen = [c for c in cases if c.group in groups]
    needed = {c.ref_key for c in chosen}
    return [c for c in cases if c in chosen or (c.dense and c.ref_key in needed)]

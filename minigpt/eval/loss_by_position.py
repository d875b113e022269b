"""Loss by position: how a model's next-token loss on held-out documents falls (or not) as its context grows.

A document's tokens d_0 … d_{n-1} are read after the tokenizer's start token s (what precedes a document in
training's stream): the input x = [s, d_0, d_1, …] predicts d_0, d_1, … . The token d_p is at *position* p: it is
predicted from p tokens of its document (and s). At length L a document gives one window, x[0 : min(n, L)], which
scores positions 0 … min(n, L) − 1: a document of at least L tokens fills the window, a shorter one contributes to
the bins it reaches. (Attention is causal, so a position's loss does not depend on L beyond it: the curve at a
shorter length is the start of a longer one's, over the same documents.)

Positions fall in power-of-two bins [0, 1), [1, 2), [2, 4), …, [16K, 32K), …; each document gives, per bin, its
summed loss and its token count (`doc_sums`, `doc_tokens`: kept in the JSON so any two curves can be compared
document by document later). A bin's mean pools tokens over documents; its interval is bootstrap.py's.

The sliding-window baseline (`sliding(window, stride)`): a model is run on windows of `window` tokens starting every
`stride` tokens; the first window scores all its positions, each later one only its last `stride`, so every
position is scored exactly once, and beyond the first window each scored token sees between window − stride + 1
and window tokens (itself included). A 2K-trained model then has a loss at every position up to L, in the same
bins, from 1K–2K tokens of context.

The loss is computed from the model's hidden states a chunk of positions at a time (per-token cross entropy in
fp32, reduction none), so a 64K window never holds its (L, vocab) logits at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

LOGITS_BUDGET = 1 << 26  # fp32 logits made at once: 256 MB


# --------------------------------------------------------------------------------------------
# bins
# --------------------------------------------------------------------------------------------
def bin_edges(length: int) -> list[int]:
    """[0, 1, 2, 4, …, 2^k] with 2^k the first power of two ≥ length: the bins' edges for positions < length."""
    edges = [0, 1]
    while edges[-1] < length:
        edges.append(edges[-1] * 2)
    return edges


def bin_of(positions: np.ndarray) -> np.ndarray:
    """The bin index of each position: 0 for position 0, k for 2^(k-1) ≤ p < 2^k."""
    p = np.asarray(positions, dtype=np.int64)
    out = np.zeros(p.shape, dtype=np.int64)
    nz = p > 0
    out[nz] = np.floor(np.log2(p[nz])).astype(np.int64) + 1  # exact at powers of two (float64)
    return out


def binned(losses: Sequence[np.ndarray], n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """(documents, bins) summed loss and token counts of per-document, per-position losses (position = index)."""
    sums, counts = np.zeros((len(losses), n_bins)), np.zeros((len(losses), n_bins), dtype=np.int64)
    for i, loss in enumerate(losses):
        b = bin_of(np.arange(len(loss)))
        sums[i] = np.bincount(b, weights=loss.astype(np.float64), minlength=n_bins)[:n_bins]
        counts[i] = np.bincount(b, minlength=n_bins)[:n_bins]
    return sums, counts


# --------------------------------------------------------------------------------------------
# windows
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Window:
    """Inputs x[start:end] of document `doc` (x = start token + its tokens); positions [score_from, end) scored."""

    doc: int
    start: int
    end: int
    score_from: int


def full_windows(n_tokens: Sequence[int], length: int) -> list[Window]:
    """One window per document: its first min(n, length) positions, all scored."""
    return [Window(i, 0, min(n, length), 0) for i, n in enumerate(n_tokens) if n > 0]


def sliding_windows(n_tokens: Sequence[int], length: int, window: int, stride: int) -> list[Window]:
    """Windows of `window` inputs every `stride` tokens over each document's first min(n, length) positions; the first
    scores all of its positions, each later one its last `stride` (fewer at the document's end)."""
    if not 0 < stride <= window:
        raise ValueError(f"sliding window {window}, stride {stride}: need 0 < stride <= window")
    out = []
    for i, n in enumerate(n_tokens):
        m = min(n, length)
        if m <= 0:
            continue
        out.append(Window(i, 0, min(window, m), 0))
        start = stride
        while out[-1].end < m:
            out.append(Window(i, start, min(start + window, m), start + window - stride))
            start += stride
    return out


# --------------------------------------------------------------------------------------------
# scoring
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def token_losses(model: torch.nn.Module, idx: Tensor, targets: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(B, N) per-token cross entropy of the model's next-token logits for idx (B, N) against targets (B, N), in
    fp32; the LM head runs LOGITS_BUDGET // (B · vocab) positions at a time (at least one)."""
    B, N = idx.shape
    chunk = max(1, LOGITS_BUDGET // (B * model.vocab_size))
    out = torch.empty(B, N, dtype=torch.float32, device=idx.device)
    with torch.autocast(idx.device.type, dtype=dtype, enabled=dtype != torch.float32):
        h = model.hidden(idx)  # (B, N, C)
        for i in range(0, N, chunk):
            logits = model.head(h[:, i : i + chunk]).float()  # (B, chunk, vocab)
            out[:, i : i + chunk] = F.cross_entropy(logits.transpose(1, 2), targets[:, i : i + chunk],
                                                    reduction="none")
    return out


def score_windows(model: torch.nn.Module, documents: Sequence[np.ndarray], start: int, windows: Sequence[Window],
                  device: torch.device, dtype: torch.dtype, batch_tokens: int,
                  progress: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """Per-document, per-position losses (float32, one per position the windows reach) of `model` (anything with
    `hidden(idx)`, `head(h)` and `vocab_size`), windows of equal length batched up to batch_tokens tokens. RuntimeError if the
    windows do not score each position they reach exactly once. `progress(n)` after each batch of n scored tokens.
    The model is left in the train/eval mode it came in."""
    reach = [0] * len(documents)
    for w in windows:
        reach[w.doc] = max(reach[w.doc], w.end)
    losses = [np.zeros(n, dtype=np.float32) for n in reach]
    times = [np.zeros(n, dtype=np.int64) for n in reach]
    sequences = [np.concatenate([[start], d]).astype(np.int64) for d in documents]
    order = sorted(windows, key=lambda w: (-(w.end - w.start), w.doc, w.start))
    was_training = model.training
    model.eval()
    try:
        i = 0
        while i < len(order):
            n = order[i].end - order[i].start
            batch = [w for w in order[i : i + max(1, batch_tokens // n)] if w.end - w.start == n]
            i += len(batch)
            rows = torch.from_numpy(np.stack([sequences[w.doc][w.start : w.end + 1] for w in batch])).to(device)
            loss = token_losses(model, rows[:, :-1], rows[:, 1:], dtype).cpu().numpy()
            for w, row in zip(batch, loss):
                losses[w.doc][w.score_from : w.end] = row[w.score_from - w.start :]
                times[w.doc][w.score_from : w.end] += 1
            if progress:
                progress(sum(w.end - w.score_from for w in batch))
    finally:
        model.train(was_training)
    bad = [d for d, t in enumerate(times) if (t != 1).any()]
    if bad:
        raise RuntimeError(f"loss by position: the windows scored some positions of document {bad[0]} "
                           f"{'twice' if (times[bad[0]] > 1).any() else 'never'}")
    return losses


# --------------------------------------------------------------------------------------------
# the trainer's periodic eval
# --------------------------------------------------------------------------------------------
def documents_from_stream(tokens: np.ndarray, separator: int, count: int) -> list[np.ndarray]:
    """The `count` longest documents of a token stream that has `separator` after each document (training's val
    stream), longest first. A document whose text held the separator's string is split there: the trainer's cheap
    source; `minigpt-eval` tokenizes the held-out documents one by one instead (heldout.py)."""
    cuts = np.flatnonzero(np.asarray(tokens) == separator)
    bounds = zip(np.concatenate([[0], cuts + 1]), np.concatenate([cuts, [len(tokens)]]))
    docs = [np.asarray(tokens[a:b], dtype=np.int64) for a, b in bounds if b > a]
    return sorted(docs, key=len, reverse=True)[:count]


def position_metrics(model: torch.nn.Module, documents: Sequence[np.ndarray], start: int, length: int,
                     device: torch.device, dtype: torch.dtype, prefix: str = "eval/loss_by_position") -> dict[str, float]:
    """Mean loss per position bin over the documents' first `length` tokens (no interval: a few documents, every
    eval), as {f"{prefix}/{lo}-{hi}": mean}, e.g. eval/loss_by_position/1024-2048. For the trainer's eval."""
    losses = score_windows(model, documents, start, full_windows([len(d) for d in documents], length), device,
                           dtype, batch_tokens=length)
    edges = bin_edges(length)
    sums, counts = binned(losses, len(edges) - 1)
    total, n = sums.sum(axis=0), counts.sum(axis=0)
    return {f"{prefix}/{edges[k]}-{edges[k + 1]}": float(total[k] / n[k]) for k in range(len(n)) if n[k]}

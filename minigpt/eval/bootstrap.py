"""Bootstrap intervals over documents for loss by position, and the issue's two goal figures.

Tokens of one document are not independent (a hard file is hard throughout), so the unit resampled is the
document: a resample draws D documents with replacement, and a statistic is recomputed from their per-bin summed
losses and token counts (pooled over tokens, as the point estimate is). All resamples at once: a (R, D) matrix of
how often each document was drawn, times the (D, bins) sums and counts. The interval is the percentile interval
(2.5 % and 97.5 % for 95 %); a fixed seed makes it repeatable. If every document has the same losses, every
resample gives the same value and the interval has width 0.

The goal figures (docs/long-context.md):
- range_difference: one model's mean over a far range minus its mean over a near range (default [16K, 32K) minus
  [1K, 2K)), over the documents that reach the far range, each document resampled with both of its ranges;
- paired_difference: model A minus model B over one range, over the documents both were scored on, paired (a
  resample draws a document for both models at once).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

RESAMPLES, LEVEL = 1000, 0.95


def resample_counts(n_docs: int, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """(resamples, n_docs): how often each document is drawn in each resample of n_docs draws with replacement."""
    draws = np.random.default_rng(seed).integers(0, n_docs, size=(resamples, n_docs))
    flat = (draws + n_docs * np.arange(resamples)[:, None]).ravel()
    return np.bincount(flat, minlength=resamples * n_docs).reshape(resamples, n_docs)


def pooled(weights: np.ndarray, sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Pooled means (weights @ sums) / (weights @ counts); NaN where a resample holds no token of a bin."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return (weights @ sums) / (weights @ counts)


def percentile_interval(samples: np.ndarray, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """The (1 - level)/2 and (1 + level)/2 percentiles along axis 0, ignoring NaN."""
    lo, hi = np.nanpercentile(samples, [50 * (1 - level), 50 * (1 + level)], axis=0)
    return lo, hi


def bin_intervals(sums: np.ndarray, counts: np.ndarray, resamples: int = RESAMPLES, seed: int = 0,
                  level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """Per-bin interval of the pooled mean, resampling documents: (low, high), each (bins,)."""
    with np.errstate(invalid="ignore"):  # a bin no resample reaches: NaN
        return percentile_interval(pooled(resample_counts(len(sums), resamples, seed), sums, counts), level)


def range_columns(edges: Sequence[int], lo: int, hi: int) -> list[int]:
    """The bins that make up positions [lo, hi); ValueError unless lo and hi are bin edges."""
    edges = list(edges)
    if lo not in edges or hi not in edges or lo >= hi:
        raise ValueError(f"positions [{lo}, {hi}): not a range of the bins (edges 0, 1, 2, 4, …, {edges[-1]})")
    return list(range(edges.index(lo), edges.index(hi)))


def _range(curve: dict[str, Any], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-document (sums, counts) over positions [lo, hi) of a curve (its JSON dict)."""
    cols = range_columns(curve["edges"], lo, hi)
    return (np.asarray(curve["doc_sums"], dtype=np.float64)[:, cols].sum(axis=1),
            np.asarray(curve["doc_tokens"], dtype=np.float64)[:, cols].sum(axis=1))


def _estimate(point: float, samples: np.ndarray, docs: int, level: float) -> dict[str, Any]:
    lo, hi = percentile_interval(samples, level)
    return {"estimate": float(point), "ci_low": float(lo), "ci_high": float(hi), "docs": int(docs)}


def range_difference(curve: dict[str, Any], far: tuple[int, int], near: tuple[int, int],
                     resamples: int = RESAMPLES, seed: int = 0, level: float = LEVEL) -> dict[str, Any] | None:
    """Mean loss over positions `far` minus over `near`, over the documents with tokens in both, with its bootstrap
    interval; None when no document reaches both (or the ranges are past the curve's bins)."""
    try:
        fs, fc = _range(curve, *far)
        ns, nc = _range(curve, *near)
    except ValueError:
        return None
    keep = (fc > 0) & (nc > 0)
    if not keep.any():
        return None
    fs, fc, ns, nc = fs[keep], fc[keep], ns[keep], nc[keep]
    w = resample_counts(len(fs), resamples, seed)
    samples = pooled(w, fs[:, None], fc[:, None])[:, 0] - pooled(w, ns[:, None], nc[:, None])[:, 0]
    return _estimate(fs.sum() / fc.sum() - ns.sum() / nc.sum(), samples, len(fs), level)


def paired_difference(a: dict[str, Any], b: dict[str, Any], positions: tuple[int, int], resamples: int = RESAMPLES,
                      seed: int = 0, level: float = LEVEL) -> dict[str, Any] | None:
    """Curve a's mean loss over `positions` minus curve b's, over the documents (by path) both have tokens there,
    with a paired bootstrap interval; None when they share none. ValueError if their tokenizers differ (per-token
    losses of two tokenizations are not comparable)."""
    if a.get("tokenizer") != b.get("tokenizer"):
        raise ValueError(f"{a['label']} and {b['label']} read other tokens (tokenizers {a.get('tokenizer')} and "
                         f"{b.get('tokenizer')}): their per-token losses are not comparable")
    try:
        (sa, ca), (sb, cb) = _range(a, *positions), _range(b, *positions)
    except ValueError:
        return None
    row_b = {p: i for i, p in enumerate(b["documents"])}
    pairs = [(i, row_b[p]) for i, p in enumerate(a["documents"]) if p in row_b and ca[i] > 0 and cb[row_b[p]] > 0]
    if not pairs:
        return None
    ia, ib = (np.array(x) for x in zip(*pairs))
    sa, ca, sb, cb = sa[ia], ca[ia], sb[ib], cb[ib]
    w = resample_counts(len(ia), resamples, seed)
    samples = pooled(w, sa[:, None], ca[:, None])[:, 0] - pooled(w, sb[:, None], cb[:, None])[:, 0]
    return _estimate(sa.sum() / ca.sum() - sb.sum() / cb.sum(), samples, len(ia), level)

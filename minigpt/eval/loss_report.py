"""Loss by position as results: a curve's JSON, the goal figures over curves, the picture and the W&B table.

A curve is one model at one length (optionally read through sliding windows). Its JSON holds the bins (mean, 95 %
interval, documents and tokens per bin) and, per document, the summed loss and token count per bin, so curves
written by different commands can be drawn and compared later (`minigpt-eval a.json b.json --out cmp`).
"""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from minigpt.eval.bootstrap import LEVEL, RESAMPLES, bin_intervals, paired_difference, range_difference
from minigpt.eval.loss_by_position import bin_edges, binned
from minigpt.eval.passkey_grid import length_label

WANDB_COLUMNS = ["curve", "log2_position", "position_lo", "position_hi", "mean", "ci_low", "ci_high", "docs", "tokens"]


def edge_label(n: int) -> str:
    """0, 1, 2, …, 512, 1K, 2K, …: a bin edge as the plot and tables name it."""
    return length_label(n) if n >= 1024 else str(n)


def make_curve(losses: Sequence[np.ndarray], documents: Sequence[str], length: int, resamples: int = RESAMPLES,
               seed: int = 0, level: float = LEVEL, **meta: Any) -> dict[str, Any]:
    """A curve's JSON from per-document, per-position losses (and `meta`: label, checkpoint, rope, … as given)."""
    edges = bin_edges(length)
    sums, counts = binned(losses, len(edges) - 1)
    lo, hi = bin_intervals(sums, counts, resamples, seed, level)
    total, tokens, docs = sums.sum(axis=0), counts.sum(axis=0), (counts > 0).sum(axis=0)
    bins = [{"lo": edges[k], "hi": edges[k + 1], "mean": float(total[k] / tokens[k]) if tokens[k] else None,
             "ci_low": float(lo[k]) if tokens[k] else None, "ci_high": float(hi[k]) if tokens[k] else None,
             "docs": int(docs[k]), "tokens": int(tokens[k])} for k in range(len(edges) - 1)]
    return {**meta, "status": "ok", "length": length, "edges": edges, "bins": bins,
            "bootstrap": {"resamples": resamples, "seed": seed, "level": level}, "documents": list(documents),
            "doc_sums": sums.tolist(), "doc_tokens": counts.tolist()}


def goal_figures(curves: Sequence[dict[str, Any]], far: tuple[int, int], near: tuple[int, int],
                 resamples: int = RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """The issue's two figures: per curve, mean over `far` minus mean over `near`; and the first PATH's curves
    (source 0) minus each other PATH's curve of the same length over `far`, paired over documents. A figure the
    curves cannot give (no document reaches the range, other tokenizers) is left out, with the reason."""
    ok = [c for c in curves if c["status"] == "ok"]
    out: dict[str, Any] = {"far": list(far), "near": list(near), "range_difference": {}, "paired_difference": [],
                           "not_computed": []}
    for c in ok:
        r = range_difference(c, far, near, resamples, seed)
        if r is None:
            out["not_computed"].append(f"{c['label']}: no document reaches both [{far[0]}, {far[1]}) and "
                                       f"[{near[0]}, {near[1]})")
        else:
            out["range_difference"][c["label"]] = r
    for a in (c for c in ok if c.get("source", 0) == 0):
        for b in (c for c in ok if c.get("source", 0) != 0 and c["length"] == a["length"]):
            try:
                r = paired_difference(a, b, far, resamples, seed)
            except ValueError as e:
                out["not_computed"].append(str(e))
                continue
            if r is None:
                out["not_computed"].append(f"{a['label']} - {b['label']}: no shared document reaches "
                                           f"[{far[0]}, {far[1]})")
            else:
                out["paired_difference"].append({"a": a["label"], "b": b["label"], **r})
    return out


def goal_lines(goals: dict[str, Any]) -> list[str]:
    """The goal figures as lines of text (stdout and the picture's footer)."""
    (f0, f1), (n0, n1) = goals["far"], goals["near"]
    far, near = f"[{edge_label(f0)}, {edge_label(f1)})", f"[{edge_label(n0)}, {edge_label(n1)})"
    fmt = lambda r: f"{r['estimate']:+.4f} (95% CI {r['ci_low']:+.4f} to {r['ci_high']:+.4f}; {r['docs']} docs)"  # noqa: E731
    lines = [f"{label}: loss {far} - {near} = {fmt(r)}" for label, r in goals["range_difference"].items()]
    lines += [f"{r['a']} - {r['b']}: loss over {far} = {fmt(r)}" for r in goals["paired_difference"]]
    return lines


def plot_curves(curves: Sequence[dict[str, Any]], path: Path, title: str, footer: str) -> Path:
    """Mean loss per bin against log2 position, a line and its interval band per curve; a dotted line where each
    model's trained length ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [c for c in curves if c["status"] == "ok"]
    n_bins = max((len(c["bins"]) for c in ok), default=1)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.45 * n_bins + 3), 5.2))
    for i, c in enumerate(ok):
        k = np.array([j for j, b in enumerate(c["bins"]) if b["tokens"]])
        mean = np.array([c["bins"][j]["mean"] for j in k])
        lo, hi = (np.array([c["bins"][j][key] for j in k]) for key in ("ci_low", "ci_high"))
        line, = ax.plot(k, mean, marker="o", markersize=3, label=c["label"])
        ax.fill_between(k, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        trained = c.get("trained_length")
        if trained and trained in c["edges"]:  # a bin edge: between bins
            ax.axvline(c["edges"].index(trained) - 0.5, color=line.get_color(), linestyle=":", linewidth=1.2)
    edges = max((c["edges"] for c in ok), key=len, default=[0, 1])
    ax.set_xticks(range(len(edges) - 1), [edge_label(e) for e in edges[:-1]], rotation=45)
    ax.set_xlabel("position in the document (bin [2^(k-1), 2^k), labelled by its start; log2 scale)")
    ax.set_ylabel("mean loss per token (nats)")
    ax.grid(alpha=0.3)
    if ok:
        ax.legend(fontsize=8, title=f"{int(100 * LEVEL)}% bootstrap over documents; dotted: trained length",
                  title_fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.text(0.01, 0.01, footer, fontsize=7, va="bottom", family="monospace")
    n_footer = footer.count("\n") + 1
    fig.tight_layout(rect=(0, 0.02 + 0.025 * n_footer, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def wrap(text: str, width: int = 150) -> str:
    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False, subsequent_indent="    "))


def wandb_rows(curves: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """A row per curve and bin with tokens: what the W&B table holds and its line plot draws (x: log2 of the bin's
    end, so bin [2^(k-1), 2^k) is at k)."""
    return [[c["label"], k, b["lo"], b["hi"], b["mean"], b["ci_low"], b["ci_high"], b["docs"], b["tokens"]]
            for c in curves if c["status"] == "ok" for k, b in enumerate(c["bins"]) if b["tokens"]]

"""How long the documents in a run's training windows are: the histogram beside the document-mask training figures.

    python -m minigpt.benchmarks.document_lengths --out DIR -- data=pycode seq_len=32768

With `data.document_mask=true` a token attends only within its document, so what the mask saves depends on how long
the documents in a window are. This draws the training batches the run would draw (same data, seed and seq_len),
splits each window at its document boundaries (a window that starts mid-document gives that part its own id, as
in training) and writes the lengths' histogram: `document_lengths.{json,md,png}` in --out. `causal_work` is the
share of the dense causal (i, j) pairs that the mask keeps, the ideal time of masked attention over dense.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def segment_lengths(document_ids: torch.Tensor) -> list[int]:
    """Lengths of the runs of equal ids in each row of (B, N) document ids (non-decreasing along N)."""
    out = []
    for row in document_ids:
        _, counts = torch.unique_consecutive(row, return_counts=True)
        out += counts.tolist()
    return out


def summarize(lengths: list[int], seq_len: int) -> dict:
    """Counts per power-of-two bin [2^k, 2^(k+1)) (whole windows, n = seq_len, a bin of their own), the
    token-weighted median and the causal work kept. ValueError for no lengths."""
    if not lengths:
        raise ValueError("no document lengths to summarize (no windows drawn)")
    bins: dict[int, dict[str, int]] = {}
    for n in lengths:
        lo = seq_len if n >= seq_len else 1 << (n.bit_length() - 1)
        b = bins.setdefault(lo, {"segments": 0, "tokens": 0})
        b["segments"] += 1
        b["tokens"] += n
    tokens = sum(lengths)
    acc, median = 0, None
    for n in sorted(lengths):  # the length of the segment that holds the middle token
        acc += n
        if median is None and 2 * acc >= tokens:
            median = n
    windows = tokens / seq_len
    kept = sum(n * (n + 1) / 2 for n in lengths) / (windows * seq_len * (seq_len + 1) / 2)
    return {"seq_len": seq_len, "windows": round(windows), "segments": len(lengths),
            "segments_per_window": len(lengths) / windows, "token_weighted_median": median,
            "causal_work": kept,
            "bins": [{"from": lo, "to": min(2 * lo, seq_len), **bins[lo]} for lo in sorted(bins)]}


def _bin_label(b: dict, seq_len: int) -> str:
    """'[4K, 8K)'; the bin of whole windows (no boundary inside) is named as such."""
    from minigpt.figures import tokens_label
    def label(n: int) -> str:  # 4096 -> '4K', 3000 -> '3,000'
        return tokens_label(n) if n % 1024 == 0 or n < 1024 else f"{n:,}"
    if b["from"] >= seq_len:
        return f"{label(seq_len)} (whole window)"
    return f"[{label(b['from'])}, {label(b['to'])})"


def to_markdown(stats: dict, what: str) -> str:
    from minigpt.files import markdown_table
    rows = [[_bin_label(b, stats["seq_len"]), b["segments"],
             f"{100 * b['tokens'] / (stats['windows'] * stats['seq_len']):.1f}%"] for b in stats["bins"]]
    return (f"Document lengths in {stats['windows']} training windows of {stats['seq_len']:,} tokens ({what}): "
            f"{stats['segments_per_window']:.2f} documents a window; the token-weighted median document is "
            f"{stats['token_weighted_median']:,} tokens; the document mask keeps {100 * stats['causal_work']:.1f}% "
            f"of the causal (i, j) pairs.\n\n"
            + markdown_table(["length", "documents", "share of tokens"], rows) + "\n")


def plot(stats: dict, what: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    total = stats["windows"] * stats["seq_len"]
    labels = [_bin_label(b, stats["seq_len"]) for b in stats["bins"]]
    ax.bar(range(len(labels)), [100 * b["tokens"] / total for b in stats["bins"]], color="#1f77b4")
    ax.set_xticks(range(len(labels)), labels, fontsize=8, rotation=30, ha="right")
    ax.set_xlabel("length of a document's part in the window (tokens)")
    ax.set_ylabel("share of tokens (%)")
    ax.set_title(f"Documents in {stats['seq_len']:,}-token training windows; mask keeps "
                 f"{100 * stats['causal_work']:.1f}% of causal work", fontsize=10)
    fig.text(0.01, 0.01, what, fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minigpt.benchmarks.document_lengths",
                                description=__doc__.split("\n")[0], usage="%(prog)s --out DIR [--batches N] -- <trainer overrides, e.g. data=pycode "
                                      "seq_len=32768>")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batches", type=int, default=100, help="training batches to draw (100)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.batches < 1:
        p.error(f"argument --batches: {args.batches}: draw at least 1 batch")
    from minigpt.compose import compose, one_line
    from minigpt.data import build_data
    try:
        cfg = compose(list(args.overrides), machine=False)
        data = build_data(cfg.data, cfg.seq_len, cfg.seed)
    except Exception as e:  # a bad override or data that cannot be read: one line, as the trainer says it
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    if not getattr(data, "document_mask", False):
        print("error: these windows carry no document ids: set data.document_mask=true (data=pycode sets it)",
              file=sys.stderr)
        return 2
    lengths = []
    for index in range(args.batches):
        _, _, ids = data.batch("train", index, cfg.batch_size)
        lengths += [cfg.seq_len] * cfg.batch_size if ids is None else segment_lengths(ids)  # None: whole windows
    stats = summarize(lengths, cfg.seq_len)
    corpus = (getattr(data, "manifest", None) or {}).get("corpus_hash")
    what = (f"data={cfg.data.name}, seq_len={cfg.seq_len}, seed={cfg.seed}, {args.batches} batches of "
            f"{cfg.batch_size} (one process's draws)" + (f"; corpus {corpus[:12]}" if corpus else "")
            + ("; passkey rows count as one document" if getattr(data, "passkey", None) else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "document_lengths.json").write_text(json.dumps({"what": what, **stats}, indent=1) + "\n")
    (args.out / "document_lengths.md").write_text(to_markdown(stats, what))
    plot(stats, what, args.out / "document_lengths.png")
    print(to_markdown(stats, what))
    return 0


if __name__ == "__main__":
    sys.exit(main())

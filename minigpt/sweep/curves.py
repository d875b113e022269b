"""Training curves of one run or of stages that continue each other, from each run's metrics.jsonl.

    python -m minigpt.sweep.curves runs/passkey-512 runs/passkey-2k runs/passkey-8k \\
        --metrics eval/passkey_acc eval/passkey_grid_acc eval/val_loss --out results/passkey_curve

Writes <out>.png (one panel per metric, the step on x, each run its own colour and labelled with its seq_len) and
<out>.md (a row per logged eval step: the run, its seq_len, the metrics, and the run's median tokens/s). Stages of
a recipe share one step axis because each resumes the previous one's checkpoint.
Exit codes: 0 done, 1 a run without metrics.jsonl, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from minigpt.files import WriteError, atomic_write, atomic_write_text, markdown_table
from minigpt.loggers import MetricsHistory, read_history
from minigpt.summary import SUMMARY_FILE, RunSummary


def load_run(run_dir: Path) -> dict[str, Any]:
    """A run's label (its directory name and seq_len), its rows and its median tokens/s."""
    rows = read_history(run_dir)
    seq_len = None
    if (run_dir / SUMMARY_FILE).exists():
        seq_len = RunSummary.read(run_dir / SUMMARY_FILE).seq_len
    speeds = [r["perf/tokens_per_s"] for r in rows if r.get("perf/tokens_per_s")]
    return {"name": run_dir.name, "seq_len": seq_len, "rows": rows,
            "tokens_per_s": statistics.median(speeds) if speeds else None}


def curve_table(runs: Sequence[dict[str, Any]], metrics: Sequence[str]) -> str:
    """Markdown: one row per step at which any of `metrics` was logged."""
    header = ["run", "seq_len", "step", *metrics, "tokens/s (run median)"]
    body = []
    for run in runs:
        for row in run["rows"]:
            if any(row.get(m) is not None for m in metrics):
                body.append([run["name"], f"{run['seq_len']:,}" if run["seq_len"] else "?", str(row["step"]),
                             *(f"{row[m]:.4f}" if row.get(m) is not None else "–" for m in metrics),
                             f"{run['tokens_per_s']:,.0f}" if run["tokens_per_s"] else "–"])
    return markdown_table(header, body)


def plot_curves(runs: Sequence[dict[str, Any]], metrics: Sequence[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(metrics), 1, figsize=(7.5, 2.6 * len(metrics)), sharex=True, squeeze=False)
    for ax, metric in zip(axes[:, 0], metrics):
        for run in runs:
            points = [(r["step"], r[metric]) for r in run["rows"] if r.get(metric) is not None]
            if points:
                label = f"{run['name']} (seq_len {run['seq_len']:,})" if run["seq_len"] else run["name"]
                ax.plot(*zip(*points), marker="o", markersize=3, label=label)
        ax.set_ylabel(metric.split("/")[-1])
        ax.grid(alpha=0.3)
    axes[0, 0].set_title(title)
    axes[0, 0].legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories, in step order")
    p.add_argument("--metrics", nargs="+", default=["eval/passkey_acc", "eval/val_loss"])
    p.add_argument("--out", type=Path, required=True, help="path without suffix: <out>.png and <out>.md")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    missing = [str(r) for r in args.runs if not (r / MetricsHistory.FILE).exists()]
    if missing:
        print(f"error: no {MetricsHistory.FILE} in {', '.join(missing)} (runs before it existed log to W&B only)",
              file=sys.stderr)
        return 1
    runs = [load_run(r) for r in args.runs]
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        plot_curves(runs, args.metrics, args.out.with_suffix(".png"), args.title)
        table = curve_table(runs, args.metrics)
        atomic_write_text(args.out.with_suffix(".md"), table)
    except (OSError, WriteError) as e:
        print(f"error: cannot write {args.out}: {e}", file=sys.stderr)
        return 1
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

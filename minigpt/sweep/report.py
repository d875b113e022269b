"""What a sweep hands back: results.json, results.csv, results.md, two PNG plots and a W&B summary run.

Reports are built from every trial recorded in the --out (its trials.jsonl), not only the variants of the
last invocation, so re-running one variant into a sweep directory never drops the others. Probe trials
(variants with @L) enter only through the full-model figures derived from them. Error trials are not
memory limits: they are listed under the table, never plotted or reported as out of memory.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, fields
from pathlib import Path

from minigpt.sweep.search import Trial, base_variant, best, derive_from_probes, is_probe
from minigpt.files import atomic_write_text, markdown_table

COLUMNS = ["variant", "max seq_len", "peak allocated at max", "KB/token", "tokens/s at max", "step time at max",
           "first failure above", "trials"]
CSV_COLUMNS = ["variant", "seq_len", "status", "peak_allocated_gib", "peak_reserved_gib", "kb_per_token",
               "tokens_per_s", "step_time_s", "wall_s", "exit_code", "error"]
FAILURE_MARKERS = {"oom": "x", "timeout": "s"}  # errors are not plotted: they say nothing about memory


def by_variant(trials: list[Trial]) -> dict[str, list[Trial]]:
    """Searched (not probe) trials by variant, each sorted by seq_len, variants in the order they first ran."""
    out: dict[str, list[Trial]] = {}
    for t in trials:
        if not is_probe(t.variant):
            out.setdefault(t.variant, []).append(t)
    return {v: sorted(ts, key=lambda t: t.seq_len) for v, ts in out.items()}


def derive_all(trials: list[Trial], n_layer: int) -> list[dict]:
    """Full-model figures for each (variant, seq_len) with two ok probes of different depth."""
    probes: dict[tuple[str, int], list[Trial]] = {}
    for t in trials:
        if is_probe(t.variant):
            probes.setdefault((base_variant(t.variant), t.seq_len), []).append(t)
    return [d for group in probes.values() if (d := derive_from_probes(group, n_layer))]


def only_errors(trials: list[Trial]) -> bool:
    """True when trials ran and every one was an error: the variant has no result at all."""
    return bool(trials) and all(t.is_error for t in trials)


def _fmt(x: float | None, spec: str, unit: str = "") -> str | None:
    return None if x is None else f"{x:{spec}}{unit}"


def _row(variant: str, trials: list[Trial]) -> list[object]:
    b = best(trials)
    walls = [t for t in trials if not t.ok and not t.is_error and (b is None or t.seq_len > b.seq_len)]
    fail = min(walls, key=lambda t: t.seq_len, default=None)
    n_errors = sum(t.is_error for t in trials)
    if fail:
        fail_s = f"{fail.seq_len:,} ({fail.status})"
    else:
        fail_s = "– (search stopped by an error)" if n_errors else "– (not reached)"
    counted = f"{len(trials)} ({n_errors} error{'s' * (n_errors > 1)})" if n_errors else len(trials)
    if b is None:
        return [variant, "**none: every trial failed with an error**" if only_errors(trials) else "none",
                None, None, None, None, fail_s, counted]
    return [variant, f"{b.seq_len:,}", _fmt(b.peak_allocated_gib, ".1f", " GiB"), _fmt(b.kb_per_token, ".1f"),
            _fmt(b.tokens_per_s, ",.0f"), _fmt(b.step_time_s, ".2f", " s"), fail_s, counted]


def _derived_row(d: dict) -> list[object]:
    """The derived figure; the failure column says whether it fits the GPU and host memory (judge_fit)."""
    host = f" (+{d['host_offload_gib']:.1f} GiB host)" if d.get("host_offload_gib") else ""
    return [f"{d['variant']} ({d['n_layer']} layers, **derived** from {d['probe_layers']}-layer probes)",
            f"{d['seq_len']:,}", f"{d['peak_allocated_gib']:.1f} GiB{host}", f"{d['kb_per_token']:.1f}",
            f"{d['tokens_per_s']:,.0f}", f"{d['step_time_s']:.1f} s", d.get("limit"), "probe"]


def markdown_report(trials_by_variant: dict[str, list[Trial]], derived: list[dict], header: str,
                    errors: list[Trial] = ()) -> str:
    """The header line, one table row per variant and derived figure, then the error trials, one line each."""
    rows = [_row(v, ts) for v, ts in trials_by_variant.items()] + [_derived_row(d) for d in derived]
    text = f"{header}\n\n{markdown_table(COLUMNS, rows)}"
    if errors:
        text += "\nErrors (not memory limits; a resumed sweep runs these trials again):\n\n"
        text += "".join(f"- {t.variant} at n={t.seq_len:,} (exit code {t.exit_code}): {t.error}\n" for t in errors)
    return text


def write_reports(trials: list[Trial], derived: list[dict], out_dir: Path, header: str) -> Path:
    """results.json, results.csv and results.md of these trials (each written atomically); returns results.md."""
    grouped = by_variant(trials)
    errors = [t for t in trials if t.is_error]
    atomic_write_text(out_dir / "results.json", json.dumps(
        {"header": header, "trials": [asdict(t) | {"kb_per_token": t.kb_per_token} for t in trials],
         "max": {v: (asdict(b) if (b := best(ts)) else None) for v, ts in grouped.items()},
         "only_errors": [v for v, ts in grouped.items() if only_errors(ts)], "derived": derived}, indent=1) + "\n")
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(CSV_COLUMNS)
    for t in trials:
        w.writerow([t.kb_per_token if c == "kb_per_token" else getattr(t, c) for c in CSV_COLUMNS])
    atomic_write_text(out_dir / "results.csv", buf.getvalue())
    return atomic_write_text(out_dir / "results.md", markdown_report(grouped, derived, header, errors))


def plot(trials_by_variant: dict[str, list[Trial]], out_dir: Path, derived: list[dict] = (),
         prefix: str = "") -> list[Path]:
    """memory_vs_seq_len.png and tokens_per_s_vs_seq_len.png: a line per variant, memory walls marked,
    derived points hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label, name in (("peak_allocated_gib", "peak allocated (GiB)", "memory_vs_seq_len.png"),
                             ("tokens_per_s", "tokens/s", "tokens_per_s_vs_seq_len.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for variant, trials in trials_by_variant.items():
            ok = [t for t in trials if t.ok and getattr(t, key)]
            line, = ax.plot([t.seq_len for t in ok], [getattr(t, key) for t in ok], marker="o", label=variant)
            for status, marker in FAILURE_MARKERS.items():
                failed = [t for t in trials if t.status == status]
                if failed:  # memory at the failure if measured, else level with the last success
                    fallback = ok[-1].peak_allocated_gib if ok and key == "peak_allocated_gib" else 0
                    y = [(getattr(t, key) or fallback) if key == "peak_allocated_gib" else 0 for t in failed]
                    ax.scatter([t.seq_len for t in failed], y, marker=marker, s=60, color=line.get_color(),
                               facecolors="none" if marker == "s" else None)
            for d in derived:
                if d["variant"] == variant:
                    ax.scatter([d["seq_len"]], [d[key]], marker="o", s=70, facecolors="none",
                               edgecolors=line.get_color(), label=f"{variant} ({d['n_layer']} layers, derived)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("seq_len (batch 1); × = out of memory, □ = over the time limit, hollow ○ = derived from probes",
                      fontsize=8)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{prefix}{name}"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def log_summary_to_wandb(trials: list[Trial], derived: list[dict], plots: list[Path], sweep_id: str, project: str,
                         out_dir: Path, exit_code: int) -> None:
    """One W&B run for the sweep, in its group: a Table of all trials, line plots per variant, the PNGs and
    the maximums in its summary."""
    import wandb

    from minigpt.loggers import WandbLogger

    grouped = by_variant(trials)
    logger = WandbLogger(project=project, name=f"{sweep_id}-summary", directory=out_dir, group=sweep_id,
                         tags=["context-sweep"], job_type="context-sweep",
                         config={"sweep_id": sweep_id, "variants": list(grouped)})
    columns = ["variant", "seq_len", "status", "peak_allocated_gib", "peak_reserved_gib", "kb_per_token",
               "tokens_per_s", "step_time_s", "error"]
    rows = [[t.variant, t.seq_len, t.status, t.peak_allocated_gib, t.peak_reserved_gib, t.kb_per_token,
             t.tokens_per_s, t.step_time_s, t.error] for ts in grouped.values() for t in ts]
    logged = {"sweep/trials": wandb.Table(columns=columns, data=rows),
              **{f"sweep/{p.stem}": wandb.Image(str(p)) for p in plots}}
    for key, title in (("peak_allocated_gib", "peak allocated GiB vs seq_len"),
                       ("tokens_per_s", "tokens/s vs seq_len")):
        series = {v: [t for t in ts if t.ok] for v, ts in grouped.items()}
        series = {v: ok for v, ok in series.items() if ok}
        if series:
            logged[f"sweep/{key}_vs_seq_len"] = wandb.plot.line_series(
                xs=[[t.seq_len for t in ok] for ok in series.values()],
                ys=[[getattr(t, key) for t in ok] for ok in series.values()],
                keys=list(series), title=title, xname="seq_len")
    logger.log(logged)
    summary: dict[str, object] = {}
    for variant, ts in grouped.items():
        b = best(ts)
        summary[f"max_seq_len/{variant}"] = b.seq_len if b else 0
        if b:
            summary[f"peak_gib_at_max/{variant}"] = b.peak_allocated_gib
            summary[f"tokens_per_s_at_max/{variant}"] = b.tokens_per_s
        if only_errors(ts):
            summary[f"only_errors/{variant}"] = ts[-1].error
    for d in derived:
        summary[f"derived/{d['variant']}/n{d['seq_len']}/peak_gib"] = d["peak_allocated_gib"]
    logger.finish(summary, exit_code)


def combine(sweep_dirs: list[Path], out_dir: Path, name: str, header: str) -> Path:
    """Merge finished sweep directories (their results.json: trials and derived probe figures) into one
    <name>.md and plot pair in out_dir."""
    trials: list[Trial] = []
    derived: list[dict] = []
    names = {f.name for f in fields(Trial)}
    for d in sweep_dirs:
        results = json.loads((Path(d) / "results.json").read_text())
        trials += [Trial(**{k: v for k, v in record.items() if k in names}) for record in results["trials"]]
        derived += results.get("derived", [])
    grouped = by_variant(trials)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(grouped, out_dir, derived, prefix=f"{name}_")
    errors = [t for ts in grouped.values() for t in ts if t.is_error]
    return atomic_write_text(out_dir / f"{name}.md", markdown_report(grouped, derived, header, errors))

"""The headline pictures: how far the context goes, and what memory and speed it costs on the way.

    python -m minigpt.figures --out results/figures                     # from the kept results
    python -m minigpt.figures --data my_sweeps.json --out runs/figures   # any file in the same format
    python -m minigpt.figures --from-sweep runs/grid --data results/context/grid_H100.json --out results/figures
                                                       # build the data file from sweep directories, then draw
                                                       # (another GPU's README.md in --out is kept: README_<gpu>.md)

Reads one JSON file (default `results/context/context_scaling_NVIDIA_H200.json`):

    {"gpu": "NVIDIA H200", "gpu_memory_gib": 139.8, "model": "gpt2-small (123.6M)",
     "groups": [{"name", "commit", "date", "gpus", "searched_to_oom", "command",
                 "trials": [{"variant", "seq_len", "status": "ok"|"oom"|..., "peak_allocated_gib",
                             "tokens_per_s", "kind": "measured"|"probe"|"derived"}, ...]}, ...]}

and writes three PNGs and a README.md beside them (what each shows, the commits and dates behind it, and which
lengths of the grid were never measured):

- longest_context_<gpu>.png: the longest seq_len each variant trained, a horizontal bar per variant on a log
  axis; bars searched up to an out-of-memory failure, bars that are only a length that ran (no search above it)
  and bars derived from 1- and 2-layer probes are drawn apart.
- memory_vs_seq_len_<gpu>.png, tokens_per_s_vs_seq_len_<gpu>.png: peak allocated GiB and tokens/s on a fixed
  grid of lengths (powers of two from 1K), one colour and one marker per variant, an x at the first grid length
  that ran out of memory. Lengths off the grid (the bisection's 139,264, say) are not drawn here: they are in
  the tables.

Probe trials (1- or 2-layer models) are not drawn; the 12-layer figures derived from them are, hollow.

`--from-sweep DIR ...` first writes that file (at --data, which must not exist yet) from `minigpt-sweep` output
directories (`--grid` or searches): each directory's results.json gives the trials and derived figures, each trial's
summary.json the GPU, commit, GPU count and versions, and its modification date the date (a copy that did not keep
file times moves it); one group per directory and commit; trials without a summary are left out. A training run's
directory (summary.json, no results.json) joins as a group of one trial, named by its setting (the 2-GPU 1M step,
say). The data has no usable-memory line (`gpu_memory_gib`): add it to the file by hand if the memory figure
should show it.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATA = Path("results/context/context_scaling_NVIDIA_H200.json")
GRID_START = 1024

# One colour and one marker per series, never reused (12 of each; 'x' is kept for out of memory).
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22",
          "#17becf", "#000000", "#0b5d1e", "#7f7f7f"]  # grey last: the bar chart's legend draws its styles in grey
MARKERS = ["o", "s", "^", "v", "D", "P", "*", "h", "<", ">", "p", "d"]
OOM_MARKER = "x"


@dataclass(frozen=True)
class Point:
    """One trial, flattened out of its group."""
    variant: str
    gpus: int
    seq_len: int
    status: str                      # ok | oom | error | timeout
    kind: str                        # measured | probe | derived
    searched: bool                   # the group searched this variant up to a failure
    peak_gib: float | None
    tokens_per_s: float | None
    commit: str
    date: str

    @property
    def series(self) -> str:
        return self.variant if self.gpus == 1 else f"{self.variant}, {self.gpus} GPUs (context {self.gpus})"


def from_sweeps(dirs: list[Path]) -> dict:
    """The figures' data (the format above) from minigpt-sweep output directories and training run directories.
    Raises ValueError for a directory that is neither (or a run it cannot draw), or when the trials ran on more than
    one kind of GPU (one figure, one GPU)."""
    from datetime import datetime, timezone

    from minigpt.sweep.search import is_probe

    groups, devices, versions, models = [], set(), {}, set()
    for d in dirs:
        results_path = Path(d) / "results.json"
        if not results_path.is_file() and (Path(d) / "summary.json").is_file():
            results = _one_run_as_results(Path(d))  # a lone training run: one trial, its own group
        elif not results_path.is_file():
            raise ValueError(f"{d}: no results.json (not a finished minigpt-sweep directory) and no summary.json "
                             f"(not a training run)")
        else:
            results = json.loads(results_path.read_text())
        by_key: dict[tuple[str, int], dict] = {}
        for t in results["trials"]:
            summary_path = Path(d) / (t.get("run_dir") or "") / "summary.json"
            if not (t.get("run_dir") and summary_path.is_file()):
                continue  # no summary (a trial killed before writing one): nothing to draw, and no GPU or commit
            summary = json.loads(summary_path.read_text())
            if summary.get("device"):
                devices.add(summary["device"])
            versions.update({k: summary[k] for k in ("torch", "triton") if summary.get(k)})
            if summary.get("model") and summary.get("n_params") and not is_probe(t["variant"]):
                models.add(f"{summary['model']} ({summary['n_params'] / 1e6:.1f}M)")
            commit = str(summary.get("commit") or "?")
            gpus = int(summary.get("world_size") or 1)
            day = datetime.fromtimestamp(summary_path.stat().st_mtime, timezone.utc).date().isoformat()
            trial = {k: t.get(k) for k in ("variant", "seq_len", "status", "peak_allocated_gib", "peak_reserved_gib",
                                           "tokens_per_s", "step_time_s", "n_layer")}
            trial["kind"] = "probe" if is_probe(t["variant"]) else "measured"
            group = by_key.setdefault((commit, gpus), {"trials": [], "dates": set()})
            group["trials"].append(trial)
            group["dates"].add(day)
        # the derived figures once per directory, in its largest group (they stand for its GPU count and commit)
        largest = max(by_key, key=lambda key: len(by_key[key]["trials"]), default=None)
        for (commit, gpus), g in by_key.items():
            if (commit, gpus) == largest:
                g["trials"] += [{k: x.get(k) for k in ("variant", "seq_len", "peak_allocated_gib", "step_time_s",
                                                       "tokens_per_s", "n_layer")} | {"status": "ok", "kind": "derived"}
                                for x in results.get("derived", [])]
            variants = {t["variant"] for t in g["trials"] if t["kind"] == "measured"}
            to_oom = all(_ran_out_above_longest(g["trials"], v) for v in variants)
            name = f"{Path(d).name}-{commit}"
            name = name if all(x["name"] != name for x in groups) else f"{name}-{len(groups)}"
            groups.append({"name": name, "commit": commit, "date": max(g["dates"]), "gpus": gpus,
                           "searched_to_oom": bool(variants) and to_oom, "command": results.get("header", ""),
                           "trials": g["trials"]})
    if len(devices) > 1:
        raise ValueError(f"the trials ran on {len(devices)} kinds of GPU ({', '.join(sorted(devices))}): draw one "
                         f"kind per figure (give the directories of one)")
    return {"about": "Built by `python -m minigpt.figures --from-sweep` from minigpt-sweep and training run "
                     f"directories ({', '.join(Path(d).name for d in dirs)}): one group per directory and commit; dates are "
                     "the modification dates of the trials' summary files (as found, so a copy may have moved them).",
            "gpu": next(iter(devices), "?"), "model": ", ".join(sorted(models)), **versions, "groups": groups}


def _one_run_as_results(run_dir: Path) -> dict:
    """A training run's directory in the shape of a sweep's results.json: its one trial, named by its setting.
    ValueError for a run the figures cannot stand beside the sweeps' (not finished ok, not one sequence a step,
    data parallel, or a setting no variant name gives)."""
    from minigpt.sweep.search import variant_of
    summary = json.loads((run_dir / "summary.json").read_text())
    why = ("it did not finish ok" if summary.get("status") != "ok"
           else "not batch 1 without accumulation" if (summary.get("batch_size"), summary.get("grad_accum")) != (1, 1)
           else "data parallel" if (summary.get("world_size") or 1) != (summary.get("context_parallel") or 1)
           else None)
    if why:
        raise ValueError(f"{run_dir}: a training run the figures cannot draw beside the sweeps ({why})")
    trial = {"variant": variant_of(summary), "seq_len": summary.get("seq_len"), "status": "ok",
             "run_dir": ".", **{k: summary.get(k) for k in ("peak_allocated_gib", "peak_reserved_gib", "tokens_per_s",
                                                            "step_time_s", "n_layer")}}
    return {"header": f"one training run ({run_dir.name}): attention={summary.get('attention')}, "
                      f"seq_len={summary.get('seq_len')}, {summary.get('world_size') or 1} GPU(s), context parallel "
                      f"{summary.get('context_parallel') or 1}, levers {summary.get('levers')}, compile "
                      f"{summary.get('compile')}", "trials": [trial]}


def _ran_out_above_longest(trials: list[dict], variant: str) -> bool:
    """Whether the variant ran out of memory at some length above the longest it trained (its search reached OOM)."""
    mine = [t for t in trials if t["variant"] == variant and t["kind"] == "measured"]
    longest = max((t["seq_len"] for t in mine if t["status"] == "ok"), default=0)
    return any(t["status"] == "oom" and t["seq_len"] > longest for t in mine)


def load(path: Path) -> tuple[dict, list[Point]]:
    """The file's metadata and every trial as a Point."""
    return load_data(json.loads(Path(path).read_text()))


def load_data(data: dict) -> tuple[dict, list[Point]]:
    """The data's metadata and every trial as a Point."""
    points = []
    for g in data["groups"]:
        for t in g["trials"]:
            points.append(Point(variant=t["variant"], gpus=int(g.get("gpus", 1)), seq_len=int(t["seq_len"]),
                                status=t["status"], kind=t.get("kind", "measured"),
                                searched=bool(g.get("searched_to_oom", False)),
                                peak_gib=t.get("peak_allocated_gib"), tokens_per_s=t.get("tokens_per_s"),
                                commit=str(g.get("commit", "?")), date=str(g.get("date", "?"))))
    return data, points


def series_order(points: list[Point]) -> list[str]:
    """Series from least to most memory saved (probes excluded): one GPU before two; then fewer lever overrides
    first, eager before compiled at equal levers; ties in the order they first appear (naive, sdpa, flash as the
    sweep runs them)."""
    seen: dict[str, tuple] = {}
    for i, p in enumerate(points):
        if p.kind != "probe" and p.series not in seen:
            seen[p.series] = (p.gpus, *_lever_weight(p.variant), i)
    return sorted(seen, key=lambda s: seen[s])


def _lever_weight(variant: str) -> tuple[int, int]:
    """(memory overrides the variant's levers add, compiled?); (0, 0) for a name the sweep does not know."""
    from minigpt.sweep.search import variant_overrides
    try:
        overrides = variant_overrides(variant)
    except ValueError:
        return 0, 0
    return sum(o.startswith("model.") for o in overrides), int("compile=true" in overrides)


def styles(series: list[str]) -> dict[str, tuple[str, str]]:
    """(colour, marker) per series, all distinct."""
    if len(series) > len(COLORS):
        raise ValueError(f"{len(series)} series, but only {len(COLORS)} distinct colours and markers are defined")
    return {s: (COLORS[i], MARKERS[i]) for i, s in enumerate(series)}


def is_grid(n: int) -> bool:
    return n >= GRID_START and n & (n - 1) == 0


def first_oom_on_grid(points: list[Point], series: str) -> Point | None:
    """The shortest grid length that ran out of memory above every grid length that trained."""
    mine = [p for p in points if p.series == series and p.kind == "measured" and is_grid(p.seq_len)]
    top_ok = max((p.seq_len for p in mine if p.status == "ok"), default=0)
    ooms = [p for p in mine if p.status == "oom" and p.seq_len > top_ok]
    return min(ooms, key=lambda p: p.seq_len, default=None)


def grid_gaps(points: list[Point]) -> dict[str, dict]:
    """Per series: grid lengths measured, the first OOM, and the grid lengths below it never measured."""
    out = {}
    for s in series_order(points):
        mine = [p for p in points if p.series == s and p.kind == "measured"]
        measured = sorted({p.seq_len for p in mine if is_grid(p.seq_len) and p.status in ("ok", "oom")})
        trained = [n for n in measured if any(p.seq_len == n and p.status == "ok" for p in mine)]
        oom = first_oom_on_grid(points, s)
        derived = [p.seq_len for p in points if p.series == s and p.kind == "derived"]
        top = oom.seq_len if oom else max(measured + derived + [GRID_START])
        grid = [n for n in _powers(GRID_START, top)]
        out[s] = {"measured": measured, "trained": trained, "first_oom": oom.seq_len if oom else None,
                  "missing": [n for n in grid if n not in measured and n not in derived],
                  "searched": any(p.searched for p in mine)}
    return out


def _powers(lo: int, hi: int) -> list[int]:
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= 2
    return out


def tokens_label(n: int) -> str:
    """1024 -> '1K', 139264 -> '136K', 4194304 -> '4M'."""
    if n >= 1 << 20:
        return f"{n / (1 << 20):g}M"
    return f"{n / 1024:g}K" if n >= 1024 else str(n)


def _short(v: float) -> str:
    """Axis numbers: 20000 -> '20K', 1.5 -> '1.5'."""
    return f"{v / 1000:g}K" if v >= 1000 else f"{v:g}"


def _footer(meta: dict, points: list[Point], what: str) -> str:
    commits = sorted({p.commit for p in points if p.kind != "probe"})
    dates = sorted({p.date for p in points})
    span = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    return (f"{meta.get('gpu', '?')}; {meta.get('model', '')}, batch 1; measured {span} at commits "
            f"{', '.join(commits)}. {what}\nMade by `python -m minigpt.figures` from "
            f"{meta.get('_source', 'the data file')}.")


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_longest(meta: dict, points: list[Point]):
    """Horizontal bars, log axis: the longest trained seq_len per series, measured and derived apart."""
    plt = _pyplot()
    from matplotlib.patches import Patch
    order = series_order(points)
    style = styles(order)
    bars = []  # (label, seq_len, colour, how)
    for s in order:
        mine = [p for p in points if p.series == s and p.status == "ok"]
        measured = [p for p in mine if p.kind == "measured"]
        derived = [p for p in mine if p.kind == "derived"]
        if measured:
            best = max(measured, key=lambda p: p.seq_len)
            how = "searched" if first_oom_any(points, s, best.seq_len) else "ran"
            bars.append((s, best.seq_len, style[s][0], how))
        if derived and (not measured or max(p.seq_len for p in derived) > bars[-1][1]):
            bars.append((f"{s} (derived)", max(p.seq_len for p in derived), style[s][0], "derived"))
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(bars) + 1.8))
    look = {"searched": dict(alpha=1.0, hatch=None), "ran": dict(alpha=0.55, hatch=".."),
            "derived": dict(alpha=0.3, hatch="//")}
    for i, (label, n, colour, how) in enumerate(bars):
        ax.barh(i, n, color=colour, edgecolor="black", linewidth=0.6, **look[how])
        ax.text(n * 1.08, i, tokens_label(n), va="center", fontsize=8)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log", base=2)
    ticks = _powers(GRID_START * 4, max(b[1] for b in bars) * 4)[::2]
    ax.set_xticks(ticks, [tokens_label(n) for n in ticks])
    ax.set_xlim(ticks[0], ticks[-1])
    ax.set_xlabel("longest seq_len trained (tokens, one sequence per step)")
    ax.set_title(f"How far the context goes: gpt2-small on {meta.get('gpu', '?')}")
    ax.legend(handles=[Patch(facecolor="grey", edgecolor="black", label="measured, searched up to an OOM"),
                       Patch(facecolor="grey", edgecolor="black", alpha=0.55, hatch="..",
                             label="measured at this length, not searched above"),
                       Patch(facecolor="grey", edgecolor="black", alpha=0.3, hatch="//",
                             label="derived from 1- and 2-layer probes")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.text(0.01, 0.005, _footer(meta, points, "Bars are the longest length that trained."), fontsize=7,
             va="bottom")
    fig.subplots_adjust(left=0.33, right=0.72, bottom=1.1 / (0.42 * len(bars) + 1.8))
    return fig


def first_oom_any(points: list[Point], series: str, above: int) -> bool:
    """Whether this series has an out-of-memory trial above `above` (on the grid or not)."""
    return any(p.series == series and p.kind == "measured" and p.status == "oom" and p.seq_len > above
               for p in points)


METRICS = {"memory": ("peak_gib", "peak allocated (GiB)", "Peak GPU memory against seq_len"),
           "tokens_per_s": ("tokens_per_s", "tokens/s (all GPUs)", "Training throughput against seq_len")}


def plot_vs_seq_len(meta: dict, points: list[Point], metric: str):
    """One line per series over the grid of powers of two; x at the first grid length that ran out of memory."""
    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter
    from matplotlib.transforms import blended_transform_factory
    attr, ylabel, title = METRICS[metric]
    order = series_order(points)
    style = styles(order)
    fig, ax = plt.subplots(figsize=(11, 6))
    handles = []
    at: dict[int, list[str]] = {}  # series whose OOM mark falls at each length
    for s in order:
        if (oom := first_oom_on_grid(points, s)) is not None:
            at.setdefault(oom.seq_len, []).append(s)
    nudge = {s: k - (len(group) - 1) / 2 for group in at.values() for k, s in enumerate(group)}
    for i, s in enumerate(order):
        colour, marker = style[s]
        size = 11 - 0.5 * i  # coinciding points stay visible: each later marker sits inside the earlier ones
        ok = sorted((p for p in points if p.series == s and p.status == "ok" and is_grid(p.seq_len)
                     and p.kind in ("measured", "derived") and getattr(p, attr) is not None),
                    key=lambda p: p.seq_len)
        meas = [p for p in ok if p.kind == "measured"]
        if meas:
            ax.plot([p.seq_len for p in meas], [getattr(p, attr) for p in meas], color=colour, marker=marker,
                    linestyle="-", markersize=size, label=s)
        der = [p for p in ok if p.kind == "derived"]
        if der:
            ax.plot([p.seq_len for p in der], [getattr(p, attr) for p in der], color=colour, marker=marker,
                    markerfacecolor="none", linestyle="none", markersize=9, label=f"{s} (derived)")
            if meas:  # a dotted bridge from the last measured point to the derived one
                ax.plot([meas[-1].seq_len, der[0].seq_len], [getattr(meas[-1], attr), getattr(der[0], attr)],
                        color=colour, linestyle=":", linewidth=1)
        oom = first_oom_on_grid(points, s)
        if oom is not None:
            x = oom.seq_len * 2 ** (0.12 * nudge[s])  # marks at one length sit side by side
            if metric == "memory" and oom.peak_gib is not None:
                ax.plot([x], [oom.peak_gib], linestyle="none", marker=OOM_MARKER, color=colour, markersize=10,
                        markeredgewidth=2)
            else:  # no throughput for a failed step: the mark sits at the bottom of the axes
                tr = blended_transform_factory(ax.transData, ax.transAxes)
                ax.plot([x], [0.03], transform=tr, linestyle="none", marker=OOM_MARKER, color=colour,
                        markersize=10, markeredgewidth=2, clip_on=False)
        handles.append(Line2D([], [], color=colour, marker=marker, label=s))
    if metric == "memory" and meta.get("gpu_memory_gib"):
        ax.axhline(meta["gpu_memory_gib"], color="grey", linestyle="--", linewidth=1)
        ax.text(GRID_START, meta["gpu_memory_gib"] * 1.08, f"{meta.get('gpu', 'GPU')}: "
                f"{meta['gpu_memory_gib']} GiB usable", fontsize=8, color="grey")
    handles += [Line2D([], [], color="black", marker="o", markerfacecolor="none", linestyle="none",
                       label="hollow: derived from 1- and 2-layer probes"),
                Line2D([], [], color="black", marker=OOM_MARKER, linestyle="none", markeredgewidth=2,
                       label="x: first grid length out of memory" + (" (peak at failure)" if metric == "memory"
                                                                     else ""))]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = _powers(GRID_START, max(p.seq_len for p in points if p.kind != "probe"))
    ax.set_xticks(ticks, [tokens_label(n) for n in ticks], fontsize=8)
    ax.set_xlim(GRID_START / 1.5, ticks[-1] * 1.5)
    ax.set_xlabel("seq_len (tokens, batch 1; powers of two only)")
    ax.set_ylabel(ylabel)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _short(v)))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: _short(v) if str(round(v))[0] in "25" else ""))
    ax.set_title(f"{title}: gpt2-small on {meta.get('gpu', '?')}")
    ax.grid(alpha=0.3, which="both")
    fig.text(0.01, 0.005, _footer(meta, points, "Lines join measured grid points; missing points were not run."),
             fontsize=7, va="bottom")
    fig.subplots_adjust(left=0.08, right=0.66, bottom=0.16)
    return fig


def gpu_slug(meta: dict) -> str:
    return str(meta.get("gpu", "GPU")).replace(" ", "_")


def write_figures(data_path: Path, out: Path) -> list[Path]:
    """The three PNGs and README.md in `out`; returns their paths."""
    meta, points = load(data_path)
    meta["_source"] = Path(data_path).as_posix()
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    slug = gpu_slug(meta)
    written = []
    for name, fig in [(f"longest_context_{slug}.png", plot_longest(meta, points)),
                      (f"memory_vs_seq_len_{slug}.png", plot_vs_seq_len(meta, points, "memory")),
                      (f"tokens_per_s_vs_seq_len_{slug}.png", plot_vs_seq_len(meta, points, "tokens_per_s"))]:
        fig.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(out / name)
    readme = out / "README.md"  # another GPU's figures' README there is kept: this one takes the GPU's name
    title = f"# Figures: {meta.get('model', '')} on {meta.get('gpu', '?')}"
    if readme.exists() and not readme.read_text().startswith(title):
        readme = out / f"README_{slug}.md"
    readme.write_text(sidecar(meta, points, [p.name for p in written]))
    return written + [readme]


def sidecar(meta: dict, points: list[Point], names: list[str]) -> str:
    """README.md for the figures: provenance and the grid points never measured."""
    lines = [f"# Figures: {meta.get('model', '')} on {meta.get('gpu', '?')}", "",
             f"Made by `python -m minigpt.figures --data {meta.get('_source')} --out <this folder>` from the "
             f"trials in `{meta.get('_source')}`; each group there names its commit, date and command.", ""]
    lines += [f"- `{n}`" for n in names]
    lines += ["", "| commit | date | GPUs | what ran |", "|---|---|---|---|"]
    seen = set()
    for p in points:
        key = (p.commit, p.date, p.gpus, p.variant)
        if key not in seen and p.kind != "probe":
            seen.add(key)
            lines.append(f"| {p.commit} | {p.date} | {p.gpus} | {p.variant} ({p.kind}) |")
    lines += ["", "## Grid points not measured", "",
              "The memory and tokens/s figures use powers of two from 1K. Per variant, the grid lengths measured, "
              "the first that ran out of memory, and those below it (or below the longest length run) that were "
              "never run:", "", "| variant | trained | first OOM | not measured |", "|---|---|---|---|"]
    for s, g in grid_gaps(points).items():
        lines.append(f"| {s} | {', '.join(map(tokens_label, g['trained'])) or '–'} | "
                     f"{tokens_label(g['first_oom']) if g['first_oom'] else '–'} | "
                     f"{', '.join(map(tokens_label, g['missing'])) or '–'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minigpt.figures", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"trials JSON (default: {DEFAULT_DATA})")
    p.add_argument("--out", type=Path, required=True, help="folder for the PNGs and their README.md")
    p.add_argument("--from-sweep", type=Path, nargs="+", metavar="DIR",
                   help="first write --data (a new file) from these minigpt-sweep directories (or training run "
                        "directories: one trial each)")
    args = p.parse_args(argv)
    if args.from_sweep:
        if args.data.exists():
            print(f"--data: {args.data} exists; name a new file for the data built from --from-sweep (nothing was "
                  f"overwritten)", file=sys.stderr)
            return 2
        try:
            data = from_sweeps(args.from_sweep)
        except ValueError as e:
            print(f"--from-sweep: {e}", file=sys.stderr)
            return 2
        args.data.parent.mkdir(parents=True, exist_ok=True)
        args.data.write_text(json.dumps(data, indent=1) + "\n")
        print(args.data.as_posix())
    if not args.data.is_file():
        print(f"--data: no file at {args.data}", file=sys.stderr)
        return 2
    for path in write_figures(args.data, args.out):
        print(path.as_posix())
    return 0


if __name__ == "__main__":
    sys.exit(main())

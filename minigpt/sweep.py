"""Context-length sweep: the largest seq_len each attention backend (with or without memory levers) can train.

For each variant (a backend plus optional levers, e.g. `flash+levers`), a search runs training trials at
batch 1: it doubles seq_len from a start value until a trial fails, then bisects between the last success
and the first failure down to a granularity (a multiple of 128, or 1/16 of the first bracket). Each trial
is `scripts/train.py` in a fresh subprocess (a clean CUDA allocator), read back from its summary.json:
out-of-memory is a result (status `oom`, with the peak at failure), other failures are `error`, a trial
over its time limit is `timeout`. Finished trials are appended to trials.jsonl, so a sweep resumes
without re-running them. Probe mode measures a model with fewer layers at the same length and derives
the full model's memory and step time from the measured per-layer increment (marked as derived).
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parent.parent
KB = 1024.0
GIB = float(1 << 30)

# Memory levers by name; a variant is "<backend>[+lever...][@L<n_layer>]", e.g. "flash+levers+offload"
# or, for a probe with 2 layers, "flash+levers@L2".
LEVERS: dict[str, list[str]] = {
    "ckpt": ["model.checkpoint_every=1"],
    "bf16ckpt": ["model.checkpoint_every=1", "model.checkpoint_dtype=bfloat16"],
    "losschunk": ["model.loss_chunk=16384"],
    "mlpchunk": ["model.mlp_chunk=65536"],
    "offload": ["model.checkpoint_every=1", "model.offload=true"],
    "keepattn": ["model.checkpoint_every=1", "model.keep_attention=true"],
}
LEVERS["levers"] = LEVERS["bf16ckpt"] + LEVERS["losschunk"] + LEVERS["mlpchunk"]


def variant_overrides(variant: str) -> list[str]:
    """Hydra overrides for a variant name like 'flash+levers' or 'flash+levers@L2'."""
    variant, _, layers = variant.partition("@L")
    backend, *levers = variant.split("+")
    if backend not in ("naive", "sdpa", "flash"):
        raise ValueError(f"variant {variant}: backend must be naive, sdpa or flash")
    out = [f"attention={backend}"]
    for lever in levers:
        if lever not in LEVERS:
            raise ValueError(f"variant {variant}: unknown lever {lever}; known: {', '.join(LEVERS)}")
        out += [o for o in LEVERS[lever] if o not in out]
    if layers:
        out.append(f"model.n_layer={int(layers)}")
    return out


@dataclass
class Trial:
    variant: str
    seq_len: int
    status: str  # ok | oom | error | timeout
    peak_allocated_gib: float | None = None
    peak_reserved_gib: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    wall_s: float | None = None
    n_layer: int | None = None
    error: str | None = None
    run_dir: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def kb_per_token(self) -> float | None:
        return self.peak_allocated_gib * GIB / KB / self.seq_len if self.peak_allocated_gib else None


TrialRunner = Callable[[str, int], Trial]


def _round(n: float, granularity: int) -> int:
    return max(granularity, int(round(n / granularity)) * granularity)


def search_max_seq_len(run: TrialRunner, variant: str, start: int, granularity: int = 128,
                       max_seq_len: int | None = None, out_of_time: Callable[[], bool] = lambda: False) -> list[Trial]:
    """Trials of the doubling-then-bisection search for `variant`; the best is the longest ok trial.

    If `start` fails, halve until a success (or below the granularity). Bisection stops when the bracket
    is at most max(granularity, first bracket / 16). Failures need not be monotone in seq_len: the
    search only ever reports a length that itself succeeded.
    """
    trials: list[Trial] = []

    def attempt(n: int) -> Trial | None:
        if out_of_time():
            return None
        t = run(variant, n)
        trials.append(t)
        return t

    lo, hi = None, None  # longest known success, shortest known failure above it
    n = start
    while True:  # phase 1: find a bracket
        t = attempt(n)
        if t is None:
            return trials
        if t.ok:
            lo = n
            if max_seq_len is not None and n >= max_seq_len:
                return trials
            n = min(n * 2, max_seq_len) if max_seq_len else n * 2
        else:
            hi = n
            if lo is not None:
                break
            if n // 2 < granularity:
                return trials
            n = _round(n // 2, granularity)
            if n >= hi:
                return trials
    stop = max(granularity, (hi - lo) // 16)
    while hi - lo > stop:  # phase 2: bisect
        mid = _round((lo + hi) / 2, granularity)
        if mid <= lo or mid >= hi:
            break
        t = attempt(mid)
        if t is None:
            break
        if t.ok:
            lo = mid
        else:
            hi = mid
    return trials


def best(trials: Iterable[Trial]) -> Trial | None:
    ok = [t for t in trials if t.ok]
    return max(ok, key=lambda t: t.seq_len) if ok else None


@dataclass
class SubprocessRunner:
    """Runs one trial as `python scripts/train.py ...` in a fresh process and reads its summary.json."""

    out_dir: Path
    base_overrides: list[str]
    sweep_id: str
    steps: int = 2
    time_limit_s: float = 600.0
    logger: str = "wandb"
    results: dict[tuple[str, int], Trial] = field(default_factory=dict)  # resumed trials by (variant, seq_len)
    log: Callable[[str], None] = print

    def __call__(self, variant: str, seq_len: int) -> Trial:
        if (variant, seq_len) in self.results:
            t = self.results[(variant, seq_len)]
            self.log(f"  {variant:24s} n={seq_len:>9,d}  {t.status:7s} (from trials.jsonl)")
            return t
        run_dir = self.out_dir / "trials" / f"{variant}-n{seq_len}"
        overrides = [*self.base_overrides, *variant_overrides(variant), f"seq_len={seq_len}", "batch_size=1",
                     f"max_steps={self.steps}", "warmup_steps=1", "eval_batches=0", "save_checkpoints=false", f"logger={self.logger}",
                     f"hydra.run.dir={run_dir}"]
        if self.logger == "wandb":
            overrides += [f"logger.group={self.sweep_id}", f"logger.run_name={variant}-n{seq_len}",
                          "logger.tags=[context-sweep]"]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *overrides], cwd=ROOT,
                                  capture_output=True, text=True, timeout=self.time_limit_s)
            returncode, tail = proc.returncode, (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        except subprocess.TimeoutExpired:
            returncode, tail = None, [f"over the {self.time_limit_s:.0f} s trial limit"]
        wall = time.perf_counter() - t0
        trial = self._read(variant, seq_len, run_dir, returncode, tail[0], wall)
        self.results[(variant, seq_len)] = trial
        with open(self.out_dir / "trials.jsonl", "a") as f:
            f.write(json.dumps(asdict(trial)) + "\n")
        kb = f"{trial.kb_per_token:7.1f} KB/token" if trial.kb_per_token else ""
        peak = f"{trial.peak_allocated_gib:6.1f} GiB" if trial.peak_allocated_gib is not None else ""
        self.log(f"  {variant:24s} n={seq_len:>9,d}  {trial.status:7s} {peak} {kb} "
                 f"{'' if not trial.tokens_per_s else f'{trial.tokens_per_s:,.0f} tok/s'} ({wall:.0f} s) {trial.error or ''}")
        return trial

    @staticmethod
    def _read(variant: str, seq_len: int, run_dir: Path, returncode: int | None, tail: str, wall: float) -> Trial:
        summary_path = run_dir / "summary.json"
        s = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        if returncode is None:
            status, error = "timeout", tail
        elif returncode == 0 and s.get("status") == "ok":
            status, error = "ok", None
        elif returncode == 3 or s.get("status") == "oom":
            status, error = "oom", None
        else:
            status, error = "error", s.get("error") or tail or f"exit code {returncode}"
        return Trial(variant, seq_len, status, s.get("peak_allocated_gib"), s.get("peak_reserved_gib"),
                     s.get("tokens_per_s"), s.get("step_time_s"), wall, s.get("n_layer"), error, str(run_dir))


def load_trials(path: Path) -> dict[tuple[str, int], Trial]:
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                t = Trial(**json.loads(line))
                out[(t.variant, t.seq_len)] = t
    return out


# ------------------------------------------------------------------------------------------------
# Probe: derive a full model's memory and time at seq_len from models with fewer layers
# ------------------------------------------------------------------------------------------------
def derive_from_probes(probes: list[Trial], n_layer: int) -> dict:
    """Linear in layers: value(L) = value(L1) + (L − L1)·(value(L2) − value(L1))/(L2 − L1), from two ok probes."""
    ok = sorted((t for t in probes if t.ok), key=lambda t: t.n_layer)
    if len(ok) < 2:
        return {}
    a, b = ok[0], ok[-1]
    per_layer_gib = (b.peak_allocated_gib - a.peak_allocated_gib) / (b.n_layer - a.n_layer)
    per_layer_s = (b.step_time_s - a.step_time_s) / (b.n_layer - a.n_layer)
    peak = a.peak_allocated_gib + (n_layer - a.n_layer) * per_layer_gib
    step = a.step_time_s + (n_layer - a.n_layer) * per_layer_s
    return {"variant": a.variant.partition("@L")[0], "seq_len": a.seq_len, "n_layer": n_layer, "derived": True,
            "probe_layers": [t.n_layer for t in ok], "per_layer_gib": per_layer_gib, "per_layer_step_s": per_layer_s,
            "peak_allocated_gib": peak, "kb_per_token": peak * GIB / KB / a.seq_len, "step_time_s": step,
            "tokens_per_s": a.seq_len / step}


# ------------------------------------------------------------------------------------------------
# Reports: JSON, CSV, markdown table, PNG plots, W&B summary run
# ------------------------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str, unit: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{unit}"


def markdown_table(trials_by_variant: dict[str, list[Trial]], derived: list[dict], header: str) -> str:
    lines = [header, "", "| variant | max seq_len | peak allocated at max | KB/token | tokens/s at max | step time at max | "
             "first failure above | trials |", "|---|---|---|---|---|---|---|---|"]
    for variant, trials in trials_by_variant.items():
        b = best(trials)
        fail = min((t for t in trials if not t.ok and (b is None or t.seq_len > b.seq_len)), key=lambda t: t.seq_len,
                   default=None)
        fail_s = f"{fail.seq_len:,} ({fail.status})" if fail else "– (not reached)"
        if b is None:
            lines.append(f"| {variant} | none | – | – | – | – | {fail_s} | {len(trials)} |")
        else:
            lines.append(f"| {variant} | {b.seq_len:,} | {_fmt(b.peak_allocated_gib, '.1f', ' GiB')} | "
                         f"{_fmt(b.kb_per_token, '.1f')} | {_fmt(b.tokens_per_s, ',.0f')} | {_fmt(b.step_time_s, '.2f', ' s')} | "
                         f"{fail_s} | {len(trials)} |")
    for d in derived:
        lines.append(f"| {d['variant']} ({d['n_layer']} layers, **derived** from {d['probe_layers']}-layer probes) | "
                     f"{d['seq_len']:,} | {d['peak_allocated_gib']:.1f} GiB | {d['kb_per_token']:.1f} | "
                     f"{d['tokens_per_s']:,.0f} | {d['step_time_s']:.1f} s | – | probe |")
    return "\n".join(lines) + "\n"


def plot(trials_by_variant: dict[str, list[Trial]], out_dir: Path, derived: list[dict] = (), prefix: str = "") -> list[Path]:
    """memory_vs_seq_len.png and tokens_per_s_vs_seq_len.png: one line per variant, failures ×, derived points hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label, name in (("peak_allocated_gib", "peak allocated (GiB)", "memory_vs_seq_len.png"),
                             ("tokens_per_s", "tokens/s", "tokens_per_s_vs_seq_len.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for variant, trials in trials_by_variant.items():
            ok = sorted((t for t in trials if t.ok and getattr(t, key)), key=lambda t: t.seq_len)
            line, = ax.plot([t.seq_len for t in ok], [getattr(t, key) for t in ok], marker="o", label=variant)
            bad = [t for t in trials if not t.ok]
            if bad:
                y = [getattr(t, key) or (ok[-1].peak_allocated_gib if key == "peak_allocated_gib" and ok else 0)
                     for t in bad] if key == "peak_allocated_gib" else [0 for _ in bad]
                ax.scatter([t.seq_len for t in bad], y, marker="x", s=60, color=line.get_color())
            for d in derived:
                if d["variant"] == variant:
                    ax.scatter([d["seq_len"]], [d[key]], marker="o", s=70, facecolors="none", edgecolors=line.get_color(),
                               label=f"{variant} ({d['n_layer']} layers, derived)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("seq_len (batch 1); × = failed (OOM); hollow = derived from probes")
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


def log_summary_to_wandb(trials_by_variant: dict[str, list[Trial]], derived: list[dict], plots: list[Path],
                         sweep_id: str, project: str, out_dir: Path) -> None:
    """One W&B run for the sweep: a Table of all trials, line plots per variant, the PNGs and the maximums."""
    import wandb

    from minigpt.loggers import wandb_mode

    run = wandb.init(project=project, group=sweep_id, name=f"{sweep_id}-summary", job_type="context-sweep",
                     dir=str(out_dir), mode=wandb_mode("auto"), settings=wandb.Settings(silent=True))
    columns = ["variant", "seq_len", "status", "peak_allocated_gib", "peak_reserved_gib", "kb_per_token",
               "tokens_per_s", "step_time_s"]
    rows = [[t.variant, t.seq_len, t.status, t.peak_allocated_gib, t.peak_reserved_gib, t.kb_per_token, t.tokens_per_s,
             t.step_time_s] for trials in trials_by_variant.values() for t in sorted(trials, key=lambda t: t.seq_len)]
    table = wandb.Table(columns=columns, data=rows)
    logged = {"sweep/trials": table, **{f"sweep/{p.stem}": wandb.Image(str(p)) for p in plots}}
    for key, title in (("peak_allocated_gib", "peak allocated GiB vs seq_len"), ("tokens_per_s", "tokens/s vs seq_len")):
        xs, ys, keys = [], [], []
        for variant, trials in trials_by_variant.items():
            ok = sorted((t for t in trials if t.ok), key=lambda t: t.seq_len)
            if ok:
                xs.append([t.seq_len for t in ok])
                ys.append([getattr(t, key) for t in ok])
                keys.append(variant)
        if keys:
            logged[f"sweep/{key}_vs_seq_len"] = wandb.plot.line_series(xs=xs, ys=ys, keys=keys, title=title, xname="seq_len")
    run.log(logged)
    for variant, trials in trials_by_variant.items():
        b = best(trials)
        run.summary[f"max_seq_len/{variant}"] = b.seq_len if b else 0
        if b:
            run.summary[f"peak_gib_at_max/{variant}"] = b.peak_allocated_gib
            run.summary[f"tokens_per_s_at_max/{variant}"] = b.tokens_per_s
    for d in derived:
        run.summary[f"derived/{d['variant']}/n{d['seq_len']}/peak_gib"] = d["peak_allocated_gib"]
    run.finish()
    wandb.teardown()  # waits until the offline run file is written (finish() returns before; see loggers.py)


def write_reports(trials_by_variant: dict[str, list[Trial]], derived: list[dict], out_dir: Path, header: str) -> Path:
    all_trials = [t for trials in trials_by_variant.values() for t in trials]
    (out_dir / "results.json").write_text(json.dumps(
        {"header": header, "trials": [asdict(t) | {"kb_per_token": t.kb_per_token} for t in all_trials],
         "max": {v: (asdict(b) if (b := best(ts)) else None) for v, ts in trials_by_variant.items()},
         "derived": derived}, indent=1) + "\n")
    with open(out_dir / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "seq_len", "status", "peak_allocated_gib", "peak_reserved_gib", "kb_per_token",
                    "tokens_per_s", "step_time_s", "wall_s", "error"])
        for t in all_trials:
            w.writerow([t.variant, t.seq_len, t.status, t.peak_allocated_gib, t.peak_reserved_gib, t.kb_per_token,
                        t.tokens_per_s, t.step_time_s, t.wall_s, t.error or ""])
    md = out_dir / "results.md"
    md.write_text(markdown_table(trials_by_variant, derived, header))
    return md


def combine(sweep_dirs: list[Path], out_dir: Path, name: str, header: str) -> Path:
    """Merge several sweep directories (their results.json: trials and derived probe figures) into one table and plot pair.

    Probe trials (variants with @L) only enter through their derived full-model figures.
    """
    trials_by_variant: dict[str, list[Trial]] = {}
    derived: list[dict] = []
    fields = set(Trial.__dataclass_fields__)
    for d in sweep_dirs:
        results = json.loads((Path(d) / "results.json").read_text())
        for record in results["trials"]:
            t = Trial(**{k: v for k, v in record.items() if k in fields})
            if "@L" not in t.variant:
                trials_by_variant.setdefault(t.variant, []).append(t)
        derived += results.get("derived", [])
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(trials_by_variant, out_dir, derived, prefix=f"{name}_")
    md = out_dir / f"{name}.md"
    md.write_text(markdown_table(trials_by_variant, derived, header))
    return md


@dataclass
class SweepConfig:
    variants: list[str]
    out_dir: Path
    base_overrides: list[str] = field(default_factory=lambda: ["model=gpt2-small"])
    start: dict[str, int] = field(default_factory=dict)  # per-variant start seq_len
    default_start: int = 4096
    granularity: int = 128
    max_seq_len: int | None = None
    steps: int = 2
    trial_time_limit_s: float = 600.0
    budget_s: float = 3600.0
    logger: str = "wandb"
    project: str = "minigpt"
    probe_seq_lens: list[int] = field(default_factory=list)  # probe mode: these lengths with fewer layers
    probe_layers: tuple[int, int] = (1, 2)
    full_n_layer: int = 12
    search: bool = True  # False: only the probes

def run_sweep(cfg: SweepConfig, runner: TrialRunner | None = None, log: Callable[[str], None] = print) -> Path:
    """Search every variant (and run the probes), then write results.{json,csv,md} and plots; returns results.md."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    sweep_id = f"sweep-{cfg.out_dir.name}"
    for v in cfg.variants:
        variant_overrides(v)  # fail fast on a bad name
    if runner is None:
        runner = SubprocessRunner(cfg.out_dir, cfg.base_overrides, sweep_id, cfg.steps, cfg.trial_time_limit_s,
                                  cfg.logger, load_trials(cfg.out_dir / "trials.jsonl"), log)
    t0 = time.perf_counter()
    out_of_time = lambda: time.perf_counter() - t0 > cfg.budget_s  # noqa: E731
    trials_by_variant: dict[str, list[Trial]] = {}
    for variant in cfg.variants if cfg.search else []:
        log(f"{variant}: searching from {cfg.start.get(variant, cfg.default_start):,}")
        trials_by_variant[variant] = search_max_seq_len(runner, variant, cfg.start.get(variant, cfg.default_start),
                                                        cfg.granularity, cfg.max_seq_len, out_of_time)
        b = best(trials_by_variant[variant])
        log(f"{variant}: max seq_len {b.seq_len:,}" if b else f"{variant}: no length trained")
        if out_of_time():
            log(f"sweep budget of {cfg.budget_s:.0f} s spent; reporting what ran")
            break
    derived = []
    for n in cfg.probe_seq_lens:
        for variant in cfg.variants:
            probes = [runner(f"{variant}@L{layers}", n) for layers in cfg.probe_layers]
            d = derive_from_probes(probes, cfg.full_n_layer)
            if d:
                derived.append(d)
                log(f"{variant} at {n:,}: derived {d['peak_allocated_gib']:.1f} GiB ({d['kb_per_token']:.1f} KB/token), "
                    f"{d['step_time_s']:.1f} s/step for {cfg.full_n_layer} layers")
    header = (f"Context-length sweep `{sweep_id}`: batch 1, {cfg.steps} training steps per trial, "
              f"overrides {' '.join(cfg.base_overrides)}. Peak = torch.cuda.max_memory_allocated.")
    plots = plot(trials_by_variant, cfg.out_dir, derived)
    md = write_reports(trials_by_variant, derived, cfg.out_dir, header)
    if cfg.logger == "wandb":
        log_summary_to_wandb(trials_by_variant, derived, plots, sweep_id, cfg.project, cfg.out_dir)
    return md


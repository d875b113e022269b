"""The sweep's logic, free of processes and files: variant names, the search for the longest seq_len, probes.

A variant is `<backend>[+lever...][@L<n_layer>]`, e.g. `flash+levers` or, for a 2-layer probe, `flash+levers@L2`.
Backends are the registered attention backends; levers are the memory levers of LEVERS. The search runs
trials at batch 1: it doubles seq_len from a start until a trial fails, then bisects between the longest
success and the shortest failure above it. Only out-of-memory and over-time trials bound the search: an
`error` (a bad setting, a crash) says nothing about memory, so it ends that variant's search instead.
Probes measure a model with fewer layers at one length and derive the full model's memory and step time
from the per-layer increment.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable

from minigpt.attention import BACKENDS, attention_names

KB = 1024.0
GIB = float(1 << 30)
PROBE_MARK = "@L"

# Memory levers by name: the trainer overrides each one adds (docs/memory.md).
LEVERS: dict[str, list[str]] = {
    "ckpt": ["model.recompute_every=1"],
    "bf16ckpt": ["model.recompute_every=1", "model.recompute_dtype=bfloat16"],
    "losschunk": ["model.loss_chunk=4096"],
    "mlpchunk": ["model.mlp_chunk=65536"],
    "offload": ["model.recompute_every=1", "model.offload=true"],
    "keepattn": ["model.recompute_every=1", "model.keep_attention=true"],
    "compile": ["compile=true"],  # regional torch.compile: a lever too (fused loss and MLP need less memory)
}
LEVERS["levers"] = LEVERS["bf16ckpt"] + LEVERS["losschunk"] + LEVERS["mlpchunk"]
NEEDS_LSE = "model.keep_attention=true"  # only backends that return their log-sum-exp can keep attention


def variant_overrides(variant: str) -> list[str]:
    """Trainer overrides for a variant name; ValueError with a one-line reason for a bad name."""
    name, _, layers = variant.partition(PROBE_MARK)
    backend, *levers = name.split("+")
    if backend not in attention_names():
        raise ValueError(f"variant {variant}: unknown backend '{backend}'; known: {', '.join(attention_names())}")
    out = [f"attention={backend}"]
    for lever in levers:
        if lever not in LEVERS:
            raise ValueError(f"variant {variant}: unknown lever '{lever}'; known: {', '.join(LEVERS)}")
        out += [o for o in LEVERS[lever] if o not in out]
    if NEEDS_LSE in out and not BACKENDS[backend].returns_lse:
        keeps = [n for n, b in BACKENDS.items() if b.returns_lse]
        raise ValueError(f"variant {variant}: keeping attention needs a backend that returns its log-sum-exp "
                         f"({', '.join(keeps)})")
    if "compile=true" not in out:
        out.append("compile=false")  # a variant without +compile is eager, whatever the trainer's default
    if PROBE_MARK in variant:
        if not layers.isdigit() or int(layers) < 1:
            raise ValueError(f"variant {variant}: {PROBE_MARK} needs a layer count >= 1, e.g. {name}{PROBE_MARK}2")
        out.append(f"model.n_layer={int(layers)}")
    return out


# The memory settings of a run without levers (the model config's defaults), as summary.json records them.
NO_LEVERS = {"recompute_every": 0, "recompute_dtype": "float32", "offload": False, "keep_attention": False,
             "mlp_chunk": 0, "loss_chunk": 0}


def lever_settings(variant: str) -> dict:
    """The memory settings a variant's levers give, in summary.json's `levers` form (NO_LEVERS where untouched)."""
    out = dict(NO_LEVERS)
    for o in variant_overrides(variant):
        key, _, value = o.partition("=")
        if key.startswith("model.") and key.removeprefix("model.") in out:
            out[key.removeprefix("model.")] = {"true": True}.get(value, int(value) if value.isdigit() else value)
    return out


# Lever names in the order a variant name lists them ("levers" first, as the sweep's variants are written)
LEVER_ORDER = ("levers", "ckpt", "bf16ckpt", "losschunk", "mlpchunk", "offload", "keepattn")


def variant_of(summary: dict) -> str:
    """The variant name of the setting a run's summary.json records (attention, levers, compile): the inverse of
    variant_overrides, so a lone training run can stand beside a sweep's variants. The shortest name in LEVER_ORDER
    whose lever_settings are the recorded ones; ValueError when no name gives them (recompute every 2 blocks, a loss
    chunk other than the levers', no attention recorded)."""
    if not summary.get("attention"):
        raise ValueError("the summary records no attention backend: not a training run's summary.json")
    recorded = {k: (summary.get("levers") or {}).get(k, v) for k, v in NO_LEVERS.items()}
    compiled = ["compile"] if summary.get("compile") else []
    for count in range(len(LEVER_ORDER) + 1):
        for names in itertools.combinations(LEVER_ORDER, count):
            name = "+".join([summary["attention"], *names, *compiled])
            try:
                if lever_settings(name) == recorded:
                    return name
            except ValueError:  # a name this backend cannot run (keepattn without an LSE)
                continue
    raise ValueError(f"no variant name gives the recorded memory settings {recorded}")


def probe_variant(variant: str, n_layer: int) -> str:
    return f"{variant}{PROBE_MARK}{n_layer}"


def base_variant(variant: str) -> str:
    """The variant a probe stands for ('flash@L2' -> 'flash'); a full variant is its own base."""
    return variant.partition(PROBE_MARK)[0]


def is_probe(variant: str) -> bool:
    return PROBE_MARK in variant


@dataclass
class Trial:
    variant: str
    seq_len: int
    status: str  # ok | oom | timeout | error
    peak_allocated_gib: float | None = None
    peak_reserved_gib: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    wall_s: float | None = None
    n_layer: int | None = None
    error: str | None = None  # one line: why, for status error or timeout
    run_dir: str | None = None  # the trial's run directory, relative to the sweep's --out
    exit_code: int | None = None  # the trainer's; None when it was stopped at the time limit
    host_offload_gib: float | None = None  # host RAM the trial's offloaded activations held, all its ranks together

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def is_error(self) -> bool:
        return self.status == "error"

    @property
    def kb_per_token(self) -> float | None:
        return self.peak_allocated_gib * GIB / KB / self.seq_len if self.peak_allocated_gib else None


TrialRunner = Callable[[str, int], Trial]


def _round(n: float, granularity: int) -> int:
    return max(granularity, int(round(n / granularity)) * granularity)


def search_max_seq_len(run: TrialRunner, variant: str, start: int, granularity: int = 128,
                       max_seq_len: int | None = None, out_of_time: Callable[[], bool] = lambda: False,
                       bisect: bool = True) -> list[Trial]:
    """Trials of the doubling-then-bisection search for `variant`; the best is the longest ok trial.

    If `start` fails, halve until a success (or below the granularity). Bisection stops when the bracket
    is at most max(granularity, first bracket / 16). Failures need not be monotone in seq_len: the
    search only ever reports a length that itself succeeded. An error trial ends the search. Without
    `bisect` it stops at the bracket: start, 2·start, 4·start, ... up to the first failure (the figures' grid).
    """
    trials: list[Trial] = []

    def attempt(n: int) -> Trial | None:
        """The trial at n, or None when the search must stop (budget spent, or an error)."""
        if out_of_time():
            return None
        t = run(variant, n)
        trials.append(t)
        return None if t.is_error else t

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
    while bisect and hi - lo > stop:  # phase 2: bisect
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


def derive_from_probes(probes: list[Trial], n_layer: int) -> dict | None:
    """Linear in layers: value(L) = value(L1) + (L − L1)·(value(L2) − value(L1))/(L2 − L1), from two ok probes
    of different depth at one seq_len; None without them."""
    ok = sorted((t for t in probes if t.ok), key=lambda t: t.n_layer)
    if len(ok) < 2 or ok[0].n_layer == ok[-1].n_layer:
        return None
    a, b = ok[0], ok[-1]
    per_layer_gib = (b.peak_allocated_gib - a.peak_allocated_gib) / (b.n_layer - a.n_layer)
    per_layer_s = (b.step_time_s - a.step_time_s) / (b.n_layer - a.n_layer)
    peak = a.peak_allocated_gib + (n_layer - a.n_layer) * per_layer_gib
    step = a.step_time_s + (n_layer - a.n_layer) * per_layer_s
    host = None  # offloading keeps each layer's block input on the host: linear in layers too
    if a.host_offload_gib is not None and b.host_offload_gib is not None:
        host = a.host_offload_gib + (n_layer - a.n_layer) * (b.host_offload_gib - a.host_offload_gib) / (
            b.n_layer - a.n_layer)
    return {"variant": base_variant(a.variant), "seq_len": a.seq_len, "n_layer": n_layer, "derived": True,
            "probe_layers": [t.n_layer for t in ok], "per_layer_gib": per_layer_gib, "per_layer_step_s": per_layer_s,
            "peak_allocated_gib": peak, "kb_per_token": peak * GIB / KB / a.seq_len, "step_time_s": step,
            "tokens_per_s": a.seq_len / step, "host_offload_gib": host}


def judge_fit(derived: dict, gpu_gib: float | None, host_gib: float | None) -> dict:
    """The derived figure with `fits` (True, False, or None where a capacity is unknown) and `limit` (what it
    exceeds, or what was not judged): its GPU peak (the fullest rank's) against gpu_gib, and the host memory its
    offloaded activations need (all ranks of one host) against host_gib. The frontier is the longest length that
    fits both (issue 35)."""
    over, unjudged = [], []
    for what, need, have in (("GPU", derived["peak_allocated_gib"], gpu_gib),
                             ("host", derived.get("host_offload_gib") or 0.0, host_gib)):
        if have is None:
            unjudged.append(what)
        elif need > have:
            over.append(f"{what} {need:.1f} > {have:.1f} GiB")
    fits = False if over else None if unjudged else True
    limit = "; ".join(over) if over else (f"{' and '.join(unjudged)} memory not given" if unjudged else "fits")
    return {**derived, "fits": fits, "limit": limit}

"""The mask benchmark (issue 33): our kernel and FlexAttention on documents, windows and GQA, against the ideal.

    python scripts/bench_attention.py --masks                 # on one GPU -> runs/bench/masks_<GPU>.{json,md}
    TRITON_INTERPRET=1 python scripts/bench_attention.py --masks --tiny    # dry run of the code on CPU

The cases are mask_cases.py's (all causal, bf16, batch 1). For each, in one process:
- ours: `minigpt_kernels.flash_attention(q, k, v, window=..., document_ids=...)`, the ids tensor passed as is;
- flex: `torch.compile(flex_attention, dynamic=False)` with `enable_gqa` for GQA, and the case's mask as a mask_mod
  (causal, within the window, same document); its BlockMask is made once per case by `create_block_mask`, outside
  the timed region, and its compile time is left out (the first call compiles, then the timing starts).
Times: median ms of fwd+bwd (`torch.autograd.grad` of a fresh forward, bench.py's measure) and of the forward alone
(inputs requiring grad, as in training), CUDA events around each rep, reps until ~0.1 s or 30 (at least 3) after
one warm-up. Where the host issues a call more slowly than the GPU runs it (short calls: GQA at 8K), those events
also catch the host's Python; so fwd+bwd is timed a second way, `queued_ms`: calls issued back to back while the GPU
first works through a sleep, the host ahead as in a model whose other layers' work is queued: the GPU's time alone.
A case's flex output is checked against ours (largest difference relative to ours' largest value).
The ideal of a case is its visible pairs × query heads × batch ÷ our dense causal rate (pairs·heads/s) measured in
the same run at the same N, head_dim and query heads: what our kernel would take if the mask cost nothing but its
visible area. For GQA that reference is the MHA case, so GQA's ratio to the ideal is its time over MHA's. The
references run first and are timed again at the end, each keeping its faster time (bench.py's two passes).
Peak memory: see `peak_extra_bytes`. A case that fails (OOM, flex unsupported) records the error and the rest go on;
cases left when --time-limit runs out are recorded as skipped. The JSON is rewritten after every case.
--mask-groups runs some sections only (with the references they need).
"""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from minigpt.benchmarks.mask_cases import (FULL, GROUPS, MIX_SEED, TINY, MaskCase, mask_cases, run_order, select,
                                           tokens)
from minigpt.files import atomic_write_text, markdown_table
from minigpt.metrics import git_commit, versions

IMPLS = ("ours", "flex")
MIB = float(1 << 20)
DEFINITIONS = (
    "ideal = visible (i, j) pairs × query heads ÷ our dense causal rate (pairs·heads/s) at the same N, D and query "
    "heads in this run (for GQA: the MHA row); ×ideal = ms ÷ ideal ms; ours/flex = flex ms ÷ ours ms (> 1: ours "
    "faster); queued = fwd+bwd ms per call issued back to back behind a GPU sleep (the host ahead: the GPU's time "
    "alone; the other times are per-call events, which also catch a slower host); TFLOP/s of the visible area: "
    "fwd = 4·pairs·D·Hq, fwd+bwd = 3.5·fwd; peak = the most memory allocated during one fwd+bwd above what was "
    "allocated before it, less the output and the three gradients. flex = "
    "torch.compile(flex_attention) (eager on CPU), its block mask built once per case outside the timed region, "
    "compile time excluded.")
DIFF_FLAG = 0.05  # flex vs ours, relative to ours' largest value: bf16 rounding is ~1e-2, a different mask ~1


@dataclass(frozen=True)
class Timing:
    warmup: int  # calls after the first (compiling) one, before the reps
    min_reps: int
    max_reps: int
    budget_ms: float  # reps go on until they add up to this (or max_reps)


GPU_TIMING = Timing(warmup=1, min_reps=3, max_reps=30, budget_ms=100.0)  # do_bench: rep=100 ms
TINY_TIMING = Timing(warmup=0, min_reps=1, max_reps=1, budget_ms=0.0)


@dataclass
class MaskRow:
    """One (case, implementation): the case's shape, then what was measured, then what is derived across rows."""
    case: str
    group: str
    impl: str
    seq_len: int
    head_dim: int
    q_heads: int
    kv_heads: int
    batch: int
    window: int | None
    doc_lengths: list[int] | None
    pairs: int  # visible (i, j) pairs of one head of one sequence
    ms_fwd_bwd: float | None = None
    ms_fwd: float | None = None
    ms_fwd_bwd_queued: float | None = None  # the GPU's time per fwd+bwd with the host ahead (queued_ms; GPU only)
    tflops_fwd_bwd: float | None = None  # of the visible area
    tflops_fwd: float | None = None
    peak_extra_mib: float | None = None
    flex_vs_ours: float | None = None  # flex rows: max |o_flex − o_ours| / max |o_ours|
    error: str = ""
    ideal_ms_fwd_bwd: float | None = None
    ideal_ms_fwd: float | None = None
    vs_ideal_fwd_bwd: float | None = None  # ms ÷ ideal ms: 1 is the ideal, 2 twice its time
    vs_ideal_fwd: float | None = None
    ours_over_flex: float | None = None  # fwd+bwd speed, flex ms ÷ ours ms: > 1 ours is faster (on both rows)
    peak_vs_mha: float | None = None  # GQA rows: peak_extra ÷ that of the MHA case with the same impl and shape

    @classmethod
    def of(cls, case: MaskCase, impl: str) -> MaskRow:
        return cls(case.name, case.group, impl, case.seq_len, case.head_dim, case.q_heads, case.kv_heads, case.batch,
                   case.window, list(case.doc_lengths) if case.doc_lengths else None, case.pairs())

    @property
    def dense(self) -> bool:
        return self.window is None and self.doc_lengths is None and self.q_heads == self.kv_heads


def ours(case: MaskCase, doc_ids: torch.Tensor | None) -> Callable:
    from minigpt_kernels import flash_attention

    return lambda q, k, v: flash_attention(q, k, v, causal=True, window=case.window, document_ids=doc_ids)


def flex_mask_mod(window: int | None, doc_ids: torch.Tensor | None) -> Callable:
    """The case's mask as FlexAttention's mask_mod, as a flex user writes it: causal, within the window, same
    document (the conditions are settled when it is traced)."""
    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        if doc_ids is not None:
            keep = keep & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
        return keep
    return mask_mod


class Flex:
    """FlexAttention: compiled on a GPU; eager on CPU, where its backward is not supported (the dry run records
    that). Block masks above eager_block_mask_max_n tokens come from a compiled create_block_mask, on CPU too (so
    the dry run builds some that way). Dynamo's recompile limit is raised, since every case compiles anew (shapes
    and mask_mods differ), and made an error when hit, so flex never falls back unnoticed to its eager path, which
    holds the N² scores."""

    def __init__(self, compiled: bool, eager_block_mask_max_n: int):
        import torch._dynamo.config as dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        for name, value in (("recompile_limit", 1024), ("cache_size_limit", 1024),
                            ("accumulated_recompile_limit", 4096), ("fail_on_recompile_limit_hit", True)):
            if hasattr(dynamo, name):
                setattr(dynamo, name, max(getattr(dynamo, name), value))
        self.eager_block_mask_max_n = eager_block_mask_max_n
        self.block_mask_eager = create_block_mask
        self.block_mask_compiled = torch.compile(create_block_mask, dynamic=False)
        self.attention = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
        if not compiled:
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")

    def __call__(self, case: MaskCase, doc_ids: torch.Tensor | None, device: torch.device) -> Callable:
        """The case's attention; its BlockMask made here, once (not timed)."""
        make = self.block_mask_eager if case.seq_len <= self.eager_block_mask_max_n else self.block_mask_compiled
        block_mask = make(flex_mask_mod(case.window, doc_ids), case.batch, None, case.seq_len, case.seq_len,
                          device=device)
        gqa = case.q_heads != case.kv_heads
        return lambda q, k, v: self.attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, timing: Timing) -> float:
    """Median ms of fn after timing.warmup calls: min_reps reps, then as many more as fit budget_ms by their median
    (at most max_reps in all). On a GPU each rep lies between two CUDA events and the reps are queued back to back
    (one synchronisation after the first min_reps and one at the end, as triton.testing.do_bench does), so host
    overhead hides behind the GPU's work; on CPU (the dry run) each rep is a perf_counter interval."""
    for _ in range(timing.warmup):
        fn()
    _sync(device)

    def rep() -> Callable[[], float]:
        """Run fn once; return how to read its ms (after a synchronisation)."""
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            return lambda: start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return lambda: ms

    reps = [rep() for _ in range(timing.min_reps)]
    _sync(device)
    each = statistics.median(r() for r in reps)
    count = min(timing.max_reps, max(timing.min_reps, int(timing.budget_ms / max(each, 1e-3))))
    reps += [rep() for _ in range(count - len(reps))]
    _sync(device)
    return statistics.median(r() for r in reps)


QUEUED_CALLS = 20  # at most; fewer for long calls (about 0.2 s of GPU time in all)
QUEUE_SLEEP_CYCLES = 200_000_000  # the GPU's head start (~0.1 s at H100 clocks): the host issues every call meanwhile


def queued_ms(fn: Callable[[], object], device: torch.device, each_ms: float) -> float | None:
    """ms per call of up to QUEUED_CALLS calls of fn issued back to back behind a GPU sleep, one pair of CUDA events
    around them all: with the host ahead, the interval is the GPU's work alone, without the gaps a slow host leaves
    between per-rep events. each_ms: fn's time by time_ms (sets the number of calls). None off the GPU."""
    if device.type != "cuda":
        return None
    calls = max(2, min(QUEUED_CALLS, int(200.0 / max(each_ms, 1e-3))))
    _sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(QUEUE_SLEEP_CYCLES)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    _sync(device)
    return start.elapsed_time(end) / calls


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def peak_extra_bytes(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> int:
    """Working memory of one fwd+bwd: torch.cuda.max_memory_allocated during `o = fn(q, k, v)` and
    `torch.autograd.grad(o, (q, k, v), do)`, minus what was allocated just before (q, k, v, dO, the masks and
    anything else held), minus the bytes of o and of the three gradients the call must return. What is left is what
    the implementation keeps or allocates beyond its inputs and outputs: saved LSE, fp32 dQ accumulators, expanded
    K/V or per-query-head dK/dV (the GQA question), scratch."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = fn(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v), do)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base - _nbytes(o, *grads)


def describe_error(e: BaseException) -> str:
    """One short line for a case that failed: OOM, or the exception's type and first line."""
    if isinstance(e, torch.OutOfMemoryError):
        return "OOM"
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}"


def _rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def run_case(case: MaskCase, device: torch.device, dtype: torch.dtype, timing: Timing, flex: Flex | None,
             impls: tuple[str, ...] = IMPLS) -> list[MaskRow]:
    """Ours, then flex, on the same inputs. The first call of each (it compiles) is also the output check."""
    torch.manual_seed(0)
    B, N, D = case.batch, case.seq_len, case.head_dim
    q = torch.randn(B, case.q_heads, N, D, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, case.kv_heads, N, D, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    doc_ids = case.document_ids(device)
    rows, ours_out = [], None
    for impl in impls:
        row, fn, out = MaskRow.of(case, impl), None, None
        try:
            fn = ours(case, doc_ids) if impl == "ours" else flex(case, doc_ids, device)
            out = fn(q, k, v)
            torch.autograd.grad(out, (q, k, v), do)
            if impl == "ours":
                ours_out = out.detach()
            elif ours_out is not None:
                row.flex_vs_ours = _rel_diff(out, ours_out)
            del out
            row.ms_fwd_bwd = time_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), device, timing)
            row.ms_fwd = time_ms(lambda: fn(q, k, v), device, timing)
            row.ms_fwd_bwd_queued = queued_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), device,
                                              row.ms_fwd_bwd)
            row.tflops_fwd_bwd = case.flops("fwd+bwd") / (row.ms_fwd_bwd * 1e-3) / 1e12
            row.tflops_fwd = case.flops("fwd") / (row.ms_fwd * 1e-3) / 1e12
            if device.type == "cuda":
                row.peak_extra_mib = peak_extra_bytes(fn, q, k, v, do) / MIB
        except NotImplementedError as e:  # flex's backward on CPU: its forward alone still checks the mask
            row.error = describe_error(e)
            if fn is not None and ours_out is not None:
                with torch.no_grad():
                    row.flex_vs_ours = _rel_diff(fn(q.detach(), k.detach(), v.detach()), ours_out)
        except Exception as e:  # noqa: BLE001 - OOM, a compile failure, an unsupported shape: record and go on
            row.error = describe_error(e)
        finally:
            fn = out = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    return rows


def add_derived(rows: list[MaskRow]) -> None:
    """Fill in the ideals and the ratios from the measured rows (in place; rows without a reference stay None)."""
    refs = {(r.seq_len, r.head_dim, r.q_heads): r for r in rows if r.impl == "ours" and r.dense}
    by_case = {(r.case, r.seq_len, r.head_dim, r.q_heads, r.kv_heads, r.impl): r for r in rows}
    for r in rows:
        ref = refs.get((r.seq_len, r.head_dim, r.q_heads))
        work = r.pairs * r.q_heads * r.batch
        for mode in ("fwd_bwd", "fwd"):
            ref_ms, ms = (getattr(ref, f"ms_{mode}"), getattr(r, f"ms_{mode}")) if ref else (None, None)
            ideal = ref_ms * work / (ref.pairs * ref.q_heads * ref.batch) if ref_ms else None
            setattr(r, f"ideal_ms_{mode}", ideal)
            setattr(r, f"vs_ideal_{mode}", ms / ideal if ms and ideal else None)
        ours_row = by_case.get((r.case, r.seq_len, r.head_dim, r.q_heads, r.kv_heads, "ours"))
        flex_row = by_case.get((r.case, r.seq_len, r.head_dim, r.q_heads, r.kv_heads, "flex"))
        if ours_row and flex_row and ours_row.ms_fwd_bwd and flex_row.ms_fwd_bwd:
            r.ours_over_flex = flex_row.ms_fwd_bwd / ours_row.ms_fwd_bwd
        mha = by_case.get(("MHA", r.seq_len, r.head_dim, r.q_heads, r.q_heads, r.impl))
        if r.group == "GQA" and not r.dense and mha and mha.peak_extra_mib and r.peak_extra_mib is not None:
            r.peak_vs_mha = r.peak_extra_mib / mha.peak_extra_mib


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"gpu": gpu, **versions(), "python": platform.python_version(), "date": dt.date.today().isoformat(),
            "commit": git_commit(), "dtype": str(dtype).removeprefix("torch."),
            "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"}


def _f(x: float | None, fmt: str) -> str | None:
    return None if x is None else format(x, fmt)


def results_table(rows: list[MaskRow], env: dict) -> str:
    """One line per case: the ideal, ours and flex fwd+bwd (ms, × ideal, TFLOP/s of the visible area), ours/flex,
    the forwards, the peak memory above inputs and outputs; then the definitions and the mixed documents' lengths."""
    pairs: dict[tuple, dict[str, MaskRow]] = {}
    for r in rows:
        pairs.setdefault((r.case, r.group, r.seq_len, r.head_dim, r.q_heads, r.kv_heads), {})[r.impl] = r
    header = ["case", "N", "D", "Hq:Hkv", "ideal ms", "ours ms", "ours ×ideal", "flex ms", "flex ×ideal",
              "ours/flex", "queued ms ours / flex", "TFLOP/s ours / flex", "fwd ms ours / flex",
              "peak MiB ours / flex", "note"]
    body = []
    for (name, _, N, D, Hq, Hkv), impls in pairs.items():
        o, fx = impls.get("ours"), impls.get("flex")
        notes = [f"{i}: {r.error[:60]}" for i, r in impls.items() if r.error]
        if fx and fx.flex_vs_ours is not None and fx.flex_vs_ours > DIFF_FLAG:
            notes.append(f"flex differs from ours by {fx.flex_vs_ours:.2f}")

        def pair(attr: str, fmt: str) -> str:
            return " / ".join(_f(getattr(r, attr), fmt) or "–" if r else "–" for r in (o, fx))

        peak = pair("peak_extra_mib", ".0f")
        if o and o.peak_vs_mha is not None:
            peak += f" (×MHA {o.peak_vs_mha:.2f} / {(_f(fx.peak_vs_mha, '.2f') if fx else None) or '–'})"
        body.append([name, tokens(N), D, f"{Hq}:{Hkv}", _f(o.ideal_ms_fwd_bwd if o else None, ".2f"),
                     _f(o.ms_fwd_bwd if o else None, ".2f"), _f(o.vs_ideal_fwd_bwd if o else None, ".2f"),
                     _f(fx.ms_fwd_bwd if fx else None, ".2f"), _f(fx.vs_ideal_fwd_bwd if fx else None, ".2f"),
                     _f(o.ours_over_flex if o else None, ".2f"), pair("ms_fwd_bwd_queued", ".2f"),
                     pair("tflops_fwd_bwd", ".0f"),
                     pair("ms_fwd", ".2f"), peak, "; ".join(notes) or None])
    mixes = sorted({(r.seq_len, tuple(r.doc_lengths)) for r in rows if r.case.startswith("docs mix")})
    mix_lines = "".join(f"\n\ndocs mix at {tokens(N)}: {len(ls)} lengths drawn log-uniform "
                        f"{tokens(max(1, N // 128))}..{tokens(N // 4)} (random.Random({MIX_SEED}), the last one cut "
                        f"to fill N): {', '.join(map(str, ls))}." for N, ls in mixes)
    return (f"Masks (issue 33), causal {env['dtype']}, batch 1, fwd+bwd unless marked: {env['gpu']}, torch "
            f"{env['torch']}, triton {env['triton']}, {env['date']}, commit {env['commit']}.\n\n"
            + markdown_table(header, body)
            + "\n" + DEFINITIONS + mix_lines + "\n")


def write_results(rows: list[MaskRow], env: dict, out_dir: Path, complete: bool) -> tuple[Path, Path]:
    """<out>/masks_<GPU>.json (rewritten after every case: a run cut short keeps what it measured) and, when
    complete, the table as masks_<GPU>.md."""
    add_derived(rows)
    stem = "masks_" + env["gpu"].replace(" ", "_")
    js = atomic_write_text(out_dir / f"{stem}.json", json.dumps(
        {"env": env, "complete": complete, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    md = out_dir / f"{stem}.md"
    if complete:
        atomic_write_text(md, results_table(rows, env))
    return js, md


def run_suite(cases: list[MaskCase], device: torch.device, dtype: torch.dtype, timing: Timing, flex: Flex,
              time_limit_s: float, after_case: Callable[[list[MaskRow]], None] = lambda rows: None,
              progress: Callable[[str], None] = print) -> list[MaskRow]:
    """Every case in run order (references first); cases not started within time_limit_s are recorded as skipped.
    Returns the rows in the cases' (table) order; after_case gets them so after each case."""
    start, done = time.monotonic(), {}
    for case in run_order(cases):
        if time.monotonic() - start > time_limit_s:
            done[case] = [MaskRow.of(case, impl) for impl in IMPLS]
            for r in done[case]:
                r.error = f"skipped: time limit {time_limit_s:.0f} s reached"
            continue
        done[case] = run_case(case, device, dtype, timing, flex)
        for r in done[case]:
            _report(r, start, progress)
        after_case([r for c in cases if c in done for r in done[c]])
    for case in (c for c in run_order(cases) if c.dense and c in done):  # the references' second pass
        if time.monotonic() - start > time_limit_s:
            break
        again = run_case(case, device, dtype, timing, flex, impls=("ours",))[0]
        _report(again, start, progress, "(again) ")
        keep_faster(done[case][0], again, case)
    return [r for c in cases if c in done for r in done[c]]


def keep_faster(row: MaskRow, again: MaskRow, case: MaskCase) -> None:
    """bench.py's two passes, for our dense references: each time is the faster of the two (the first cases of a
    run can read slow on a GPU not yet warm, and a slow reference would flatter every ideal built on it); the
    queued time too, which has no TFLOP/s of its own."""
    for mode, flops in (("fwd_bwd", "fwd+bwd"), ("fwd", "fwd"), ("fwd_bwd_queued", None)):
        ms = getattr(again, f"ms_{mode}")
        if ms is not None and (getattr(row, f"ms_{mode}") is None or ms < getattr(row, f"ms_{mode}")):
            setattr(row, f"ms_{mode}", ms)
            if flops:
                setattr(row, f"tflops_{mode}", case.flops(flops) / (ms * 1e-3) / 1e12)


def _report(r: MaskRow, start: float, progress: Callable[[str], None], tag: str = "") -> None:
    ms = f"fwd+bwd {_f(r.ms_fwd_bwd, '9.3f') or '–'} ms fwd {_f(r.ms_fwd, '8.3f') or '–'} ms"
    diff = "" if r.flex_vs_ours is None else f"diff {r.flex_vs_ours:.1e} "
    progress(f"[{time.monotonic() - start:6.1f} s] {tag}{r.case:16s} {r.impl:4s} N={tokens(r.seq_len):5s} "
             f"D={r.head_dim:3d} {r.q_heads:2d}:{r.kv_heads:<2d} {ms} peak+ {_f(r.peak_extra_mib, '.0f') or '–'} MiB "
             f"{diff}{r.error}")


def run_masks(head_dims: tuple[int, ...] | list[int] = FULL.head_dims, groups: tuple[str, ...] | list[str] = GROUPS,
              out: Path = Path("runs/bench"), tiny: bool = False, time_limit_s: float = 510.0,
              progress: Callable[[str], None] = print) -> Path:
    """The suite (the cases of `groups` and their references) on this process's GPU in bf16, or `tiny` (TINY sizes,
    fp32, one rep; on CPU with TRITON_INTERPRET=1 when there is no GPU). Prints the table last; returns its path."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    sizes = replace(TINY if tiny else FULL, head_dims=tuple(head_dims))
    dtype, timing = (torch.float32, TINY_TIMING) if tiny else (torch.bfloat16, GPU_TIMING)
    env = environment(device, dtype)
    flex = Flex(compiled=device.type == "cuda", eager_block_mask_max_n=sizes.eager_block_mask_max_n)
    rows = run_suite(select(mask_cases(sizes), groups), device, dtype, timing, flex, time_limit_s,
                     after_case=lambda rows: write_results(rows, env, out, complete=False), progress=progress)
    js, md = write_results(rows, env, out, complete=True)
    progress(f"results: {js.resolve()}, {md.resolve()}")
    progress(md.read_text())
    return md

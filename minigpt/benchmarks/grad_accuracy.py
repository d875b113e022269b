"""Gradient accuracy over long columns: does the backward's accumulation shrink dK, dV and dQ as the forward's did?

The forward's P·V accumulator truncates (accuracy.py, kernels/NOTES.md); the fold removed that bias from o. The
backward has the same kind of chain, in the other direction: every query row adds into a key's
dV_j = Σ_i P_ij dO_i and dK_j = scale · Σ_i dS_ij q_i, and every key into dQ_i = scale · Σ_j dS_ij k_j. Over L query
rows that is a chain of L additions per key, so the question is the forward's: does it keep a sign, and does it
truncate?

The inputs are accuracy.py's periodic q, k, v (period 1009), and a periodic dO in two kinds:
- "dO centred": dO centred on 0.5, as where the loss pushes o one way over the whole sequence: Σ_i P_ij dO_i then
  keeps one sign, the worst case for a truncating chain;
- "dO zero-mean": the control.

Every query sees every key (non-causal, L queries and L keys). Because everything repeats every 1009 tokens, the
float64 reference needs only the 1009 × 1009 scores of one period, each weighted by how often its residue occurs
among the L rows, not L × L: exact, and cheap at a million tokens. The kernels' dQ, dK and dV on 64 rows spread over
the sequence are compared with it, for our kernel and SDPA's (`measure_grad`: the bias toward zero is taken element
by element, since dQ and dK change sign from row to row where o does not).

dV depends on the forward only through P; dQ and dK also through D_i = dO_i · o_i, which each kernel takes from its
own o: a forward that shrinks o shows in its dQ and dK even where its backward adds exactly (SDPA's o at 1M keys is
3e-3 small). Read dV for the backward's own accumulation, dQ and dK for the pair.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from minigpt.attention import get_provider
from minigpt.benchmarks.accuracy import (PERIOD, ROWS, accuracy_env, figures_text, make_inputs, score, suite_setup,
                                         write_table)
from minigpt.benchmarks.mask_bench import describe_error

GRAD_KINDS = ("dO centred", "dO zero-mean")
GRADS = ("dq", "dk", "dv")


@dataclass
class GradAccuracyRow:
    grads: str  # "dO centred" or "dO zero-mean"
    keys: int  # L: the queries and keys (every query sees every key)
    provider: str
    tensor: str  # "dq", "dk" or "dv"
    rms: float | None  # RMS of the error ÷ RMS of the reference (measure_grad)
    bias: float | None  # RMS over (head, dim) of the mean over rows of the error ÷ RMS of the reference
    toward_zero: float | None  # mean of error · sign(reference) ÷ RMS of the reference; < 0: shrunk toward zero
    error: str = ""


def make_grad_inputs(kind: str, keys: int, heads: int, head_dim: int, device: torch.device, dtype: torch.dtype,
                     seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """accuracy.make_inputs' periodic q, k, v and a periodic dO (1, heads, keys, head_dim), centred on 0.5 for
    "dO centred" and on 0 for "dO zero-mean"."""
    q, k, v = make_inputs("periodic", keys, heads, head_dim, device, dtype, seed)
    g = torch.Generator(device).manual_seed(seed + 1)
    do = torch.randn(1, heads, PERIOD, head_dim, generator=g, device=device) + (0.5 if kind == "dO centred" else 0.0)
    do = do.repeat(1, 1, -(-keys // PERIOD), 1)[:, :, :keys]
    return q, k, v, do.to(dtype).contiguous()


def periodic_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                       rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """float64 dq, dk, dv of non-causal attention of all L queries over all L keys, on `rows`
    ((len(rows), heads, head_dim) each), from one period of the inputs (which must repeat every PERIOD tokens):
    residue r of the L rows occurs count[r] times, so each sum over rows is a sum over residues weighted by count."""
    L, D = q.shape[2], q.shape[3]
    period = min(PERIOD, L)
    q0, k0, v0, do0 = (t[0, :, :period].double().cpu() for t in (q, k, v, do))  # (heads, period, D)
    count = torch.bincount(torch.arange(L) % period, minlength=period).double()  # rows of each residue
    scale = 1 / math.sqrt(D)
    s = q0 @ k0.transpose(1, 2) * scale  # (heads, query residue a, key residue b)
    lse = torch.logsumexp(s + count.log(), dim=2, keepdim=True)  # over all L keys of each residue
    p = torch.exp(s - lse)  # the probability of one key of residue b for a query of residue a
    o = (p * count) @ v0  # (heads, a, D)
    dp = do0 @ v0.transpose(1, 2)  # dO_a · v_b
    delta = (do0 * o).sum(-1, keepdim=True)  # D_a = dO_a · o_a
    ds = p * (dp - delta)
    dq = (ds * count) @ k0 * scale  # Σ over keys: count[b] keys of residue b
    dk = (ds * count[None, :, None]).transpose(1, 2) @ q0 * scale  # Σ over queries: count[a] of residue a
    dv = (p * count[None, :, None]).transpose(1, 2) @ do0
    residues = (rows.cpu() % period).long()
    return {name: t[:, residues].transpose(0, 1) for name, t in (("dq", dq), ("dk", dk), ("dv", dv))}


def measure_grad(g: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(RMS error, bias, signed bias toward zero) of g (rows, heads, head_dim) against ref, over ref's RMS. Unlike
    accuracy.measure (o keeps its sign over rows), the sign is each element's: g = (1 − ε)·ref reads −ε·mean|ref|/RMS
    whatever the signs, and zero-mean noise reads about 0."""
    e, rms = g - ref, ref.pow(2).mean().sqrt()
    bias = e.mean(0).pow(2).mean().sqrt()
    return (e.pow(2).mean().sqrt() / rms).item(), (bias / rms).item(), ((e * ref.sign()).mean() / rms).item()


def grads_of(provider: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
             rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """A provider's dq, dk, dv on `rows` ((len(rows), heads, head_dim) each, float64) for non-causal attention of all
    queries over all keys."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    get_provider(provider)(q, k, v, causal=False).backward(do)
    return {name: t.grad[0, :, rows].transpose(0, 1).double().cpu() for name, t in (("dq", q), ("dk", k), ("dv", v))}


def run_grad_accuracy(keys: list[int], head_dim: int = 64, heads: int | None = None,
                      providers: list[str] | None = None, out: Path = Path("runs/bench"), tiny: bool = False,
                      progress: Callable[[str], None] = print) -> tuple[list[GradAccuracyRow], Path]:
    """The suite: for each dO kind and L in `keys`, our kernel and each of `providers` (default: SDPA's fused
    kernels; "sdpa" with --tiny), against the periodic float64 reference. The table is rewritten after every
    (kind, L). Returns the rows and <out>/grad_accuracy_<GPU>.md.
    tiny: fp32 on whatever device there is (CPU under TRITON_INTERPRET=1), to check the code."""
    device, dtype, heads, providers = suite_setup(keys, head_dim, heads, providers, tiny)
    results: list[GradAccuracyRow] = []
    md = None
    for kind in GRAD_KINDS:
        for L in keys:
            runs = ["flash", *providers]
            try:
                q, k, v, do = make_grad_inputs(kind, L, heads, head_dim, device, dtype)
                rows = torch.linspace(0, L - 1, ROWS, device=device).long()
                ref = periodic_reference(q, k, v, do, rows)
            except Exception as e:  # noqa: BLE001 - recorded; the other sizes still run
                measured = [(name, describe_error(e)) for name in runs]
            else:
                measured = []
                for name in runs:
                    try:
                        measured.append((name, grads_of(name, q, k, v, do, rows)))
                    except Exception as e:  # noqa: BLE001 - a kernel that cannot run this shape: recorded
                        measured.append((name, describe_error(e)))
                del q, k, v, do
            for name, grads in measured:
                for tensor in GRADS:
                    got = grads if isinstance(grads, str) else grads[tensor]
                    row = GradAccuracyRow(kind, L, name, tensor, *score(got, ref[tensor], measure_grad))
                    results.append(row)
                    progress(f"{kind:13s} L={L:8d} {name:15s} {tensor} " + figures_text(row))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            md = write_grad_accuracy(results, out, head_dim, heads, dtype)
    return results, md


def write_grad_accuracy(rows: list[GradAccuracyRow], out: Path, head_dim: int, heads: int,
                        dtype: torch.dtype) -> Path:
    """<out>/grad_accuracy_<GPU>.{json,md}: the rows, the environment and how they were made."""
    env = accuracy_env(head_dim, heads, dtype)
    head = (f"Gradient accuracy over long columns on {env['gpu']}, {env['dtype']}, {heads} heads of {head_dim}, "
            f"non-causal, L queries over L keys of periodic inputs (period {PERIOD}); against float64 on {ROWS} rows; "
            f"figures over each gradient's RMS; commit {env['commit']}, {env['date']}. Command: "
            f"`python scripts/bench_attention.py --accuracy --grads`.")
    return write_table("grad_accuracy", rows, env, ["dO", "keys", "provider", "gradient"],
                       lambda r: [r.grads, r.keys, r.provider, r.tensor], head, out)

"""Attention accuracy over long rows: each kernel against float64, where the error is a bias and not noise.

Text repeats itself. Filler, boilerplate and code all do, and at initialisation attention averages nearly every key
it sees. A row's unnormalised sum Σ_j p_j·v_j then keeps one sign over millions of keys, so an accumulator that
truncates rather than rounds to nearest (tensor cores add into fp32 that way) loses the same small amount at every
step. The error grows with the row's number of keys and does not average out over tokens (kernels/NOTES.md,
"The forward's truncation bias").

The suite builds non-causal attention of L keys in two input kinds:
- "periodic": q, k, v repeat every 1009 tokens, with v centred on 0.5, like text;
- "random": no period, v centred on 0, the control.

Every query row sees the same L keys. Each provider's output on 64 rows is compared with float64, giving three
figures, each over o's RMS:
- the RMS error;
- the bias, the mean over rows of the error;
- the signed bias toward zero, the mean of error·sign(o).

Our kernel also runs over the same keys split into 2, 4 and 8 calls, merged in float64 from each call's output and
log-sum-exp. If the bias comes from the length of the accumulation, splitting divides it by the number of calls.
"""
from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from minigpt.attention import get_provider
from minigpt.files import atomic_write_text, markdown_table
from minigpt.metrics import git_commit, versions

PERIOD = 1009  # tokens after which the "periodic" inputs repeat (a prime, so no tile size divides it)
ROWS = 64  # query rows compared with float64
SPLITS = (1, 2, 4, 8)  # our kernel's calls over the same keys
KINDS = ("periodic", "random")


@dataclass
class AccuracyRow:
    inputs: str  # "periodic" or "random"
    keys: int  # L, the keys every row sees
    provider: str
    calls: int  # calls the keys were split over (merged in float64); 1 = one call
    rms: float | None  # RMS of the error ÷ RMS of o
    bias: float | None  # RMS over (head, dim) of the mean over rows of the error ÷ RMS of o
    toward_zero: float | None  # mean of error·sign(o) ÷ RMS of o; < 0: o shrunk toward zero
    error: str = ""  # why the provider gave no output (the figures are then None)


def make_inputs(kind: str, keys: int, heads: int, head_dim: int, device: torch.device, dtype: torch.dtype,
                seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (1, heads, keys, head_dim): q and k at half scale, so attention is spread over many keys as at
    initialisation; "periodic" repeats a PERIOD-token pattern and centres v on 0.5, "random" centres v on 0."""
    g = torch.Generator().manual_seed(seed)
    length = PERIOD if kind == "periodic" else keys
    q, k, v = (torch.randn(1, heads, length, head_dim, generator=g) for _ in range(3))
    q, k = q * 0.5, k * 0.5
    if kind == "periodic":
        v = v + 0.5
        q, k, v = (t.repeat(1, 1, -(-keys // PERIOD), 1)[:, :, :keys] for t in (q, k, v))
    return tuple(t.to(device, dtype).contiguous() for t in (q, k, v))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """float64 attention of q's `rows` over all keys: (len(rows), heads, head_dim), one head at a time."""
    scale = 1 / math.sqrt(q.shape[-1])
    out = torch.empty(len(rows), q.shape[1], q.shape[-1], dtype=torch.float64)
    for h in range(q.shape[1]):
        s = q[0, h, rows].double() @ k[0, h].double().T * scale
        out[:, h] = (torch.softmax(s, 1) @ v[0, h].double()).cpu()
    return out


def ours_in_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, calls: int) -> torch.Tensor:
    """Our kernel over the keys in `calls` equal parts (each part's q the first L / calls rows, which hold `rows`),
    merged in float64 by the parts' log-sum-exps (base 2): (len(rows), heads, head_dim)."""
    from minigpt_kernels import flash_attention_with_lse

    n = k.shape[2] // calls
    num = den = 0
    for i in range(calls):
        o, lse = flash_attention_with_lse(q[:, :, :n].contiguous(), k[:, :, i * n:(i + 1) * n].contiguous(),
                                          v[:, :, i * n:(i + 1) * n].contiguous(), causal=False)
        weight = torch.exp2(lse[0, :, rows].double()).transpose(0, 1)[..., None].cpu()  # (rows, heads, 1)
        num = num + weight * o[0, :, rows].transpose(0, 1).double().cpu()
        den = den + weight
    return num / den


def measure(o: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(RMS error, bias, signed bias toward zero) of o (rows, heads, head_dim) against ref, over ref's RMS."""
    e, rms = o - ref, ref.pow(2).mean().sqrt()
    bias = e.mean(0).pow(2).mean().sqrt()
    toward_zero = (e.mean(0) * ref.mean(0).sign()).mean()
    return (e.pow(2).mean().sqrt() / rms).item(), (bias / rms).item(), (toward_zero / rms).item()


def run_accuracy(keys: list[int], head_dim: int = 64, heads: int = 12, providers: list[str] | None = None,
                 out: Path = Path("runs/bench"), tiny: bool = False,
                 progress: Callable[[str], None] = print) -> tuple[list[AccuracyRow], Path]:
    """The suite: for each input kind and L in `keys`, our kernel in SPLITS calls and each SDPA provider (q of the
    compared rows only: PyTorch's kernels take fewer queries than keys). Returns the rows and the table written to
    <out>/accuracy_<GPU>.md (beside its .json).
    tiny: fp32 on whatever device there is (CPU under TRITON_INTERPRET=1), to check the code."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if tiny else torch.bfloat16
    providers = providers if providers is not None else (["sdpa"] if tiny else ["sdpa-flash", "sdpa-cudnn",
                                                                                 "sdpa-efficient"])
    results = []
    for kind in KINDS:
        for L in keys:
            if L % max(SPLITS) or L // max(SPLITS) < ROWS:
                raise ValueError(f"keys={L}: needs a multiple of {max(SPLITS)} with at least {ROWS} keys a part")
            q, k, v = make_inputs(kind, L, heads, head_dim, device, dtype)
            rows = torch.linspace(0, L // max(SPLITS) - 1, ROWS, device=device).long()
            ref = reference(q, k, v, rows)
            found = [("flash", calls, ours_in_calls(q, k, v, rows, calls)) for calls in SPLITS]
            for name in providers:
                try:
                    o = get_provider(name)(q[:, :, rows].contiguous(), k, v, causal=False)
                    found.append((name, 1, o[0].transpose(0, 1).double().cpu()))
                except Exception as e:  # noqa: BLE001 - a backend that cannot run this shape: recorded, not fatal
                    found.append((name, 1, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"))
            for name, calls, o in found:
                if isinstance(o, str):
                    row = AccuracyRow(kind, L, name, calls, None, None, None, error=o)
                    progress(f"{kind:8s} L={L:8d} {name:15s} {o}")
                else:
                    row = AccuracyRow(kind, L, name, calls, *measure(o, ref))
                    progress(f"{kind:8s} L={L:8d} {name:15s} calls={calls} rms={row.rms:.3e} bias={row.bias:.3e} "
                             f"toward 0={row.toward_zero:+.3e}")
                results.append(row)
            del q, k, v
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results, write_accuracy(results, out, head_dim, heads, dtype)


def write_accuracy(rows: list[AccuracyRow], out: Path, head_dim: int, heads: int, dtype: torch.dtype) -> Path:
    """<out>/accuracy_<GPU>.{json,md}: the rows, the environment and how they were made."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    env = {"gpu": gpu, "commit": git_commit(), "date": dt.date.today().isoformat(), "dtype": str(dtype),
           "head_dim": head_dim, "heads": heads, "period": PERIOD, "rows": ROWS, **versions()}
    stem = out / f"accuracy_{gpu.replace(' ', '_')}"
    atomic_write_text(stem.with_suffix(".json"), json.dumps({"env": env, "rows": [asdict(r) for r in rows]},
                                                           indent=1) + "\n")
    table = markdown_table(["inputs", "keys", "provider", "calls", "error RMS", "bias", "toward zero"],
                           [[r.inputs, r.keys, r.provider, r.calls, *((f"{r.rms:.2e}", f"{r.bias:.2e}",
                             f"{r.toward_zero:+.2e}") if not r.error else (r.error, None, None))] for r in rows])
    head = (f"Attention accuracy over long rows on {gpu}, {env['dtype'].removeprefix('torch.')}, {heads} heads of "
            f"{head_dim}, non-causal, every row over all L keys; against float64 on {ROWS} rows; figures over o's "
            f"RMS; commit {env['commit']}, {env['date']}. Command: `python scripts/bench_attention.py --accuracy`.\n\n")
    return atomic_write_text(stem.with_suffix(".md"), head + table + "\n")

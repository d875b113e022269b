"""Attention accuracy over long rows: each kernel against float64, where the error is a bias and not noise.

Text repeats itself. Filler, boilerplate and code all do, and at initialisation attention averages nearly every key
it sees. A row's unnormalised sum Σ_j p_j·v_j then keeps one sign over millions of keys. If the accumulator
truncates instead of rounding to nearest, it loses the same small amount at every step. The error then grows with
the row's number of keys and does not average out over tokens. Our kernel on an H100 behaves this way, as tensor
cores truncating into fp32 would (kernels/NOTES.md, "The forward's truncation bias").

The suite builds non-causal attention of L keys in two input kinds:
- "periodic": q, k, v repeat every 1009 tokens, with v centred on 0.5, like text;
- "random": no period, v centred on 0, the control.

Every query row sees the same L keys. Each provider's output on 64 rows is compared with float64, giving three
figures, each over o's RMS:
- the RMS error;
- the bias, the mean over rows of the error;
- the signed bias toward zero: that mean times the sign of o's mean over rows, averaged over heads and dims.

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
from minigpt.benchmarks.mask_bench import describe_error
from minigpt.files import atomic_write_text, markdown_table
from minigpt.metrics import git_commit, versions

PERIOD = 1009  # tokens after which the "periodic" inputs repeat (a prime, so no tile size divides it)
ROWS = 64  # query rows compared with float64
SPLITS = (1, 2, 4, 8)  # our kernel's calls over the same keys
KINDS = ("periodic", "random")
HIDDEN = 768  # gpt2-small's width: heads = HIDDEN // head_dim, as in the model whose 1M runs showed the bias
SDPA_PROVIDERS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient")


@dataclass
class AccuracyRow:
    inputs: str  # "periodic" or "random"
    keys: int  # L, the keys every row sees
    provider: str
    calls: int  # calls the keys were split over (merged in float64); 1 = one call
    rms: float | None  # RMS of the error ÷ RMS of o
    bias: float | None  # RMS over (head, dim) of the mean over rows of the error ÷ RMS of o
    toward_zero: float | None  # that mean · sign of o's mean, averaged ÷ RMS of o; < 0: o shrunk toward zero
    error: str = ""  # why the provider gave no output (the figures are then None)


def check_keys(keys: list[int]) -> None:
    """ValueError unless every L splits into max(SPLITS) parts of at least ROWS keys (the compared rows)."""
    bad = [L for L in keys if L % max(SPLITS) or L // max(SPLITS) < ROWS]
    if bad:
        raise ValueError(f"keys {bad}: each must be a multiple of {max(SPLITS)} with at least {ROWS} keys a part "
                         f"(>= {ROWS * max(SPLITS)})")


def make_inputs(kind: str, keys: int, heads: int, head_dim: int, device: torch.device, dtype: torch.dtype,
                seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (1, heads, keys, head_dim): q and k at half scale, so attention is spread over many keys as at
    initialisation; "periodic" repeats a PERIOD-token pattern and centres v on 0.5, "random" centres v on 0."""
    g = torch.Generator(device).manual_seed(seed)  # made where they are used: 1M keys of 12 heads are 3 GB in fp32
    length = PERIOD if kind == "periodic" else keys
    q, k, v = (torch.randn(1, heads, length, head_dim, generator=g, device=device) for _ in range(3))
    q, k = q * 0.5, k * 0.5
    if kind == "periodic":
        v = v + 0.5
        q, k, v = (t.repeat(1, 1, -(-keys // PERIOD), 1)[:, :, :keys] for t in (q, k, v))
    return tuple(t.to(dtype).contiguous() for t in (q, k, v))


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


def sdpa_rows(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A PyTorch kernel's output on `rows`, over all keys. Its queries are the first L / max(SPLITS) rows (which
    hold `rows`), not only the compared ones: with few query blocks FlashAttention-2 splits the keys over
    programs, a shorter accumulation than a long sequence gets."""
    o = get_provider(name)(q[:, :, : k.shape[2] // max(SPLITS)].contiguous(), k, v, causal=False)
    return o[0, :, rows].transpose(0, 1).double().cpu()


def measure(o: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(RMS error, bias, signed bias toward zero) of o (rows, heads, head_dim) against ref, over ref's RMS."""
    e, rms = o - ref, ref.pow(2).mean().sqrt()
    bias = e.mean(0).pow(2).mean().sqrt()
    toward_zero = (e.mean(0) * ref.mean(0).sign()).mean()
    return (e.pow(2).mean().sqrt() / rms).item(), (bias / rms).item(), (toward_zero / rms).item()


def truncate_to_fp32(x: torch.Tensor) -> torch.Tensor:
    """float64 x rounded to fp32 toward zero (as an accumulator that truncates), returned in float64."""
    f = x.float()
    over = f.double().abs() > x.abs()
    f[over] = torch.nextafter(f[over], torch.zeros_like(f[over]))
    return f.double()


def emulate_accumulation(keys: int, heads: int = 12, head_dim: int = 64, step: int = 8,
                         truncate: bool = True) -> float:
    """The hypothesis for our kernel's bias, emulated on CPU: the signed bias toward zero (as in `measure`) of
    o = Σ p·v / Σ p over `keys` periodic keys (a multiple of `step`), the unnormalised sum accumulated in fp32
    `step` keys at a time with each addition truncated (or rounded to nearest), p rounded to bf16 for the product
    and o to bf16 at the end. Truncating every 8 keys gives the H100's figures (kernels/NOTES.md)."""
    q, k, v = (t[0].double() for t in make_inputs("periodic", keys, heads, head_dim, torch.device("cpu"),
                                                   torch.bfloat16))
    rows = torch.linspace(0, keys // max(SPLITS) - 1, ROWS).long()
    s = torch.einsum("hrd,hld->rhl", q[:, rows], k) / math.sqrt(head_dim)
    s = s - s.amax(-1, keepdim=True)
    p = torch.exp(s).float().double()  # fp32 probabilities; the denominator sums them (round to nearest)
    p16 = p.to(torch.bfloat16).double()  # the P·V product's operand
    acc = torch.zeros(ROWS, heads, head_dim, dtype=torch.float64)
    steps = keys // step
    p16, v = p16.view(ROWS, heads, steps, step), v.view(heads, steps, step, head_dim)
    for b in range(0, steps, 512):  # each step's addend Σ_{j in step} p·v exactly, 512 steps at a time
        adds = torch.einsum("rhsl,hsld->srhd", p16[:, :, b:b + 512], v[:, b:b + 512])
        for add in adds:
            acc = truncate_to_fp32(acc + add) if truncate else (acc + add).float().double()
    o = (acc / p.sum(-1, keepdim=True)).to(torch.bfloat16).double()
    ref = torch.einsum("rhl,hld->rhd", torch.softmax(s, -1), v.view(heads, keys, head_dim))
    return measure(o, ref)[2]


def suite_setup(keys: list[int], head_dim: int, heads: int | None, providers: list[str] | None,
                tiny: bool) -> tuple[torch.device, torch.dtype, int, list[str]]:
    """An accuracy suite's settings, the keys checked: the device (CUDA if there is one), bf16 (fp32 when tiny),
    gpt2-small's heads at head_dim unless given, and the providers (SDPA's fused kernels; "sdpa" when tiny)."""
    check_keys(keys)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if tiny else torch.bfloat16
    heads = heads or HIDDEN // head_dim
    providers = providers if providers is not None else (["sdpa"] if tiny else list(SDPA_PROVIDERS))
    return device, dtype, heads, providers


def run_accuracy(keys: list[int], head_dim: int = 64, heads: int | None = None, providers: list[str] | None = None,
                 out: Path = Path("runs/bench"), tiny: bool = False,
                 progress: Callable[[str], None] = print) -> tuple[list[AccuracyRow], Path]:
    """The suite: for each input kind and L in `keys`, our kernel in SPLITS calls and each of `providers` (default:
    SDPA's fused kernels; "sdpa" with --tiny). The table is rewritten after every (kind, L), so a run stopped or out
    of memory keeps what it measured. Returns the rows and <out>/accuracy_<GPU>.md (beside its .json).
    tiny: fp32 on whatever device there is (CPU under TRITON_INTERPRET=1), to check the code."""
    device, dtype, heads, providers = suite_setup(keys, head_dim, heads, providers, tiny)
    results: list[AccuracyRow] = []
    md = None
    for kind in KINDS:
        for L in keys:
            measured: list[tuple[str, int, torch.Tensor | str]] = []
            try:
                q, k, v = make_inputs(kind, L, heads, head_dim, device, dtype)
                rows = torch.linspace(0, L // max(SPLITS) - 1, ROWS, device=device).long()
                ref = reference(q, k, v, rows)
            except Exception as e:  # noqa: BLE001 - recorded; the other sizes still run
                measured = [(name, 1, describe_error(e)) for name in ["flash", *providers]]
            else:
                for name, calls in [*(("flash", c) for c in SPLITS), *((p, 1) for p in providers)]:
                    try:
                        o = ours_in_calls(q, k, v, rows, calls) if name == "flash" else sdpa_rows(name, q, k, v, rows)
                        measured.append((name, calls, o))
                    except Exception as e:  # noqa: BLE001 - a kernel that cannot run this shape: recorded
                        measured.append((name, calls, describe_error(e)))
                del q, k, v
            for name, calls, o in measured:
                row = AccuracyRow(kind, L, name, calls, *score(o, ref, measure))
                results.append(row)
                progress(f"{kind:8s} L={L:8d} {name:15s} calls={calls} " + figures_text(row))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            md = write_accuracy(results, out, head_dim, heads, dtype)
    return results, md


def score(out: torch.Tensor | str, ref: torch.Tensor,
          measure_fn: Callable[[torch.Tensor, torch.Tensor], tuple[float, float, float]]) -> tuple:
    """(rms, bias, toward_zero, error) of a provider's output against ref, or of the error it gave instead (a str):
    None figures, and "non-finite output" where the figures are not finite."""
    if isinstance(out, str):
        return None, None, None, out
    figures = measure_fn(out, ref)
    return (*figures, "") if all(map(math.isfinite, figures)) else (None, None, None, "non-finite output")


def figures_text(row) -> str:
    """A measured row's figures (or its error) for the progress line."""
    return row.error or f"rms={row.rms:.3e} bias={row.bias:.3e} toward 0={row.toward_zero:+.3e}"


def accuracy_env(head_dim: int, heads: int, dtype: torch.dtype) -> dict:
    """The environment an accuracy table records: GPU, commit, date, dtype, shapes, versions."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "commit": git_commit(), "date": dt.date.today().isoformat(),
            "dtype": str(dtype).removeprefix("torch."), "head_dim": head_dim, "heads": heads, "period": PERIOD,
            "rows": ROWS, **versions()}


def write_table(stem: str, rows: list, env: dict, columns: list[str], keys: Callable[[object], list],
                head: str, out: Path) -> Path:
    """<out>/<stem>_<GPU>.{json,md}: the rows (dataclasses with rms, bias, toward_zero and error) with `env`, and
    the markdown table of `columns`: keys(row), then the three figures (or the error), under `head`."""
    path = out / f"{stem}_{env['gpu'].replace(' ', '_')}"
    atomic_write_text(path.with_suffix(".json"), json.dumps({"env": env, "rows": [asdict(r) for r in rows]},
                                                           indent=1, allow_nan=False) + "\n")
    table = markdown_table([*columns, "error RMS", "bias", "toward zero"],
                           [[*keys(r), *((r.error, None, None) if r.error else
                                         (f"{r.rms:.2e}", f"{r.bias:.2e}", f"{r.toward_zero:+.2e}"))] for r in rows])
    return atomic_write_text(path.with_suffix(".md"), head + "\n\n" + table + "\n")


def write_accuracy(rows: list[AccuracyRow], out: Path, head_dim: int, heads: int, dtype: torch.dtype) -> Path:
    """<out>/accuracy_<GPU>.{json,md}: the rows, the environment and how they were made."""
    env = accuracy_env(head_dim, heads, dtype)
    head = (f"Attention accuracy over long rows on {env['gpu']}, {env['dtype']}, {heads} heads of {head_dim}, "
            f"non-causal, every row over all L keys; against float64 on {ROWS} rows; figures over o's RMS; commit "
            f"{env['commit']}, {env['date']}. Command: `python scripts/bench_attention.py --accuracy`.")
    return write_table("accuracy", rows, env, ["inputs", "keys", "provider", "calls"],
                       lambda r: [r.inputs, r.keys, r.provider, r.calls], head, out)

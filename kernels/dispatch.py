"""Which kernel runs a call, with which tiles: one table (TABLE) and one function (`plan`).

    plan(kernel, head_dim, seq_len, dtype, causal, deterministic=..., capability=..., gluon_inputs=..., ...) -> Plan

`kernel` is a direction ("fwd": the forward; "bwd": the whole backward) or one backward kernel launched alone ("dq",
"dkdv": ring attention's). The answer depends on the call only through its arguments (no device is queried here), so
tests pin it on a CPU (tests/test_dispatch.py). The table's rows are tried in order, first match wins:

    interpreter  >  fp32  >  sm_90 non-causal forward (Gluon)  >  masks or GQA  >  non-causal  >
    sm_90 warp-specialized (Gluon)  >  causal by length  >  every length

Calls with masks (a sliding window, document ids, blocks at offsets) or GQA (`masked=True`) take the rows marked
`masks`: on sm_90 the Gluon forward and five-matmul backward (rows `sm90-masks`) for a causal sequence against
itself (launch.gluon_masks_ready; the backward not in deterministic mode), else the Triton kernels; no dense Gluon or
dS-path row applies. But a causal fresh GQA call without masks, as the model makes it, runs the dense Gluon forward
on the dense rows' tiles: that kernel reads each query head's K/V head itself (launch.gqa_dense_tiles).
The non-causal Gluon forward (rows `sm90-non-causal`: ring attention's blocks of other ranks,
which continue a running (o, lse)) takes GQA too, not masks: launch.gluon_forward_ready says which calls fit it.

Paths: the forward runs "triton" (triton_kernels.fwd_kernel) or "gluon" (gluon/forward.py, persistent where its tiles
say so); the backward "triton" (the seven-matmul backward: dQ kernel, then dK/dV kernel; its dQ kernel is the Gluon
one where `dq_tiles.specialized`), "via_ds" (dS kept in memory, launch.launch_backward_via_ds) or "gluon" (the
five-matmul backward of gluon/backward.py). MINIGPT_FLASH_PATH=triton|via_ds|gluon forces a path for the forward and
backward (`auto` or unset: the table); where the forced path cannot run, plan raises ValueError.

The timings behind each row: kernels/NOTES.md, "Dispatch table timings", and the lettered sections the rows name.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from minigpt_kernels.device import INTERPRET

# The tensor cores truncate as they add P·V into the fp32 accumulator: over a row of L keys o shrinks by about
# L/8 · 0.36 · 2⁻²⁴ (3e-3 at 1M keys, kernels/NOTES.md). From FOLD_FROM_KEYS keys on, the forwards fold their
# accumulator into a round-to-nearest fp32 sum every FOLD_KEYS keys (a bias under 1e-5); MINIGPT_FOLD_FROM and
# MINIGPT_FOLD_KEYS override both (tests run the folds on short rows).
FOLD_KEYS = int(os.environ.get("MINIGPT_FOLD_KEYS", 2048))
FOLD_FROM_KEYS = int(os.environ.get("MINIGPT_FOLD_FROM", 32768))


def fold_tiles(n_keys: int, block_n: int, window: int | None = None) -> int:
    """Key tiles per accumulator chain of a forward over n_keys keys: FOLD_KEYS' worth where a row may see
    FOLD_FROM_KEYS keys or more, 0 (one chain) below. Under a window a row sees at most 2·window − 1 of them."""
    seen = n_keys if window is None else min(n_keys, 2 * window - 1)
    return max(1, FOLD_KEYS // block_n) if seen >= FOLD_FROM_KEYS else 0

PATH_ENV = "MINIGPT_FLASH_PATH"
PATHS = ("auto", "triton", "via_ds", "gluon")  # the values PATH_ENV takes
# The dS path's buffer (B·H·ds_head_elements(N, tile) elements) is at most this many bytes: beyond, the table's row
# does not apply (a forced via_ds raises)
VIA_DS_MAX_BYTES = 1 << 30
SM90 = (9, 0)
ALL_HEAD_DIMS = (16, 32, 64, 128, 256)
ALL_LENGTHS = (1, None)  # (from, to) in tokens, both included; None: no end


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False  # stream tiles through TMA descriptors (Hopper+, aligned inputs; else pointer loads)
    maxnreg: int | None = None  # cap on registers per thread, so more programs share an SM (GPU only)
    # the warp-specialized Gluon kernels (sm_90; num_warps is then per consumer warpgroup, maxnreg unused): the
    # forward of gluon/forward.py with block_m/64 consumers of 64 query rows; the dK/dV/dQ and dQ kernels of
    # gluon/backward.py with two consumers: dK/dV/dQ block_n = 128 keys per program, block_m the streamed
    # query tile; dQ block_m = 128 rows per program, block_n the streamed key tile
    specialized: bool = False
    # the persistent variant of the forward or the dK/dV/dQ kernel: one program per SM walking a host-made list of
    # query tiles or key blocks (gluon/schedule.py)
    persistent: bool = False


@dataclass(frozen=True)
class Entry:
    """One row of the table: `kernel` ("fwd", "dq", "dkdv", "dkdvdq": the five-matmul backward, "via_ds": the dQ
    kernel of the dS path) at these head_dims runs `tiles` where `when` holds and the length is within `lengths`.
    when: "interpreter" (Triton's CPU interpreter), "fp32", "sm90-non-causal" (non-causal 2-byte on sm_90 that the
    Gluon forward takes, GQA included), "non-causal" (2-byte), "sm90" (causal 2-byte on sm_90, with inputs that fit
    the Gluon kernels; via_ds: any CUDA inputs), "sm90-masks" (the same with masks or GQA that the Gluon forward and
    five-matmul backward take), "causal" (2-byte), "any" (2-byte).
    why: the reason, naming its kernels/NOTES.md section. masks: the row applies only to calls with masks or GQA."""
    kernel: str
    head_dims: tuple[int, ...]
    when: str
    tiles: TileConfig
    why: str
    lengths: tuple[int, int | None] = ALL_LENGTHS
    masks: bool = False

    def covers(self, seq_len: int | None) -> bool:
        if seq_len is None:  # no length given: rows for every length only
            return self.lengths == ALL_LENGTHS
        lo, hi = self.lengths
        return lo <= seq_len and (hi is None or seq_len <= hi)


def _tc(*args, **kwargs) -> TileConfig:
    return TileConfig(*args, **kwargs)


_GLUON = dict(tma=True, specialized=True)
_NOTES = "NOTES.md 'Dispatch table timings'"
_MASKS = f"masks/GQA: Triton only, the dense rows' tiles, not tuned ({_NOTES})"
_RING = ("non-causal on the ping-pong forward, the causal rows' tiles: within 3.5% of the best of 2 or 3 consumers, "
         "2 or 3 stages, plain or persistent on the ring's blocks (NOTES.md, 'Ring attention's launches timed alone')")
# dQ needs block_m % block_n == 0, dK/dV block_n % block_m == 0; the forward takes either (powers of two).
TABLE: tuple[Entry, ...] = (
    # Triton's CPU interpreter (tests): small tiles, several per test sequence, so diagonal, full and ragged tiles run
    Entry("fwd", ALL_HEAD_DIMS, "interpreter", _tc(32, 16, 4, 1, tma=True), "tests: every tile kind runs on CPU"),
    Entry("dkdv", ALL_HEAD_DIMS, "interpreter", _tc(16, 32, 4, 1, tma=True), "tests: every tile kind runs on CPU"),
    Entry("dq", ALL_HEAD_DIMS, "interpreter", _tc(32, 16, 4, 1, tma=True), "tests: every tile kind runs on CPU"),
    # fp32 (TF32 dots): tiles hold twice the bytes
    Entry("fwd", (16, 32, 64, 128), "fp32", _tc(64, 32, 4, 2, tma=True), f"half the tile area fits smem ({_NOTES})"),
    Entry("fwd", (256,), "fp32", _tc(32, 16, 4, 1), f"shared memory at head_dim 256 ({_NOTES})"),
    Entry("dkdv", (16, 32, 64, 128), "fp32", _tc(32, 64, 4, 2, tma=True), f"half the tile area fits smem ({_NOTES})"),
    Entry("dkdv", (256,), "fp32", _tc(16, 32, 4, 1), f"shared memory at head_dim 256 ({_NOTES})"),
    Entry("dq", (16, 32, 64, 128), "fp32", _tc(64, 32, 4, 2, tma=True), f"half the tile area fits smem ({_NOTES})"),
    Entry("dq", (256,), "fp32", _tc(32, 16, 4, 1), f"shared memory at head_dim 256 ({_NOTES})"),
    # sm_90, non-causal 2-byte inputs that fit the Gluon forward (launch.gluon_forward_ready; ring attention's blocks
    # of other ranks, continued, and GQA without masks): the causal rows' tiles by the queries' length
    Entry("fwd", (64,), "sm90-non-causal", _tc(128, 128, 4, 3, persistent=True, **_GLUON), _RING, (1024, 2047)),
    Entry("fwd", (64,), "sm90-non-causal", _tc(192, 128, 4, 3, persistent=True, **_GLUON), _RING, (2048, 131071)),
    Entry("fwd", (64,), "sm90-non-causal", _tc(192, 128, 4, 3, **_GLUON), _RING, (131072, None)),
    Entry("fwd", (128,), "sm90-non-causal", _tc(128, 128, 4, 3, persistent=True, **_GLUON), _RING, (1024, None)),
    # masks (window, documents, offsets) or GQA, 2-byte inputs: on sm_90 the Gluon kernels for a causal sequence against
    # itself, else the Triton kernels, the dense rows' tiles without the dK/dV register cap (its per-group loop and id
    # loads need more), not tuned with masks yet
    Entry("fwd", (64, 128), "sm90-masks", _tc(128, 128, 4, 3, **_GLUON),
          "masks/GQA on the ping-pong forward (GQA alone: the dense rows, launch.gqa_dense_tiles): 2 consumers, a "
          "plain grid (persistent for a window alone), only the key tiles the rows see (NOTES.md, 'One kernel per "
          "direction')", masks=True),
    Entry("dkdvdq", (64,), "sm90-masks", _tc(64, 128, 4, 3, **_GLUON),
          "masks/GQA on the five-matmul backward: a plain grid (persistent for an MHA window alone), each key block's "
          "query tiles that see it (NOTES.md, 'Masks and GQA in the Gluon backward')", masks=True),
    Entry("dkdvdq", (128,), "sm90-masks", _tc(64, 128, 4, 2, **_GLUON),
          "masks/GQA on the five-matmul backward, dQ split, the dense plain grid's 2 stages (NOTES.md, 'Masks and GQA "
          "in the Gluon backward')", masks=True),
    Entry("fwd", (16, 32, 64), "any", _tc(64, 64, 4, 3, tma=True), _MASKS, masks=True),
    Entry("fwd", (128,), "any", _tc(128, 64, 8, 3, tma=True), _MASKS, masks=True),
    Entry("fwd", (256,), "any", _tc(64, 32, 4, 2), _MASKS, masks=True),
    Entry("dkdv", (16, 32, 64), "any", _tc(64, 64, 4, 3, tma=True), _MASKS, masks=True),
    Entry("dkdv", (128,), "any", _tc(64, 64, 4, 2, tma=True), _MASKS, masks=True),
    Entry("dkdv", (256,), "any", _tc(16, 64, 4, 2), _MASKS, masks=True),
    Entry("dq", (16, 32, 64), "any", _tc(128, 64, 8, 3, tma=True), _MASKS, masks=True),
    Entry("dq", (128,), "any", _tc(128, 64, 8, 4, tma=True), _MASKS, masks=True),
    Entry("dq", (256,), "any", _tc(64, 16, 4, 2), _MASKS, masks=True),
    # non-causal 2-byte inputs, where their own exploration differs from the causal choice
    Entry("fwd", (16, 32, 64), "non-causal", _tc(128, 64, 8, 3, tma=True), f"128-row tiles, 2.35 vs 2.45 ms ({_NOTES})"),
    # sm_90, causal 2-byte inputs that fit the warp-specialized Gluon kernels (NOTES.md O, Q, S, T, V, W, Z, AA)
    Entry("fwd", (64,), "sm90", _tc(128, 128, 4, 3, persistent=True, **_GLUON), f"persistent, 2 consumers ({_NOTES}; S)",
          (1024, 2047)),
    Entry("fwd", (64,), "sm90", _tc(192, 128, 4, 3, persistent=True, **_GLUON), f"persistent, 3 consumers ({_NOTES}; Z, AA)",
          (2048, 131071)),
    Entry("fwd", (64,), "sm90", _tc(192, 128, 4, 3, **_GLUON), f"plain ping-pong from 128K ({_NOTES}; AA)",
          (131072, None)),
    Entry("fwd", (128,), "sm90", _tc(128, 128, 4, 3, persistent=True, **_GLUON), f"persistent, 2 consumers ({_NOTES}; S, AA)",
          (1024, None)),
    Entry("dkdvdq", (64,), "sm90", _tc(64, 128, 4, 3, persistent=True, **_GLUON),
          f"five matmuls, persistent from 2K ({_NOTES}; T, session 24)", (2048, 16383)),
    Entry("dkdvdq", (64,), "sm90", _tc(64, 128, 4, 3, **_GLUON), f"five matmuls, plain from 16K ({_NOTES}; Q, T)",
          (16384, None)),
    Entry("dkdvdq", (128,), "sm90", _tc(64, 128, 4, 3, persistent=True, **_GLUON),
          f"dQ split, persistent s3 ({_NOTES}; W)", (2048, 8191)),
    Entry("dkdvdq", (128,), "sm90", _tc(64, 128, 4, 2, **_GLUON), f"dQ split, plain s2 from 8K ({_NOTES}; V, W)",
          (8192, None)),
    Entry("dq", (128,), "sm90", _tc(128, 64, 4, 3, **_GLUON), f"Gluon dQ from 4K ({_NOTES}; P)", (4096, None)),
    Entry("via_ds", (128,), "sm90", _tc(64, 64, 4, 3), f"dS kept in memory up to 1K ({_NOTES}; AB)", (1, 1024)),
    # causal 2-byte inputs, by length (NOTES.md C, J, L)
    Entry("fwd", (128,), "causal", _tc(64, 64, 4, 3, tma=True), f"64×64 up to 8K ({_NOTES}; C)", (1, 8192)),
    Entry("fwd", (16, 32, 64), "causal", _tc(64, 128, 4, 2, tma=True), f"128-key tiles from 8K ({_NOTES}; L)",
          (8192, None)),
    # 2-byte inputs at every length (the H200/H100 explorations; NOTES.md 'Tile choice', J, K)
    Entry("fwd", (16, 32, 64), "any", _tc(64, 64, 4, 3, tma=True), f"exploration at 8K ({_NOTES})"),
    Entry("fwd", (128,), "any", _tc(128, 64, 8, 3, tma=True), f"exploration at 8K, 1.086 vs 1.120 ms ({_NOTES})"),
    Entry("fwd", (256,), "any", _tc(64, 32, 4, 2), f"fits shared memory, not tuned ({_NOTES})"),
    Entry("dkdv", (16, 32, 64), "any", _tc(64, 64, 4, 3, tma=True, maxnreg=168), f"3 programs per SM ({_NOTES}; J, K)"),
    Entry("dkdv", (128,), "any", _tc(64, 64, 4, 2, tma=True), f"2 programs per SM ({_NOTES}; J)"),
    Entry("dkdv", (256,), "any", _tc(16, 64, 4, 2), f"fits shared memory, not tuned ({_NOTES})"),
    Entry("dq", (16, 32, 64), "any", _tc(128, 64, 8, 3, tma=True), f"exploration at 8K ({_NOTES})"),
    Entry("dq", (128,), "any", _tc(128, 64, 8, 4, tma=True), f"exploration at 8K ({_NOTES})"),
    Entry("dq", (256,), "any", _tc(64, 16, 4, 2), f"fits shared memory, not tuned ({_NOTES})"),
)


@dataclass(frozen=True)
class Plan:
    """What runs: `path` (see the module docstring) with `tiles` (the forward's, the five-matmul kernel's, the dK/dV
    kernel's, or the one kernel's asked for) and, for the backward's "triton" and "via_ds" paths, `dq_tiles` (the dQ
    kernel's). `why`: the table's reason, or the forcing variable."""
    path: str
    tiles: TileConfig
    dq_tiles: TileConfig | None = None
    why: str = ""


def ds_head_elements(n: int, tile: int) -> int:
    """The dS buffer's elements per causal head of n tokens: its tile × tile blocks on or below the diagonal."""
    t = -(-n // tile)
    return t * (t + 1) // 2 * tile * tile


@functools.lru_cache(maxsize=4096)
def _entry(kernel: str, head_dim: int, seq_len: int | None, dtype: torch.dtype, causal: bool,
           capability: tuple[int, int] | None, gluon_inputs: bool, interpret: bool, masked: bool = False) -> Entry | None:
    """The table's first row for this kernel and call, None if none applies (masked: masks or GQA)."""
    two_byte = dtype in (torch.float16, torch.bfloat16)
    holds = {"interpreter": interpret,
             "fp32": not interpret and dtype == torch.float32,
             "sm90-non-causal": not interpret and two_byte and not causal and capability == SM90 and gluon_inputs,
             "non-causal": not interpret and two_byte and not causal,
             "sm90": not interpret and two_byte and causal and capability == SM90 and not masked
             and (gluon_inputs or kernel == "via_ds"),
             "sm90-masks": not interpret and two_byte and causal and capability == SM90 and masked and gluon_inputs,
             "causal": not interpret and two_byte and causal,
             "any": not interpret and two_byte}
    for e in TABLE:
        if e.kernel == kernel and head_dim in e.head_dims and holds[e.when] and e.covers(seq_len) \
                and (masked or not e.masks):
            return e
    return None


def _first_gluon(kernel: str, head_dim: int, when: str = "sm90") -> Entry | None:
    """The table's first Gluon row for this kernel, head_dim and condition (a forced path's tiles below the table's
    lengths)."""
    return next((e for e in TABLE if e.kernel == kernel and head_dim in e.head_dims and e.when == when), None)


def plan(kernel: str, head_dim: int, seq_len: int | None, dtype: torch.dtype, causal: bool = True, *,
         deterministic: bool = False, capability: tuple[int, int] | None = None, gluon_inputs: bool = False,
         batch_heads: int = 1, interpret: bool | None = None, path: str | None = None, masked: bool = False) -> Plan:
    """Which kernel runs this call, with which tiles.

    kernel: "fwd", "bwd", or one backward kernel alone, "dq" or "dkdv". seq_len: the queries' length (None: the
    rows for every length only). capability: the GPU's (None: not a CUDA tensor). gluon_inputs: the call fits the
    Gluon kernels (the forward: launch.gluon_forward_ready; the backward: launch.specialized_ready, CUDA, TMA-aligned,
    one length, causal, or gluon_masks_ready; the table adds sm_90, fp16/bf16 and, but for the forward, causal).
    deterministic: no five-matmul backward. batch_heads: B·H (the dS path's buffer size).
    interpret: Triton's CPU interpreter (default: TRITON_INTERPRET=1). path: forces a path for "fwd" and "bwd"
    (default: $MINIGPT_FLASH_PATH; see PATHS). masked: the call has masks or GQA: the Gluon forward and (not
    deterministic) five-matmul backward where gluon_inputs says they take them (launch.gluon_masks_ready), else the
    Triton kernels; a forced via_ds path, or a forced gluon path the call does not fit, raises."""
    interpret = INTERPRET if interpret is None else interpret
    if path is None:
        path = os.environ.get(PATH_ENV) or "auto"
    if path not in PATHS:
        raise ValueError(f"{PATH_ENV}={path!r}: allowed values are {', '.join(PATHS)}")
    return _plan(kernel, head_dim, seq_len, dtype, causal, deterministic, capability, gluon_inputs, batch_heads,
                 interpret, path, masked, VIA_DS_MAX_BYTES)


@functools.lru_cache(maxsize=1024)  # every layer of a step asks the same few questions: answered once each
def _plan(kernel: str, head_dim: int, seq_len: int | None, dtype: torch.dtype, causal: bool, deterministic: bool,
          capability: tuple[int, int] | None, gluon_inputs: bool, batch_heads: int, interpret: bool, path: str,
          masked: bool, max_ds_bytes: int) -> Plan:
    """plan, its defaults resolved (the table and the settings as arguments: a cache key)."""
    if masked:  # the Gluon forward and five-matmul backward (not deterministic) where the inputs fit, else Triton
        gluon_ok = gluon_inputs and (kernel == "fwd" or (kernel == "bwd" and not deterministic))
        if (path == "via_ds" or (path == "gluon" and not gluon_ok)) and kernel in ("fwd", "bwd"):
            raise _cannot(path, "masks (window, document ids, offsets) and GQA run the Triton kernels, but for the "
                                "Gluon forward and the five-matmul backward (not deterministic) of a causal sequence "
                                "against itself on sm_90")
        gluon_inputs = gluon_ok and path != "triton"
    if kernel in ("dq", "dkdv"):  # one kernel alone: the Gluon dQ kernel where the table says so
        e = _entry(kernel, head_dim, seq_len, dtype, causal, capability, gluon_inputs, interpret, masked)
        return Plan("gluon" if e.tiles.specialized else "triton", e.tiles, why=e.why)
    if kernel == "fwd":
        return _forward(head_dim, seq_len, dtype, causal, capability, gluon_inputs, interpret, path, masked)
    if kernel == "bwd":
        return _backward(head_dim, seq_len, dtype, causal, deterministic, capability, gluon_inputs, batch_heads,
                         interpret, path, max_ds_bytes, masked)
    raise ValueError(f"plan: kernel must be one of fwd, bwd, dq, dkdv; got {kernel!r}")


def _cannot(path: str, why: str) -> ValueError:
    return ValueError(f"{PATH_ENV}={path}: {why}; allowed values are {', '.join(PATHS)} (auto: the table)")


def _forward(head_dim, seq_len, dtype, causal, capability, gluon_inputs, interpret, path, masked=False) -> Plan:
    e = _entry("fwd", head_dim, seq_len, dtype, causal, capability, gluon_inputs and path in ("auto", "gluon"),
               interpret, masked)
    if path == "gluon" and not e.tiles.specialized:
        if masked and causal:
            raise _cannot(path, "the masked Gluon forward takes causal fp16/bf16 inputs at head_dim 64 or 128 on sm_90")
        g = _first_gluon("fwd", head_dim, "sm90" if causal else "sm90-non-causal")
        if g is None or _entry("fwd", head_dim, g.lengths[0], dtype, causal, capability, gluon_inputs,
                               interpret, masked) is not g:
            raise _cannot(path, "the Gluon forward takes fp16/bf16 inputs at head_dim 64 or 128 that fit it "
                                "(launch.gluon_forward_ready), on sm_90")
        e = g
    return Plan("gluon" if e.tiles.specialized else "triton", e.tiles, why=e.why if path == "auto" else
                f"{PATH_ENV}={path}")


def _backward(head_dim, seq_len, dtype, causal, deterministic, capability, gluon_inputs, batch_heads, interpret, path,
              max_ds_bytes, masked=False) -> Plan:
    forced = "" if path == "auto" else f"{PATH_ENV}={path}"
    if masked:
        if gluon_inputs and path in ("auto", "gluon"):  # the five-matmul backward (plan: not deterministic)
            e = _entry("dkdvdq", head_dim, seq_len, dtype, causal, capability, True, interpret, True)
            if e is not None:
                return Plan("gluon", e.tiles, why=forced or e.why)
        if path == "gluon":
            raise _cannot(path, "the masked five-matmul backward takes causal fp16/bf16 inputs at head_dim 64 or 128 "
                                "on sm_90")
        # the seven-matmul Triton backward, the masks rows' tiles
        dkdv = _entry("dkdv", head_dim, seq_len, dtype, causal, capability, False, interpret, True)
        dq = _entry("dq", head_dim, seq_len, dtype, causal, capability, False, interpret, True)
        return Plan("triton", dkdv.tiles, dq.tiles, forced or dq.why)
    if path in ("auto", "gluon") and not deterministic:  # the five-matmul backward (its dQ sums in a varying order)
        e = _entry("dkdvdq", head_dim, seq_len, dtype, causal, capability, gluon_inputs, interpret)
        if e is None and path == "gluon":
            g = _first_gluon("dkdvdq", head_dim)
            if g is not None and _entry("dkdvdq", head_dim, g.lengths[0], dtype, causal, capability, gluon_inputs,
                                        interpret) is g:
                e = g
        if e is not None:
            return Plan("gluon", e.tiles, why=forced or e.why)
    dkdv = _entry("dkdv", head_dim, seq_len, dtype, causal, capability, False, interpret).tiles
    if path in ("auto", "via_ds"):  # dS kept in memory: deterministic, so also in deterministic mode
        e = _entry("via_ds", head_dim, seq_len, dtype, causal, capability, gluon_inputs, interpret)
        fits = batch_heads * ds_head_elements(seq_len or 1, dkdv.block_m) * dtype.itemsize <= max_ds_bytes
        if path == "via_ds":
            if not (causal and dkdv.block_m == dkdv.block_n and fits):
                raise _cannot(path, f"the dS path takes causal inputs whose dK/dV tiles are square (here {dkdv}) and "
                                    f"a dS buffer of at most VIA_DS_MAX_BYTES ({max_ds_bytes})")
            return Plan("via_ds", dkdv, TileConfig(dkdv.block_m, dkdv.block_n, 4, 3), forced)
        if e is not None and fits:
            return Plan("via_ds", dkdv, e.tiles, e.why)
    dq = _entry("dq", head_dim, seq_len, dtype, causal, capability, gluon_inputs and path != "triton", interpret)
    if path == "gluon" and not dq.tiles.specialized:
        raise _cannot(path, "no Gluon backward for these inputs (the five-matmul one: causal fp16/bf16 at head_dim 64 "
                            "or 128 on sm_90, not deterministic; the dQ kernel at head_dim 128 from 4K tokens)")
    return Plan("triton", dkdv, dq.tiles, forced or dq.why)


# ------------------------------------------------------------------------------------------------
# The old choosers' questions, answered by plan (kept for callers of minigpt_kernels.flash_attention)
# ------------------------------------------------------------------------------------------------
def tile_config(kernel: str, head_dim: int, causal: bool = True, dtype: torch.dtype = torch.bfloat16,
                seq_len: int | None = None, specialized: bool = False) -> TileConfig:
    """The tiles of one kernel ('fwd', 'dkdv' or 'dq') as the table gives them; specialized: the inputs fit the
    Gluon kernels on an sm_90 GPU (the table then sends long causal sequences to them)."""
    return plan(kernel, head_dim, seq_len, dtype, causal, capability=SM90 if specialized else None,
                gluon_inputs=specialized, path="auto").tiles


def fused_backward_config(head_dim: int, causal: bool, dtype: torch.dtype, seq_len: int,
                          specialized: bool) -> TileConfig | None:
    """The five-matmul backward's tiles where the table sends the backward to it, None elsewhere."""
    p = plan("bwd", head_dim, seq_len, dtype, causal, capability=SM90 if specialized else None,
             gluon_inputs=specialized, path="auto")
    return p.tiles if p.path == "gluon" else None

"""The launchers: run the kernels of triton_kernels.py and gluon/ on tensors, with the plan dispatch.py gives (or the
tiles a caller forces), and check what they are given. Public for ring attention (minigpt/ring_attention.py), which
launches the forward and the backward's kernels one by one, into its own fp32 accumulators, on plain grids
(persistent=False: NCCL's kernels hold SMs beside them, which a persistent kernel's fixed work lists wait for).

    launch_forward                    (o, lse), fresh or continued over more keys (accumulate)
    launch_backward                   (dq, dk, dv): the path the plan names
      launch_backward_fused             the five-matmul backward (Gluon, sm_90)
      launch_backward_via_ds            dS kept in memory, dQ = dS K from it
      launch_backward_dq / _dkdv        the seven-matmul backward's two kernels (ring attention: one at a time)
      launch_backward_delta             delta = rowsum(dO ∘ O), for launches one by one
    launch_backward_block             one ring attention launch's dQ, dK, dV added into (or written to) its buffers:
                                      the five-matmul Gluon kernel where gluon_block_ready says so, else the two above

Masks and GQA (keyword-only, every launcher but the Gluon- and dS-only ones): k and v may have fewer heads than q
(q_heads a multiple of kv_heads; query head h reads K/V head h // (q_heads // kv_heads), and dK/dV sum over the
group inside the dK/dV kernel); `window` (keys within it of the query: causal i − window < j ≤ i, else
|i − j| < window); `q_doc_ids` (B, Nq) and `k_doc_ids` (B, Nk), non-decreasing ints (a query sees a key only of the
same document); `q_offset` and `k_offset`, the global positions of the first query and key row, for a query block
against a key block elsewhere in the sequence (ring attention): causal and window then compare global positions,
and a causal launch may have Nq != Nk. A row that sees no key gets o = 0 and lse = −inf. The kernels find each tile's
span of visible keys (or queries) on the device and skip the tiles outside it (triton_kernels.py, "Masks").
Causal masked and GQA calls of a sequence against itself (gluon_masks_ready) take the Gluon forward and, unless
deterministic, the five-matmul backward on sm_90 (dispatch.py's sm90-masks rows; MINIGPT_FLASH_PATH=triton keeps
the Triton kernels). The forward's one test of what its Gluon kernel takes is gluon_forward_ready: besides those, on
sm_90, dense calls (GQA at most) causal or not, with Nq != Nk where not causal, fresh or continued (`accumulate`),
into an fp32 o or one in q's dtype: ring attention's launches without a window or documents. Masks with non-causal
or continued calls run the Triton forward.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import torch
import triton
from torch import Tensor

from minigpt_kernels.device import INTERPRET, capability, cdiv, strides3, tma_ready, tma_scratch
from minigpt_kernels.dispatch import PATH_ENV, TileConfig, ds_head_elements, fold_tiles, plan
from minigpt_kernels.relaunch import launch_kernel
from minigpt_kernels.triton_kernels import (
    LOG2E, bwd_delta_kernel, bwd_dkdv_kernel, bwd_dq_from_ds_kernel, bwd_dq_kernel, fwd_kernel)

try:  # the warp-specialized kernels need triton's Gluon API for Hopper (3.6's or later); without it, Triton's alone
    from minigpt_kernels.gluon import backward as gluon_backward
    from minigpt_kernels.gluon import forward as gluon_forward
except (ImportError, AttributeError):  # another triton's Gluon
    gluon_backward = gluon_forward = None


def _hopper_or_newer(t: Tensor) -> bool:
    return INTERPRET or (t.is_cuda and capability(t.device)[0] >= 9)


def _use_tma(cfg: TileConfig, *tensors: Tensor) -> bool:
    """Whether this launch streams these tensors through TMA. Device-side descriptors need Triton's scratch
    allocator; it is per thread (a ContextVar) and autograd runs the backward on its own thread, so it is set on
    every launch."""
    if not (cfg.tma and _hopper_or_newer(tensors[0]) and tma_ready(*tensors)):
        return False
    if not INTERPRET:
        triton.set_allocator(tma_scratch)
    return True


def specialized_ready(q: Tensor, k: Tensor, v: Tensor, causal: bool, accumulate: bool = False,
                      out: tuple[Tensor, Tensor] | None = None, also: tuple[Tensor, ...] = ()) -> bool:
    """Whether the warp-specialized Gluon kernels can take these inputs: an sm_90 GPU (wgmma) with their Gluon API,
    causal, fp16/bf16, head_dim 64 or 128, as many queries as keys, TMA-aligned q/k/v (and `also`, e.g. do), a fresh
    result (no `accumulate`) and, for the forward's out=(o, lse), o in q's dtype and contiguous LSE rows."""
    return (not INTERPRET and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128)
            and causal and not accumulate and q.shape == k.shape == v.shape
            and (out is None or (out[0].dtype == q.dtype and out[1].is_contiguous()))
            and capability(q.device) == (9, 0) and tma_ready(q, k, v, *also)
            and all(t.stride(-1) == 1 for t in (q, k, v, *also))
            and gluon_forward is not None)


def gluon_masks_ready(q: Tensor, k: Tensor, v: Tensor, causal: bool, q_doc_ids: Tensor | None,
                      k_doc_ids: Tensor | None, q_offset: int | None, k_offset: int | None, accumulate: bool = False,
                      out: tuple[Tensor, Tensor] | None = None, also: tuple[Tensor, ...] = ()) -> bool:
    """Whether the Gluon forward (and the five-matmul backward, with `also` = (do,)) takes this call with masks or
    GQA: a causal sequence against itself (no offsets, the same document ids for queries and keys), K/V heads
    dividing q's, and inputs specialized_ready takes."""
    same_ids = q_doc_ids is k_doc_ids or (
        q_doc_ids is not None and k_doc_ids is not None and q_doc_ids.data_ptr() == k_doc_ids.data_ptr()
        and q_doc_ids.shape == k_doc_ids.shape and q_doc_ids.stride() == k_doc_ids.stride())
    kv_heads = (k.shape == v.shape and k.shape[0] == q.shape[0] and k.shape[2:] == q.shape[2:]
                and q.shape[1] % k.shape[1] == 0)
    return (not q_offset and not k_offset and same_ids and kv_heads
            and specialized_ready(q, q, q, causal, accumulate, out, also=(k, v, *also)))


def gluon_forward_ready(q: Tensor, k: Tensor, v: Tensor, causal: bool, accumulate: bool = False,
                        out: tuple[Tensor, Tensor] | None = None, *, window: int | None = None,
                        q_doc_ids: Tensor | None = None, k_doc_ids: Tensor | None = None, q_offset: int | None = None,
                        k_offset: int | None = None) -> bool:
    """Whether the Gluon forward (gluon/forward.py) takes this launch_forward call; the Triton forward takes the rest.

    Always: an sm_90 GPU with triton's Gluon API, q, k, v fp16/bf16 of one dtype with head_dim 64 or 128, TMA-aligned
    and with contiguous last dimensions (specialized_ready's inputs), K/V heads dividing q's; out=(o, lse), if given,
    with o in q's dtype or fp32 and lse rows a fixed distance apart (_row_stride), Nq apart for a causal fresh call
    (those variants address a contiguous LSE). Then either
    - no window, document ids or offsets that move the causal diagonal: causal (Nq == Nk) or not (any Nq, Nk >= 1),
      fresh or continued (`accumulate`, o fp32); or
    - a window or document ids (gluon_masks_ready): causal, fresh, a sequence against itself (no offsets, the same
      ids for queries and keys).
    Masks with non-causal or continued calls (ring attention's windowed and document launches) stay with Triton."""
    B, H, n_q = q.shape[:3]
    if out is None:
        if accumulate:  # nothing to continue from (launch_forward raises)
            return False
    else:
        o, lse = out
        stride = _row_stride(lse) if lse.dim() == 3 else None
        if (o.dtype not in (q.dtype, torch.float32) or (accumulate and o.dtype != torch.float32)
                or o.stride(-1) != 1 or lse.dtype != torch.float32 or stride is None
                or (causal and not accumulate and stride != n_q and B * H > 1)):
            return False
    shift = (q_offset or 0) - (k_offset or 0)
    if window is not None or q_doc_ids is not None or k_doc_ids is not None or (
            causal and (shift != 0 or n_q != k.shape[2])):
        return causal and not accumulate and gluon_masks_ready(q, k, v, causal, q_doc_ids, k_doc_ids, q_offset,
                                                               k_offset)
    return (k.shape == v.shape and k.shape[0] == B and k.shape[3] == q.shape[3] and k.shape[2] >= 1
            and H % k.shape[1] == 0 and q.dtype == k.dtype == v.dtype
            and specialized_ready(q, q, q, True, also=(k, v)))


def _capability(t: Tensor) -> tuple[int, int] | None:
    """The compute capability of t's GPU, None off the GPU: what plan asks of the device."""
    return capability(t.device) if t.is_cuda else None


_NOT_SPECIALIZED = ("flash_attention: the warp-specialized {} takes causal fp16/bf16 inputs with head_dim 64 or 128, "
                    "TMA-aligned, on an sm_90 GPU, without accumulate (see specialized_ready)")


def _reg_cap(cfg: TileConfig) -> dict[str, int]:
    return {} if cfg.maxnreg is None or INTERPRET else {"maxnreg": cfg.maxnreg}


def _needs_int64(n: int, *tensors: Tensor) -> bool:
    """Whether a row offset (seq position × row stride) can pass 2³¹: then the kernels use int64 tile offsets.

    Only then: int64 offsets cost 10-15% on an H200 at benchmark sizes (they hide alignment from the compiler).
    """
    return any(n * t.stride(2) >= 2**31 for t in tensors)


def _in_layout_of(t: Tensor, flat: Tensor, heads: int) -> Tensor:
    """flat (B·heads·N·D elements) viewed as (B, heads, N, D) in t's memory order (see empty_in_layout_of), so that
    copying it into a head slice of a tensor laid out like t walks both in the same order."""
    B, _, N, D = t.shape
    if t.stride(1) < t.stride(2):
        return flat.view(B, N, heads, D).transpose(1, 2)
    return flat.view(B, heads, N, D)


def empty_in_layout_of(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An uninitialized (B, H, N, D) tensor (of t's dtype unless given) laid out in memory like t: as (B, N, H, D)
    rows when t is a head-transposed view of a (B, N, ...) buffer (the model's q/k/v), so that the model's
    transpose + reshape back to (B, N, H·D) is a free view; plain (B, H, N, D) otherwise."""
    B, H, N, D = t.shape
    dtype = t.dtype if dtype is None else dtype
    if t.stride(1) < t.stride(2):  # heads vary faster than positions: rows of (H, D)
        return torch.empty((B, N, H, D), dtype=dtype, device=t.device).transpose(1, 2)
    return torch.empty((B, H, N, D), dtype=dtype, device=t.device)


def _check_lengths(q: Tensor, k: Tensor, v: Tensor, causal: bool, positioned: bool = False) -> None:
    """The launchers take Nq query rows against Nk key rows, and q_heads a multiple of kv_heads (GQA). A causal mask
    without positions is the diagonal of a square, so causal launches need Nq == Nk unless q_offset/k_offset place
    the blocks (positioned). (flash_attention's own check, check_inputs, keeps one length for q, k, v.)"""
    if (k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or k.shape[2] < 1
            or k.shape[1] < 1 or q.shape[1] % k.shape[1]):
        raise ValueError(f"flash_attention: q (B, Hq, Nq, D) and k, v (B, Hkv, Nk, D) with Nk >= 1 and Hq a multiple "
                         f"of Hkv expected, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if causal and q.shape[2] != k.shape[2] and not positioned:
        raise ValueError(f"flash_attention: causal attention needs as many queries as keys, got Nq={q.shape[2]}, "
                         f"Nk={k.shape[2]} (different lengths only without the causal mask, or with q_offset/k_offset)")


CHECK_MASKS_ENV = "MINIGPT_CHECK_MASKS"  # =1: check that document ids do not decrease (a host sync per launch)
_tile_counts: list | None = None  # count_tiles' record while it is active (tests, interpreter only)


@contextlib.contextmanager
def count_tiles():
    """Tests under Triton's interpreter: while active, every Triton attention kernel launch counts the tiles it
    visits. Yields a list that receives (kernel, counts, (block_m, block_n)) per launch: kernel "fwd", "dq" or "dkdv",
    counts an int32 (B·q_heads, query tiles, key tiles) tensor of visits (the dK/dV kernel counts per query head)."""
    global _tile_counts
    if not INTERPRET:
        raise RuntimeError("count_tiles runs under Triton's interpreter only (TRITON_INTERPRET=1)")
    _tile_counts = []
    try:
        yield _tile_counts
    finally:
        _tile_counts = None


def check_doc_ids(name: str, ids: Tensor, q: Tensor, n: int) -> None:
    """ValueError unless `ids` is a (B, n) int32/int64 tensor on q's device. Its values are not looked at (that
    would sync with the GPU and break a compiled graph); the launchers check them under MINIGPT_CHECK_MASKS=1."""
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape != (q.shape[0], n):
        raise ValueError(f"flash_attention: {name} must be a (batch, seq) = ({q.shape[0]}, {n}) tensor, got "
                         f"{tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"flash_attention: {name} must be int32 or int64, got {ids.dtype}")
    if ids.device != q.device:
        raise ValueError(f"flash_attention: {name} must be on q's device {q.device}, got {ids.device}")


def _checked_doc_ids(name: str, ids: Tensor, q: Tensor, n: int) -> Tensor:
    """check_doc_ids; non-decreasing when MINIGPT_CHECK_MASKS=1; rows made contiguous for the kernels."""
    check_doc_ids(name, ids, q, n)
    if os.environ.get(CHECK_MASKS_ENV) == "1" and n > 1 and bool((ids[:, 1:] < ids[:, :-1]).any()):
        raise ValueError(f"flash_attention: {name} must be non-decreasing along the sequence (packed documents)")
    return ids if ids.stride(1) == 1 or n == 1 else ids.contiguous()
def _mask_args(q: Tensor, k: Tensor, causal: bool, window: int | None, q_doc_ids: Tensor | None,
               k_doc_ids: Tensor | None, q_offset: int | None, k_offset: int | None, kernel: str,
               blocks: tuple[int, int]) -> tuple[tuple, dict]:
    """Checked masks, as the Triton kernels take them: (Q_IDS, K_IDS, stride_qids, stride_kids, shift, window, steps,
    COUNTS) and the constexprs GROUP, MASKS, WINDOWED, DOCS, COUNT. MASKS where some mask leaves out keys beyond
    today's causal diagonal: a window narrower than the blocks' span, documents, or a causal launch off the
    diagonal (offsets that differ, Nq != Nk)."""
    B, H, N_Q = q.shape[:3]
    N_K = k.shape[2]
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"flash_attention: window must be an int >= 1 (or None), got {window!r}")
    for name, off in (("q_offset", q_offset), ("k_offset", k_offset)):
        if off is not None and (isinstance(off, bool) or not isinstance(off, int) or off < 0):
            raise ValueError(f"flash_attention: {name} must be an int >= 0 (or None), got {off!r}")
    if (q_doc_ids is None) != (k_doc_ids is None):
        raise ValueError("flash_attention: q_doc_ids and k_doc_ids go together (both or neither)")
    docs = q_doc_ids is not None
    if docs:
        q_doc_ids = _checked_doc_ids("q_doc_ids", q_doc_ids, q, N_Q)
        k_doc_ids = _checked_doc_ids("k_doc_ids", k_doc_ids, q, N_K)
    shift = (q_offset or 0) - (k_offset or 0)  # query i sits at key index i + shift
    if window is not None and window > max(abs(N_Q - 1 + shift), abs(shift - (N_K - 1))):
        window = None  # wider than any query-key distance of these blocks: leaves nothing out
    masks = window is not None or docs or (causal and (shift != 0 or N_Q != N_K))
    counts = None
    if _tile_counts is not None:
        counts = torch.zeros((B * H, cdiv(N_Q, blocks[0]), cdiv(N_K, blocks[1])), dtype=torch.int32,
                             device=q.device)
        _tile_counts.append((kernel, counts, blocks))
    ids = (q_doc_ids, k_doc_ids, q_doc_ids.stride(0), k_doc_ids.stride(0)) if masks and docs else (q, q, 0, 0)
    # unmasked launches pass constants (no new specialization of the dense kernels per length)
    spans = (shift, window or 0, max(N_Q, N_K).bit_length()) if masks else (0, 0, 0)
    args = (*ids, *spans, q if counts is None else counts)
    return args, dict(GROUP=H // k.shape[1], MASKS=masks, WINDOWED=masks and window is not None,
                      DOCS=masks and docs, COUNT=counts is not None)


def _masked(q: Tensor, k: Tensor, causal: bool, window, q_doc_ids, q_offset, k_offset) -> bool:
    """Whether a launch has masks or GQA: then only the Triton kernels take it, or on sm_90 the masked Gluon forward
    and five-matmul backward where gluon_masks_ready says so (the dense Gluon and dS paths take neither; the dense
    Gluon forward takes GQA alone, launch_forward)."""
    return q.shape[1] != k.shape[1] or _has_masks(q, k, causal, window, q_doc_ids, q_offset, k_offset)


def _has_masks(q: Tensor, k: Tensor, causal: bool, window, q_doc_ids, q_offset, k_offset) -> bool:
    """Whether a launch has masks: a window, document ids, or a causal diagonal moved by offsets or unequal lengths."""
    shift = (q_offset or 0) - (k_offset or 0)
    return window is not None or q_doc_ids is not None or (causal and (shift != 0 or q.shape[2] != k.shape[2]))


def _row_stride(t: Tensor) -> int | None:
    """The distance between the (batch, head) rows of a (B, H, N) tensor that the kernels address as
    t + (b·H + h)·stride + n (LSE, delta): a contiguous tensor or a slice of one along N. None if t is not such."""
    B, H, N = t.shape
    stride = t.stride(1) if H > 1 else t.stride(0)
    if (N > 1 and t.stride(2) != 1) or (B > 1 and H > 1 and t.stride(0) != H * stride):
        return None
    return stride


def _rows_in(t: Tensor) -> tuple[Tensor, int]:
    """A (B, H, N) kernel input and its row stride; copied to contiguous memory only if its rows do not fit."""
    stride = _row_stride(t)
    if stride is None:
        t = t.contiguous()
        stride = _row_stride(t)
    return t, stride


def _rows_for_tma(t: Tensor, stride: int) -> tuple[Tensor, int]:
    """(rows, stride) of a (B, H, N) fp32 input whose (b, h) rows must each start 16-byte aligned (a 1-D TMA
    descriptor's base): t itself when they do, else a copy into rows padded to a multiple of 4 (B·H·N·4 bytes)."""
    if tma_ready(t) and (stride * t.element_size()) % 16 == 0:
        return t, stride
    B, H, N = t.shape
    padded = torch.empty((B, H, (N + 3) // 4 * 4), dtype=torch.float32, device=t.device)
    padded[:, :, :N].copy_(t)
    return padded, padded.stride(1)


def _check_out(name: str, t: Tensor, shape: torch.Size | tuple[int, ...], accumulate: bool) -> None:
    """An output buffer given by the caller: its shape, a contiguous last dimension, fp32 when accumulated into."""
    if t.shape != shape or t.stride(-1) != 1 or (accumulate and t.dtype != torch.float32):
        raise ValueError(f"flash_attention: out {name} must be {tuple(shape)}{', fp32,' if accumulate else ''} with a "
                         f"contiguous last dimension, got {tuple(t.shape)} {t.dtype} with strides {t.stride()}")


def _grad_outputs(out: tuple[Tensor, ...] | None, accumulate: bool, names: tuple[str, ...],
                  likes: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The backward launchers' output buffers: new ones laid out like their inputs, or the caller's `out`, checked
    (accumulating needs one to add into)."""
    if out is None:
        if accumulate:
            raise ValueError("flash_attention: accumulate=True adds into `out`; none given")
        return tuple(empty_in_layout_of(t) for t in likes)
    for name, t, like in zip(names, out, likes):
        _check_out(name, t, like.shape, accumulate)
    return tuple(out)


def gqa_dense_tiles(head_dim: int, n_q: int, dtype: torch.dtype, capability: tuple[int, int] | None,
                    gluon_inputs: bool, interpret: bool | None = None) -> TileConfig | None:
    """The tiles for a causal fresh GQA call without masks (no window, documents or moved diagonal): the dense rows'
    Gluon tiles (persistent, 3 consumers where they say), whose kernel reads K/V head h // group per query head;
    None where the dense row is not a Gluon one (the masked row's then). The masked row's plain grid of 2 consumers
    ran GQA 16:4 at 8K tokens 1.3x slower than MHA's forward (results/kernels/masks_NVIDIA_H100.md)."""
    dense = plan("fwd", head_dim, n_q, dtype, True, capability=capability, gluon_inputs=gluon_inputs,
                 interpret=interpret).tiles
    return dense if dense.specialized else None


def launch_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: float, cfg: TileConfig | None = None,
                   out: tuple[Tensor, Tensor] | None = None, accumulate: bool = False, *, window: int | None = None,
                   q_doc_ids: Tensor | None = None, k_doc_ids: Tensor | None = None, q_offset: int | None = None,
                   k_offset: int | None = None, persistent: bool = True) -> tuple[Tensor, Tensor]:
    """Run the forward kernel: (o, lse) of the Nq rows of q against the Nk keys of k, v (Nq == Nk when causal).
    `cfg` overrides the tile table (the benchmark's tile exploration). persistent=False: the table's tiles on a plain
    grid even where its row is persistent (ring attention: its launches share the SMs with NCCL's kernels, and a
    persistent kernel's fixed work lists wait for them); cfg is taken as given.

    out=(o, lse): write the result there instead of into new tensors: o (B, H, Nq, D), any dtype, any strides with
    a contiguous last dimension; lse (B, H, Nq) fp32, a contiguous tensor or a slice of one along Nq. On sm_90 the
    Gluon forward takes the call where gluon_forward_ready says so (the ring's dense launches included), else Triton's.
    accumulate=True: out holds, in fp32, the attention of these rows over other keys (o normalized, lse base 2; a
    row with lse = -inf holds nothing yet, whatever its o) and is overwritten with the attention over both key
    sets. Ring attention folds each arriving block into its running output this way, without a merge pass.
    window, q_doc_ids, k_doc_ids, q_offset, k_offset, and k, v with fewer heads than q: see the module docstring."""
    _check_lengths(q, k, v, causal, q_offset is not None or k_offset is not None)
    B, H, N_Q, D = q.shape
    N_K = k.shape[2]
    masked = _masked(q, k, causal, window, q_doc_ids, q_offset, k_offset)
    ready = gluon_forward_ready(q, k, v, causal, accumulate, out, window=window, q_doc_ids=q_doc_ids,
                                k_doc_ids=k_doc_ids, q_offset=q_offset, k_offset=k_offset)
    if cfg is not None and cfg.specialized and not ready:
        raise ValueError("flash_attention: the warp-specialized forward takes fp16/bf16 inputs with head_dim 64 or "
                         "128, TMA-aligned, on an sm_90 GPU; masks only in causal fresh calls of a sequence against "
                         "itself (see gluon_forward_ready)")
    dense_gqa = None  # GQA alone as the model calls it: the dense launchers and tiles (ring attention's calls,
    # continued ones and a caller's cfg keep what they had)
    gqa_alone = masked and not _has_masks(q, k, causal, window, q_doc_ids, q_offset, k_offset)
    if gqa_alone and causal and not accumulate and persistent and cfg is None and ready:
        dense_gqa = gqa_dense_tiles(D, N_Q, q.dtype, _capability(q), ready)
    if cfg is None:
        cfg = dense_gqa or plan("fwd", D, N_Q, q.dtype, causal, capability=_capability(q), gluon_inputs=ready,
                                masked=masked).tiles
        cfg = cfg if persistent else dataclasses.replace(cfg, persistent=False)
    margs, mflags = _mask_args(q, k, causal, window, q_doc_ids, k_doc_ids, q_offset, k_offset, "fwd",
                               (cfg.block_m, cfg.block_n))
    if out is None:
        if accumulate:
            raise ValueError("flash_attention: accumulate=True continues the state in `out`; none given")
        o, lse = empty_in_layout_of(q), torch.empty((B, H, N_Q), dtype=torch.float32, device=q.device)
    else:
        o, lse = out
        _check_out("o", o, q.shape, accumulate)
        if lse.shape != (B, H, N_Q) or lse.dtype != torch.float32 or _row_stride(lse) is None:
            raise ValueError(f"flash_attention: out lse must be ({B}, {H}, {N_Q}) fp32 with contiguous rows, got "
                             f"{tuple(lse.shape)} {lse.dtype} with strides {lse.stride()}")
    if cfg.specialized:
        triton.set_allocator(tma_scratch)  # its TMA descriptors are made on the device, like _use_tma's
        stride_lse = _row_stride(lse)
        if masked and causal and not accumulate and dense_gqa is None:  # margs: (ids, ids, strides, shift,
            # window, steps, counts), as _mask_args checked them
            gluon_forward.launch_forward_masked(q, k, v, o, lse, sm_scale * LOG2E, cfg.block_m // 64, cfg.block_n,
                                                cfg.num_stages, margs[5] if mflags["WINDOWED"] else None,
                                                margs[0] if mflags["DOCS"] else None, stride_lse=stride_lse,
                                                persistent=None if persistent else False)  # ring: plain grids
            return o, lse
        # no masks (GQA at most, its K/V head read per query head): causal or not, fresh or continuing the rows'
        # (o, lse)
        launch = gluon_forward.launch_forward_persistent if cfg.persistent else gluon_forward.launch_forward_pingpong
        launch(q, k, v, o, lse, sm_scale * LOG2E, cfg.block_m // 64, cfg.block_n, cfg.num_stages, causal=causal,
               accumulate=accumulate, stride_lse=stride_lse)
        return o, lse
    grid = (cdiv(N_Q, cfg.block_m), B * H)
    launch_kernel(fwd_kernel, grid, q, k, v, o, lse, *strides3(q), *strides3(k), *strides3(v), *strides3(o),
                  _row_stride(lse),
                  H, N_Q, N_K, sm_scale * LOG2E, *margs, CAUSAL=causal, CONTINUE=accumulate, HEAD_DIM=D,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, INT64_OFFSETS=_needs_int64(max(N_Q, N_K), q, k, v),
                  TMA=_use_tma(cfg, k, v),
                  FOLD=fold_tiles(N_K, cfg.block_n, margs[5] if mflags["WINDOWED"] else None),  # margs[5]: window
                  num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, **mflags, **_reg_cap(cfg))
    return o, lse


def launch_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, sm_scale: float,
                    dkdv_cfg: TileConfig | None = None, dq_cfg: TileConfig | None = None,
                    deterministic: bool = False, out: tuple[Tensor, Tensor, Tensor] | None = None,
                    fp32_dq: bool = False, *, window: int | None = None, q_doc_ids: Tensor | None = None,
                    k_doc_ids: Tensor | None = None, q_offset: int | None = None,
                    k_offset: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The backward: (dq, dk, dv). Where the table says so (long causal sequences at head_dim 64 or 128 on an
    H100/H200), the five-matmul backward (launch_backward_fused), unless deterministic results are asked for (deterministic=True or
    torch.use_deterministic_algorithms): its dQ is summed in a varying order. Short causal sequences at head_dim 128
    on an H100/H200 (fp16/bf16, up to 1K tokens, its dS buffer at most VIA_DS_MAX_BYTES, no cfg given): the backward
    that keeps dS in memory (launch_backward_via_ds; deterministic, so also in deterministic mode). Otherwise the
    deterministic seven-matmul backward: the dQ kernel, then the dK/dV kernel (the cfgs override their tiles). The
    dQ kernel also computes delta = rowsum(dO ∘ O) for its rows (it loads dO anyway) and leaves it for the dK/dV
    kernel, which saves a pass over O and dO: 1–3% of the backward at 1K–4K and at 128K tokens (NOTES.md L).
    out=(dq, dk, dv): write the gradients there (q's, k's, v's shapes, contiguous last dimensions; dq overlapping
    no input) and return them;
    fp32_dq: where the five-matmul backward runs, return its fp32 dQ accumulator in out's dq's stead (see
    launch_backward_fused). Masks and GQA (window, q_doc_ids, k_doc_ids, q_offset, k_offset; the module docstring):
    the five-matmul backward for a causal sequence against itself on sm_90 (gluon_masks_ready; not deterministic),
    else the seven-matmul backward, the masks' tiles of the table."""
    if do.stride(-1) != 1:
        do = do.contiguous()
    B, H, N = lse.shape
    masks = dict(window=window, q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids, q_offset=q_offset, k_offset=k_offset)
    masked = _masked(q, k, causal, window, q_doc_ids, q_offset, k_offset)
    if out is not None:
        _grad_outputs(out, False, ("dq", "dk", "dv"), (q, k, v))  # checked here, before either path runs
    if dkdv_cfg is None and dq_cfg is None:  # the plan's path; else the seven-matmul backward with the tiles given
        args = (q.shape[-1], N, q.dtype, causal)
        options = dict(deterministic=deterministic or torch.are_deterministic_algorithms_enabled(),
                       capability=_capability(q), batch_heads=B * H, masked=masked)
        p = plan("bwd", *args, gluon_inputs=True, **options)  # the inputs are checked only where a Gluon kernel runs
        if (p.path == "gluon" or p.dq_tiles.specialized) and not (
                gluon_masks_ready(q, k, v, causal, q_doc_ids, k_doc_ids, q_offset, k_offset, also=(do,)) if masked
                else specialized_ready(q, k, v, causal, also=(do,))):
            p = plan("bwd", *args, gluon_inputs=False, **options)
        if p.path == "gluon":
            return launch_backward_fused(do, q, k, v, o, lse, sm_scale, p.tiles, out=out, fp32_dq=fp32_dq, **masks)
        if p.path == "via_ds":
            return launch_backward_via_ds(do, q, k, v, o, lse, sm_scale, p.tiles, p.dq_tiles, out=out)
        dkdv_cfg, dq_cfg = p.tiles, p.dq_tiles
    # rows start 16-byte aligned whatever N, as TMA reads them
    delta = torch.empty((B, H, (N + 3) // 4 * 4), dtype=torch.float32, device=lse.device)[:, :, :N]
    dq = launch_backward_dq(do, q, k, v, lse, delta, causal, sm_scale, dq_cfg, o=o,
                            out=None if out is None else out[0], **masks)
    dk, dv = launch_backward_dkdv(do, q, k, v, lse, delta, causal, sm_scale, dkdv_cfg,
                                  out=None if out is None else out[1:], **masks)
    return dq, dk, dv


# The five-matmul backward's fp32 dQ accumulator takes at most this many bytes, or one head's (B·N·D·4) where that is
# more: inputs with more heads · tokens run it head group by head group (from 128K tokens one head alone fills an
# H200), so its memory stays bounded by the larger of the two.
FUSED_DQ_ACC_BYTES = 256 << 20


# fused_heads_per_launch cuts a short GQA grid into one launch per K/V head from this many tokens; below, a call is
# short enough that its launches' host time and the fp32 dK, dV's copies outweigh the SMs left idle (not measured)
SHORT_GQA_CUT_FROM = 4096


# 2-byte heads of dq whose memory holds one fp32 plane of dK and one of dV (_fp32_pair_within): a group needs this many
# query heads per K/V head for its split to add into dq's memory instead of a buffer of its own
DQ_HEADS_PER_FP32_PAIR = 4


def fused_heads_per_launch(B: int, H: int, kv_heads: int, N: int, D: int, sms: int, *,
                           cut_short_gqa: bool = True) -> int:
    """Query heads per launch of the five-matmul backward: as many as FUSED_DQ_ACC_BYTES of fp32 dQ accumulator hold
    (at least one head's), in whole GQA groups so that a K/V head's dK, dV are summed in one launch. A short GQA grid
    (fewer (batch, K/V head, key block) items than `sms`: each item walks its whole group, so the longest, key block
    0, sets the time) is split over more programs (gluon/backward.group_splits) adding into fp32 dK, dV. Groups of
    four query heads or more keep one launch: its splits add into dq's memory (_fp32_pair_within: four 2-byte heads
    hold one fp32 pair). Smaller groups get one launch per K/V head, each a one-K/V-head call whose fp32 pair is a
    buffer of its own while the dQ accumulator shrinks to the group's, so the call's memory stays at most MHA's: GQA
    8:2 at head_dim 128 and 8K tokens (128 items), cut so, ran 0.66x the unsplit launch's time, 16:2 at 64 0.66x
    (kernels/NOTES.md, session 19). cut_short_gqa=False keeps one launch: windows and documents (short items: a
    window of 1K at 8K ran 1.24x slower cut) and callers that take the fp32 accumulator of every head
    (launch_backward_fused's fp32_dq)."""
    kv_group = H // kv_heads
    n_kblocks = -(-N // 128)
    if (cut_short_gqa and 1 < kv_heads < H and kv_group < DQ_HEADS_PER_FP32_PAIR and N >= SHORT_GQA_CUT_FROM
            and B * kv_heads * n_kblocks < sms):
        return kv_group
    heads = max(1, min(H, FUSED_DQ_ACC_BYTES // (B * N * D * 4)))
    return max(kv_group, heads // kv_group * kv_group)


def _fp32_pair_within(t: Tensor, kv_heads: int = 1) -> tuple[Tensor, Tensor] | None:
    """Two fp32 (B, kv_heads, N, D) views inside the memory of t, a 2-byte (B, h, N, D) gradient of h >= 4·kv_heads
    heads that is written only later (dQ, copied from its accumulator after the dK/dV/dQ kernel): room for a split's
    fp32 dK, dV (group_splits), so that they need no memory of their own. None where t is laid out otherwise (or its
    2-byte offsets and strides would not land on 4-byte boundaries)."""
    B, h, N, D = t.shape
    sb, sh, sn, sd = t.stride()
    need = DQ_HEADS_PER_FP32_PAIR * kv_heads  # 2-byte heads that hold two fp32 planes of kv_heads heads
    if (t.element_size() != 2 or h < need or sd != 1 or t.storage_offset() % 2
            or any(x % 2 for x in (sb, sh, sn)) or (B > 1 and sb < h * N * D)):  # batches must not share memory
        return None
    if sh == D and sn >= h * D:  # (B, N, h·D) rows: per token, its heads' values back to back
        rows = t.transpose(1, 2)[:, :, :need].flatten(2).view(torch.float32)  # (B, N, 2·kv_heads·D) fp32
        planes = rows.unflatten(2, (2 * kv_heads, D)).transpose(1, 2)  # (B, 2·kv_heads, N, D)
        return planes[:, :kv_heads], planes[:, kv_heads:]
    if sn == D and sh == N * D:  # (B, h, N, D): per head, its N·D values back to back
        planes = t[:, :need].flatten(1).view(torch.float32).view(B, 2 * kv_heads, N, D)
        return planes[:, :kv_heads], planes[:, kv_heads:]
    return None


def launch_backward_fused(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, sm_scale: float,
                          cfg: TileConfig | None = None, out: tuple[Tensor, Tensor, Tensor] | None = None,
                          fp32_dq: bool = False, *, window: int | None = None, q_doc_ids: Tensor | None = None,
                          k_doc_ids: Tensor | None = None, q_offset: int | None = None,
                          k_offset: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The causal five-matmul backward (kernels/NOTES.md Q): (dq, dk, dv) in the memory layouts of q, k, v. A delta
    kernel, then the dK/dV/dQ kernel of gluon/backward.py, which adds dQ into a zeroed fp32 accumulator
    (a TMA reduce-add per query tile and block of 128 keys), then one cast into dq. No kernel recomputes QKᵀ and dO·Vᵀ
    for dQ; dQ's summation order follows the programs' timing, so it can differ in the last bits between runs.
    Needs inputs that fit the warp-specialized kernels (specialized_ready); at head_dim 128 the kernel splits dQ's
    columns between its consumers. out=(dq, dk, dv): write the gradients there (dq overlapping no input: it may
    serve as scratch before dQ is written).
    fp32_dq: return the fp32 accumulator (q's shape and memory order) as dq, without the cast, when it holds
    every head at once (a caller that transforms dQ anyway, e.g. rotates it back, then rounds it only once; out's
    dq, if given, is then left holding scratch); otherwise dq as usual. Masks and GQA (the module docstring) of a
    causal sequence against itself (gluon_masks_ready): one program per key block and K/V head (a plain grid;
    persistent for an MHA window alone) sums dK, dV over the head's group of query heads (a single K/V head over a
    short grid: split over programs, group_splits, whose fp32 dK, dV borrow dq's memory until dq is written,
    _fp32_pair_within; GQA alone over a grid shorter than the GPU: split too, in one launch where each group has
    four query heads or more, else one launch per K/V head, fused_heads_per_launch) and visits only the query tiles
    that see its keys (gluon/backward.py, launch_dkdv_dq_masked)."""
    if do.stride(-1) != 1:
        do = do.contiguous()
    B, H, N, D = q.shape
    masked = _masked(q, k, True, window, q_doc_ids, q_offset, k_offset)
    if not (gluon_masks_ready(q, k, v, True, q_doc_ids, k_doc_ids, q_offset, k_offset, also=(do,)) if masked
            else specialized_ready(q, k, v, True, also=(do,))):
        raise ValueError("flash_attention: the warp-specialized dK/dV/dQ kernel takes causal fp16/bf16 inputs with "
                         "head_dim 64 or 128, TMA-aligned, on an sm_90 GPU (see specialized_ready); with masks or "
                         "GQA, only of a sequence against itself (gluon_masks_ready)")
    if cfg is not None and not (cfg.specialized and cfg.block_m == 64 and cfg.block_n == 128 and cfg.num_stages >= 2):
        raise ValueError(f"flash_attention: the dK/dV/dQ kernel runs 128 keys per program over 64-query tiles with at "
                         f"least 2 stages (TileConfig(64, 128, 4, stages, specialized=True)), got {cfg}")
    # the table's tiles for this length, or its first Gluon row's below the table's lengths
    c = cfg or plan("bwd", D, N, q.dtype, True, capability=_capability(q), gluon_inputs=True, path="gluon",
                    masked=masked).tiles
    dq, dk, dv = _grad_outputs(out, False, ("dq", "dk", "dv"), (q, k, v))
    kv_group = H // k.shape[1]  # query heads per K/V head (GQA)
    # GQA alone over a short grid: one launch whose splits add dK, dV into dq's memory where the group has four query
    # heads or more (_fp32_pair_within), else one launch per K/V head (each split like MQA)
    cut_short_gqa = window is None and q_doc_ids is None and not fp32_dq
    may_cut = cut_short_gqa and 1 < kv_group < DQ_HEADS_PER_FP32_PAIR
    sms = gluon_backward.sm_count(q.device) if may_cut else 0  # asked only where it may cut (CPU tests stub the rest)
    group = fused_heads_per_launch(B, H, k.shape[1], N, D, sms, cut_short_gqa=cut_short_gqa)  # heads per launch
    keep_acc = fp32_dq and group == H
    acc = torch.empty(B * group * N * D, dtype=torch.float32, device=q.device)
    triton.set_allocator(tma_scratch)
    if masked:  # checked (ids' shape, dtype, device; the window) and normalized (a window wider than N: none)
        margs, mflags = _mask_args(q, k, True, window, q_doc_ids, k_doc_ids, q_offset, k_offset, "dkdvdq",
                                   (c.block_m, c.block_n))
        masks = dict(window=margs[5] if mflags["WINDOWED"] else None, document_ids=margs[0] if mflags["DOCS"] else None)
        launch = functools.partial(gluon_backward.launch_dkdv_dq_masked, **masks)
    else:
        launch = gluon_backward.launch_dkdv_dq_persistent if c.persistent else gluon_backward.launch_dkdv_dq
    for h0 in range(0, H, group):
        hs = slice(h0, min(H, h0 + group))
        kvs = slice(h0 // kv_group, hs.stop // kv_group)  # their K/V heads
        dq_acc = _in_layout_of(q, acc[:B * (hs.stop - h0) * N * D], hs.stop - h0).zero_()
        do_h, delta = launch_backward_delta(do[:, hs], o[:, hs], lse[:, hs])
        (lse_h, stride_lse), (delta, stride_delta) = _rows_in(lse[:, hs]), _rows_in(delta)
        (lse_h, stride_lse), (delta, stride_delta) = _rows_for_tma(lse_h, stride_lse), _rows_for_tma(delta, stride_delta)
        grouped = masked and kvs.stop - kvs.start < hs.stop - hs.start  # GQA, MQA: perhaps split (group_splits), its
        # fp32 dK, dV then in these heads' dq, which is written only below
        scratch = dict(split_scratch=_fp32_pair_within(dq[:, hs], kvs.stop - kvs.start)) if grouped else {}
        launch(do_h, q[:, hs], k[:, kvs], v[:, kvs], lse_h, stride_lse, delta, stride_delta, dk[:, kvs], dv[:, kvs],
               dq_acc, sm_scale, sm_scale * LOG2E, c.block_m, c.num_stages, **scratch)
        if keep_acc:
            return dq_acc, dk, dv
        dq[:, hs].copy_(dq_acc)
    return dq, dk, dv


# The backward's kernels are also launched one by one, with delta from a kernel of its own: ring attention runs a
# block's dQ and dK/dV kernels at different times, to overlap different transfers, and has them add into its fp32
# accumulators (`accumulate`).
# lse and delta are those of the whole softmax row (the final o, lse), whatever part of its keys a launch sees.
def launch_backward_delta(do: Tensor, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """(do with a contiguous last dimension, delta = rowsum(dO ∘ O) as (B, H, N) fp32)."""
    B, H, N, D = o.shape
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = torch.empty_like(lse, memory_format=torch.contiguous_format)
    launch_kernel(bwd_delta_kernel, (cdiv(N, 128), B * H), o, do, delta, *strides3(o), *strides3(do), H, N,
                                                    HEAD_DIM=D, BLOCK_M=128, num_warps=4)
    return do, delta


def launch_backward_dkdv(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, causal: bool,
                         sm_scale: float, cfg: TileConfig | None = None, out: tuple[Tensor, Tensor] | None = None,
                         accumulate: bool = False, ds: Tensor | None = None, *, window: int | None = None,
                         q_doc_ids: Tensor | None = None, k_doc_ids: Tensor | None = None, q_offset: int | None = None,
                         k_offset: int | None = None) -> tuple[Tensor, Tensor]:
    """(dk, dv) of the Nk keys over the Nq queries (Nq == Nk when causal), in the memory layouts of k and v, or
    written into out=(dk, dv) (k's shape, contiguous last dimension); accumulate=True adds them to what out holds
    (fp32): ring attention's travelling dK/dV accumulator. ds (causal, square tiles): a flat buffer of
    B·H·ds_head_elements(N, tile) elements in q's dtype that receives every dS tile (launch_backward_via_ds).
    Masks and GQA: the module docstring (with GQA, one program sums a key tile's dK/dV over its group of query heads)."""
    _check_lengths(q, k, v, causal, q_offset is not None or k_offset is not None)
    B, H, N_Q, D = q.shape
    masked = _masked(q, k, causal, window, q_doc_ids, q_offset, k_offset)
    N_K = k.shape[2]
    dk, dv = _grad_outputs(out, accumulate, ("dk", "dv"), (k, v))
    (lse, stride_lse), (delta, stride_delta) = _rows_in(lse), _rows_in(delta)
    if cfg is not None and cfg.specialized:
        raise ValueError("flash_attention: the warp-specialized dK/dV kernel computes dQ too: launch_backward_fused "
                         "runs it")
    c = cfg or plan("dkdv", D, N_Q, q.dtype, causal, masked=masked).tiles
    if ds is not None and not (causal and not masked and c.block_m == c.block_n and ds.dtype == q.dtype and ds.is_contiguous()
                               and ds.numel() == B * H * ds_head_elements(N_Q, c.block_m)
                               and ds_head_elements(N_Q, c.block_m) < 2**31):  # offsets inside a head are int32
        raise ValueError(f"flash_attention: ds takes causal launches without masks or GQA, with square tiles, a "
                         f"contiguous {q.dtype} buffer of B·H·ds_head_elements(N, tile) elements, under 2³¹ per head; "
                         f"got {c} and {ds.numel()} {ds.dtype}")
    margs, mflags = _mask_args(q, k, causal, window, q_doc_ids, k_doc_ids, q_offset, k_offset, "dkdv",
                               (c.block_m, c.block_n))
    launch_kernel(bwd_dkdv_kernel, (cdiv(N_K, c.block_n), B * k.shape[1]),
        q, k, v, do, lse, delta, dk, dv,
        dk if ds is None else ds,  # DS: any pointer when nothing is stored
        *strides3(q), *strides3(k), *strides3(v), *strides3(do),
        *strides3(dk), *strides3(dv), stride_lse, stride_delta, H, N_Q, N_K, sm_scale * LOG2E, sm_scale, *margs,
        CAUSAL=causal, ACCUMULATE=accumulate, HEAD_DIM=D, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        INT64_OFFSETS=_needs_int64(max(N_Q, N_K), q, k, v, do), TMA=_use_tma(c, q, do),
        ROW_TMA=_use_tma(c, lse, delta), STORE_DS=ds is not None,
        num_warps=c.num_warps, num_stages=c.num_stages, **mflags, **_reg_cap(c))
    return dk, dv


@contextlib.contextmanager
def _unfilled():
    """torch.empty without the NaN fill that deterministic mode (torch.use_deterministic_algorithms) adds, for a buffer
    the kernels write in full before reading it."""
    was = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = was


def launch_backward_via_ds(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, sm_scale: float,
                           cfg: TileConfig | None = None, dq_cfg: TileConfig | None = None,
                           out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The causal backward with dS kept in memory: (dq, dk, dv). The delta kernel; the dK/dV kernel, which also
    writes each dS tile (q's dtype, as its own dK matmul rounds it) into a buffer of the lower triangle of tiles;
    then dQ = scale · dS K from that buffer, one matmul per tile where the seven-matmul backward's dQ kernel does
    three. Five matmuls, no atomics, deterministic; dK, dV are the dK/dV kernel's own, and dQ came out bitwise the
    seven-matmul backward's in every shape measured on an H200 (NOTES.md AB; not guaranteed: other tiles, other
    delta source). The buffer holds B·H·ds_head_elements(N, tile) elements (~B·H·N²/2; at 1K tokens and head_dim
    128, 4.25× q's size), so the table takes this path only for short sequences (dispatch.plan).
    cfg: the dK/dV kernel's tiles (square); dq_cfg: the dQ kernel's warps and stages (its tiles are cfg's)."""
    _check_lengths(q, k, v, True)
    if q.shape != k.shape:
        raise ValueError("flash_attention: the dS path takes as many K/V heads as query heads (no GQA)")
    B, H, N, D = q.shape
    c = cfg or plan("dkdv", D, N, q.dtype, True).tiles
    dc = dq_cfg or TileConfig(c.block_m, c.block_n, 4, 3)  # 4 warps, 3 stages: best of 2–4 stages, 4 or 8 warps
    if c.block_m != c.block_n or (dc.block_m, dc.block_n) != (c.block_m, c.block_n):
        raise ValueError(f"flash_attention: the dS path takes square tiles, the same for both kernels; got {c}, {dc}")
    dq, dk, dv = _grad_outputs(out, False, ("dq", "dk", "dv"), (q, k, v))
    do, delta = launch_backward_delta(do, o, lse)
    with _unfilled():  # every element is written before it is read: no NaN fill in deterministic mode
        ds = torch.empty(B * H * ds_head_elements(N, c.block_m), dtype=q.dtype, device=q.device)
    launch_backward_dkdv(do, q, k, v, lse, delta, True, sm_scale, c, out=(dk, dv), ds=ds)
    launch_kernel(bwd_dq_from_ds_kernel, (cdiv(N, c.block_m), B * H),
        ds, k, dq, *strides3(k), *strides3(dq), H, N, sm_scale, HEAD_DIM=D, BLOCK=c.block_m,
        num_warps=dc.num_warps, num_stages=dc.num_stages)
    return dq, dk, dv


def launch_backward_dq(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, causal: bool,
                       sm_scale: float, cfg: TileConfig | None = None, out: Tensor | None = None,
                       accumulate: bool = False, o: Tensor | None = None, *, window: int | None = None,
                       q_doc_ids: Tensor | None = None, k_doc_ids: Tensor | None = None, q_offset: int | None = None,
                       k_offset: int | None = None) -> Tensor:
    """dq of the Nq queries over the Nk keys (Nq == Nk when causal), in the memory layout of q, or written into
    `out` (q's shape, contiguous last dimension); accumulate=True adds it to what out holds (fp32).
    o given (the forward's output): delta is computed here from o and do and written into `delta` (then an output,
    (B, H, Nq) fp32) instead of read from it. Masks and GQA: the module docstring."""
    _check_lengths(q, k, v, causal, q_offset is not None or k_offset is not None)
    B, H, N_Q, D = q.shape
    masked = _masked(q, k, causal, window, q_doc_ids, q_offset, k_offset)
    N_K = k.shape[2]
    (dq,) = _grad_outputs(None if out is None else (out,), accumulate, ("dq",), (q,))
    if o is not None and (o.shape != q.shape or o.stride(-1) != 1):
        raise ValueError(f"flash_attention: o must have q's shape {tuple(q.shape)} and a contiguous last dimension, "
                         f"got {tuple(o.shape)} with strides {o.stride()}")
    if o is not None and (delta.shape != (B, H, N_Q) or delta.dtype != torch.float32 or _row_stride(delta) is None):
        # written here: it must not be a copy made for reading
        raise ValueError(f"flash_attention: delta to compute must be ({B}, {H}, {N_Q}) fp32 with contiguous rows, got "
                         f"{tuple(delta.shape)} {delta.dtype} with strides {delta.stride()}")
    (lse, stride_lse), (delta, stride_delta) = _rows_in(lse), _rows_in(delta)
    # the warp-specialized dQ kernel computes delta from o (it has no path that reads it); the inputs are checked only
    # where the table (or cfg) wants it
    if cfg is not None and cfg.specialized and not (o is not None and cfg.block_m == 128 and not masked
                                                    and specialized_ready(q, k, v, causal, accumulate, also=(do,))):
        raise ValueError(_NOT_SPECIALIZED.format("dQ kernel") + ", with o given, no masks or GQA; its block_m is 128")
    c = cfg
    if c is None:
        c = plan("dq", D, N_Q, q.dtype, causal, capability=_capability(q), gluon_inputs=True, masked=masked).tiles
        if c.specialized and not (o is not None and specialized_ready(q, k, v, causal, accumulate, also=(do,))):
            c = plan("dq", D, N_Q, q.dtype, causal, capability=_capability(q), gluon_inputs=False).tiles
    if c.specialized:
        triton.set_allocator(tma_scratch)
        gluon_backward.launch_dq(
            do, q, k, v, o, lse, stride_lse, delta, stride_delta, dq, sm_scale, sm_scale * LOG2E, c.block_n,
            c.num_stages)
        return dq
    margs, mflags = _mask_args(q, k, causal, window, q_doc_ids, k_doc_ids, q_offset, k_offset, "dq",
                               (c.block_m, c.block_n))
    launch_kernel(bwd_dq_kernel, (cdiv(N_Q, c.block_m), B * H),
        q, k, v, do, lse, delta, dq, o, *strides3(q), *strides3(k), *strides3(v), *strides3(do),
        *strides3(dq), *(strides3(o) if o is not None else (0, 0, 0)), stride_lse, stride_delta,
        H, N_Q, N_K, sm_scale * LOG2E, sm_scale, *margs,
        CAUSAL=causal, ACCUMULATE=accumulate, HEAD_DIM=D, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
        INT64_OFFSETS=_needs_int64(max(N_Q, N_K), q, k, v, do), TMA=_use_tma(c, k, v), DELTA_FROM_O=o is not None,
        num_warps=c.num_warps, num_stages=c.num_stages, **mflags, **_reg_cap(c))
    return dq


# ------------------------------------------------------------------------------------------------
# Ring attention's block backward: a (query rows, key block) launch's dQ, dK, dV from one Gluon kernel
# ------------------------------------------------------------------------------------------------
# The tiles of launch_backward_block's Gluon kernel where no table row names them (a block off the diagonal, or
# GQA): a plain grid of 128-key blocks over 64-query tiles, 3 stages at head_dim 64 and 2 at 128, as dispatch.py's
# sm90-masks rows. On ring attention's off-diagonal blocks (2c x c and c x 2c, c = 4K-16K, one H100) they are within
# 3.5% of the best of 2-4 stages, plain or persistent (NOTES.md, 'Ring attention's launches timed alone').
BLOCK_BACKWARD_TILES = {64: TileConfig(64, 128, 4, 3, tma=True, specialized=True),
                        128: TileConfig(64, 128, 4, 2, tma=True, specialized=True)}


def gluon_block_ready(do: Tensor, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> bool:
    """Whether launch_backward_block runs the fused Gluon dK/dV/dQ kernel on an unmasked block: an sm_90 GPU with
    the Gluon API; q, k, v, do of one dtype, fp16 or bf16; head_dim 64 or 128; K/V heads dividing q's (GQA); causal
    with as many queries as keys, or non-causal with N_Q a multiple of 64 and N_K of 128 (the kernel's tiles: none
    reaches past the rows of the caller's dQ); q, k, v, do TMA-aligned with a contiguous last dimension; results not
    asked to be deterministic (dQ's reduce-adds sum in a varying order) and MINIGPT_FLASH_PATH unset, auto or
    gluon."""
    n_q, n_k = q.shape[2], k.shape[2]
    lengths = n_q == n_k if causal else (n_q % 64 == 0 and n_k % 128 == 0)
    return (lengths and q.dtype == k.dtype == v.dtype == do.dtype and do.shape == q.shape and k.shape == v.shape
            and k.shape[0] == q.shape[0] and k.shape[3] == q.shape[3] and q.shape[1] % k.shape[1] == 0
            and gluon_backward is not None and specialized_ready(q, q, q, True, also=(k, v, do))
            and not torch.are_deterministic_algorithms_enabled()
            and (os.environ.get(PATH_ENV) or "auto") in ("auto", "gluon"))


def launch_backward_block(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, causal: bool,
                          sm_scale: float, dq: Tensor, dk: Tensor, dv: Tensor, accumulate_dq: bool,
                          accumulate_dkdv: bool, *, cfg: TileConfig | None = None, window: int | None = None,
                          q_doc_ids: Tensor | None = None, k_doc_ids: Tensor | None = None,
                          q_offset: int | None = None, k_offset: int | None = None,
                          persistent: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """One launch of ring attention's backward: the N_Q query rows of q, do against the N_K keys of k, v (N_Q == N_K
    when causal without offsets), lse and delta the whole rows' (the final ones; (B, H, N_Q) fp32, contiguous rows
    or row slices of such, as launch_backward_dq takes them). Adds the block's dQ into dq (fp32, q's shape, any
    strides with a contiguous last dimension) or, without accumulate_dq, writes it there; adds its dK, dV into dk, dv
    (fp32, k's shape, contiguous last dimension: e.g. the stack_kv-shaped accumulator's views) or, without
    accumulate_dkdv, writes them (any float dtype). Returns (dq, dk, dv).

    Where gluon_block_ready takes an unmasked block (no window, document ids or causal offset), one launch of the
    five-matmul Gluon kernel (gluon/backward.py, launch_dkdv_dq_block): dQ is reduce-added by TMA straight into dq
    where its strides have a 2-D form (dq_acc_geometry: the ring's dq rows in q's layout have one; a fresh dq is
    zeroed first), else into a zeroed fp32 scratch in q's layout that is then added (or copied) into dq. Not
    deterministic (dQ's summation order varies). Tiles: causal without GQA, the table's five-matmul row for N_Q
    (persistent where it says, unless persistent=False: a plain grid, as launch_forward's); else
    BLOCK_BACKWARD_TILES (a plain grid); cfg overrides them (Gluon only: ValueError where the Gluon kernel does not
    take the call). Otherwise the seven-matmul Triton kernels, launch_backward_dq
    then launch_backward_dkdv, with the same semantics and the masks."""
    _check_lengths(q, k, v, causal, q_offset is not None or k_offset is not None)
    (dq,) = _grad_outputs((dq,), accumulate_dq, ("dq",), (q,))
    dk, dv = _grad_outputs((dk, dv), accumulate_dkdv, ("dk", "dv"), (k, v))
    if do.stride(-1) != 1:
        do = do.contiguous()
    masks = dict(window=window, q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids, q_offset=q_offset, k_offset=k_offset)
    unmasked = (window is None and q_doc_ids is None and k_doc_ids is None
                and (not causal or (q_offset or 0) == (k_offset or 0)))  # offsets matter only to a causal mask
    ready = unmasked and gluon_block_ready(do, q, k, v, causal)
    gqa = k.shape[1] != q.shape[1]
    if cfg is not None and not (ready and cfg.specialized and cfg.block_m == 64 and cfg.block_n == 128
                                and cfg.num_stages >= 2 and not (cfg.persistent and gqa)):
        raise ValueError(f"flash_attention: the block backward's Gluon kernel takes unmasked blocks that "
                         f"gluon_block_ready takes, with TileConfig(64, 128, 4, stages >= 2, specialized=True) "
                         f"(persistent only without GQA); got {cfg}")
    if not ready:
        launch_backward_dq(do, q, k, v, lse, delta, causal, sm_scale, out=dq, accumulate=accumulate_dq, **masks)
        launch_backward_dkdv(do, q, k, v, lse, delta, causal, sm_scale, out=(dk, dv), accumulate=accumulate_dkdv,
                             **masks)
        return dq, dk, dv
    B, H, N_Q, D = q.shape
    if cfg is None:  # the diagonal block as the table's five-matmul backward runs it; other blocks a plain grid
        cfg = (plan("bwd", D, N_Q, q.dtype, True, capability=_capability(q), gluon_inputs=True, path="gluon").tiles
               if causal and not gqa else BLOCK_BACKWARD_TILES[D])
        cfg = cfg if persistent else dataclasses.replace(cfg, persistent=False)
    (lse, stride_lse), (delta, stride_delta) = _rows_in(lse), _rows_in(delta)
    (lse, stride_lse), (delta, stride_delta) = _rows_for_tma(lse, stride_lse), _rows_for_tma(delta, stride_delta)
    geometry = gluon_backward.dq_acc_geometry(dq)
    if geometry is not None:  # the kernel adds into dq itself
        acc = dq if accumulate_dq else dq.zero_()
    else:  # no 2-D form for TMA (or not fp32): a zeroed fp32 scratch in q's layout, added into dq below
        acc = empty_in_layout_of(q, torch.float32).zero_()
        geometry = gluon_backward.dq_acc_geometry(acc)
    triton.set_allocator(tma_scratch)  # the kernel makes its TMA descriptors on the device
    gluon_backward.launch_dkdv_dq_block(do, q, k, v, lse, stride_lse, delta, stride_delta, dk, dv, acc, geometry,
                                        sm_scale, sm_scale * LOG2E, cfg.block_m, cfg.num_stages, causal,
                                        accumulate_dkdv, persistent=cfg.persistent)
    if acc is not dq:
        dq.add_(acc) if accumulate_dq else dq.copy_(acc)
    return dq, dk, dv


def via_ds_chosen(q: Tensor, causal: bool) -> bool:
    """Whether the table sends the backward of these inputs to launch_backward_via_ds (in deterministic mode too)."""
    B, H, N, D = q.shape
    return plan("bwd", D, N, q.dtype, causal, deterministic=True, capability=_capability(q), batch_heads=B * H,
                path="auto").path == "via_ds"

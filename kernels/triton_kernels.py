"""FlashAttention in Triton: the kernels, in reading order (tile sources, forward, backward). launch.py launches
them; dispatch.py says with which tiles.

    o = softmax(scale · q kᵀ + mask) v          q, o: (batch, q_heads, seq, head_dim); k, v: (batch, kv_heads, seq, head_dim)

The N×N score matrix never exists in memory. The forward walks over key tiles keeping, per query row,
a running max m and running sum l of exp(scores − m), and rescales its accumulator whenever m grows;
it saves the row log-sum-exp (LSE) so the backward can rebuild any tile of probabilities
P = exp(S − LSE) without a second softmax pass. All exponentials are base 2 with log2(e) folded into
the scale (exp(x) = exp2(x · log2 e)), which is one multiply cheaper per score.

Backward (FlashAttention-2): one kernel owns a query tile and walks the key tiles to accumulate dQ; it also
computes delta = rowsum(dO ∘ O) for its rows and leaves it for the other, which owns a key tile and walks the
query tiles to accumulate dK and dV. No atomics: every output tile has one writer, so results are deterministic.
The dK/dV kernel can also write its dS tiles to memory (STORE_DS), and dQ = dS K then becomes one matmul per tile
(bwd_dq_from_ds_kernel; launch.launch_backward_via_ds): O(N²) memory, worth it only where N² is small. The
warp-specialized Hopper kernels of gluon/ compute the same outputs (the five-matmul dQ up to its summation order).

Tiles stream through TMA descriptors on Hopper (hardware bulk copies; rows past the end read as 0) when
the inputs are 16-byte aligned, through masked pointer loads otherwise.

Causal masking: tiles entirely above the diagonal are never visited; only tiles on the diagonal pay for
the mask. Sequence tails (seq not a multiple of the tile) are handled with masked loads and stores.

Masks (MASKS: a sliding window, document ids, blocks at offsets) and GQA. Each query row sees an interval of keys
(causal: j <= i; window: i − window < j, and non-causal j < i + window; documents: the keys of its document) whose
ends never decrease with the row, so a query tile's keys span from its first row's lower end to its last row's
upper end, and the keys every row of it sees from the last row's lower end to the first row's upper end
(_key_span; the dK/dV kernel's mirror over queries is _query_span). Document ends come from a binary search over
the non-decreasing ids on the device (log2 N scalar loads per program; no host sync, so no graph break). Tiles
outside the span are never visited, whole tiles inside the common part run unmasked, and only the tiles between
apply the elementwise mask (_visible). A row that sees no key (possible only for blocks at offsets) ends with o = 0
and lse = −inf, and gets P = 0 in the backward. GQA (GROUP query heads per K/V head): query head h reads K/V head
h // GROUP; the dK/dV kernel runs one program per K/V head and key tile and sums its group's query heads in turn,
so no per-query-head copy of K/V or dK/dV exists. Without masks and with GROUP 1, the kernels are the dense ones.
Offsets that can exceed 2³¹ (batch/head bases; tile starts on inputs where seq × row stride passes 2³¹,
e.g. a million tokens in the model's qkv layout) are int64; offsets inside a tile stay int32.

Queries and keys of different lengths (Nq query rows against Nk key rows) are supported for non-causal attention
(ring attention uses them). The kernels can also fold new keys into a partial result instead of starting afresh:
the forward continues from an fp32 (o, lse) state (CONTINUE), which it reads as its initial online-softmax state
and overwrites with the attention over both key sets, and the backward kernels add their dQ or dK/dV into fp32
buffers (ACCUMULATE). Both only touch a program's prologue and epilogue (constexpr flags): the inner loops are those
of the plain kernels.

Precision: fp16/bf16 inputs use tensor-core dots with fp32 accumulation and an fp32 softmax; fp32 inputs
are accepted and run the same kernels with TF32 dots (about 1e-3 relative error; exact fp32 under
Triton's CPU interpreter).
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x · LOG2E); the launchers fold it into the softmax scale


# ------------------------------------------------------------------------------------------------
# Tile sources: what the inner loops stream over (keys/values in the forward, queries/grads in the backward)
# ------------------------------------------------------------------------------------------------
@triton.jit
def _tile_source(base, N, stride_n, offs_n, offs_d, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """One head's (N, HEAD_DIM) rows as a TMA descriptor (bulk asynchronous tile copies on Hopper, rows past
    N read as 0, addressing done in hardware) or as a tile of pointers to rows 0..BLOCK that the loop advances."""
    if TMA:
        return tl.make_tensor_descriptor(base, shape=[N, HEAD_DIM], strides=[stride_n, 1],
                                         block_shape=[BLOCK, HEAD_DIM])
    else:
        return base + offs_n[:, None] * stride_n + offs_d[None, :]


@triton.jit
def _tile_start(src, lo, stride_n, INT64_OFFSETS: tl.constexpr, TMA: tl.constexpr):
    """Point a pointer tile at row lo (a descriptor is addressed by row at each load instead)."""
    if TMA:
        return src
    elif INT64_OFFSETS:  # lo·stride passes 2³¹ on very long inputs
        return src + tl.cast(lo, tl.int64) * stride_n
    else:
        return src + lo * stride_n


@triton.jit
def _load_tile(src, row, rows_ok, MASKED: tl.constexpr, TMA: tl.constexpr):
    """The tile of rows starting at `row` (where a pointer tile already points); rows past the end read as 0."""
    if TMA:
        return src.load([row, 0])
    elif MASKED:
        return tl.load(src, mask=rows_ok[:, None], other=0.0)
    else:
        return tl.load(src)


@triton.jit
def _triangle_tile(i, j):
    """Where tile (query tile i, key tile j ≤ i) of a causal head lies in its dS buffer: (0,0), (1,0), (1,1), …"""
    return i * (i + 1) // 2 + j


@triton.jit
def _next_tile(src, BLOCK: tl.constexpr, stride_n, TMA: tl.constexpr):
    if TMA:
        return src
    else:
        return src + BLOCK * stride_n


@triton.jit
def _row_source(base, N, BLOCK: tl.constexpr, TMA: tl.constexpr):
    """One head's N per-row fp32 values (LSE, delta) as a TMA descriptor of BLOCK-row pieces, or as a pointer."""
    if TMA:
        return tl.make_tensor_descriptor(base, shape=[N], strides=[1], block_shape=[BLOCK])
    else:
        return base


@triton.jit
def _load_rows(src, row, rows, rows_ok, other, TMA: tl.constexpr):
    """The values of rows row..row+BLOCK. A TMA copy is one instruction for the whole block where masked pointer
    loads cost every thread an address, a predicate and an asynchronous copy per value it holds (a quarter of the
    dK/dV loop's instructions). Rows past the end read as 0 through TMA, as `other` through pointers."""
    if TMA:
        return src.load([row])
    else:
        return tl.load(src + rows, mask=rows_ok, other=other)


# ------------------------------------------------------------------------------------------------
# Masks: which keys a query sees (causal, sliding window, documents), and which tiles hold any of them
# ------------------------------------------------------------------------------------------------
@triton.jit
def _search(ids, n, target, steps, AFTER: tl.constexpr):
    """The first index j in [0, n) of the non-decreasing ids with ids[j] > target (AFTER) or ids[j] >= target (n if
    none): a binary search of `steps` >= log2(n + 1) halvings, one scalar load each, on the device (no host sync)."""
    lo = tl.full([], 0, tl.int32)
    hi = lo + n
    for _ in range(steps):
        active = lo < hi
        mid = (lo + hi) // 2
        val = tl.load(ids + tl.minimum(mid, n - 1))
        if AFTER:
            right = val <= target
            left = val > target
        else:
            right = val < target
            left = val >= target
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & left, mid, hi)
    return lo


@triton.jit
def _segments(lo, a, b, hi, BLOCK: tl.constexpr):
    """Tiles of BLOCK rows over the visible span [lo, hi): (first, full_lo, full_hi, hi) where tiles from `first`
    (lo rounded down to a tile) to hi are visited, those in [full_lo, full_hi) (inside [a, b): visible to every row
    of the other side) without the elementwise mask, the others with it. Nothing visible (hi <= lo): no tile."""
    first = lo // BLOCK * BLOCK  # lo, a >= 0
    hi = tl.where(hi > lo, hi, first)
    hi_t = tl.cdiv(hi, BLOCK) * BLOCK
    full_lo = tl.minimum(tl.maximum(tl.cdiv(a, BLOCK) * BLOCK, first), hi_t)
    full_hi = tl.maximum(tl.minimum(tl.maximum(b, 0) // BLOCK * BLOCK, hi_t), full_lo)
    return first, full_lo, full_hi, hi


@triton.jit
def _key_span(start_m, N_Q, N_K, shift, window, q_ids, k_ids, steps, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
              DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key tiles query rows [start_m, start_m + BLOCK_M) visit, as _segments gives them. A query at index i sits
    at key index i + shift (shift = q_offset − k_offset). Each row sees an interval of keys whose ends do not decrease
    with the row, so the first row bounds the span from below and the last from above; the full tiles are those
    every row sees: the last row's lower bound to the first row's upper bound, and whole tiles inside N_K."""
    first = start_m + shift
    last = tl.minimum(start_m + BLOCK_M, N_Q) - 1 + shift
    lo = tl.full([], 0, tl.int32)
    a = lo
    hi = lo + N_K
    b = hi
    if CAUSAL:  # keys j <= i
        hi = tl.minimum(hi, last + 1)
        b = tl.minimum(b, first + 1)
    if WINDOWED:  # keys i − window < j (and, non-causal, j < i + window)
        lo = tl.maximum(lo, first - window + 1)
        a = tl.maximum(a, last - window + 1)
        if not CAUSAL:
            hi = tl.minimum(hi, last + window)
            b = tl.minimum(b, first + window)
    if DOCS:  # keys of the rows' documents: from the first row's document to the last row's
        doc_first = tl.load(q_ids + start_m)
        doc_last = tl.load(q_ids + tl.minimum(start_m + BLOCK_M, N_Q) - 1)
        lo = tl.maximum(lo, _search(k_ids, N_K, doc_first, steps, False))
        hi = tl.minimum(hi, _search(k_ids, N_K, doc_last, steps, True))
        a = tl.maximum(a, _search(k_ids, N_K, doc_last, steps, False))
        b = tl.minimum(b, _search(k_ids, N_K, doc_first, steps, True))
    return _segments(lo, a, b, hi, BLOCK_N)


@triton.jit
def _query_span(start_n, N_Q, N_K, shift, window, q_ids, k_ids, steps, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The query tiles that see keys [start_n, start_n + BLOCK_N), as _segments gives them (the dK/dV kernel's span;
    _key_span's mirror: a key at index j sits at query index j − shift). Query rows past N_Q need no mask here (their
    q and dO load as 0), so the last ragged query tile may be full."""
    first = start_n - shift
    last = tl.minimum(start_n + BLOCK_N, N_K) - 1 - shift
    lo = tl.full([], 0, tl.int32)
    a = lo
    hi = lo + N_Q
    b = lo + tl.cdiv(N_Q, BLOCK_M) * BLOCK_M
    if CAUSAL:  # queries i >= j
        lo = tl.maximum(lo, first)
        a = tl.maximum(a, last)
    if WINDOWED:  # queries i < j + window (and, non-causal, j − window < i)
        hi = tl.minimum(hi, last + window)
        b = tl.minimum(b, first + window)
        if not CAUSAL:
            lo = tl.maximum(lo, first - window + 1)
            a = tl.maximum(a, last - window + 1)
    if DOCS:
        doc_first = tl.load(k_ids + start_n)
        doc_last = tl.load(k_ids + tl.minimum(start_n + BLOCK_N, N_K) - 1)
        lo = tl.maximum(lo, _search(q_ids, N_Q, doc_first, steps, False))
        hi = tl.minimum(hi, _search(q_ids, N_Q, doc_last, steps, True))
        a = tl.maximum(a, _search(q_ids, N_Q, doc_last, steps, False))
        b = tl.minimum(b, _search(q_ids, N_Q, doc_first, steps, True))
    return _segments(lo, a, b, hi, BLOCK_M)


@triton.jit
def _visible(d, q_doc, k_doc, window, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, DOCS: tl.constexpr):
    """Which (query, key) pairs of a tile the masks leave visible: d = query position − key position (2-D), q_doc and
    k_doc the pairs' document ids (broadcast to d's shape). At least one mask is on."""
    if CAUSAL:
        vis = d >= 0
        if WINDOWED:
            vis = vis & (d < window)
    elif WINDOWED:
        vis = (d < window) & (d > -window)
    if DOCS:
        if CAUSAL or WINDOWED:
            vis = vis & (q_doc == k_doc)
        else:
            vis = q_doc == k_doc
    return vis


@triton.jit
def _count_visit(counts, tile, COUNT: tl.constexpr):
    """Tests (interpreter only): count a visit of this tile (launch.count_tiles)."""
    if COUNT:
        tl.atomic_add(counts + tile, 1)


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, start_m, lo, hi, N_K, qk_scale,
               q_doc, k_ids, shift, window, counts,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               INT64_OFFSETS: tl.constexpr, TMA: tl.constexpr, MASKS: tl.constexpr, WINDOWED: tl.constexpr,
               DOCS: tl.constexpr, COUNT: tl.constexpr):
    """Fold key tiles [lo, hi) into the running (acc, l, m) of one query tile.

    MASKED tiles (the causal diagonal, or the ragged last tile) apply the causal/bounds mask; the rest
    are known to be fully visible and skip it. k_src/v_src are TMA descriptors (TMA) or pointer tiles over the
    N_K keys. MASKS: the mask is _visible's (window, documents q_doc / k_ids, queries at key index i + shift), and a
    row may have seen no key yet after a masked tile (its max stays −inf).
    """
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    k_src = _tile_start(k_src, lo, stride_kn, INT64_OFFSETS, TMA)
    v_src = _tile_start(v_src, lo, stride_vn, INT64_OFFSETS, TMA)
    for start_n in range(lo, hi, BLOCK_N):
        in_bounds = (start_n + offs_n) < N_K
        k = _load_tile(k_src, start_n, in_bounds, MASKED, TMA)
        v = _load_tile(v_src, start_n, in_bounds, MASKED, TMA)
        qk = tl.dot(q, tl.trans(k))
        _count_visit(counts, start_n // BLOCK_N, COUNT)
        if MASKED:
            visible = in_bounds[None, :]
            if MASKS:
                cols = start_n + offs_n
                if DOCS:
                    k_doc = tl.load(k_ids + cols, mask=in_bounds, other=0)
                else:
                    k_doc = cols
                visible = visible & _visible((offs_m + shift)[:, None] - cols[None, :], q_doc[:, None],
                                             k_doc[None, :], window, CAUSAL, WINDOWED, DOCS)
            elif CAUSAL:
                visible = visible & (offs_m[:, None] >= (start_n + offs_n)[None, :])
            qk = tl.where(visible, qk, float("-inf"))
        # scores in base-2 units are s = qk · scale·log2(e);  m_new = max(m_old, rowmax(s))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_use = m_new
        if MASKS:
            if MASKED:  # a row that has seen no key yet: subtract 0, not −inf, so p = α = 0 instead of NaN
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        # p = exp2(s − m_new), one fused multiply-add per score
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        # α = exp2(m_old − m_new) rescales what was accumulated under the old max
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        # acc = α·acc + p v, the add done by the tensor core's accumulator
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
        k_src = _next_tile(k_src, BLOCK_N, stride_kn, TMA)
        v_src = _next_tile(v_src, BLOCK_N, stride_vn, TMA)
    return acc, l_i, m_i


@triton.jit
def _fwd_chains(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, start_m, lo, hi, N_K, qk_scale,
                q_doc, k_ids, shift, window, counts,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                INT64_OFFSETS: tl.constexpr, TMA: tl.constexpr, MASKS: tl.constexpr, WINDOWED: tl.constexpr,
                DOCS: tl.constexpr, COUNT: tl.constexpr, FOLD: tl.constexpr):
    """_fwd_tiles over [lo, hi), in chains of FOLD key tiles: each chain starts from a zero accumulator, and its sum
    is added to the running one on the CUDA cores, rounding to nearest. The tensor cores' accumulator truncates, so
    one long chain shrinks o in proportion to its keys (kernels/NOTES.md); FOLD = 0: one chain."""
    if FOLD == 0:
        return _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, start_m, lo, hi, N_K, qk_scale,
                          q_doc, k_ids, shift, window, counts, MASKED, CAUSAL, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA,
                          MASKS, WINDOWED, DOCS, COUNT)
    outer, m_fold = acc, m_i  # the sum so far, under the row max m_fold
    for c0 in range(lo, hi, FOLD * BLOCK_N):
        chain, l_i, m_i = _fwd_tiles(tl.zeros_like(acc), l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, start_m,
                                     c0, tl.minimum(c0 + FOLD * BLOCK_N, hi), N_K, qk_scale, q_doc, k_ids, shift,
                                     window, counts, MASKED, CAUSAL, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA, MASKS,
                                     WINDOWED, DOCS, COUNT)
        # outer · 2^(m_fold − m) + chain under the new max (0 where nothing was seen before: no exp2(−inf + inf))
        scale = tl.where(m_fold == float("-inf"), 0.0, tl.math.exp2(m_fold - m_i))
        outer = outer * scale[:, None] + chain
        m_fold = m_i
    return outer, l_i, m_i


@triton.jit
def fwd_kernel(Q, K, V, O, LSE,
                stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on, stride_lse,
                H, N_Q, N_K, qk_scale,
                Q_IDS, K_IDS, stride_qids, stride_kids, shift, window, steps, COUNTS,
                CAUSAL: tl.constexpr, CONTINUE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, INT64_OFFSETS: tl.constexpr, TMA: tl.constexpr, GROUP: tl.constexpr,
                MASKS: tl.constexpr, WINDOWED: tl.constexpr, DOCS: tl.constexpr, COUNT: tl.constexpr,
                FOLD: tl.constexpr = 0):
    """One query tile of N_Q rows against N_K keys (N_Q == N_K when CAUSAL without MASKS). LSE rows are stride_lse
    apart. CONTINUE: (O, LSE) hold an fp32 partial result over other keys, continued here and overwritten.
    GROUP: query heads per K/V head (GQA; head h reads K/V head h // GROUP). MASKS: the key span comes from
    _key_span (causal, WINDOWED: keys within `window`, DOCS: documents Q_IDS/K_IDS (rows stride_*ids apart per batch),
    queries at key index i + shift) and rows that see no key get o = 0, lse = −inf. COUNT (tests): count each
    visited tile in COUNTS (B·H, query tiles, key tiles)."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # longest rows first: the last query tiles see the most keys
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    hk = h // GROUP  # the K/V head this query head reads
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    q_ptrs = Q + b * stride_qb + h * stride_qh + start_m.to(tl.int64) * stride_qn \
        + offs_m[:, None] * stride_qn + offs_d[None, :]
    row_ok = (start_m + offs_m) < N_Q
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    k_src = _tile_source(K + b * stride_kb + hk * stride_kh, N_K, stride_kn, offs_n, offs_d, BLOCK_N, HEAD_DIM, TMA)
    v_src = _tile_source(V + b * stride_vb + hk * stride_vh, N_K, stride_vn, offs_n, offs_d, BLOCK_N, HEAD_DIM, TMA)
    q_ids = Q_IDS + b * stride_qids
    k_ids = K_IDS + b * stride_kids
    if DOCS:
        q_doc = tl.load(q_ids + start_m + offs_m, mask=row_ok, other=0)
    else:
        q_doc = offs_m
    counts = COUNTS + (bh * tl.cdiv(N_Q, BLOCK_M) + pid_m) * tl.cdiv(N_K, BLOCK_N)

    if CONTINUE:
        # the state of a softmax over earlier keys, (o, lse) = (Σ 2^s v / Σ 2^s, log2 Σ 2^s), as a running
        # (m, l, acc): m = lse, l = Σ 2^(s − m) = 1, acc = o·l = o. The loop's rescaling then folds the new keys in.
        m_i = tl.load(LSE + bh.to(tl.int64) * stride_lse + start_m + offs_m, mask=row_ok, other=float("-inf"))
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        # a row with lse = −inf holds nothing yet: acc = 0 whatever its o says. Its first tile has a visible key
        # (key 0 in a causal launch; any key of a non-causal one), so m becomes finite there and α = exp2(−inf) = 0
        # wipes l = 1: no exp2(−inf − (−inf)) is ever taken.
        o_ptrs = O + b * stride_ob + h * stride_oh + start_m.to(tl.int64) * stride_on \
            + offs_m[:, None] * stride_on + offs_d[None, :]
        acc = tl.load(o_ptrs, mask=row_ok[:, None] & (m_i > float("-inf"))[:, None], other=0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max (base-2 units)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running row sum of exp2(s − m)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running unnormalized output

    if MASKS:  # masked tiles at both ends of the span, full ones between; each part in chains (a document's head
        # span can be long: a query tile that straddles a boundary sees its whole earlier document there)
        first, full_lo, full_hi, hi = _key_span(start_m, N_Q, N_K, shift, window, q_ids, k_ids, steps, CAUSAL,
                                                WINDOWED, DOCS, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_chains(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, start_m, first, full_lo,
                                    N_K, qk_scale, q_doc, k_ids, shift, window, counts, True, CAUSAL, BLOCK_M,
                                    BLOCK_N, INT64_OFFSETS, TMA, MASKS, WINDOWED, DOCS, COUNT, FOLD)
        acc, l_i, m_i = _fwd_chains(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, start_m, full_lo, full_hi,
                                    N_K, qk_scale, q_doc, k_ids, shift, window, counts, False, CAUSAL, BLOCK_M,
                                    BLOCK_N, INT64_OFFSETS, TMA, MASKS, WINDOWED, DOCS, COUNT, FOLD)
        acc, l_i, m_i = _fwd_chains(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, start_m, full_hi, hi,
                                    N_K, qk_scale, q_doc, k_ids, shift, window, counts, True, CAUSAL, BLOCK_M,
                                    BLOCK_N, INT64_OFFSETS, TMA, MASKS, WINDOWED, DOCS, COUNT, FOLD)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # a row that saw no key: o = 0, lse = m = −inf
    else:
        if CAUSAL:  # key tiles wholly before the query tile are fully visible; the rest, to the diagonal, get the mask
            full_hi = (start_m // BLOCK_N) * BLOCK_N  # = start_m unless key tiles are wider than query tiles
            diag_hi = tl.minimum(start_m + BLOCK_M, N_K)
        else:  # all keys visible; only the ragged last tile is masked
            full_hi = (N_K // BLOCK_N) * BLOCK_N
            diag_hi = N_K
        acc, l_i, m_i = _fwd_chains(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, start_m, 0, full_hi, N_K,
                                    qk_scale, q_doc, k_ids, 0, 0, counts, False, CAUSAL, BLOCK_M, BLOCK_N,
                                    INT64_OFFSETS, TMA, MASKS, WINDOWED, DOCS, COUNT, FOLD)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_src, v_src, stride_kn, stride_vn, start_m, full_hi, diag_hi,
                                   N_K, qk_scale, q_doc, k_ids, 0, 0, counts, True, CAUSAL, BLOCK_M, BLOCK_N,
                                   INT64_OFFSETS, TMA, MASKS, WINDOWED, DOCS, COUNT)

    # o = acc / l;  LSE = m + log2(l) (base 2), what the backward needs to rebuild P = exp2(s − LSE)
    o = acc / l_i[:, None]
    lse_ptrs = LSE + bh.to(tl.int64) * stride_lse + start_m + offs_m
    tl.store(lse_ptrs, m_i + tl.math.log2(l_i), mask=row_ok)
    o_ptrs = O + b * stride_ob + h * stride_oh + start_m.to(tl.int64) * stride_on \
        + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None])


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------
@triton.jit
def bwd_delta_kernel(O, DO, DELTA, stride_ob, stride_oh, stride_on, stride_dob, stride_doh, stride_don,
                      H, N, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta_i = Σ_d dO_id · O_id  (= Σ_j P_ij dP_ij, the softmax backward's row term)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = (start_m + offs_m) < N
    rows = start_m.to(tl.int64) + offs_m
    o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_don + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh.to(tl.int64) * N + rows, delta, mask=row_ok)


@triton.jit
def _bwd_dkdv_tiles(dk, dv, k, v, q_src, do_src, lse_src, delta_src, ds_head, stride_qn, stride_don,
                    start_n, lo, hi, N_Q, qk_scale, q_ids, k_doc, shift, window, counts, count_step,
                    MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INT64_OFFSETS: tl.constexpr,
                    TMA: tl.constexpr, ROW_TMA: tl.constexpr, STORE_DS: tl.constexpr, CAUSAL: tl.constexpr,
                    MASKS: tl.constexpr, WINDOWED: tl.constexpr, DOCS: tl.constexpr, COUNT: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi) of the N_Q queries. Works on transposed tiles
    (keys × queries). STORE_DS: also write each bf16/fp16 dS tile into this head's triangle of tiles (ds_head), for
    bwd_dq_from_ds_kernel. MASKED without MASKS: the causal diagonal; with MASKS: _visible's mask (k_doc: the key
    tile's document ids), and rows that saw no key (lse = −inf) get P = 0."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    q_src = _tile_start(q_src, lo, stride_qn, INT64_OFFSETS, TMA)
    do_src = _tile_start(do_src, lo, stride_don, INT64_OFFSETS, TMA)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < N_Q
        q = _load_tile(q_src, start_m, row_ok, True, TMA)
        do = _load_tile(do_src, start_m, row_ok, True, TMA)
        # rows past the end: through pointers LSE = +inf, so their probabilities are exactly 0; through TMA
        # LSE = 0 and P = 1 there, but their Q and dO rows are 0 too, so they add exactly 0 to dV (P dO) and dK
        # (dS = P ∘ (V dOᵀ − delta) = 0, delta = 0)
        lse = _load_rows(lse_src, start_m, rows, row_ok, float("inf"), ROW_TMA)
        if MASKS:  # a row that sees no key (launches at offsets): P = exp2(s − ∞) = 0
            lse = tl.where(lse == float("-inf"), float("inf"), lse)
        _count_visit(counts, (start_m // BLOCK_M) * count_step, COUNT)
        # Pᵀ = exp2(K Qᵀ · scale·log2e − LSE)
        pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
        if MASKED:
            if MASKS:
                if DOCS:
                    q_doc = tl.load(q_ids + rows, mask=row_ok, other=0)
                else:
                    q_doc = rows
                pT = tl.where(_visible((rows + shift)[None, :] - offs_n[:, None], q_doc[None, :], k_doc[:, None],
                                       window, CAUSAL, WINDOWED, DOCS), pT, 0.0)
            else:
                pT = tl.where(rows[None, :] >= offs_n[:, None], pT, 0.0)
        # dV += Pᵀ dO
        dv = tl.dot(pT.to(do.dtype), do, dv)
        # dPᵀ = V dOᵀ;  dSᵀ = Pᵀ ∘ (dPᵀ − delta)
        delta = _load_rows(delta_src, start_m, rows, row_ok, 0.0, ROW_TMA)
        dsT = pT * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dsT = dsT.to(q.dtype)
        # dK += dSᵀ Q  (the softmax scale is applied once at the end)
        dk = tl.dot(dsT, q, dk)
        if STORE_DS:  # dSᵀ is [key][query] here; the buffer keeps each tile [query][key], as dQ = dS K reads it
            tile = ds_head + _triangle_tile(start_m // BLOCK_M, start_n // BLOCK_N) * (BLOCK_M * BLOCK_N)
            tl.store(tile + offs_m[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None], dsT)
        q_src = _next_tile(q_src, BLOCK_M, stride_qn, TMA)
        do_src = _next_tile(do_src, BLOCK_M, stride_don, TMA)
    return dk, dv


@triton.jit
def _bwd_dkdv_head(dk, dv, k, v, Q, DO, LSE, DELTA, DS, stride_qb, stride_qh, stride_qn, stride_dob, stride_doh,
                   stride_don, stride_lse, stride_delta, b, h, H, N_Q, N_K, start_n, qk_scale,
                   q_ids, k_doc, shift, window, first, full_lo, full_hi, hi, COUNTS,
                   CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   INT64_OFFSETS: tl.constexpr, TMA: tl.constexpr, ROW_TMA: tl.constexpr, STORE_DS: tl.constexpr,
                   MASKS: tl.constexpr, WINDOWED: tl.constexpr, DOCS: tl.constexpr, COUNT: tl.constexpr):
    """Add query head h's share to the dK, dV of one key tile: its query tiles [first, hi) under MASKS (masked
    outside [full_lo, full_hi)), else the causal diagonal and below, or every query tile."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    bh = b * H + h
    q_src = _tile_source(Q + b * stride_qb + h * stride_qh, N_Q, stride_qn, offs_m, offs_d, BLOCK_M, HEAD_DIM, TMA)
    do_src = _tile_source(DO + b * stride_dob + h * stride_doh, N_Q, stride_don, offs_m, offs_d, BLOCK_M, HEAD_DIM,
                          TMA)
    lse_src = _row_source(LSE + bh * stride_lse, N_Q, BLOCK_M, ROW_TMA)
    delta_src = _row_source(DELTA + bh * stride_delta, N_Q, BLOCK_M, ROW_TMA)
    n_tiles = tl.cdiv(N_Q, BLOCK_M)
    ds_head = DS + bh * (_triangle_tile(n_tiles, 0) * (BLOCK_M * BLOCK_N))  # this head's triangle
    n_key_tiles = tl.cdiv(N_K, BLOCK_N)
    counts = COUNTS + bh * n_tiles * n_key_tiles + start_n // BLOCK_N
    if MASKS:
        dk, dv = _bwd_dkdv_tiles(dk, dv, k, v, q_src, do_src, lse_src, delta_src, ds_head, stride_qn, stride_don,
                                 start_n, first, full_lo, N_Q, qk_scale, q_ids, k_doc, shift, window, counts,
                                 n_key_tiles, True, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA, ROW_TMA, False, CAUSAL,
                                 MASKS, WINDOWED, DOCS, COUNT)
        dk, dv = _bwd_dkdv_tiles(dk, dv, k, v, q_src, do_src, lse_src, delta_src, ds_head, stride_qn, stride_don,
                                 start_n, full_lo, full_hi, N_Q, qk_scale, q_ids, k_doc, shift, window, counts,
                                 n_key_tiles, False, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA, ROW_TMA, False, CAUSAL,
                                 MASKS, WINDOWED, DOCS, COUNT)
        dk, dv = _bwd_dkdv_tiles(dk, dv, k, v, q_src, do_src, lse_src, delta_src, ds_head, stride_qn, stride_don,
                                 start_n, full_hi, hi, N_Q, qk_scale, q_ids, k_doc, shift, window, counts,
                                 n_key_tiles, True, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA, ROW_TMA, False, CAUSAL,
                                 MASKS, WINDOWED, DOCS, COUNT)
    elif CAUSAL:  # queries before this key tile cannot see it; the diagonal tiles get the mask
        diag_hi = tl.minimum(start_n + BLOCK_N, N_Q)
        dk, dv = _bwd_dkdv_tiles(dk, dv, k, v, q_src, do_src, lse_src, delta_src, ds_head, stride_qn, stride_don,
                                 start_n, start_n, diag_hi, N_Q, qk_scale, q_ids, k_doc, 0, 0, counts, n_key_tiles,
                                 True, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA, ROW_TMA, STORE_DS, CAUSAL, MASKS,
                                 WINDOWED, DOCS, COUNT)
        dk, dv = _bwd_dkdv_tiles(dk, dv, k, v, q_src, do_src, lse_src, delta_src, ds_head, stride_qn, stride_don,
                                 start_n, diag_hi, N_Q, N_Q, qk_scale, q_ids, k_doc, 0, 0, counts, n_key_tiles,
                                 False, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA, ROW_TMA, STORE_DS, CAUSAL, MASKS,
                                 WINDOWED, DOCS, COUNT)
    else:
        dk, dv = _bwd_dkdv_tiles(dk, dv, k, v, q_src, do_src, lse_src, delta_src, ds_head, stride_qn, stride_don,
                                 start_n, 0, N_Q, N_Q, qk_scale, q_ids, k_doc, 0, 0, counts, n_key_tiles,
                                 False, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA, ROW_TMA, False, CAUSAL, MASKS,
                                 WINDOWED, DOCS, COUNT)
    return dk, dv


@triton.jit
def bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DS,
                     stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                     stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_lse, stride_delta,
                     H, N_Q, N_K, qk_scale, sm_scale,
                     Q_IDS, K_IDS, stride_qids, stride_kids, shift, window, steps, COUNTS,
                     CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, INT64_OFFSETS: tl.constexpr, TMA: tl.constexpr, ROW_TMA: tl.constexpr,
                     STORE_DS: tl.constexpr, GROUP: tl.constexpr, MASKS: tl.constexpr, WINDOWED: tl.constexpr,
                     DOCS: tl.constexpr, COUNT: tl.constexpr):
    """dK, dV of one tile of the N_K keys of one K/V head over the N_Q queries (N_Q == N_K when CAUSAL without
    MASKS). H query heads, GROUP of them per K/V head (GQA): the program sums the shares of its group's query heads
    one after the other, so dK, dV need no per-query-head buffer. ACCUMULATE: add them to what DK, DV hold (fp32)
    instead of overwriting it. ROW_TMA: LSE and delta rows are read through TMA. STORE_DS (causal, BLOCK_M ==
    BLOCK_N, GROUP 1, no MASKS): also leave the dS tiles in DS (launch_backward_via_ds). MASKS, WINDOWED, DOCS,
    COUNT: as for fwd_kernel, the query span from _query_span (the same for every head of the group)."""
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    b, hk = (bhk // (H // GROUP)).to(tl.int64), (bhk % (H // GROUP)).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = (start_n + offs_n) < N_K
    rows_n = start_n.to(tl.int64) + offs_n
    k = tl.load(K + b * stride_kb + hk * stride_kh + rows_n[:, None] * stride_kn + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + rows_n[:, None] * stride_vn + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    q_ids = Q_IDS + b * stride_qids
    k_ids = K_IDS + b * stride_kids
    if DOCS:
        k_doc = tl.load(k_ids + start_n + offs_n, mask=col_ok, other=0)
    else:
        k_doc = offs_n
    if MASKS:
        first, full_lo, full_hi, hi = _query_span(start_n, N_Q, N_K, shift, window, q_ids, k_ids, steps, CAUSAL,
                                                  WINDOWED, DOCS, BLOCK_M, BLOCK_N)
    else:
        first, full_lo, full_hi, hi = 0, 0, 0, 0

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if GROUP == 1:
        dk, dv = _bwd_dkdv_head(dk, dv, k, v, Q, DO, LSE, DELTA, DS, stride_qb, stride_qh, stride_qn, stride_dob,
                                stride_doh, stride_don, stride_lse, stride_delta, b, hk, H, N_Q, N_K, start_n,
                                qk_scale, q_ids, k_doc, shift, window, first, full_lo, full_hi, hi, COUNTS, CAUSAL,
                                HEAD_DIM, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA, ROW_TMA, STORE_DS, MASKS, WINDOWED,
                                DOCS, COUNT)
    else:  # the group's query heads, one after the other, into the same accumulators
        for g in range(GROUP):
            dk, dv = _bwd_dkdv_head(dk, dv, k, v, Q, DO, LSE, DELTA, DS, stride_qb, stride_qh, stride_qn, stride_dob,
                                    stride_doh, stride_don, stride_lse, stride_delta, b, hk * GROUP + g, H, N_Q, N_K,
                                    start_n, qk_scale, q_ids, k_doc, shift, window, first, full_lo, full_hi, hi,
                                    COUNTS, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA, ROW_TMA, False,
                                    MASKS, WINDOWED, DOCS, COUNT)

    dk *= sm_scale  # dS was taken w.r.t. the scaled scores
    dk_ptrs = DK + b * stride_dkb + hk * stride_dkh + rows_n[:, None] * stride_dkn + offs_d[None, :]
    dv_ptrs = DV + b * stride_dvb + hk * stride_dvh + rows_n[:, None] * stride_dvn + offs_d[None, :]
    if ACCUMULATE:  # dK = dK_before + this launch's share (scaled above, alone); this program is the tile's only writer
        dk += tl.load(dk_ptrs, mask=col_ok[:, None], other=0.0)
        dv += tl.load(dv_ptrs, mask=col_ok[:, None], other=0.0)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_m, lo, hi, N_K, qk_scale,
                  q_doc, k_ids, shift, window, counts,
                  MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INT64_OFFSETS: tl.constexpr,
                  TMA: tl.constexpr, CAUSAL: tl.constexpr, MASKS: tl.constexpr, WINDOWED: tl.constexpr,
                  DOCS: tl.constexpr, COUNT: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles [lo, hi) of the N_K keys (MASKED, MASKS: as _fwd_tiles)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    k_src = _tile_start(k_src, lo, stride_kn, INT64_OFFSETS, TMA)
    v_src = _tile_start(v_src, lo, stride_vn, INT64_OFFSETS, TMA)
    for start_n in range(lo, hi, BLOCK_N):
        # keys past the end load as zeros: they add exactly 0 to dQ (dQ += dS K), so no score mask is needed
        col_ok = (start_n + offs_n) < N_K
        k = _load_tile(k_src, start_n, col_ok, True, TMA)
        v = _load_tile(v_src, start_n, col_ok, True, TMA)
        # P = exp2(Q Kᵀ · scale·log2e − LSE)
        _count_visit(counts, start_n // BLOCK_N, COUNT)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
        if MASKED:
            if MASKS:
                cols = start_n + offs_n
                if DOCS:
                    k_doc = tl.load(k_ids + cols, mask=col_ok, other=0)
                else:
                    k_doc = cols
                p = tl.where(_visible((offs_m + shift)[:, None] - cols[None, :], q_doc[:, None], k_doc[None, :],
                                      window, CAUSAL, WINDOWED, DOCS), p, 0.0)
            else:
                p = tl.where(offs_m[:, None] >= (start_n + offs_n)[None, :], p, 0.0)
        # dP = dO Vᵀ;  dS = P ∘ (dP − delta);  dQ += dS K
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
        k_src = _next_tile(k_src, BLOCK_N, stride_kn, TMA)
        v_src = _next_tile(v_src, BLOCK_N, stride_vn, TMA)
    return dq


@triton.jit
def bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, O,
                   stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                   stride_dqb, stride_dqh, stride_dqn, stride_ob, stride_oh, stride_on, stride_lse, stride_delta,
                   H, N_Q, N_K, qk_scale, sm_scale,
                   Q_IDS, K_IDS, stride_qids, stride_kids, shift, window, steps, COUNTS,
                   CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, INT64_OFFSETS: tl.constexpr, TMA: tl.constexpr, DELTA_FROM_O: tl.constexpr,
                   GROUP: tl.constexpr, MASKS: tl.constexpr, WINDOWED: tl.constexpr, DOCS: tl.constexpr,
                   COUNT: tl.constexpr):
    """dQ of one tile of the N_Q queries over the N_K keys (N_Q == N_K when CAUSAL without MASKS). ACCUMULATE: add
    it to what DQ holds (fp32) instead of overwriting it. DELTA_FROM_O: compute the tile's delta rows from O and dO
    (loaded here anyway) and write them to DELTA for the dK/dV kernel, instead of reading them: no separate delta
    pass. GROUP, MASKS, WINDOWED, DOCS, COUNT: as for fwd_kernel."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # longest rows first
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = (start_m + offs_m) < N_Q
    rows = start_m.to(tl.int64) + offs_m
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_don + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * stride_lse + rows, mask=row_ok, other=float("inf"))
    if MASKS:  # a row that sees no key (launches at offsets): P = exp2(s − ∞) = 0
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
    if DELTA_FROM_O:  # delta_i = Σ_d dO_id · O_id, as bwd_delta_kernel computes it
        o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        tl.store(DELTA + bh.to(tl.int64) * stride_delta + rows, delta, mask=row_ok)
    else:
        delta = tl.load(DELTA + bh.to(tl.int64) * stride_delta + rows, mask=row_ok, other=0.0)
    hk = h // GROUP  # the K/V head this query head reads
    k_src = _tile_source(K + b * stride_kb + hk * stride_kh, N_K, stride_kn, offs_n, offs_d, BLOCK_N, HEAD_DIM, TMA)
    v_src = _tile_source(V + b * stride_vb + hk * stride_vh, N_K, stride_vn, offs_n, offs_d, BLOCK_N, HEAD_DIM, TMA)
    q_ids = Q_IDS + b * stride_qids
    k_ids = K_IDS + b * stride_kids
    if DOCS:
        q_doc = tl.load(q_ids + rows, mask=row_ok, other=0)
    else:
        q_doc = offs_m
    counts = COUNTS + (bh * tl.cdiv(N_Q, BLOCK_M) + pid_m) * tl.cdiv(N_K, BLOCK_N)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if MASKS:  # masked tiles at both ends of the span, full ones between
        first, full_lo, full_hi, hi = _key_span(start_m, N_Q, N_K, shift, window, q_ids, k_ids, steps, CAUSAL,
                                                WINDOWED, DOCS, BLOCK_M, BLOCK_N)
        dq = _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_m, first, full_lo, N_K,
                           qk_scale, q_doc, k_ids, shift, window, counts, True, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA,
                           CAUSAL, MASKS, WINDOWED, DOCS, COUNT)
        dq = _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_m, full_lo, full_hi, N_K,
                           qk_scale, q_doc, k_ids, shift, window, counts, False, BLOCK_M, BLOCK_N, INT64_OFFSETS,
                           TMA, CAUSAL, MASKS, WINDOWED, DOCS, COUNT)
        dq = _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_m, full_hi, hi, N_K,
                           qk_scale, q_doc, k_ids, shift, window, counts, True, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA,
                           CAUSAL, MASKS, WINDOWED, DOCS, COUNT)
    elif CAUSAL:
        dq = _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_m, 0, start_m, N_K,
                           qk_scale, q_doc, k_ids, 0, 0, counts, False, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA, CAUSAL,
                           MASKS, WINDOWED, DOCS, COUNT)
        dq = _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_m, start_m,
                           tl.minimum(start_m + BLOCK_M, N_K), N_K, qk_scale, q_doc, k_ids, 0, 0, counts, True,
                           BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA, CAUSAL, MASKS, WINDOWED, DOCS, COUNT)
    else:
        dq = _bwd_dq_tiles(dq, q, do, lse, delta, k_src, v_src, stride_kn, stride_vn, start_m, 0, N_K, N_K,
                           qk_scale, q_doc, k_ids, 0, 0, counts, False, BLOCK_M, BLOCK_N, INT64_OFFSETS, TMA, CAUSAL,
                           MASKS, WINDOWED, DOCS, COUNT)
    dq *= sm_scale
    dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqn + offs_d[None, :]
    if ACCUMULATE:  # dQ = dQ_before + this launch's share (scaled above, alone); this program is the tile's only writer
        dq += tl.load(dq_ptrs, mask=row_ok[:, None], other=0.0)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def bwd_dq_from_ds_kernel(DS, K, DQ, stride_kb, stride_kh, stride_kn, stride_dqb, stride_dqh, stride_dqn, H, N,
                           sm_scale, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """dQ of one causal query tile from the dS tiles the dK/dV kernel left (STORE_DS): dQ_i = scale · Σ_{j≤i} dS_ij K_j,
    one matmul per tile instead of the three (QKᵀ, dO Vᵀ, dS K) of bwd_dq_kernel."""
    i = tl.num_programs(0) - 1 - tl.program_id(0)  # longest rows first
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    offs_m = tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    n_tiles = tl.cdiv(N, BLOCK)
    # this row of tiles, (i, 0) … (i, i), lies contiguous in the head's triangle
    ds_ptrs = DS + bh.to(tl.int64) * (_triangle_tile(n_tiles, 0) * (BLOCK * BLOCK)) \
        + _triangle_tile(i, 0) * (BLOCK * BLOCK) + offs_m[:, None] * BLOCK + offs_n[None, :]
    k_ptrs = K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    dq = tl.zeros([BLOCK, HEAD_DIM], dtype=tl.float32)
    for j in range(0, i + 1):
        # keys past the end load as zeros: whatever their dS holds (finite), they add exactly 0
        k = tl.load(k_ptrs, mask=(j * BLOCK + offs_n)[:, None] < N, other=0.0)
        dq = tl.dot(tl.load(ds_ptrs), k, dq)  # dQ_i += dS_ij K_j
        ds_ptrs += BLOCK * BLOCK
        k_ptrs += BLOCK * stride_kn
    rows = i.to(tl.int64) * BLOCK + offs_m
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqn + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows[:, None] < N)

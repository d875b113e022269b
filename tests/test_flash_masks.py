"""Sliding windows, document ids and GQA in the Triton kernels (issue 33), against a float64 reference with an
explicit boolean mask (attention_reference.visible_mask, masked_attention).

On CPU this runs in Triton's interpreter (fp32 and fp16; its bf16 dot is wrong), with the interpreter's small tiles
(fwd and dQ 32×16, dK/dV 16×32: dispatch.TABLE), so 40-70 tokens give ragged, full and masked tiles. Inputs are the
model's layout (head-transposed views of one (B, N, Hq + 2·Hkv, D) buffer), outputs are poisoned with NaN.
Covered: GQA group sizes 1, 2, 3 and one K/V head; windows of 1, a few tokens and >= N; documents of one token,
not aligned to tiles, a single one; each with and without causal, and combined; gradients; the visited tiles (the
mask's non-empty ones, each once); the ValueErrors; the launchers' block form (q_offset/k_offset, query and key
document ids), including rows that see no key and a forward continued over a second key block.
"""
import importlib

import pytest
import torch

from attention_reference import masked_attention, rel_err, visible_mask
from minigpt_kernels import dispatch, launch
from minigpt_kernels.flash_attention import flash_attention, flash_attention_with_lse

fa = importlib.import_module("minigpt_kernels.flash_attention")

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
LSE_TOL = {torch.float32: 1e-5, torch.float16: 5e-3}


pytestmark = pytest.mark.usefixtures("poison_outputs")  # tests/conftest.py: unwritten outputs read as NaN


@pytest.fixture(autouse=True)
def check_masks(monkeypatch):
    monkeypatch.setenv(launch.CHECK_MASKS_ENV, "1")


def qkv_rows(B, N, Hq, Hkv, D, dtype, seed):
    """q (B, Hq, N, D), k, v (B, Hkv, N, D): head-transposed views of one (B, N, Hq + 2·Hkv, D) leaf, as a GQA
    model's fused projection lays them out."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, Hq + 2 * Hkv, D, generator=g).to(dtype).requires_grad_()
    q, k, v = qkv.split((Hq, Hkv, Hkv), dim=2)
    return qkv, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def documents(kind: str, B: int, N: int) -> torch.Tensor | None:
    """(B, N) int64 document ids: "tokens" one token each, "ragged" lengths not aligned to tiles (different per
    batch row), "one" a single document, "none" no ids."""
    if kind == "none":
        return None
    if kind == "tokens":
        return torch.arange(N).repeat(B, 1)
    if kind == "one":
        return torch.zeros(B, N, dtype=torch.int64)
    lengths = ([5, 19, 1, 3, 40], [23, 2, 11, 7, 40])  # cut at N
    rows = [torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls))[:N] for ls in lengths]
    return torch.stack(rows[:B]).to(torch.int64)


# (Hq, Hkv, N, causal, window, documents, dtype)
CASES = [
    (2, 2, 47, True, None, "none", torch.float32),      # dense MHA (the unmasked kernels)
    (4, 2, 47, True, None, "none", torch.float32),      # GQA, group 2
    (6, 2, 45, False, None, "none", torch.float32),     # GQA, group 3, non-causal
    (3, 1, 50, True, None, "none", torch.float16),      # MQA (one K/V head), group 3
    (2, 2, 47, True, 1, "none", torch.float32),         # window 1: the diagonal only
    (2, 2, 47, False, 1, "none", torch.float32),
    (2, 1, 61, True, 5, "none", torch.float32),         # a few tokens, with MQA
    (2, 2, 61, False, 5, "none", torch.float16),
    (2, 2, 40, True, 40, "none", torch.float32),        # window >= N: no mask beyond causal
    (2, 2, 40, False, 64, "none", torch.float32),
    (2, 2, 45, True, None, "tokens", torch.float32),    # documents of one token
    (2, 2, 45, False, None, "tokens", torch.float32),
    (2, 2, 66, True, None, "ragged", torch.float32),    # documents not aligned to tiles
    (4, 2, 66, False, None, "ragged", torch.float32),
    (2, 2, 66, True, None, "ragged", torch.float16),
    (2, 2, 38, True, None, "one", torch.float32),       # a single document
    (2, 2, 38, False, None, "one", torch.float32),
    (6, 2, 66, True, 9, "ragged", torch.float32),       # everything combined
    (4, 1, 66, False, 9, "ragged", torch.float32),
    (2, 2, 66, True, 9, "ragged", torch.float16),
]


def case_id(c):
    hq, hkv, n, causal, window, docs, dtype = c
    return f"h{hq}/{hkv}-n{n}-{'causal' if causal else 'full'}-w{window}-{docs}-{str(dtype)[6:]}"


@pytest.mark.parametrize("hq,hkv,n,causal,window,docs,dtype", CASES, ids=[case_id(c) for c in CASES])
def test_output_and_gradients_match_the_masked_reference(hq, hkv, n, causal, window, docs, dtype):
    B, D = 2, 16
    qkv, q, k, v = qkv_rows(B, n, hq, hkv, D, dtype, seed=n * 7 + hq + (window or 0))
    ids = documents(docs, B, n)
    o = flash_attention(q, k, v, causal, window=window, document_ids=ids)
    assert o.shape == q.shape and o.dtype == dtype and not o.isnan().any()

    qkv64 = qkv.detach().double().requires_grad_()
    q64, k64, v64 = (t.transpose(1, 2) for t in qkv64.split((hq, hkv, hkv), dim=2))
    visible = visible_mask(n, n, causal, window, ids, ids)
    ref, _ = masked_attention(q64, k64, v64, visible)
    assert rel_err(o, ref) < TOL[dtype]

    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(n)).to(dtype)
    (grad,) = torch.autograd.grad(o, qkv, do)
    (grad_ref,) = torch.autograd.grad(ref, qkv64, do.double())
    assert not grad.isnan().any()
    for name, part, part_ref in zip("qkv", grad.split((hq, hkv, hkv), 2), grad_ref.split((hq, hkv, hkv), 2)):
        err = rel_err(part, part_ref)
        assert err < 2 * TOL[dtype], f"d{name} relative error {err:.2e}"


def test_int32_ids_and_flash_attention_with_lse():
    """int32 document ids give the int64 ids' result; the forward-only function returns the masked lse."""
    _, q, k, v = qkv_rows(1, 50, 4, 2, 32, torch.float32, seed=3)
    ids = documents("ragged", 1, 50)
    o, lse = flash_attention_with_lse(q.detach(), k.detach(), v.detach(), True, window=7, document_ids=ids.int())
    ref, lse_ref = masked_attention(q, k, v, visible_mask(50, 50, True, 7, ids, ids))
    assert rel_err(o, ref) < 1e-5 and (lse.double() - lse_ref).abs().max() < 1e-5


def nonempty_tiles(visible: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """(B, query tiles, key tiles) int32: 1 where the tile holds a visible (query, key) pair."""
    vis = visible if visible.dim() == 3 else visible[None]
    B, nq, nk = vis.shape
    tm, tn = -(-nq // block_m), -(-nk // block_n)
    padded = torch.zeros(B, tm * block_m, tn * block_n, dtype=torch.bool)
    padded[:, :nq, :nk] = vis
    return padded.view(B, tm, block_m, tn, block_n).any(4).any(2).int()


MASKS = [(True, None, "none"), (False, None, "none"), (True, 1, "none"), (False, 3, "none"), (True, 9, "none"),
         (True, None, "tokens"), (False, None, "ragged"), (True, None, "ragged"), (True, 9, "ragged"),
         (False, 9, "ragged"), (True, None, "one")]


@pytest.mark.parametrize("causal,window,docs", MASKS,
                         ids=[f"{'causal' if c else 'full'}-w{w}-{d}" for c, w, d in MASKS])
def test_exactly_the_masks_nonempty_tiles_are_visited(causal, window, docs):
    """Each kernel (forward, dQ, dK/dV) visits every tile holding a visible pair once, and no other."""
    B, Hq, Hkv, n = 2, 4, 2, 66
    qkv, q, k, v = qkv_rows(B, n, Hq, Hkv, 16, torch.float32, seed=5)
    ids = documents(docs, B, n)
    with launch.count_tiles() as record:
        o = flash_attention(q, k, v, causal, window=window, document_ids=ids)
        o.backward(torch.ones_like(o))
    assert sorted(kernel for kernel, *_ in record) == ["dkdv", "dq", "fwd"]
    visible = visible_mask(n, n, causal, window, ids, ids)
    for kernel, counts, (bm, bn) in record:
        want = nonempty_tiles(visible, bm, bn).expand(B, -1, -1)  # per batch; the same for each head
        got = counts.view(B, Hq, *counts.shape[1:])
        for h in range(Hq):
            assert torch.equal(got[:, h], want.expand_as(got[:, h])), (kernel, h)
    if window is not None or docs not in ("none", "one"):  # the masks skip tiles: fewer than the causal (or full) count
        dense = nonempty_tiles(visible_mask(n, n, causal), *record[0][2]).sum() * B * Hq
        assert record[0][1].sum() < dense


BAD = [
    (dict(kv_heads=4), "multiple"),
    (dict(window=0), "window"),
    (dict(window=-2), "window"),
    (dict(window=2.5), "window"),
    (dict(window=True), "window"),
    (dict(ids=lambda B, N: torch.zeros(B, N + 1, dtype=torch.int64)), "document_ids must be a"),
    (dict(ids=lambda B, N: torch.zeros(N, dtype=torch.int64)), "document_ids must be a"),
    (dict(ids=lambda B, N: torch.zeros(B, N)), "int32 or int64"),
    (dict(ids=lambda B, N: torch.zeros(B, N, dtype=torch.int16)), "int32 or int64"),
    (dict(ids=lambda B, N: torch.zeros(B, N, dtype=torch.int64, device="meta")), "device"),
    (dict(ids=lambda B, N: torch.arange(N).flip(0).repeat(B, 1)), "non-decreasing"),
]


@pytest.mark.parametrize("bad,match", BAD, ids=[m + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_masks_raise_value_error(bad, match):
    B, N = 2, 8
    q = torch.randn(B, 6, N, 16)
    k = v = torch.randn(B, bad.get("kv_heads", 2), N, 16)
    ids = bad["ids"](B, N) if "ids" in bad else None
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, window=bad.get("window"), document_ids=ids)


def test_the_launchers_refuse_bad_masks():
    q = k = v = torch.randn(1, 2, 8, 16)
    ids = torch.zeros(1, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="go together"):
        launch.launch_forward(q, k, v, True, 0.25, q_doc_ids=ids)
    with pytest.raises(ValueError, match="q_offset"):
        launch.launch_forward(q, k, v, True, 0.25, q_offset=-1)
    with pytest.raises(ValueError, match="k_doc_ids must be a"):
        launch.launch_forward(q, k[:, :, :5], v[:, :, :5], False, 0.25, q_doc_ids=ids, k_doc_ids=ids)
    with pytest.raises(ValueError, match="causal attention needs as many"):  # no offsets: the causal square
        launch.launch_forward(q, k[:, :, :5], v[:, :, :5], True, 0.25)


# (q rows, k rows, causal, window, documents, dtype): a query block against a key block at other positions
BLOCKS = [
    ((30, 62), (0, 30), True, None, "ragged", torch.float32),    # earlier keys (a ring's src < rank)
    ((30, 62), (30, 62), True, 9, "ragged", torch.float32),     # the diagonal block, offsets equal
    ((0, 30), (30, 62), True, None, "none", torch.float32),     # later keys: no row sees any (o 0, lse -inf)
    ((10, 50), (20, 66), True, 13, "ragged", torch.float32),    # overlapping, Nq != Nk, some rows see nothing
    ((5, 37), (25, 66), False, 7, "ragged", torch.float32),
    ((40, 66), (0, 45), False, None, "ragged", torch.float16),
    ((20, 60), (3, 33), True, 6, "tokens", torch.float16),
]


@pytest.mark.parametrize("qr,kr,causal,window,docs,dtype", BLOCKS,
                         ids=[f"q{a}:{b}-k{c}:{d}-{'causal' if m else 'full'}-w{w}-{doc}-{str(t)[6:]}"
                              for (a, b), (c, d), m, w, doc, t in BLOCKS])
def test_launchers_at_offsets_match_the_reference_block(qr, kr, causal, window, docs, dtype):
    """launch_forward and launch_backward of rows qr against keys kr (q_offset/k_offset, their ids): the output,
    lse and gradients of the block's own masked attention (rows that see no key: o = 0, lse = -inf, no gradient)."""
    B, Hq, Hkv, n, D = 2, 4, 2, 66, 16
    _, q, k, v = qkv_rows(B, n, Hq, Hkv, D, dtype, seed=qr[0] + kr[1])
    q, k, v = (t.detach() for t in (q, k, v))
    ids = documents(docs, B, n)
    qs, ks = slice(*qr), slice(*kr)
    qb, kb, vb = q[:, :, qs], k[:, :, ks], v[:, :, ks]
    masks = dict(window=window, q_offset=qr[0], k_offset=kr[0])
    if ids is not None:
        masks.update(q_doc_ids=ids[:, qs], k_doc_ids=ids[:, ks])
    scale = 0.25
    o, lse = launch.launch_forward(qb, kb, vb, causal, scale, **masks)
    visible = visible_mask(n, n, causal, window, ids, ids)[..., qs, ks]
    o_ref, lse_ref = masked_attention(qb, kb, vb, visible, scale)
    assert not o.isnan().any() and not lse.isnan().any()
    assert rel_err(o, o_ref) < TOL[dtype]
    assert torch.equal(lse.isinf(), lse_ref.isinf())
    finite = lse_ref.isfinite()
    if finite.any():
        assert (lse.double()[finite] - lse_ref[finite]).abs().max() < LSE_TOL[dtype]

    do = torch.randn(qb.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = launch.launch_backward(do, qb, kb, vb, o, lse, causal, scale, **masks)
    leaves = [t.double().requires_grad_() for t in (qb, kb, vb)]
    refs = torch.autograd.grad(masked_attention(*leaves, visible, scale)[0], leaves, do.double())
    for name, got, ref in zip("qkv", grads, refs):
        assert got.shape == ref.shape and not got.isnan().any(), f"d{name}"
        assert rel_err(got, ref) < 2 * TOL[dtype], f"d{name}"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_a_forward_continued_over_a_second_key_block_is_the_row_slice_of_the_whole(causal):
    """Rows [28, 66) against keys [0, 30), then continued (accumulate) over keys [30, 66), with documents and a window
    at offsets: the slice of the full masked attention, lse included (the ring's forward on one rank, in small)."""
    B, Hq, Hkv, n, D = 1, 2, 1, 66, 32
    _, q, k, v = qkv_rows(B, n, Hq, Hkv, D, torch.float32, seed=9)
    q, k, v = (t.detach() for t in (q, k, v))
    ids = documents("ragged", B, n)
    rows = slice(28, n)
    o = torch.empty(B, Hq, n - 28, D)
    lse = torch.empty(B, Hq, n - 28)
    for keys, accumulate in ((slice(0, 30), False), (slice(30, n), True)):
        launch.launch_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], causal, D ** -0.5, out=(o, lse),
                              accumulate=accumulate, window=17, q_doc_ids=ids[:, rows], k_doc_ids=ids[:, keys],
                              q_offset=rows.start, k_offset=keys.start)
    o_ref, lse_ref = masked_attention(q, k, v, visible_mask(n, n, causal, 17, ids, ids))
    assert rel_err(o, o_ref[:, :, rows]) < 1e-5 and (lse.double() - lse_ref[:, :, rows]).abs().max() < 1e-5


def test_masks_and_gqa_run_the_gluon_kernels_on_sm90_where_they_fit_else_triton():
    """On sm_90, a masked call whose inputs fit (launch.gluon_masks_ready) runs the Gluon forward and five-matmul
    backward (rows sm90-masks) at every length; deterministic mode, unfit inputs and a forced Triton
    path run Triton's; a path forced to via_ds refuses masks, as does a forced gluon path the call does not fit; the
    dense plans are unchanged (tests/test_dispatch.py pins them)."""
    sm90 = dict(capability=(9, 0), gluon_inputs=True, interpret=False)
    for kernel, d, n, stages in (("fwd", 64, 8192, 3), ("bwd", 64, 8192, 3), ("bwd", 128, 512, 2),
                                 ("bwd", 64, 100, 3), ("fwd", 128, 100, 3)):
        dense = dispatch.plan(kernel, d, n, torch.bfloat16, True, **sm90)
        masked = dispatch.plan(kernel, d, n, torch.bfloat16, True, masked=True, **sm90)
        assert n < 1024 or dense.path in ("gluon", "via_ds"), (kernel, n)
        assert masked.path == "gluon" and masked.tiles.specialized and not masked.tiles.persistent, (kernel, n)
        assert masked.tiles.num_stages == stages and "masks/GQA" in masked.why
        for why, options in (("deterministic", dict(deterministic=True)), ("unfit", dict(gluon_inputs=False)),
                             ("forced triton", dict(path="triton"))):
            if kernel == "fwd" and why == "deterministic":
                continue
            triton = dispatch.plan(kernel, d, n, torch.bfloat16, True, masked=True, **{**sm90, **options})
            assert triton.path == "triton" and not triton.tiles.specialized, (kernel, n, why)
            assert triton.dq_tiles is None or not triton.dq_tiles.specialized
    for kernel in ("dq", "dkdv"):  # launched alone (ring attention): Triton's
        assert dispatch.plan(kernel, 64, 8192, torch.bfloat16, True, masked=True, **sm90).path == "triton"
    for kernel in ("fwd", "bwd"):
        with pytest.raises(ValueError, match="masks"):
            dispatch.plan(kernel, 64, 8192, torch.bfloat16, True, masked=True, path="via_ds", **sm90)
        with pytest.raises(ValueError, match="allowed values"):
            dispatch.plan(kernel, 64, 8192, torch.float32, True, masked=True, path="gluon", **sm90)
    with pytest.raises(ValueError, match="masks"):
        dispatch.plan("bwd", 64, 8192, torch.bfloat16, True, masked=True, path="gluon", deterministic=True, **sm90)
    assert dispatch.plan("bwd", 64, 8192, torch.bfloat16, True, masked=True, path="gluon", **sm90).path == "gluon"


@pytest.mark.parametrize("hq,hkv,window,docs,cap_heads,launches", [
    (4, 2, 5, "ragged", 2, 2), (4, 1, 100, "none", 2, 1), (6, 3, None, "tokens", 3, 3), (4, 4, 9, "none", 8, 1),
    (6, 3, None, "none", None, 3), (4, 2, 5, "none", None, 1)])
def test_the_masked_five_matmul_backward_runs_whole_gqa_groups_per_launch(monkeypatch, hq, hkv, window, docs, cap_heads,
                                                                           launches):
    """launch_backward_fused's host side with masks and GQA, its Gluon kernel (launch_dkdv_dq_masked) stubbed by a
    float64 reference over the slices it is given: the query heads run in launches of whole GQA groups (the dQ
    accumulator's cap, FUSED_DQ_ACC_BYTES, rounded up to a group; cap_heads None: a GQA grid shorter than the GPU,
    one K/V head per launch without masks, one launch with a window) with their K/V heads, a window wider than any
    distance reaches the kernel as none, the ids as given; the gradients are the whole call's."""
    B, n, D = 2, 45, 16
    _, q, k, v = qkv_rows(B, n, hq, hkv, D, torch.float32, seed=15)
    q, k, v = (t.detach() for t in (q, k, v))
    ids = documents(docs, B, n)
    scale = D ** -0.5
    visible = visible_mask(n, n, True, window, ids, ids)
    calls = []

    def kernel(do, q, k, v, lse, stride_lse, delta, stride_delta, dk, dv, dq_acc, sm_scale, qk_scale, block_m, stages,
               window, document_ids, split_scratch=None):
        calls.append((q.shape[1], k.shape[1], window, document_ids))
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        vis = visible_mask(n, n, True, window, document_ids, document_ids)
        grads = torch.autograd.grad(masked_attention(*leaves, vis, sm_scale)[0], leaves, do.double())
        dq_acc += grads[0].float()
        dk.copy_(grads[1])
        dv.copy_(grads[2])

    monkeypatch.setattr(launch.gluon_backward, "launch_dkdv_dq_masked", kernel)
    monkeypatch.setattr(launch, "specialized_ready", lambda *a, **kw: True)  # as if on an H100/H200
    if cap_heads is None:  # a short GQA grid, no masks: 2 · hkv items for a GPU of 132 SMs, cut per K/V head
        monkeypatch.setattr(launch, "SHORT_GQA_CUT_FROM", 1)
        monkeypatch.setattr(launch.gluon_backward, "sm_count", lambda device: 132)
    else:
        monkeypatch.setattr(launch, "FUSED_DQ_ACC_BYTES", cap_heads * B * n * D * 4)
    o, lse = masked_attention(q, k, v, visible, scale)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(16))
    got = launch.launch_backward_fused(do, q, k, v, o.float(), lse.float(), scale,
                                       dispatch.TileConfig(64, 128, 4, 3, tma=True, specialized=True), window=window,
                                       q_doc_ids=ids, k_doc_ids=ids)
    group = hq // hkv
    assert [c[:2] for c in calls] == [(hq // launches, hkv // launches)] * launches and (hq // launches) % group == 0
    assert all(c[2] == (window if window is not None and window < n else None) for c in calls)
    assert all((c[3] is None) == (ids is None) and (ids is None or torch.equal(c[3], ids)) for c in calls)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    refs = torch.autograd.grad(masked_attention(*leaves, visible, scale)[0], leaves, do.double())
    for name, g, r in zip("qkv", got, refs):
        assert g.shape == r.shape and rel_err(g, r) < 1e-5, f"d{name}"


def test_torch_compile_traces_the_masked_custom_ops_without_a_graph_break():
    """fullgraph=True (Dynamo + AOTAutograd here; Inductor on the GPU, tests/test_gpu_masks.py): a function passing
    document_ids and a window to flash_attention with GQA compiles to one graph with the eager output and gradients
    (the ids are never read on the host)."""
    qkv, q, k, v = qkv_rows(1, 45, 4, 2, 16, torch.float32, seed=13)
    ids = documents("ragged", 1, 45)
    do = torch.randn(1, 4, 45, 16, generator=torch.Generator().manual_seed(14))

    def attend(q, k, v, ids):
        return flash_attention(q, k, v, window=6, document_ids=ids)

    def step(fn):
        o = fn(q, k, v, ids)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    torch._dynamo.reset()
    eager = step(attend)
    compiled = step(torch.compile(attend, backend="aot_eager", fullgraph=True))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_gqa_alone_takes_the_dense_forward_rows_on_sm90():
    """GQA without masks gets the dense Gluon forward's tiles (persistent, 3 consumers at head_dim 64 from 2K) on
    sm_90 where the dense row is a Gluon one, else none (the masked row's then; launch.gqa_dense_tiles)."""
    for d, n in ((64, 8192), (64, 1500), (128, 32768)):
        dense = dispatch.plan("fwd", d, n, torch.bfloat16, True, capability=(9, 0), gluon_inputs=True,
                              interpret=False).tiles
        assert dense.persistent and launch.gqa_dense_tiles(d, n, torch.bfloat16, (9, 0), True, False) == dense
    assert launch.gqa_dense_tiles(64, 8192, torch.bfloat16, (9, 0), True, False).block_m == 192  # three consumers
    assert launch.gqa_dense_tiles(64, 512, torch.bfloat16, (9, 0), True, False) is None  # no Gluon row below 1K
    assert launch.gqa_dense_tiles(64, 8192, torch.bfloat16, (8, 0), True, False) is None  # not Hopper

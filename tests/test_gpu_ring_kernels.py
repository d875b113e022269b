"""GPU-only (sm_90): the Gluon forward on ring attention's calls
(python -m pytest -m gpu tests/test_gpu_ring_kernels.py).

Non-causal Nq x Nk launches (2c x c and c x 2c, ragged lengths), continued fp32 (o, lse) over a second key set, the fp32
o in the model's (B, N, H, D) memory order through strided views with LSE row slices, rows holding nothing yet
(lse = -inf, o NaN), GQA, bf16 and fp16 at head_dim 64 and 128: against float64, against the Triton forward's error,
bitwise against the same kernel where only the output dtype or the work list differs, and with a spy on the Gluon
launchers (and on the Triton forward) that says which kernel ran. Then ring attention's exact call pattern
(ring_attention._block_forward over zigzag shards, K/V as ring messages) on one GPU: every launch on the Gluon forward,
each rank's rows equal to attention over the whole sequence. Masks with non-causal or continued launches stay with
the Triton forward. The CPU twin (the predicate, the host path into a PyTorch mirror of the kernel):
tests/test_flash_attention_ring.py.
"""
import importlib

import pytest
import torch
import triton

from attention_reference import masked_attention, rel_err
from minigpt_kernels.dispatch import TileConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon forward is written for sm_90 (wgmma)")
launch = importlib.import_module("minigpt_kernels.launch")
device = importlib.import_module("minigpt_kernels.device")
# relative error of o against float64 (tests/test_gpu.py's); LSE (base 2) absolute, as the ping-pong test's
TOL = {torch.bfloat16: 1e-2, torch.float16: 1.5e-3}
LSE_TOL = 1e-4
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
# the Gluon forward's tile shapes: (consumers, block_n, stages), as the table and test_gpu.py run them
SHAPES = [(3, 128, 3), (2, 128, 2), (2, 128, 3), (2, 64, 3)]


@pytest.fixture
def ran(monkeypatch):
    """Which forward kernels run: a list receiving ("gluon", launcher, causal, accumulate) per Gluon launch and
    ("triton",) per Triton forward launch."""
    calls = []
    kernels = launch.gluon_forward
    for name in ("launch_forward_pingpong", "launch_forward_persistent", "launch_forward_masked"):
        def spy(*args, _name=name, _real=getattr(kernels, name), **kwargs):
            calls.append(("gluon", _name, kwargs.get("causal", True), kwargs.get("accumulate", False)))
            return _real(*args, **kwargs)
        monkeypatch.setattr(kernels, name, spy)
    real_fwd = launch.fwd_kernel

    class TritonSpy:
        def __getitem__(self, grid):
            calls.append(("triton",))
            return real_fwd[grid]

    monkeypatch.setattr(launch, "fwd_kernel", TritonSpy())
    return calls


def rows_of(B, N, H, D, dtype, g, parts=1):
    """`parts` (B, H, N, D) views of one (B, N, parts, H, D) buffer: the model's q/k/v layout (rows of heads)."""
    x = torch.randn(B, N, parts, H, D, device="cuda", generator=g).to(dtype)
    return [t.transpose(1, 2) for t in x.unbind(2)]


def fp32_out(q):
    """An fp32 (o, lse) for q's rows, NaN-filled: o in the model's (B, N, H, D) memory order (empty_in_layout_of, as
    ring_forward makes it), lse (B, H, N) contiguous."""
    o = launch.empty_in_layout_of(q, torch.float32).fill_(float("nan"))
    return o, torch.full(q.shape[:3], float("nan"), device="cuda")


def everything(nq, nk):
    return torch.ones(nq, nk, dtype=torch.bool, device="cuda")


def check(o, lse, ref, dtype, triton_o=None):
    """o and lse against the float64 (o, lse); o's error at most 1.1x the Triton forward's where given."""
    o_ref, lse_ref = ref
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    err = rel_err(o, o_ref)
    assert err < TOL[dtype], err
    if triton_o is not None:
        assert err <= 1.1 * rel_err(triton_o, o_ref) + 1e-6, (err, rel_err(triton_o, o_ref))
    assert (lse.double() - lse_ref).abs().max().item() < LSE_TOL


def triton_forward(monkeypatch, *args, **kwargs):
    """launch_forward on the forced Triton path (MINIGPT_FLASH_PATH=triton)."""
    with monkeypatch.context() as m:
        m.setenv("MINIGPT_FLASH_PATH", "triton")
        return launch.launch_forward(*args, **kwargs)


# ------------------------------------------------------------------------------------------------
# Non-causal Nq x Nk
# ------------------------------------------------------------------------------------------------
NONCAUSAL = [(2048, 1024), (1024, 2048), (2304, 1152), (1152, 2304), (4096, 2048), (1030, 1000)]


@needs_hopper
@DTYPES
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("nq,nk", NONCAUSAL, ids=[f"q{a}-k{b}" for a, b in NONCAUSAL])
def test_non_causal_forward_takes_the_gluon_kernel(nq, nk, head_dim, dtype, ran, monkeypatch):
    """A non-causal launch of Nq rows against Nk keys from 1K rows (the ring's 2c x c and c x 2c, c = 1024 and 1152;
    1000 keys: a ragged last key tile) runs the Gluon forward (the spy) and nothing else, on the model's strided
    views: o and LSE against float64, o's error within 1.1x the Triton forward's."""
    g = torch.Generator(device="cuda").manual_seed(nq + nk + head_dim)
    (q,) = rows_of(2, nq, 3, head_dim, dtype, g)
    k, v = rows_of(2, nk, 3, head_dim, dtype, g, parts=2)
    scale = head_dim ** -0.5
    o, lse = launch.launch_forward(q, k, v, False, scale)
    assert [c[:1] + c[2:] for c in ran] == [("gluon", False, False)], ran
    triton_o, _ = triton_forward(monkeypatch, q, k, v, False, scale)
    check(o, lse, masked_attention(q, k, v, everything(nq, nk), scale), dtype, triton_o)


TILES = [(1, 130), (65, 1), (1000, 2000), (2001, 999), (777, 4100), (192, 128)]


@needs_hopper
@DTYPES
@pytest.mark.parametrize("head_dim,consumers,block_n,stages", [(64, *s) for s in SHAPES[:2]] + [(128, *s) for s in
                                                                                                SHAPES[2:]])
@pytest.mark.parametrize("persistent", [False, True], ids=["plain", "persistent"])
def test_non_causal_gluon_forward_on_every_tile_shape(head_dim, consumers, block_n, stages, persistent, dtype, ran):
    """The non-causal kernel forced on each tile shape, plain and persistent, on ragged lengths: one query row, one
    key, key counts below, at and past a tile, query tiles ending mid-consumer. Against float64; the Gluon forward
    ran every time."""
    cfg = TileConfig(64 * consumers, block_n, 4, stages, tma=True, specialized=True, persistent=persistent)
    for nq, nk in TILES:
        g = torch.Generator(device="cuda").manual_seed(nq * 3 + nk)
        (q,) = rows_of(2, nq, 2, head_dim, dtype, g)
        k, v = rows_of(2, nk, 2, head_dim, dtype, g, parts=2)
        o, lse = launch.launch_forward(q, k, v, False, head_dim ** -0.5, cfg)
        check(o, lse, masked_attention(q, k, v, everything(nq, nk), head_dim ** -0.5), dtype)
    assert len(ran) == len(TILES) and all(c[0] == "gluon" and not c[2] for c in ran), ran


# ------------------------------------------------------------------------------------------------
# Continued: fresh over key set A, then accumulate over key set B
# ------------------------------------------------------------------------------------------------
# (rows, keys A, keys B, A causal): the ring's local block then a block of another rank, and plain two-set splits
CONTINUED = [(2048, 2048, 1024, True), (2048, 1024, 2048, False), (2304, 2304, 1152, True), (1152, 1152, 2304, True),
             (1024, 777, 1500, False), (3000, 3000, 1000, True)]


@needs_hopper
@DTYPES
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("nq,na,nb,causal_a", CONTINUED, ids=[f"q{a}-A{b}{'c' if c else ''}-B{d}"
                                                               for a, b, d, c in CONTINUED])
def test_continued_over_two_key_sets_equals_attention_over_both(nq, na, nb, causal_a, head_dim, dtype, ran,
                                                               monkeypatch):
    """Fresh over key set A (causal when A is the rows' own keys, as the ring's local block) into an fp32 o in the
    model's memory order, then continued (accumulate=True, non-causal) over key set B: attention over A ∪ B against
    float64, o's error within 1.1x the Triton path's doing the same; both launches on the Gluon forward with the
    flags the ring's launches have."""
    g = torch.Generator(device="cuda").manual_seed(nq + na + 3 * nb + head_dim)
    (q,) = rows_of(2, nq, 3, head_dim, dtype, g)
    ka, va = rows_of(2, na, 3, head_dim, dtype, g, parts=2)  # causal: the rows' own keys (na == nq)
    kb, vb = rows_of(2, nb, 3, head_dim, dtype, g, parts=2)
    scale = head_dim ** -0.5
    outs = []
    for forced in (False, True):
        o, lse = fp32_out(q)
        run = (lambda *a, **kw: triton_forward(monkeypatch, *a, **kw)) if forced else launch.launch_forward
        assert run(q, ka, va, causal_a, scale, out=(o, lse))[0] is o
        run(q, kb, vb, False, scale, out=(o, lse), accumulate=True)
        outs.append((o, lse))
    gluon = [c for c in ran if c[0] == "gluon"]
    assert [c[2:] for c in gluon] == [(causal_a, False), (False, True)], ran
    assert len(ran) == 4  # and the Triton path's two
    vis_a = everything(nq, na).tril() if causal_a else everything(nq, na)
    ref = masked_attention(q, torch.cat((ka, kb), 2), torch.cat((va, vb), 2),
                           torch.cat((vis_a, everything(nq, nb)), 1), scale)
    (o, lse), (triton_o, _) = outs
    assert o.dtype == torch.float32 and o.stride() == launch.empty_in_layout_of(q).stride()
    check(o, lse, ref, dtype, triton_o)


@needs_hopper
@DTYPES
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rows_holding_nothing_yet_get_the_new_keys_alone(head_dim, dtype, ran):
    """Rows with lse = -inf hold nothing, whatever their o (here NaN): continued over B they get attention over B
    alone, with no NaN; the other rows over A and B. Every third row, in every query tile and consumer."""
    nq, na, nb = 2048, 1024, 1536
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    (q,) = rows_of(2, nq, 2, head_dim, dtype, g)
    ka, va = rows_of(2, na, 2, head_dim, dtype, g, parts=2)
    kb, vb = rows_of(2, nb, 2, head_dim, dtype, g, parts=2)
    scale = head_dim ** -0.5
    o, lse = fp32_out(q)
    launch.launch_forward(q, ka, va, False, scale, out=(o, lse))
    empty = torch.arange(nq, device="cuda") % 3 == 0
    o[:, :, empty] = float("nan")
    lse[:, :, empty] = float("-inf")
    launch.launch_forward(q, kb, vb, False, scale, out=(o, lse), accumulate=True)
    assert [c[0] for c in ran] == ["gluon", "gluon"] and ran[1][3], ran
    visible = torch.cat((everything(nq, na) & ~empty[:, None], everything(nq, nb)), 1)
    check(o, lse, masked_attention(q, torch.cat((ka, kb), 2), torch.cat((va, vb), 2), visible, scale), dtype)


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [2, 4])
def test_continued_gqa(head_dim, group, ran):
    """GQA (query head h reads K/V head h // group) without masks on the non-causal and continued kernel."""
    nq, na, nb, hq = 1152, 2304, 1152, 4
    g = torch.Generator(device="cuda").manual_seed(head_dim + group)
    (q,) = rows_of(1, nq, hq, head_dim, torch.bfloat16, g)
    ka, va = rows_of(1, na, hq // group, head_dim, torch.bfloat16, g, parts=2)
    kb, vb = rows_of(1, nb, hq // group, head_dim, torch.bfloat16, g, parts=2)
    o, lse = fp32_out(q)
    launch.launch_forward(q, ka, va, False, 0.1, out=(o, lse))
    launch.launch_forward(q, kb, vb, False, 0.1, out=(o, lse), accumulate=True)
    assert [c[2:] for c in ran] == [(False, False), (False, True)], ran
    ref = masked_attention(q, torch.cat((ka, kb), 2), torch.cat((va, vb), 2), everything(nq, na + nb), 0.1)
    check(o, lse, ref, torch.bfloat16)


@needs_hopper
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_an_fp32_o_holds_the_value_the_16_bit_o_rounds(causal, head_dim, ran):
    """Fresh into an fp32 o (the ring's local block) the kernel stores acc / l unrounded: cast to bf16 it is the o of
    the same launch into a bf16 o (one rounding of the same value; allowed one bf16 step, should ptxas order the
    division differently), and the LSE is bitwise the same."""
    n = 2304
    g = torch.Generator(device="cuda").manual_seed(head_dim + causal)
    q, k, v = rows_of(1, n, 3, head_dim, torch.bfloat16, g, parts=3)
    o16, lse16 = launch.launch_forward(q, k, v, causal, 0.125)
    o32, lse32 = fp32_out(q)
    launch.launch_forward(q, k, v, causal, 0.125, out=(o32, lse32))
    assert [c[0] for c in ran] == ["gluon", "gluon"], ran
    torch.testing.assert_close(o32.to(torch.bfloat16), o16, rtol=2 ** -7, atol=0)
    assert torch.equal(lse32, lse16)


@needs_hopper
@pytest.mark.parametrize("head_dim,consumers,block_n,stages", [(64, 3, 128, 3), (64, 2, 128, 2), (128, 2, 128, 3)])
def test_persistent_non_causal_and_continued_forward_matches_the_plain_kernel(head_dim, consumers, block_n, stages):
    """Few programs, many items each, over the non-causal work list (every item the same cost) and continued rows
    (the state read and written per item): bitwise the plain kernel's o and LSE, on ragged lengths and several heads,
    with the ring's LSE row slices."""
    kernels = launch.gluon_forward
    triton.set_allocator(device.tma_scratch)  # the kernels make their TMA descriptors on the device
    scale = head_dim ** -0.5 * 1.4426950408889634
    for nq, nk, batch, heads, programs in ((777, 1500, 2, 3, 3), (2048, 1024, 1, 5, 7), (1100, 4100, 2, 2, 1)):
        g = torch.Generator(device="cuda").manual_seed(nq + nk + consumers)
        (q,) = rows_of(batch, nq, heads, head_dim, torch.bfloat16, g)
        k, v = rows_of(batch, nk, heads, head_dim, torch.bfloat16, g, parts=2)
        start = torch.randn(batch, 2 * nq, heads, head_dim, device="cuda", generator=g).transpose(1, 2)
        start_lse = torch.randn(batch, heads, 2 * nq, device="cuda", generator=g) + 8
        outs = []
        for run_kernel in (kernels.launch_forward_pingpong, kernels.launch_forward_persistent):
            for accumulate in (False, True):
                o, lse = start.clone(), start_lse.clone()  # rows [nq, 2nq) of them: the ring's slices
                kwargs = {"programs": programs} if run_kernel is kernels.launch_forward_persistent else {}
                run_kernel(q, k, v, o[:, :, nq:], lse[:, :, nq:], scale, consumers, block_n, stages, causal=False,
                           accumulate=accumulate, stride_lse=2 * nq, **kwargs)
                assert torch.equal(o[:, :, :nq], start[:, :, :nq]) and torch.equal(lse[:, :, :nq],
                                                                                   start_lse[:, :, :nq])
                outs.append((o, lse))
        for (o1, l1), (o2, l2) in zip(outs[:2], outs[2:]):
            assert torch.equal(o1, o2) and torch.equal(l1, l2), (nq, nk, programs)


# ------------------------------------------------------------------------------------------------
# Ring attention's call pattern on one GPU
# ------------------------------------------------------------------------------------------------
RING = [(2, 1024, 4, 4, 64, torch.bfloat16), (2, 1152, 2, 2, 128, torch.float16), (4, 1024, 4, 4, 128, torch.bfloat16),
        (4, 1152, 4, 2, 64, torch.bfloat16), (3, 1000, 2, 2, 64, torch.float16)]


@needs_hopper
@pytest.mark.parametrize("K,c,hq,hkv,head_dim,dtype", RING, ids=[f"K{k}-c{c}-h{a}/{b}-d{d}-{str(t)[6:]}"
                                                                 for k, c, a, b, d, t in RING])
def test_the_rings_block_forward_runs_the_gluon_forward(K, c, hq, hkv, head_dim, dtype, ran, monkeypatch):
    """ring_attention._block_forward's launches for every rank of a K-rank ring, run rank after rank on one GPU (the
    local block, then every other rank's as the ring brings it, K/V as ring messages, the fp32 o in the model's
    memory order, LSE row slices): each launch runs the Gluon forward (local block causal and fresh, the others
    non-causal and continued; with GQA the local block takes the masked launcher), no Triton forward runs, and each
    rank's (o, lse) is attention over the whole sequence at its positions, o within 1.1x the error of the same
    ring on the Triton path. c = 1000: the c x 2c launches fall below the table's 1K rows and run Triton's."""
    from minigpt.distributed.sharding import zigzag_shard
    from test_flash_attention_ring import ring_forward_on_one_process

    B, N = 1, 2 * K * c
    g = torch.Generator(device="cuda").manual_seed(K * c + head_dim)
    q = torch.randn(B, N, hq, head_dim, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(B, N, hkv, head_dim, device="cuda", generator=g).to(dtype) for _ in range(2))
    scale = head_dim ** -0.5
    ours = ring_forward_on_one_process(q, k, v, K, scale)
    kinds = list(ran)
    with monkeypatch.context() as m:
        m.setenv("MINIGPT_FLASH_PATH", "triton")
        theirs = ring_forward_on_one_process(q, k, v, K, scale)
    assert len(kinds) == K * K  # per rank: the local block's launch, one per other block (the plain causal ring)
    gluon = [kind for kind in kinds if kind[0] == "gluon"]
    # rows [c, 2c) against a later rank's block: c rows, below the Gluon rows' 1K when c = 1000
    assert len(kinds) - len(gluon) == (0 if c >= 1024 else K * (K - 1) // 2), kinds
    local = [kind for kind in gluon if kind[2]]
    assert len(local) == K and not any(kind[3] for kind in local)  # causal, fresh
    assert all(kind[1] == "launch_forward_masked" for kind in local) or hq == hkv  # causal GQA: the masked launcher
    assert all(kind[3] for kind in gluon if not kind[2])  # the others: non-causal, continued
    visible = torch.ones(N, N, dtype=torch.bool, device="cuda").tril()
    o_ref, lse_ref = masked_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), visible, scale)
    for rank, ((o, lse), (triton_o, _)) in enumerate(zip(ours, theirs)):
        want = (zigzag_shard(o_ref.transpose(1, 2), K, rank, dim=1).transpose(1, 2),
                zigzag_shard(lse_ref, K, rank, dim=2))
        check(o, lse, want, dtype, triton_o)


@needs_hopper
def test_masked_ring_launches_stay_with_the_triton_forward(ran):
    """A window's launches off the diagonal (non-causal, at offsets) and documents with a continued launch are not
    the Gluon forward's: they run the Triton forward (and still give the masked attention)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    c, d = 1024, 64
    q, k, v = rows_of(1, 2 * c, 2, d, torch.bfloat16, g, parts=3)
    ids = torch.repeat_interleave(torch.arange(4, device="cuda"), c // 2)[None]
    o, lse = fp32_out(q)
    launch.launch_forward(q, k, v, True, 0.125, out=(o, lse), q_doc_ids=ids, k_doc_ids=ids)  # Gluon: masked, fresh
    rows, keys = slice(c, 2 * c), slice(0, c)
    launch.launch_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], False, 0.125, window=700, q_offset=5 * c,
                          k_offset=4 * c)  # non-causal with a window: Triton
    launch.launch_forward(q[:, :, rows], k[:, :, keys], v[:, :, keys], False, 0.125,
                          out=(o[:, :, rows], lse[:, :, rows]), accumulate=True, q_doc_ids=ids[:, rows],
                          k_doc_ids=ids[:, keys])  # documents, continued: Triton
    assert [kind[0] for kind in ran] == ["gluon", "triton", "triton"], ran
    # o, lse: attention over [all keys (causal, documents) | keys [0, c) again (documents, rows [c, 2c) only)]
    same = ids[0][:, None] == ids[0][None, :]
    again = same[:, :c].clone()
    again[:c] = False
    visible = torch.cat((same.tril(), again), 1)
    ref = masked_attention(q, torch.cat((k, k[:, :, keys]), 2), torch.cat((v, v[:, :, keys]), 2), visible, 0.125)
    check(o, lse, ref, torch.bfloat16)

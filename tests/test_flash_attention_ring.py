"""Ring attention's forward calls on the Gluon forward, on a CPU: which calls launch.gluon_forward_ready hands to it,
how launch_forward passes them on (the CAUSAL / CONTINUE flags, the caller's strided fp32 o and LSE row slices,
never a copy), and the kernel's arithmetic mirrored key tile by key tile in PyTorch (gluon/forward.py: the online
softmax, the ragged last key tile of a non-causal launch, the epilogue that folds in the continued (o, lse)) against
float64 attention over the whole sequence. The kernel itself runs on an H100/H200: tests/test_gpu_ring_kernels.py.
"""
import math

import pytest
import torch

from attention_reference import rel_err
from minigpt.distributed.ring_attention import _block_forward, _rows, stack_kv, unstack_kv
from minigpt.distributed.ring_plan import RingSchedule, block_launches, ring_schedule
from minigpt.distributed.sharding import zigzag_shard
from minigpt_kernels import dispatch, launch
from minigpt_kernels.dispatch import TileConfig

pytestmark = pytest.mark.usefixtures("poison_outputs")  # tests/conftest.py: unwritten outputs read as NaN
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
GLUON = TileConfig(128, 128, 4, 3, tma=True, specialized=True, persistent=True)


def mirror_forward(q, k, v, o, lse, qk_scale, consumers, block_n, stages, programs=None, *, causal=True,
                   accumulate=False, stride_lse=None):
    """gluon/forward.py's pingpong_fwd_kernel in PyTorch, every (batch, head) and query row at once, key tile by key
    tile: fp32 scores and softmax, P rounded to the inputs' dtype for P·V, each tile's keys past the row masked
    (causal) or the last tile's past Nk (the slice stops there), and CONTINUE's epilogue; LSE addressed as the
    kernel does (rows stride_lse apart from lse's first element; N apart in a causal fresh launch), o through its own
    strides; GQA: query head h reads K/V head h // group."""
    B, H, N, D = q.shape
    n_k, group = k.shape[2], H // k.shape[1]
    row_stride = N if (causal and not accumulate) or stride_lse is None else stride_lse
    lse_rows = torch.as_strided(lse, (B, H, N), (H * row_stride, row_stride, 1))
    qf = q.float()
    kf, vf = (t.repeat_interleave(group, 1) for t in (k.float(), v))
    rows = torch.arange(N)[:, None]
    m = torch.full((B, H, N), float("-inf"))
    l = torch.zeros(B, H, N)
    acc = torch.zeros(B, H, N, D)
    for key0 in range(0, n_k, block_n):
        keys = torch.arange(key0, min(key0 + block_n, n_k))[None, :]
        s = (qf @ kf[:, :, key0:key0 + block_n].transpose(-1, -2)) * qk_scale
        if causal:
            s = s.masked_fill(keys > rows, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp2(s - m_new[..., None])
        alpha = torch.exp2(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p.to(q.dtype).float() @ vf[:, :, key0:key0 + block_n].float()
        m = m_new
    if accumulate:  # _write_rows: fold in (o_in, lse_in) under one max
        lse_in = lse_rows.clone()
        m_new = torch.maximum(m, lse_in)
        a, c = torch.exp2(lse_in - m_new), torch.exp2(m - m_new)
        l, m = a + c * l, m_new
        o_in = torch.where((lse_in > float("-inf"))[..., None], o, 0.0)
        out = acc / l[..., None] * c[..., None] + o_in * (a / l)[..., None]
    else:
        out = acc / l[..., None]
    lse_rows.copy_(m + torch.log2(l))
    o.copy_(out.to(o.dtype))


@pytest.fixture
def on_sm90(monkeypatch):
    """launch_forward as on an H100/H200 (the device checks pass, the GPU tables), the Gluon launchers replaced by
    mirror_forward with a record of each call, and any Triton forward launch an error. Yields the record:
    (launcher, q, o, lse, options) per call."""
    monkeypatch.setattr(launch, "specialized_ready", lambda *a, **kw: True)
    monkeypatch.setattr(launch, "_capability", lambda t: (9, 0))
    monkeypatch.setattr(dispatch, "INTERPRET", False)
    monkeypatch.setattr(launch.triton, "set_allocator", lambda allocator: None)  # no CUDA scratch here
    calls = []

    def recorder(name):
        def run(q, k, v, o, lse, *args, **options):
            if name == "launch_forward_masked":  # (..., window, document_ids): causal fresh; none here
                *args, window, document_ids = args
                assert window is None and document_ids is None, "masks are not mirrored"
                assert options.pop("persistent") is False, "the ring's masked launch must keep a plain grid"
                options = dict(options, causal=True, accumulate=False)
            calls.append((name, q, o, lse, options))
            mirror_forward(q, k, v, o, lse, *args, **options)
        return run

    for name in ("launch_forward_pingpong", "launch_forward_persistent", "launch_forward_masked"):
        monkeypatch.setattr(launch.gluon_forward, name, recorder(name))

    class NoTriton:
        def __getitem__(self, grid):
            raise AssertionError("the Triton forward ran")

    monkeypatch.setattr(launch, "fwd_kernel", NoTriton())
    return calls


def model_rows(B, N, H, D, dtype, g, parts=1):
    """`parts` (B, H, N, D) views of one (B, N, parts, H, D) buffer, as the model lays out q/k/v."""
    x = torch.randn(B, N, parts, H, D, generator=g).to(dtype)
    return [t.transpose(1, 2) for t in x.unbind(2)]


def attention64(q, k, v, visible, scale, chunk=1024):
    """float64 (o, lse base 2) with `visible` (Nq, Nk); GQA by repeating K/V heads; `chunk` query rows at a time."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    outs, lses = [], []
    for r in range(0, q.shape[2], chunk):
        vis = visible[r:r + chunk]
        end = int(vis.any(0).nonzero().max()) + 1  # keys past every row's last visible one: left out
        s = ((q[:, :, r:r + chunk].double() @ k[:, :, :end].transpose(-2, -1)) * scale).masked_fill(~vis[:, :end],
                                                                                                   float("-inf"))
        outs.append(s.softmax(-1) @ v[:, :, :end])
        lses.append(torch.logsumexp(s, -1) / math.log(2))
    return torch.cat(outs, 2), torch.cat(lses, 2)


def test_gluon_forward_ready_takes_dense_calls_causal_or_not_fresh_or_continued(monkeypatch):
    """The predicate's rules with the device checks passing (specialized_ready: an H100/H200, TMA-aligned fp16/bf16 at
    head_dim 64 or 128): dense calls causal or not (Nq != Nk without the causal mask), fresh or continued into an
    fp32 o with LSE row slices, GQA; masks only in causal fresh calls of a sequence against itself; a causal fresh
    call's LSE rows Nq apart. On a CPU (the real device checks) nothing."""
    g = torch.Generator().manual_seed(0)
    q2c, = model_rows(2, 256, 4, 64, torch.bfloat16, g)
    k, v = model_rows(2, 128, 4, 64, torch.bfloat16, g, parts=2)
    kg, vg = model_rows(2, 128, 2, 64, torch.bfloat16, g, parts=2)
    o32 = launch.empty_in_layout_of(q2c, torch.float32)
    lse = torch.empty(2, 4, 256)
    half = slice(128, 256)
    ready = launch.gluon_forward_ready
    assert not ready(q2c, k, v, False)  # a CPU: specialized_ready says no
    monkeypatch.setattr(launch, "specialized_ready", lambda *a, **kw: True)
    assert ready(q2c, k, v, False) and ready(q2c[:, :, half], q2c, q2c, False)  # 2c x c, c x 2c
    assert ready(q2c, k, v, False, True, (o32, lse)) and ready(q2c, kg, vg, False, True, (o32, lse))  # GQA
    assert ready(q2c[:, :, half], q2c, q2c, False, True, (o32[:, :, half], lse[:, :, half]))  # LSE rows 2c apart
    assert ready(q2c, q2c, q2c, True, False, (o32, lse)) and ready(q2c, q2c, q2c, True, True, (o32, lse))
    assert ready(q2c, q2c, q2c, True, False, (torch.empty_like(q2c), lse))  # o in q's dtype
    assert ready(q2c, q2c, q2c, True, q_offset=5, k_offset=5)  # offsets that do not move the diagonal
    assert not ready(q2c, k, v, False, True)  # nothing to continue
    assert not ready(q2c, k, v, False, True, (torch.empty_like(q2c), lse))  # continued: o fp32
    assert not ready(q2c, k, v, False, False, (o32, lse.double()))
    assert not ready(q2c, k, v, False, False, (o32, lse.transpose(1, 2).contiguous().transpose(1, 2)))
    assert not ready(q2c, q2c, q2c, False, False, (o32.half(), lse))  # another 16-bit dtype
    assert not ready(q2c, k.half(), v.half(), False)
    assert not ready(q2c, kg[:, :1].expand(2, 3, 128, 64), vg[:, :1].expand(2, 3, 128, 64), False)  # 4 % 3
    rows = q2c[:, :, half]
    assert not ready(rows, rows, rows, True, False, (o32[:, :, half], lse[:, :, half]))  # causal fresh: rows N apart
    one = q2c[:1, :1, half]
    assert ready(one, one, one, True, False, (o32[:1, :1, half], lse[:1, :1, half]))  # ... unless one row of LSE
    ids = torch.zeros(2, 256, dtype=torch.int64)
    assert ready(q2c, q2c, q2c, True, window=7) and ready(q2c, q2c, q2c, True, q_doc_ids=ids, k_doc_ids=ids)
    assert ready(q2c, kg[:, :, :1].expand(2, 2, 256, 64), vg[:, :, :1].expand(2, 2, 256, 64), True, window=7)
    for call in (dict(causal=False, window=7), dict(causal=True, accumulate=True, out=(o32, lse), window=7),
                 dict(causal=False, q_doc_ids=ids, k_doc_ids=ids),
                 dict(causal=True, q_doc_ids=ids, k_doc_ids=ids.clone()),
                 dict(causal=True, q_offset=256, k_offset=0)):
        assert not ready(q2c, q2c, q2c, **call), call


def test_the_rings_launches_without_masks_take_the_gluon_forward_and_theirs_stay_with_triton(monkeypatch):
    """Without a window or documents every launch of ring attention's forward (_block_forward's: the local block
    causal into the fp32 o, the others non-causal continuing it, 2c x c or c x 2c) fits the Gluon forward. With a
    window or documents only the local block's causal fresh launch over all its rows does (documents); the masked
    non-causal and continued ones do not, nor does a causal fresh launch into LSE row slices (a window's diagonal
    pairs); a pair the window does not cut is a dense launch again."""
    monkeypatch.setattr(launch, "specialized_ready", lambda *a, **kw: True)
    K, c = 4, 128
    g = torch.Generator().manual_seed(1)
    q, k, v = model_rows(1, 2 * c, 2, 64, torch.bfloat16, g, parts=3)
    o, lse = launch.empty_in_layout_of(q, torch.float32), torch.empty(1, 2, 2 * c)
    ids = torch.zeros(1, 2 * c, dtype=torch.int64)
    for rank in range(K):
        for src in range(K):
            for window, docs in ((None, False), (None, True), (3 * c, False), (c // 2, False)):
                for l in block_launches(src, rank, K, c, window):
                    masks = dict(window=l.window, q_offset=l.q_offset, k_offset=l.k_offset,
                                 **(dict(q_doc_ids=ids[:, l.rows], k_doc_ids=ids[:, l.keys]) if docs else {}))
                    fits = launch.gluon_forward_ready(q[:, :, l.rows], k[:, :, l.keys], v[:, :, l.keys], l.causal,
                                                      not l.fresh_rows, (o[:, :, l.rows], lse[:, :, l.rows]),
                                                      **masks)
                    full = l.rows == slice(0, 2 * c)
                    if docs or l.window is not None:  # masks: causal fresh, a sequence against itself
                        expected = l.causal and l.fresh_rows and full and l.keys == l.rows
                    else:  # dense: a causal fresh launch writes LSE rows Nq apart
                        expected = full or not (l.causal and l.fresh_rows)
                    assert fits == expected, (rank, src, window, docs, l)
                    assert fits or window is not None or docs, l  # the plain ring: every launch


def ring_forward_on_one_process(q, k, v, K, scale):
    """ring_forward's launches for every rank of a K-rank ring, run one rank after another in this process: the
    local block, then each other rank's block as the ring brings it (its K/V as ring messages, stack_kv), each
    through _block_forward into the rank's fp32 o (the model's (B, N, H, D) memory order) and (B, H, 2c) LSE.
    q, k, v: (B, N, H, D) whole sequences. Returns the (o, lse) of each rank."""
    c = q.shape[1] // (2 * K)
    shards = [[zigzag_shard(t, K, r, dim=1).transpose(1, 2) for t in (q, k, v)] for r in range(K)]
    out = []
    for rank in range(K):
        q_r = shards[rank][0]
        o, lse = launch.empty_in_layout_of(q_r, torch.float32), torch.empty(q_r.shape[:3], device=q.device)
        _block_forward(q_r, shards[rank][1], shards[rank][2], None, None, block_launches(rank, rank, K, c), scale,
                       o, lse)
        for direction, depth in ring_schedule(K, c).steps():
            src = RingSchedule.source(rank, K, direction, depth)
            k_src, v_src = unstack_kv(stack_kv(shards[src][1], shards[src][2]))
            _block_forward(q_r, k_src, v_src, None, None, block_launches(src, rank, K, c), scale, o, lse)
        out.append((o, lse))
    return out


@pytest.mark.parametrize("K,c,heads,dtype", [(2, 1152, (2, 2), torch.bfloat16), (4, 1024, (2, 1), torch.float16)])
def test_ring_forward_through_the_gluon_launchers_equals_whole_sequence_attention(on_sm90, K, c, heads, dtype):
    """The ring's exact calls (_block_forward, zigzag shards, K/V as ring messages, fp32 o in the model's layout, LSE
    row slices) all reach the Gluon launchers, the local block causal and fresh, the others non-causal and
    continued, with the caller's buffers (no copy) and their LSE row stride; the mirrored kernel gives attention
    over the whole sequence at each rank's positions. With GQA (the second case) the local block takes the masked
    launcher (a plain grid, as causal GQA calls always have), the others the plain ping-pong one (the ring asks for
    plain grids where the table's rows are persistent)."""
    Hq, Hkv = heads
    B, N, D = 1, 2 * K * c, 64
    g = torch.Generator().manual_seed(K + c)
    q = torch.randn(B, N, Hq, D, generator=g).to(dtype)
    k, v = (torch.randn(B, N, Hkv, D, generator=g).to(dtype) for _ in range(2))
    scale = D ** -0.5
    results = ring_forward_on_one_process(q, k, v, K, scale)
    launches = sum(len(block_launches(src, 0, K, c)) for src in range(K))
    assert len(on_sm90) == K * launches
    for name, q_l, o_l, lse_l, options in on_sm90:
        local = options["causal"]
        assert name == ("launch_forward_masked" if local and Hq != Hkv else "launch_forward_pingpong")
        assert options["accumulate"] == (not local)
        assert q_l.shape[2] == 2 * c if local else q_l.shape[2] in (c, 2 * c)
        assert o_l.dtype == torch.float32 and options["stride_lse"] == 2 * c  # rows of the rank's (B, H, 2c) LSE
        assert any(o_l.data_ptr() == o.data_ptr() + o.stride(2) * start * 4 and lse_l.data_ptr() == lse.data_ptr()
                   + start * 4 for o, lse in results for start in (0, c))  # views of a rank's buffers, no copies
    visible = torch.ones(N, N, dtype=torch.bool).tril()
    o_ref, lse_ref = attention64(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), visible, scale)
    for rank, (o, lse) in enumerate(results):
        want_o = zigzag_shard(o_ref.transpose(1, 2), K, rank, dim=1).transpose(1, 2)
        want_lse = zigzag_shard(lse_ref, K, rank, dim=2)
        assert not o.isnan().any() and rel_err(o, want_o) < TOL[dtype], rank
        assert (lse.double() - want_lse).abs().max() < 1e-4, rank


def test_the_rings_forward_launches_run_on_plain_grids_and_other_callers_keep_the_tables_tiles(on_sm90):
    """Where the table's Gluon forward row is persistent (head_dim 64, 1K-128K query rows), _block_forward's
    launches (the local causal block, 2c rows; a block of another rank, c or 2c rows continued) reach the plain-grid
    launcher with the row's tiles; launch_forward called as anyone else calls it gets the persistent launcher."""
    K, c, D = 2, 1024, 64
    g = torch.Generator().manual_seed(3)
    q, k, v = model_rows(1, 2 * c, 2, D, torch.bfloat16, g, parts=3)
    o, lse = launch.empty_in_layout_of(q, torch.float32), torch.empty(1, 2, 2 * c)
    ring_calls = []
    for src in (0, 1):  # rank 0's own block, then rank 1's
        launches = block_launches(src, 0, K, c)
        _block_forward(q, k, v, None, None, launches, D ** -0.5, o, lse)
        ring_calls += [(l, src) for l in launches]
    assert [name for name, *_ in on_sm90] == ["launch_forward_pingpong"] * len(ring_calls)
    for (_, q_l, *_, options), (l, _) in zip(on_sm90, ring_calls):
        tiles = dispatch.plan("fwd", D, q_l.shape[2], q.dtype, l.causal, capability=(9, 0), gluon_inputs=True).tiles
        assert tiles.persistent and options["causal"] == l.causal  # the table would run this launch persistent
    on_sm90.clear()
    for l, src in ring_calls:  # the same launches, as another caller makes them
        launch.launch_forward(_rows(q, l.rows), _rows(k, l.keys), _rows(v, l.keys), l.causal, D ** -0.5,
                              out=(_rows(o, l.rows), _rows(lse, l.rows)), accumulate=not l.fresh_rows)
    assert [name for name, *_ in on_sm90] == ["launch_forward_persistent"] * len(ring_calls)


@pytest.mark.parametrize("nq,nk,kv_heads", [(1000, 2000, 2), (2000, 1000, 1), (1024, 1, 2), (1030, 129, 2)])
def test_continued_rows_fold_in_the_state_they_hold(on_sm90, nq, nk, kv_heads):
    """A non-causal fresh launch over keys A into an fp32 o, then a continued one over keys B (ragged lengths: the
    last key tile reaches past Nk; GQA), some rows emptied first (lse = −inf, o NaN): every row gets attention over
    what it holds and B, the emptied ones over B alone, no NaN."""
    g = torch.Generator().manual_seed(nq + nk)
    (q,) = model_rows(1, nq, 2, 64, torch.bfloat16, g)
    ka, va = model_rows(1, 300, kv_heads, 64, torch.bfloat16, g, parts=2)
    kb, vb = model_rows(1, nk, kv_heads, 64, torch.bfloat16, g, parts=2)
    o, lse = launch.empty_in_layout_of(q, torch.float32), torch.empty(1, 2, nq)
    scale = 0.125
    launch.launch_forward(q, ka, va, False, scale, GLUON, out=(o, lse))
    empty = torch.arange(nq) % 5 == 1
    o[:, :, empty], lse[:, :, empty] = float("nan"), float("-inf")
    launch.launch_forward(q, kb, vb, False, scale, GLUON, out=(o, lse), accumulate=True)
    assert [options["accumulate"] for *_, options in on_sm90] == [False, True]
    visible = torch.cat((~empty[:, None].expand(nq, 300), torch.ones(nq, nk, dtype=torch.bool)), 1)
    o_ref, lse_ref = attention64(q, torch.cat((ka, kb), 2), torch.cat((va, vb), 2), visible, scale)
    assert not o.isnan().any() and rel_err(o, o_ref) < TOL[torch.bfloat16]
    assert (lse.double() - lse_ref).abs().max() < 1e-4


def test_a_forced_gluon_forward_that_does_not_fit_raises():
    """cfg naming the Gluon forward for a call it does not take (here: a CPU) is an error naming the predicate."""
    q = torch.randn(1, 2, 64, 64)
    with pytest.raises(ValueError, match="gluon_forward_ready"):
        launch.launch_forward(q, q, q, False, 0.125, GLUON)


def test_gqa_alone_takes_the_dense_persistent_forward_where_the_model_calls_it(on_sm90):
    """A causal GQA call as the model makes it (fresh, default grids, no masks) reaches the dense persistent
    launcher with the dense row's tiles (three consumers at head_dim 64 from 2K tokens); the ring's local block (a
    plain grid asked for, an fp32 o) keeps the masked launcher; both give the same attention."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4 if i == 0 else 2, 2048, 64, generator=g).to(torch.bfloat16) for i in range(3))
    o, lse = launch.launch_forward(q, k, v, True, 0.125)
    o_plain, _ = launch.launch_forward(q, k, v, True, 0.125, out=(torch.empty(q.shape), torch.empty(1, 4, 2048)),
                                       persistent=False)
    names = [name for name, *_ in on_sm90]
    assert names == ["launch_forward_persistent", "launch_forward_masked"], names
    consumers = on_sm90[0][4]  # (launcher, q, o, lse, options): the options of the persistent launch
    assert consumers["causal"] and not consumers["accumulate"]
    assert rel_err(o.float(), o_plain.float()) < TOL[torch.bfloat16]

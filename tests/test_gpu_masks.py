"""GPU-only checks of sliding windows, document ids and GQA in our FlashAttention (issue 33; python -m pytest -m gpu
tests/test_gpu_masks.py): bf16/fp16 at 4K-16K tokens against a float32 masked SDPA reference (outputs and gradients),
the launchers' block form at offsets, deterministic mode, and torch.compile(fullgraph=True) of a function that
passes document_ids (no graph break: the tile spans are found on the device); on sm_90 the masked Gluon forward and
five-matmul backward against float32 and the forced Triton path. The same for attention straight from the qkv
projection (B, N, Hq + 2·Hkv, D) with RoPE inside (flash_attention_qkv): GQA, masks, YaRN, against the pair
qkv_rotary + flash_attention and float32, and its memory (no K/V of Hq heads). The CPU twins are
tests/test_flash_masks.py and tests/test_flash_attention_qkv.py.
"""
import importlib

import pytest
import torch
import torch.nn.functional as F

from attention_reference import masked_attention, rel_err, rope64, visible_mask
from minigpt.benchmarks.mask_bench import peak_extra_bytes
from minigpt.model import Rotary
from minigpt_kernels.flash_attention import flash_attention
from minigpt_kernels.flash_attention_qkv import flash_attention_qkv
from minigpt_kernels.rotary import qkv_rotary

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
launch = importlib.import_module("minigpt_kernels.launch")
# Relative error against float32; bf16 keeps 8 mantissa bits, fp16 11.
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def qkv_rows(B, N, Hq, Hkv, D, dtype, seed):
    """q (B, Hq, N, D), k, v (B, Hkv, N, D): head-transposed views of one (B, N, Hq + 2·Hkv, D) leaf."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(B, N, Hq + 2 * Hkv, D, device="cuda", generator=g).to(dtype).requires_grad_()
    q, k, v = qkv.split((Hq, Hkv, Hkv), dim=2)
    return qkv, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def documents(kind: str, B: int, N: int, seed: int = 0) -> torch.Tensor | None:
    """(B, N) int64 ids on the GPU: "ragged" random lengths of 1 to 3000 tokens (per batch row), "tokens" one token
    each, "one" a single document, "none" no ids."""
    if kind == "none":
        return None
    if kind == "tokens":
        return torch.arange(N, device="cuda").repeat(B, 1)
    if kind == "one":
        return torch.zeros(B, N, dtype=torch.int64, device="cuda")
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        lengths = torch.randint(1, 3000, (N,), generator=g)
        rows.append(torch.repeat_interleave(torch.arange(N), lengths)[:N])
    return torch.stack(rows).cuda()


def sdpa_reference(q, k, v, visible, scale=None):
    """float32 masked SDPA (GQA by repeating K/V heads): visible (Nq, Nk) or (B, Nq, Nk)."""
    q, k, v = (t.float() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = visible.cuda() if visible.dim() == 2 else visible.cuda()[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# (N, Hq, Hkv, head_dim, causal, window, documents)
CASES = [
    (4096, 4, 4, 64, True, None, "ragged"),
    (4096, 4, 2, 64, True, None, "none"),
    (4096, 6, 2, 128, False, None, "none"),
    (4096, 4, 1, 64, True, 1, "none"),
    (4096, 4, 2, 128, True, 256, "none"),
    (4096, 2, 2, 64, False, 300, "none"),
    (4096, 4, 2, 64, True, 5000, "none"),
    (4096, 2, 2, 64, True, None, "tokens"),
    (4096, 2, 2, 64, False, None, "one"),
    (8192, 8, 2, 128, True, 1000, "ragged"),
    (8192, 4, 2, 64, False, 700, "ragged"),
    (16384, 4, 1, 64, True, 2048, "ragged"),
    (16384, 2, 2, 128, True, None, "ragged"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,hq,hkv,head_dim,causal,window,docs", CASES,
                         ids=[f"n{n}-h{a}/{b}-d{d}-{'causal' if c else 'full'}-w{w}-{doc}"
                              for n, a, b, d, c, w, doc in CASES])
def test_masks_accuracy_vs_float32_sdpa(n, hq, hkv, head_dim, causal, window, docs, dtype):
    qkv, q, k, v = qkv_rows(1, n, hq, hkv, head_dim, dtype, seed=n + hq * 7 + (window or 0))
    ids = documents(docs, 1, n, seed=n)
    o = flash_attention(q, k, v, causal, window=window, document_ids=ids)
    do = torch.randn(o.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).to(dtype)
    (grad,) = torch.autograd.grad(o, qkv, do)

    qkv32 = qkv.detach().float().requires_grad_()
    q32, k32, v32 = (t.transpose(1, 2) for t in qkv32.split((hq, hkv, hkv), dim=2))
    visible = visible_mask(n, n, causal, window, ids, ids)
    ref = sdpa_reference(q32, k32, v32, visible)
    (grad_ref,) = torch.autograd.grad(ref, qkv32, do.float())
    errs = {"o": rel_err(o, ref)}
    for name, part, part_ref in zip("qkv", grad.split((hq, hkv, hkv), 2), grad_ref.split((hq, hkv, hkv), 2)):
        errs[f"d{name}"] = rel_err(part, part_ref)
    assert all(e < TOL[dtype] for e in errs.values()), errs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_launchers_at_offsets_vs_the_reference_block(causal, dtype):
    """A query block against a key block elsewhere (q_offset/k_offset, their document ids, a window, GQA): the block's
    own masked attention in float64, rows that see no key included (o = 0, lse = -inf), and its gradients."""
    n, hq, hkv, d = 8192, 4, 2, 64
    _, q, k, v = qkv_rows(1, n, hq, hkv, d, dtype, seed=3)
    q, k, v = (t.detach() for t in (q, k, v))
    ids = documents("ragged", 1, n, seed=4)
    for qs, ks in ((slice(4096, 8192), slice(0, 4096)), (slice(1000, 5000), slice(3000, 8192))):
        masks = dict(window=1500, q_doc_ids=ids[:, qs], k_doc_ids=ids[:, ks], q_offset=qs.start, k_offset=ks.start)
        qb, kb, vb = q[:, :, qs], k[:, :, ks], v[:, :, ks]
        o, lse = launch.launch_forward(qb, kb, vb, causal, d ** -0.5, **masks)
        visible = visible_mask(n, n, causal, 1500, ids, ids)[..., qs, ks]
        ref, lse_ref = masked_attention(qb, kb, vb, visible.cuda(), d ** -0.5)  # float64, rows that see nothing: 0
        assert not o.isnan().any() and rel_err(o, ref) < TOL[dtype]
        assert torch.equal(lse.isinf(), lse_ref.isinf())
        finite = lse_ref.isfinite()
        assert (lse.double()[finite] - lse_ref[finite]).abs().max() < 0.05
        do = torch.randn(qb.shape, device="cuda").to(dtype)
        grads = launch.launch_backward(do, qb, kb, vb, o, lse, causal, d ** -0.5, **masks)
        leaves = [t.double().requires_grad_() for t in (qb, kb, vb)]
        refs = torch.autograd.grad(masked_attention(*leaves, visible.cuda(), d ** -0.5)[0], leaves, do.double())
        for name, got, r in zip("qkv", grads, refs):
            assert not got.isnan().any() and rel_err(got, r) < TOL[dtype], f"d{name}"


def test_deterministic_mode_gives_bitwise_equal_gradients():
    """Masks and GQA run the seven-matmul backward (no atomics): two runs, under torch.use_deterministic_algorithms,
    give the same bits; so does deterministic=True."""
    qkv, q, k, v = qkv_rows(2, 8192, 8, 2, 128, torch.bfloat16, seed=5)
    ids = documents("ragged", 2, 8192, seed=6)
    do = torch.randn(q.shape, device="cuda").to(torch.bfloat16)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [torch.autograd.grad(flash_attention(q, k, v, window=2000, document_ids=ids), qkv, do)[0]
                for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(was)
    flag = torch.autograd.grad(flash_attention(q, k, v, window=2000, document_ids=ids, deterministic=True), qkv, do)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], flag[0])


def test_torch_compile_with_document_ids_has_no_graph_break():
    """fullgraph=True: a graph break (a host sync on the ids, say) is an error. Output and gradients match eager."""
    def block(x, w, ids):
        B, N, _ = x.shape
        qkv = (x @ w).view(B, N, 8 + 2 * 2, 64)
        q, k, v = (t.transpose(1, 2) for t in qkv.split((8, 2, 2), dim=2))
        return flash_attention(q, k, v, window=1024, document_ids=ids).transpose(1, 2).reshape(B, N, -1)

    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(2, 4096, 256, device="cuda", generator=g).bfloat16()
    w = (torch.randn(256, 12 * 64, device="cuda", generator=g) / 16).bfloat16().requires_grad_()
    ids = documents("ragged", 2, 4096, seed=8)
    eager = block(x, w, ids)
    (g_eager,) = torch.autograd.grad(eager.float().square().mean(), w)
    compiled = torch.compile(block, fullgraph=True)(x, w, ids)
    (g_compiled,) = torch.autograd.grad(compiled.float().square().mean(), w)
    assert rel_err(compiled, eager.double()) < 1e-2 and rel_err(g_compiled, g_eager.double()) < 1e-2


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not HOPPER, reason="the masked Gluon forward is written for sm_90 (wgmma)")
@pytest.mark.parametrize("N, Hq, Hkv, D, window, docs", [
    (777, 4, 4, 64, None, "ragged"), (4100, 4, 2, 64, 100, "ragged"), (8192, 8, 2, 128, 1000, "none"),
    (4096, 4, 1, 64, 1, "none"), (5000, 4, 4, 128, None, "tokens"), (4096, 4, 4, 64, None, "one"),
    (3000, 2, 2, 64, 5000, "none"), (6000, 6, 3, 128, 300, "ragged"), (2048, 4, 4, 64, 129, "none")])
def test_the_masked_gluon_forward_matches_float32_and_the_triton_path(N, Hq, Hkv, D, window, docs, monkeypatch):
    """Causal masked and GQA calls of a sequence against itself run the Gluon forward on sm_90 (each query tile over
    the key tiles its rows see): its output against float32 masked SDPA and against the forced Triton path, on odd
    lengths, windows of 1 to wider than N, documents of one token, ragged, or one."""
    gluon_forward = launch.gluon_forward
    ran = []
    real = gluon_forward.launch_forward_masked
    monkeypatch.setattr(gluon_forward, "launch_forward_masked", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    _, q, k, v = qkv_rows(2, N, Hq, Hkv, D, torch.bfloat16, seed=N + D)
    ids = documents(docs, 2, N, seed=N)
    with torch.no_grad():
        o = flash_attention(q, k, v, causal=True, window=window, document_ids=ids)
        monkeypatch.setenv("MINIGPT_FLASH_PATH", "triton")
        o_triton = flash_attention(q, k, v, causal=True, window=window, document_ids=ids)
    assert ran == [1], "the masked call did not run the Gluon forward"
    visible = visible_mask(N, N, causal=True, window=window, q_ids=None if ids is None else ids.cpu(),
                           k_ids=None if ids is None else ids.cpu())
    ref = sdpa_reference(q, k, v, visible)
    assert torch.isfinite(o).all()
    assert rel_err(o.float(), ref) < TOL[torch.bfloat16], (N, window, docs)
    assert rel_err(o.float(), o_triton.float()) < TOL[torch.bfloat16], (N, window, docs)


@pytest.mark.skipif(not HOPPER, reason="the Gluon forward is written for sm_90 (wgmma)")
@pytest.mark.parametrize("N, Hq, Hkv, D", [(4096, 8, 2, 64), (3001, 16, 4, 64), (8192, 8, 1, 128), (1500, 6, 3, 128),
                                          (1024, 4, 2, 64)])
def test_gqa_alone_runs_the_dense_gluon_forward(N, Hq, Hkv, D, monkeypatch):
    """Causal GQA without masks runs the dense Gluon forward on the dense rows' tiles (persistent with 3 consumers
    where they say; each item reads its K/V head h // group), not the masked row's plain grid; the backward's plain
    grid is launched in schedule.plain_order. The output against float32 SDPA, the output and the gradients against
    the forced Triton path, on odd lengths, groups of 2 to 8."""
    from minigpt_kernels.dispatch import plan

    ran = []
    for name in ("launch_forward_persistent", "launch_forward_pingpong", "launch_forward_masked"):
        real = getattr(launch.gluon_forward, name)
        monkeypatch.setattr(launch.gluon_forward, name,
                            lambda *a, _name=name, _real=real, **kw: ran.append(_name) or _real(*a, **kw))
    dense = plan("fwd", D, N, torch.bfloat16, True, capability=(9, 0), gluon_inputs=True, path="auto").tiles
    qkv, q, k, v = qkv_rows(2, N, Hq, Hkv, D, torch.bfloat16, seed=N + Hq)
    do = torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(N)).bfloat16()
    o = flash_attention(q, k, v, causal=True)
    grads = torch.autograd.grad(o, qkv, do)[0].split((Hq, Hkv, Hkv), dim=2)
    monkeypatch.setenv("MINIGPT_FLASH_PATH", "triton")
    o_triton = flash_attention(q, k, v, causal=True)
    grads_triton = torch.autograd.grad(o_triton, qkv, do)[0].split((Hq, Hkv, Hkv), dim=2)
    assert ran == ["launch_forward_persistent" if dense.persistent else "launch_forward_pingpong"], ran
    ref = sdpa_reference(q.detach(), k.detach(), v.detach(), visible_mask(N, N, causal=True))
    assert rel_err(o.float(), ref) < TOL[torch.bfloat16], (N, Hq, Hkv, D)
    assert rel_err(o.float(), o_triton.float()) < TOL[torch.bfloat16], (N, Hq, Hkv, D)
    for name, g, g_triton in zip(("dq", "dk", "dv"), grads, grads_triton):
        assert rel_err(g.float(), g_triton.float()) < TOL[torch.bfloat16], (name, N, Hq, Hkv, D)


@pytest.mark.skipif(not HOPPER, reason="the masked Gluon kernels are written for sm_90 (wgmma)")
@pytest.mark.parametrize("N, Hq, Hkv, D, window", [
    (32768, 16, 16, 64, 1024), (16384, 8, 8, 128, 1024), (8192, 16, 4, 64, 300), (4097, 4, 4, 64, 1),
    (6000, 6, 3, 128, 5000), (20000, 8, 8, 128, 4096)])
def test_persistent_windowed_launches_match_the_plain_grid(N, Hq, Hkv, D, window, monkeypatch):
    """The windowed forward and backward on one program per SM (gluon/schedule.py MASKED_PERSISTENT_WAVES, a
    schedule balanced on the host) compute each item as the plain grid does: o, dK and dV bitwise equal, dQ (added by
    TMA in an order that varies) within bf16's tolerance; windows of one token to most of N, odd lengths, GQA
    (its forward persistent, its backward a plain grid)."""
    qkv, q, k, v = qkv_rows(2, N, Hq, Hkv, D, torch.bfloat16, seed=N + Hq)
    do = torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(N)).bfloat16()

    def run(waves):  # 0: every windowed launch persistent; 10**9: none
        monkeypatch.setattr(launch.gluon_forward, "MASKED_PERSISTENT_WAVES", waves)
        monkeypatch.setattr(launch.gluon_backward, "MASKED_PERSISTENT_WAVES", waves)
        o = flash_attention(q, k, v, causal=True, window=window)
        (g,) = torch.autograd.grad(o, qkv, do)
        return o, *g.split((Hq, Hkv, Hkv), dim=2)

    o_plain, dq_plain, dk_plain, dv_plain = run(10**9)
    o, dq, dk, dv = run(0)
    assert torch.equal(o, o_plain) and torch.equal(dk, dk_plain) and torch.equal(dv, dv_plain), (N, window)
    assert rel_err(dq.float(), dq_plain.float()) < TOL[torch.bfloat16], (N, window)


@pytest.mark.skipif(not HOPPER, reason="the masked Gluon forward is written for sm_90 (wgmma)")
@pytest.mark.parametrize("N, Hq, Hkv, D, window, docs", [
    (32768, 8, 8, 64, None, "ragged"), (16384, 8, 2, 64, None, "ragged"), (8197, 8, 8, 64, 300, "ragged"),
    (4096, 16, 4, 64, None, "tokens"), (6000, 12, 3, 64, None, "one"), (5000, 16, 16, 64, 1, "ragged"),
    (8192, 16, 16, 128, None, "ragged")])
def test_persistent_document_forward_matches_the_plain_grid(N, Hq, Hkv, D, window, docs, monkeypatch):
    """The forward with document ids on one program per SM, each taking its next query tile from a work queue as it
    frees up (common.hand_out_ticket), computes each tile as the plain grid does: o bitwise equal, on odd lengths,
    with and without a window, GQA, documents ragged, of one token, or one, at both head dims, twice (the queue zeroed
    afresh per launch)."""
    queued = []
    real = launch.gluon_forward._launch
    monkeypatch.setattr(launch.gluon_forward, "_launch",
                        lambda *a, **kw: queued.append(kw.get("queue_programs", 0)) or real(*a, **kw))
    _, q, k, v = qkv_rows(2, N, Hq, Hkv, D, torch.bfloat16, seed=N + D)
    ids = documents(docs, 2, N, seed=N)

    def run(waves):  # 0: persistent where the launcher takes it; 10**9: a plain grid
        monkeypatch.setattr(launch.gluon_forward, "MASKED_PERSISTENT_WAVES", waves)
        with torch.no_grad():
            return flash_attention(q, k, v, causal=True, window=window, document_ids=ids)

    o_plain = run(10**9)
    o = run(0)
    assert queued[0] == 0 and queued[1] > 0, queued
    assert torch.equal(o, o_plain), (N, window, docs)
    assert torch.equal(run(0), o_plain), "a second queued launch"


@pytest.mark.skipif(not HOPPER, reason="the masked Gluon backward is written for sm_90 (wgmma)")
@pytest.mark.parametrize("N, Hq, Hkv, D, window, docs", [
    (32768, 8, 8, 64, None, "ragged"), (8197, 8, 8, 64, 300, "ragged"), (6000, 12, 12, 64, None, "one"),
    (5000, 16, 16, 64, 1, "ragged"), (4096, 16, 16, 64, None, "tokens"), (16384, 8, 2, 64, None, "ragged"),
    (8192, 16, 16, 128, None, "ragged"), (8197, 8, 8, 128, 300, "ragged"), (6000, 12, 12, 128, None, "one"),
    (4096, 16, 16, 128, None, "tokens"), (8192, 8, 2, 128, None, "ragged")])
def test_persistent_document_backward_matches_the_plain_grid(N, Hq, Hkv, D, window, docs, monkeypatch):
    """The backward with document ids (both head dims, schedule.DOCUMENTS_QUEUED_BACKWARD_HEAD_DIMS), one query head
    per item, on one program per SM, each taking its next key block from a work queue as it frees up
    (common.hand_out_ticket, read by both consumers and, at head_dim 64, the dQ warpgroup), computes each key block
    as the plain grid does: dK, dV bitwise equal, dQ (added by TMA in an order that varies) within bf16's tolerance;
    odd lengths, with and without a window, documents ragged, of one token, or one. GQA (an item walks a group)
    keeps the plain grid."""
    queued = []
    real = launch.gluon_backward._launch_dkdvdq
    monkeypatch.setattr(launch.gluon_backward, "_launch_dkdvdq",
                        lambda *a, **kw: queued.append(kw.get("queue_programs", 0)) or real(*a, **kw))
    qkv, q, k, v = qkv_rows(2, N, Hq, Hkv, D, torch.bfloat16, seed=N + D + 1)
    do = torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(N)).bfloat16()
    ids = documents(docs, 2, N, seed=N + 1)

    def run(waves):  # 0: persistent where the launcher takes it; 10**9: a plain grid
        monkeypatch.setattr(launch.gluon_backward, "MASKED_PERSISTENT_WAVES", waves)
        o = flash_attention(q, k, v, causal=True, window=window, document_ids=ids)
        (g,) = torch.autograd.grad(o, qkv, do)
        return g.split((Hq, Hkv, Hkv), dim=2)

    dq_plain, dk_plain, dv_plain = run(10**9)
    assert not any(queued)
    dq, dk, dv = run(0)
    assert (queued[-1] > 0) == (D in launch.gluon_backward.DOCUMENTS_QUEUED_BACKWARD_HEAD_DIMS and Hq == Hkv), \
        "MHA at a queued head dim runs on the queue, else a plain grid"
    assert torch.equal(dk, dk_plain) and torch.equal(dv, dv_plain), (N, window, docs)
    assert rel_err(dq.float(), dq_plain.float()) < TOL[torch.bfloat16], (N, window, docs)


# (N, Hq, Hkv, D, window, documents, layout, split): odd lengths, windows of 1 to wider than N, documents of one
# token, ragged or one, GQA groups 1, 2, 4 and one K/V head; "rows": q, k, v head-transposed views of one
# (B, N, Hq + 2·Hkv, D) leaf (the model's), "heads": contiguous (B, H, N, D) leaves; split: a dQ accumulator cap of
# two heads, so the backward runs in head groups (whole GQA groups each)
BACKWARD_CASES = [
    (777, 4, 4, 64, None, "ragged", "rows", False), (4100, 4, 2, 64, 100, "ragged", "rows", True),
    (8192, 8, 2, 128, 1000, "none", "rows", True), (4096, 4, 1, 64, 1, "none", "heads", False),
    (5000, 4, 4, 128, None, "tokens", "rows", False), (4096, 4, 4, 64, None, "one", "rows", False),
    (3000, 2, 2, 64, 5000, "none", "heads", False), (6000, 6, 3, 128, 300, "ragged", "heads", False),
    (2048, 4, 4, 64, 129, "none", "rows", False), (1000, 8, 2, 128, 64, "ragged", "rows", False),
    (3001, 4, 1, 128, 2, "tokens", "rows", False), (2500, 8, 2, 64, 700, "one", "rows", False),
    # one K/V head over a short grid: the group split over programs (group_splits: 4 splits of 16 heads, 4 of 8)
    (8192, 16, 1, 64, None, "ragged", "rows", False), (4097, 8, 1, 128, 300, "none", "heads", False),
    # GQA alone over a short grid (2 · 2 K/V heads · 32 key blocks for 132 SMs): groups of four split in one launch
    # (their fp32 dK, dV in dq's memory), groups of two cut to a launch per K/V head, each split
    (4096, 8, 2, 128, None, "none", "heads", False), (4096, 8, 2, 64, None, "none", "rows", False),
    (4096, 4, 2, 64, None, "none", "heads", False)]


@pytest.mark.skipif(not HOPPER, reason="the masked Gluon backward is written for sm_90 (wgmma)")
@pytest.mark.parametrize("N, Hq, Hkv, D, window, docs, layout, split", BACKWARD_CASES,
                         ids=[f"n{n}-h{a}/{b}-d{d}-w{w}-{doc}-{lay}{'-split' if s else ''}"
                              for n, a, b, d, w, doc, lay, s in BACKWARD_CASES])
def test_the_masked_gluon_backward_matches_float32_and_the_triton_path(N, Hq, Hkv, D, window, docs, layout, split,
                                                                       monkeypatch):
    """Causal masked and GQA calls of a sequence against itself run the five-matmul Gluon backward on sm_90 (each key
    block over the query tiles that see it, dK/dV summed over the GQA group in one program, or over group_splits
    programs for one K/V head over a short grid): its gradients against
    float32 masked SDPA's and against the forced Triton path's (the seven-matmul backward)."""
    gluon_backward = launch.gluon_backward
    ran = []
    real = gluon_backward.launch_dkdv_dq_masked
    monkeypatch.setattr(gluon_backward, "launch_dkdv_dq_masked", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    B = 2
    if split:  # two heads' fp32 dQ accumulator per launch, rounded up to whole GQA groups
        monkeypatch.setattr(launch, "FUSED_DQ_ACC_BYTES", 2 * B * N * D * 4)
    qkv, q, k, v = qkv_rows(B, N, Hq, Hkv, D, torch.bfloat16, seed=N + D + Hkv)
    if layout == "heads":
        q, k, v = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
        leaves = (q, k, v)
    else:
        leaves = (qkv,)
    ids = documents(docs, B, N, seed=N)
    do = torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(N)).bfloat16()

    def grads():  # (dq, dk, dv) as (B, heads, N, D)
        o = flash_attention(q, k, v, causal=True, window=window, document_ids=ids)
        got = torch.autograd.grad(o, leaves, do)
        if layout == "heads":
            return got
        return tuple(t.transpose(1, 2) for t in got[0].split((Hq, Hkv, Hkv), dim=2))

    gluon = grads()
    launches = len(ran)
    monkeypatch.setenv("MINIGPT_FLASH_PATH", "triton")
    triton = grads()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_launch = launch.fused_heads_per_launch(B, Hq, Hkv, N, D, sms, cut_short_gqa=window is None and ids is None)
    if split:
        assert per_launch < Hq
    assert launches == -(-Hq // per_launch) and len(ran) == launches, \
        "the masked call did not run the Gluon backward (or the Triton path did)"

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    visible = visible_mask(N, N, causal=True, window=window, q_ids=None if ids is None else ids.cpu(),
                           k_ids=None if ids is None else ids.cpu())
    refs = torch.autograd.grad(sdpa_reference(q32, k32, v32, visible), (q32, k32, v32), do.float())
    for name, got, tri, ref in zip(("dq", "dk", "dv"), gluon, triton, refs):
        assert torch.isfinite(got).all(), name
        assert rel_err(got.float(), ref) < TOL[torch.bfloat16], (name, N, window, docs)
        assert rel_err(got.float(), tri.float()) < TOL[torch.bfloat16], (name, N, window, docs)

# ------------------------------------------------------------------------------------------------
# flash_attention_qkv: the qkv projection (B, N, Hq + 2·Hkv, D), RoPE inside, GQA and masks
# ------------------------------------------------------------------------------------------------
def adds_dkdv_atomically(B: int, hq: int, hkv: int, n: int, head_dim: int, cut: bool, masked: bool) -> bool:
    """Whether the five-matmul backward sums this call's dK, dV over programs (atomically, in a varying order):
    group_splits splits a launch's grid, where the launch has one K/V head (MQA, or GQA cut per K/V head) or its group
    of four query heads or more lends dq's memory to the split's fp32 dK, dV (launch._fp32_pair_within). cut: whether
    the call may cut a short GQA grid (flash_attention without masks; not the qkv path, which takes the fp32 dQ);
    masked: a window or document ids (the split count then from the rule of two waves, not the model)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_launch = launch.fused_heads_per_launch(B, hq, hkv, n, head_dim, sms, cut_short_gqa=cut)
    group = hq // hkv
    kv_per_launch = per_launch // group
    if kv_per_launch > 1 and group < launch.DQ_HEADS_PER_FP32_PAIR:  # no room in dq: no split
        return False
    n_kblocks = -(-n // 128)
    return launch.gluon_backward.group_splits(B, per_launch, kv_per_launch, n_kblocks, sms,
                                              None if masked else n) > 1


def assert_agree_but_for_the_order(got: torch.Tensor, want: torch.Tensor, eps: float, rotated: bool = False) -> None:
    """That two gradients that sum the same fp32 terms in different orders (dK, dV over a GQA group's query heads
    and query tiles) agree as well as that allows: the sums differ by the accumulation's rounding, which scales with
    the running sums rather than with the result (a small dV_j can be the rest of large partial sums that cancel;
    allowed: 2^-13 of the tensor's largest value), and then by a unit in the last place each where rounded.
    rotated: RoPE's inverse rotation followed (dK), which mixes each pair [x1, x2]: a unit of x1 or x2 (at most
    eps · the pair's norm, which the rotation keeps, up to YaRN's scale) moves both outputs by up to √2 such units,
    so a small output can differ by many of its own units. A wrong gradient differs by the size of its values."""
    got, want = got.float(), want.float()
    if rotated:
        w1, w2 = want.chunk(2, dim=-1)
        scale = 3 * torch.sqrt(w1.square() + w2.square()).repeat(*[1] * (want.dim() - 1), 2)
    else:
        scale = want.abs()
    largest = max(want.abs().amax().item(), torch.finfo(torch.float32).tiny)
    beyond = ((got - want).abs() - eps * scale).amax().item() / largest  # of the largest value
    assert beyond <= 2.0 ** -13, f"differs by {beyond:.2e} of the largest value beyond the last-place units"


def rope_tables(head_dim: int, n: int, rope: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's fp32 (N, 1, D/2) tables on the GPU: plain RoPE, or YaRN ×4 over an original length of n/4."""
    r = Rotary(head_dim) if rope == "none" else Rotary(head_dim, 10000.0, "yarn", 4.0, n // 4)
    return r.cuda()(n, torch.arange(n, device="cuda") + 11)


# (B, N, Hq, Hkv, head_dim, window, documents, rope): groups 1 to 8, one K/V head, odd lengths
# A GQA call cut to one K/V head per launch by the dQ accumulator's cap (launch.fused_heads_per_launch; this path keeps
# short GQA grids in one launch, as it takes the fp32 dQ) takes the MQA split in each launch, whose dK, dV sum in
# another order, as MQA's (the test asks adds_dkdv_atomically)
QKV_CASES = [
    (2, 4096, 8, 2, 64, None, "none", "none"),
    (1, 4100, 12, 4, 128, 1024, "ragged", "yarn"),
    (1, 8192, 8, 1, 64, 2048, "none", "yarn"),
    (2, 8192, 4, 4, 128, None, "ragged", "none"),
    (1, 8191, 6, 2, 128, 700, "tokens", "none"),
    (1, 16384, 6, 2, 64, 4096, "ragged", "none"),
    (1, 16384, 4, 4, 64, None, "none", "yarn"),  # multi-head, no masks: the five-matmul backward on an H100/H200
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("B,n,hq,hkv,head_dim,window,docs,rope", QKV_CASES,
                         ids=[f"b{b}-n{n}-h{a}/{c}-d{d}-w{w}-{doc}-{r}" for b, n, a, c, d, w, doc, r in QKV_CASES])
def test_flash_attention_qkv_gqa_and_masks_vs_the_pair_and_float32(B, n, hq, hkv, head_dim, window, docs, rope, dtype):
    """The forward, dK and dV bitwise those of qkv_rotary + flash_attention (the same kernels; dK, dV as close as
    sums in another order allow where either call's MQA split adds them atomically, assert_agree_but_for_the_order);
    dQ too where GQA or a mask runs the seven-matmul
    backward (off sm_90), else (the five-matmul one, dQ rotated back from its fp32 accumulator) within the pair's
    error; all within the dtype's error of float32 RoPE + masked SDPA over K/V repeated per group."""
    g = torch.Generator(device="cuda").manual_seed(n + hq * 7 + hkv)
    qkv = torch.randn(B, n, hq + 2 * hkv, head_dim, device="cuda", generator=g).to(dtype).requires_grad_()
    cos, sin = rope_tables(head_dim, n, rope)
    ids = documents(docs, B, n, seed=n)
    do = torch.randn(B, hq, n, head_dim, device="cuda", generator=g).to(dtype)
    o = flash_attention_qkv(qkv, cos, sin, n_kv_head=hkv, window=window, document_ids=ids)
    (grad,) = torch.autograd.grad(o, qkv, do)
    q, k, v = qkv_rotary(qkv, cos, sin, n_kv_head=hkv)
    want = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window=window, document_ids=ids)
    (want_grad,) = torch.autograd.grad(want, qkv, do)
    assert o.shape == (B, hq, n, head_dim) and torch.equal(o, want)
    masks = window is not None or ids is not None
    if HOPPER and (adds_dkdv_atomically(B, hq, hkv, n, head_dim, cut=False, masked=masks)  # either call's split
                   or adds_dkdv_atomically(B, hq, hkv, n, head_dim, cut=not masks, masked=masks)):  # programs add
        # dK, dV in a varying order (group_splits), the other in one program's registers (or split otherwise): sums of
        # the same terms in another order (assert_agree_but_for_the_order)
        eps = torch.finfo(dtype).eps
        assert_agree_but_for_the_order(grad[:, :, hq + hkv:], want_grad[:, :, hq + hkv:], eps)  # dV
        assert_agree_but_for_the_order(grad[:, :, hq:hq + hkv], want_grad[:, :, hq:hq + hkv], eps, rotated=True)  # dK
    else:
        assert torch.equal(grad[:, :, hq:], want_grad[:, :, hq:])  # dK, dV
    masked = hkv != hq or window is not None or ids is not None

    qkv32 = qkv.detach().float().requires_grad_()
    q32, k32, v32 = qkv32.split((hq, hkv, hkv), dim=2)
    q32, k32 = rope64(q32, cos, sin).float(), rope64(k32, cos, sin).float()
    ref = sdpa_reference(q32.transpose(1, 2), k32.transpose(1, 2), v32.transpose(1, 2),
                         visible_mask(n, n, True, window, ids, ids))
    (grad_ref,) = torch.autograd.grad(ref, qkv32, do.float())
    errs = {"o": rel_err(o, ref)}
    for name, part, part_ref in zip("qkv", grad.split((hq, hkv, hkv), 2), grad_ref.split((hq, hkv, hkv), 2)):
        errs[f"d{name}"] = rel_err(part, part_ref)
    assert all(e < TOL[dtype] for e in errs.values()), errs
    if masked and not HOPPER:  # the seven-matmul Triton backward, as for the pair
        assert torch.equal(grad, want_grad)
    else:  # the five-matmul backward (Gluon on sm_90 with or without masks): dQ from its fp32 accumulator
        assert errs["dq"] <= 1.05 * rel_err(want_grad[:, :, :hq], grad_ref[:, :, :hq]) + 1e-6, errs


def test_flash_attention_qkv_gqa_deterministic_and_bitwise_repeatable():
    qkv = torch.randn(2, 8192, 8 + 2 * 2, 128, device="cuda").to(torch.bfloat16).requires_grad_()
    cos, sin = rope_tables(128, 8192, "yarn")
    ids = documents("ragged", 2, 8192, seed=9)
    do = torch.randn(2, 8, 8192, 128, device="cuda").to(torch.bfloat16)
    runs = [torch.autograd.grad(flash_attention_qkv(qkv, cos, sin, n_kv_head=2, window=3000, document_ids=ids,
                                                    deterministic=True), qkv, do)[0] for _ in range(2)]
    assert torch.isfinite(runs[0]).all() and torch.equal(runs[0], runs[1])


def test_flash_attention_qkv_gqa_memory_holds_no_kv_of_query_heads():
    """One K/V head for 16 query heads at 16K tokens, head_dim 128: the forward allocates q (rotated), k, v and o
    (and the LSE), the backward dqkv (and delta; on sm_90 the five-matmul backward's fp32 dQ accumulator; the fp32
    dK, dV that the MQA split's programs add into live in dqkv's query heads until those are written): a K, V, dK or
    dV of 16 heads (a repeat per group, 64 MiB each), a partial dK, dV per split, or a separate fp32 dK, dV (8 MiB
    each) would show in either peak."""
    B, n, hq, hkv, d = 1, 16384, 16, 1, 128
    qkv = torch.randn(B, n, hq + 2 * hkv, d, device="cuda").to(torch.bfloat16).requires_grad_()
    cos, sin = rope_tables(d, n, "none")
    do = torch.randn(B, hq, n, d, device="cuda").to(torch.bfloat16)
    flash_attention_qkv(qkv, cos, sin, n_kv_head=hkv, window=2048).backward(do)  # compiles the kernels first
    heads = B * n * d * 2  # bytes of one head
    slack = 8 << 20  # LSE, delta, TMA descriptors' scratch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = flash_attention_qkv(qkv, cos, sin, n_kv_head=hkv, window=2048)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= (2 * hq + 2 * hkv) * heads + slack  # q, k, v, o
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    (grad,) = torch.autograd.grad(o, qkv, do)
    torch.cuda.synchronize()
    dq_accumulator = 2 * hq * heads if HOPPER else 0  # the five-matmul Gluon backward's fp32 dQ (Hq heads, no more)
    assert torch.cuda.max_memory_allocated() - base <= (hq + 2 * hkv) * heads + dq_accumulator + slack
    assert torch.isfinite(grad).all()


@pytest.mark.skipif(not HOPPER, reason="the five-matmul Gluon backward and its split are written for sm_90")
@pytest.mark.parametrize("n, hq, hkv, head_dim", [(8192, 16, 1, 64), (32768, 16, 1, 64), (8192, 8, 1, 128),
                                                  (8192, 8, 2, 128)])
def test_split_fwd_bwd_takes_no_more_memory_than_mha(n, hq, hkv, head_dim):
    """The goal's memory question for a split backward (one K/V head, or GQA whose groups of four split in one
    launch): the most memory one fwd+bwd allocates above its inputs, its output and its three gradients is no more
    than MHA's at the same query heads (the split's fp32 dK, dV live in dq's memory until dq is written; before,
    2·Hkv·N·D·4 bytes more, 4 MiB at 16 heads of 64 and 8K tokens: 1.13x MHA). The 1 MiB of slack is for small
    allocations that differ between the two paths; the fp32 pair alone is 4 MiB or more."""

    def peak_extra(kv_heads: int) -> int:  # as the mask benchmark measures it (peak_extra_bytes)
        q = torch.randn(1, hq, n, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, kv_heads, n, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        do = torch.randn_like(q)
        torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), do)  # compiles the kernels first
        return peak_extra_bytes(lambda q, k, v: flash_attention(q, k, v, causal=True), q, k, v, do)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert launch.gluon_backward.group_splits(1, hq, hkv, -(-n // 128), sms, n) > 1  # the grid is split
    split, mha = peak_extra(hkv), peak_extra(hq)
    assert split <= mha + (1 << 20), (split / 2**20, mha / 2**20)

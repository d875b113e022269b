"""launch.launch_backward_block, ring attention's per-launch backward, on the CPU: its Triton fallback under Triton's
interpreter against float64, on the buffers as ring_backward lays them out (dq: fp32 rows of q's (B, N, H, D) layout;
dk, dv: fp32 unstack_kv views of a (2, B, N, Hkv, D) accumulator), added into or written; the host side of its Gluon
path with the kernel stubbed by a float64 reference that adds dQ through the 2-D form dq_acc_geometry gives (so a
wrong geometry shows as a wrong dq); and that geometry against the strides of the layouts it takes or refuses. The
Gluon kernel itself runs in tests/test_gpu_ring_backward.py.
"""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from attention_reference import rel_err  # noqa: E402
from block_reference import block_gradients, causal_mask, ring_block_inputs, row_statistics  # noqa: E402
from minigpt.distributed.ring_attention import unstack_kv  # noqa: E402
from minigpt_kernels import launch  # noqa: E402
from minigpt_kernels.dispatch import TileConfig  # noqa: E402

gluon_backward = pytest.importorskip("minigpt_kernels.gluon.backward")  # the geometry and the launcher's names

# (rows, keys, causal) of the ring's launches on a rank's 2c local rows: a block before the rank (2c rows × c keys),
# a block after it (c rows × 2c keys), the local block (causal, 2c × 2c)
C = 16
LAUNCHES = {"before": (slice(0, 2 * C), slice(0, C), False), "after": (slice(C, 2 * C), slice(0, 2 * C), False),
            "local": (slice(0, 2 * C), slice(0, 2 * C), True)}


def ring_buffers(x: dict, rows: slice, keys: slice, accumulate: bool, dkdv_dtype=torch.float32, seed: int = 1):
    """(dq, dk, dv, prefill) as ring_backward holds them: dq the launch's rows of an fp32 tensor in q's layout, dk, dv
    the launch's keys of unstack_kv views of a (2, B, 2c, Hkv, D) accumulator; filled with random values to add to
    (accumulate), else NaN (every element must be written). prefill: clones of the launch's views before the call."""
    q, k = x["q"], x["k"]
    g = torch.Generator(device="cpu").manual_seed(seed)
    dq_all = launch.empty_in_layout_of(q, torch.float32)
    B, Hkv, n, D = k.shape
    kv = torch.empty(2, B, n, Hkv, D, dtype=dkdv_dtype, device=q.device)
    for t in (dq_all, kv):
        t.copy_(torch.randn(t.shape, generator=g) if accumulate else torch.full(t.shape, float("nan")))
    dk_all, dv_all = unstack_kv(kv)
    dq, dk, dv = dq_all[:, :, rows], dk_all[:, :, keys], dv_all[:, :, keys]
    return dq, dk, dv, tuple(t.double().clone() for t in (dq, dk, dv))


def check(got: tuple, prefill: tuple, refs: tuple, accumulate_dq: bool, accumulate_dkdv: bool, tol: float) -> None:
    for name, g, p, r, acc in zip(("dq", "dk", "dv"), got, prefill, refs, (accumulate_dq, accumulate_dkdv,
                                                                           accumulate_dkdv)):
        added = g.double() - p if acc else g.double()
        assert torch.isfinite(added).all(), name
        assert rel_err(added, r) < tol, (name, rel_err(added, r))


def test_the_reference_blocks_sum_to_autograd_of_the_whole_rows():
    """block_gradients over a partition of a row's keys (one causal, one full) with the whole rows' lse and delta:
    the dQ parts sum to autograd's dQ of the whole attention, each part's dK, dV are autograd's for its keys."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, n, D, scale = 2, 4, 2, 12, 8, 0.3
    q, do = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for _ in range(2))
    k1, v1, k2, v2 = (torch.randn(B, Hkv, m, D, generator=g, dtype=torch.float64) for m in (n, n, 7, 7))
    visible = torch.cat((causal_mask(n), torch.ones(n, 7, dtype=torch.bool)), 1)
    lse2, delta = row_statistics(q, [(k1, v1), (k2, v2)], do, scale, visible)
    parts = [block_gradients(q, k1, v1, do, lse2, delta, scale, causal_mask(n)),
             block_gradients(q, k2, v2, do, lse2, delta, scale)]
    from attention_reference import masked_attention
    leaves = [t.clone().requires_grad_() for t in (q, torch.cat((k1, k2), 2), torch.cat((v1, v2), 2))]
    dq, dk, dv = torch.autograd.grad(masked_attention(*leaves, visible, scale)[0], leaves, do)
    assert torch.allclose(parts[0][0] + parts[1][0], dq, atol=1e-10)
    assert torch.allclose(torch.cat((parts[0][1], parts[1][1]), 2), dk, atol=1e-10)
    assert torch.allclose(torch.cat((parts[0][2], parts[1][2]), 2), dv, atol=1e-10)


@pytest.mark.parametrize("launch_kind", list(LAUNCHES))
@pytest.mark.parametrize("hkv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "write"])
def test_the_triton_fallback_adds_or_writes_a_blocks_gradients(launch_kind, hkv, accumulate, monkeypatch):
    """Off the GPU the launcher runs the seven-matmul Triton kernels (launch_backward_dq, then launch_backward_dkdv;
    spies count them, the Gluon launcher is never reached): prefill + the block's float64 gradients when adding,
    exactly them (every element written over NaN) when writing; fp32 under the interpreter."""
    rows, keys, causal = LAUNCHES[launch_kind]
    x = ring_block_inputs(2, 4, hkv, C, 16, torch.float32, "cpu", rows, keys, causal, seed=hkv)
    dq, dk, dv, prefill = ring_buffers(x, rows, keys, accumulate)
    calls = []
    for name in ("launch_backward_dq", "launch_backward_dkdv"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    monkeypatch.setattr(gluon_backward, "launch_dkdv_dq_block", lambda *a, **kw: pytest.fail("the Gluon launcher ran"))
    got = launch.launch_backward_block(x["dob"], x["qb"], x["kb"], x["vb"], x["lseb"], x["deltab"], causal,
                                       x["scale"], dq, dk, dv, accumulate, accumulate)
    assert calls == ["launch_backward_dq", "launch_backward_dkdv"]
    assert all(a is b for a, b in zip(got, (dq, dk, dv)))
    check(got, prefill, x["refs"], accumulate, accumulate, 1e-5)


def test_the_fallback_writes_a_fresh_dk_dv_in_the_inputs_dtype_and_adds_dq():
    """The local block as _local_dkdv has it: dQ added into the fp32 rows, dK, dV written into fp16 buffers in k's
    layout (fp16 inputs under the interpreter)."""
    rows, keys, causal = LAUNCHES["local"]
    x = ring_block_inputs(1, 2, 2, C, 16, torch.float16, "cpu", rows, keys, causal, seed=3)
    dq, _, _, prefill = ring_buffers(x, rows, keys, True)
    dk, dv = launch.empty_in_layout_of(x["kb"]), launch.empty_in_layout_of(x["vb"])
    got = launch.launch_backward_block(x["dob"], x["qb"], x["kb"], x["vb"], x["lseb"], x["deltab"], True, x["scale"],
                                       dq, dk, dv, True, False)
    assert got[1].dtype == torch.float16 and got[2].dtype == torch.float16
    check(got, (prefill[0], None, None), x["refs"], True, False, 3e-3)


def test_bad_buffers_and_a_cfg_off_the_gluon_path_raise():
    rows, keys, causal = LAUNCHES["before"]
    x = ring_block_inputs(1, 2, 2, C, 16, torch.float32, "cpu", rows, keys, causal)
    dq, dk, dv, _ = ring_buffers(x, rows, keys, True)
    args = (x["dob"], x["qb"], x["kb"], x["vb"], x["lseb"], x["deltab"], False, x["scale"])
    with pytest.raises(ValueError, match="fp32"):  # adding needs fp32 buffers
        launch.launch_backward_block(*args, dq.half(), dk, dv, True, True)
    with pytest.raises(ValueError, match="out dk"):
        launch.launch_backward_block(*args, dq, dk[:, :, :-1], dv, True, True)
    with pytest.raises(ValueError, match="block backward's Gluon kernel"):
        launch.launch_backward_block(*args, dq, dk, dv, True, True, cfg=launch.BLOCK_BACKWARD_TILES[64])


# ------------------------------------------------------------------------------------------------
# The Gluon path's host side, its kernel stubbed
# ------------------------------------------------------------------------------------------------
def acc_rows(acc: torch.Tensor, geometry) -> torch.Tensor:
    """The 2-D array the kernel's TMA descriptor sees: rows of `cols` fp32 elements from acc's first element."""
    (rows, cols), _ = geometry
    return torch.as_strided(acc, (rows, cols), (cols, 1), acc.storage_offset())


def stub_kernel(calls: list):
    """launch_dkdv_dq_block as a float64 reference: dQ added through the geometry's 2-D array (row b·rows_b +
    h·rows_h + n, columns h·cols_h ...), dK, dV written or added. The block's mask: causal or none."""
    def kernel(do, q, k, v, lse, stride_lse, delta, stride_delta, dk, dv, dq_acc, acc_geometry, sm_scale, qk_scale,
               block_m, stages, causal, accumulate_dkdv, persistent=False, programs=None):
        calls.append(dict(causal=causal, accumulate_dkdv=accumulate_dkdv, block_m=block_m, stages=stages,
                          persistent=persistent, acc=dq_acc, lse_stride=stride_lse))
        B, H, n_q, D = q.shape
        lse_rows = torch.as_strided(lse, (B * H, n_q), (stride_lse, 1)).view(B, H, n_q)
        delta_rows = torch.as_strided(delta, (B * H, n_q), (stride_delta, 1)).view(B, H, n_q)
        dq, dk_b, dv_b = block_gradients(q, k, v, do, lse_rows, delta_rows, sm_scale,
                                         causal_mask(n_q) if causal else None)
        flat = acc_rows(dq_acc, acc_geometry)
        _, (rows_b, rows_h, cols_h) = acc_geometry
        for b in range(B):
            for h in range(H):
                r, c = b * rows_b + h * rows_h, h * cols_h
                flat[r:r + n_q, c:c + D] += dq[b, h].float()
        for out, grad in ((dk, dk_b), (dv, dv_b)):
            out.copy_(out.double() + grad if accumulate_dkdv else grad)
    return kernel


@pytest.mark.parametrize("launch_kind", list(LAUNCHES))
@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "write"])
@pytest.mark.parametrize("dq_layout", ["ring", "scratch", "bf16"])
def test_the_gluon_path_adds_dq_through_its_2d_form(launch_kind, accumulate, dq_layout, monkeypatch):
    """gluon_block_ready stubbed True, the kernel a float64 reference writing dQ through dq_acc_geometry's 2-D array:
    the ring's dq rows are the accumulator itself (zeroed first when written); a dq whose strides have no 2-D form
    goes through a zeroed fp32 scratch then added (or copied) into it, as does a 16-bit dq written fresh; the kernel
    gets the flags, the lse/delta rows and the tiles (cfg; BLOCK_BACKWARD_TILES by default off the diagonal)."""
    rows, keys, causal = LAUNCHES[launch_kind]
    D = 64
    # GQA off the diagonal; the local block without it, on a persistent schedule (the table's tiles there)
    x = ring_block_inputs(2, 4, 4 if causal else 2, C, D, torch.float32, "cpu", rows, keys, causal, seed=5)
    dq, dk, dv, prefill = ring_buffers(x, rows, keys, accumulate)
    if dq_layout == "scratch":  # batch rows 4 elements further apart than a whole number of (H, D) rows
        B, H, n_q, _ = dq.shape
        base = torch.randn(B * (n_q * H * D + 4), generator=torch.Generator().manual_seed(2))
        dq = torch.as_strided(base, dq.shape, (n_q * H * D + 4, D, H * D, 1))
        assert gluon_backward.dq_acc_geometry(dq) is None
        prefill = (dq.double().clone(), *prefill[1:])
    if dq_layout == "bf16":
        if accumulate:
            pytest.skip("adding needs an fp32 dq")
        dq = torch.full(dq.shape, float("nan"), dtype=torch.bfloat16)
    calls = []
    monkeypatch.setattr(launch, "gluon_block_ready", lambda *a: True)
    monkeypatch.setattr(gluon_backward, "launch_dkdv_dq_block", stub_kernel(calls))
    cfg = TileConfig(64, 128, 4, 3, tma=True, specialized=True, persistent=causal)
    got = launch.launch_backward_block(x["dob"], x["qb"], x["kb"], x["vb"], x["lseb"], x["deltab"], causal,
                                       x["scale"], dq, dk, dv, accumulate, accumulate, cfg=cfg if causal else None)
    assert len(calls) == 1 and calls[0]["causal"] == causal and calls[0]["accumulate_dkdv"] == accumulate
    tiles = cfg if causal else launch.BLOCK_BACKWARD_TILES[D]
    assert (calls[0]["block_m"], calls[0]["stages"], calls[0]["persistent"]) == (64, tiles.num_stages, tiles.persistent)
    assert (calls[0]["acc"] is dq) == (dq_layout == "ring")
    assert calls[0]["lse_stride"] == 2 * C  # the rows of the (B, H, 2c) lse, not a copy
    tol = 1e-2 if dq_layout == "bf16" else 1e-6
    check(got, prefill, x["refs"], accumulate, accumulate, tol)


def test_the_rings_block_backward_runs_on_plain_grids_and_other_callers_keep_the_tables_tiles(monkeypatch):
    """As on an H100/H200 (gluon_block_ready stubbed True, sm_90, the GPU table) at head_dim 64 and 2c = 4K rows, where
    the table's five-matmul row for the local causal block is persistent: _block_backward's launches (rank 0 of two:
    its own block, then rank 1's) reach the Gluon launcher with persistent=False and the row's stages;
    launch_backward_block called as anyone else calls it gets the row's persistent schedule."""
    from minigpt.distributed.ring_attention import _block_backward
    from minigpt.distributed.ring_plan import block_launches
    from minigpt_kernels import dispatch

    monkeypatch.setattr(launch, "gluon_block_ready", lambda *a: True)
    monkeypatch.setattr(launch, "_capability", lambda t: (9, 0))
    monkeypatch.setattr(dispatch, "INTERPRET", False)
    calls = []

    def spy(do, q, k, v, lse, stride_lse, delta, stride_delta, dk, dv, dq_acc, acc_geometry, sm_scale, qk_scale,
            block_m, stages, causal, accumulate_dkdv, persistent=False, programs=None):
        calls.append((causal, stages, persistent))
    monkeypatch.setattr(gluon_backward, "launch_dkdv_dq_block", spy)
    K, c, H, D = 2, 2048, 2, 64
    row = dispatch.plan("bwd", D, 2 * c, torch.bfloat16, True, capability=(9, 0), gluon_inputs=True, path="gluon")
    assert row.tiles.persistent
    q, do = (torch.randn(1, 2 * c, H, D).bfloat16().transpose(1, 2) for _ in range(2))
    k, v = unstack_kv(torch.randn(2, 1, 2 * c, H, D).bfloat16())
    lse, delta = torch.zeros(1, H, 2 * c), torch.zeros(1, H, 2 * c)
    dq = launch.empty_in_layout_of(q, torch.float32).zero_()
    dk, dv = unstack_kv(torch.zeros(2, 1, 2 * c, H, D))
    local, other = block_launches(0, 0, K, c), block_launches(1, 0, K, c)
    for launches in (local, other):
        _block_backward(do, q, k, v, None, None, lse, delta, launches, D ** -0.5, dq, dk, dv)
    assert [l.causal for l in local + other] == [True] + [False] * len(other)
    assert calls == [(True, row.tiles.num_stages, False)] + [(False, 3, False)] * len(other)
    calls.clear()
    launch.launch_backward_block(do, q, k, v, lse, delta, True, D ** -0.5, dq, dk, dv, True, False)
    assert calls == [(True, row.tiles.num_stages, True)]


# ------------------------------------------------------------------------------------------------
# dq_acc_geometry
# ------------------------------------------------------------------------------------------------
def addressed(t: torch.Tensor, geometry) -> torch.Tensor:
    """t read through its 2-D form: element (b, h, n, d) from row b·rows_b + h·rows_h + n, column h·cols_h + d."""
    flat = acc_rows(t, geometry)
    _, (rows_b, rows_h, cols_h) = geometry
    B, H, N, D = t.shape
    return torch.stack([torch.stack([flat[b * rows_b + h * rows_h:][:N, h * cols_h:h * cols_h + D] for h in range(H)])
                        for b in range(B)])


@pytest.mark.parametrize("name", ["heads", "rows", "ring rows", "one query", "one head", "one batch", "padded row"])
def test_the_2d_form_addresses_every_element_where_it_is(name):
    """For each layout the 2-D form reads back every element of the view (and, its last row being the view's, no row
    past it); (B, H, N, D) memory has heads in rows, the model's (B, N, H, D) side by side in a row."""
    B, H, N, D = 2, 3, 8, 64
    base = torch.arange(2 * 4 * 3 * 16 * 72, dtype=torch.float32)
    t = {"heads": lambda: base[:B * H * N * D].view(B, H, N, D),
         "rows": lambda: base[:B * N * H * D].view(B, N, H, D).transpose(1, 2),
         "ring rows": lambda: base[:B * 2 * N * H * D].view(B, 2 * N, H, D).transpose(1, 2)[:, :, N:],
         "one query": lambda: base[:B * H * D].view(B, 1, H, D).transpose(1, 2),
         "one head": lambda: base[:B * N * D].view(B, N, 1, D).transpose(1, 2),
         "one batch": lambda: base[:N * H * D].view(1, N, H, D).transpose(1, 2),
         "padded row": lambda: base[:B * N * H * (D + 8)].view(B, N, H, D + 8)[..., :D].transpose(1, 2)}[name]()
    geometry = gluon_backward.dq_acc_geometry(t)
    assert geometry is not None
    assert torch.equal(addressed(t, geometry), t)
    (rows, cols), (rows_b, rows_h, cols_h) = geometry
    assert t.storage_offset() + (rows - 1) * cols + (H - 1) * cols_h + D <= base.numel()
    if name == "heads":
        assert geometry == ((B * H * N, D), (H * N, N, 0))
    if name == "rows":
        assert geometry == ((B * N, H * D), (N, 0, D))


def test_layouts_without_a_2d_form_or_tma_alignment_have_none():
    B, H, N, D = 2, 3, 8, 64
    base = torch.zeros(4 * B * H * N * D + 64)
    assert gluon_backward.dq_acc_geometry(base[:B * H * N * D].view(B, H, N, D).double()) is None  # not fp32
    assert gluon_backward.dq_acc_geometry(base[1:1 + B * H * N * D].view(B, H, N, D)) is None  # start off 16 bytes
    assert gluon_backward.dq_acc_geometry(torch.as_strided(base, (B, H, N, D), (H * N * D + 4, D, H * D, 1))) is None
    assert gluon_backward.dq_acc_geometry(torch.as_strided(base, (B, H, N, D), (H * N * D, D, H * D + 2, 1))) is None
    assert gluon_backward.dq_acc_geometry(torch.as_strided(base, (B, H, N, D), (H * N * D * 2, D, 2 * D, 1))) is None

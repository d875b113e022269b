"""Every Gluon launcher passes its kernel the arguments the kernel's signature names, on CPU.

The Gluon kernels only run on an H100/H200, where a launch whose arguments no longer match the kernel (one added to
the signature and not to the call) fails or, positional arguments shifting, computes garbage. Here each kernel is
replaced by a stand-in that binds the launch's arguments to the kernel's signature (inspect.Signature.bind: a missing
or unknown argument raises TypeError), so the launchers run through on CPU tensors without launching anything.
"""
from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from minigpt_kernels.device import staged_by_tma  # noqa: E402
from minigpt_kernels.gluon import backward as bwd  # noqa: E402
from minigpt_kernels.gluon import forward as fwd  # noqa: E402

LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg"}  # Triton's, not the kernel's parameters


class BindingKernel:
    """Stands in for a @gluon.jit kernel: `kernel[grid](*args, **kwargs)` binds the arguments to the kernel's
    signature and records them by name."""

    def __init__(self, kernel):
        self.signature = inspect.signature(kernel.fn)
        self.calls: list[dict] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            bound = self.signature.bind(*args, **{k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
            self.calls.append(dict(bound.arguments, grid=grid))
        return launch


@pytest.fixture
def kernels(monkeypatch):
    """The three Gluon kernels replaced by BindingKernels; a GPU of 4 SMs for the persistent launchers."""
    stand_ins = {"fwd": BindingKernel(fwd.pingpong_fwd_kernel), "dkdvdq": BindingKernel(bwd.dkdvdq_kernel),
                 "dq": BindingKernel(bwd.dq_kernel)}
    monkeypatch.setattr(fwd, "pingpong_fwd_kernel", stand_ins["fwd"])
    monkeypatch.setattr(bwd, "dkdvdq_kernel", stand_ins["dkdvdq"])
    monkeypatch.setattr(bwd, "dq_kernel", stand_ins["dq"])
    monkeypatch.setattr(fwd, "sm_count", lambda device: 4)
    monkeypatch.setattr(bwd, "sm_count", lambda device: 4)
    return stand_ins


def _qkv(B=2, H=4, Hkv=4, N=300, D=64):
    q = torch.randn(B, H, N, D)
    k, v = torch.randn(B, Hkv, N, D), torch.randn(B, Hkv, N, D)
    return q, k, v


def test_forward_launchers_bind_to_the_kernel(kernels):
    q, k, v = _qkv()
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    ids = torch.arange(q.shape[2]).div(70, rounding_mode="floor").int().expand(q.shape[0], -1).contiguous()
    fwd.launch_forward_pingpong(q, k, v, o, lse, 0.2, 2, 128, 2)
    fwd.launch_forward_persistent(q, k, v, o, lse, 0.2, 2, 128, 2)
    fwd.launch_forward_masked(q, k[:, :2], v[:, :2], o, lse, 0.2, 2, 128, 2, 100, None)
    fwd.launch_forward_masked(q, k, v, o, lse, 0.2, 2, 128, 2, None, ids)
    calls = kernels["fwd"].calls
    assert len(calls) == 4
    assert all(c["H"] == 4 and c["N"] == 300 for c in calls)
    assert calls[2]["group"] == 2 and calls[2]["GQA"] and calls[2]["WINDOWED"] and calls[3]["DOCS"]


@pytest.mark.parametrize("D, listed", [(64, True), (128, True), (128, False)])
def test_documents_take_their_items_from_a_zeroed_queue(kernels, D, listed, monkeypatch):
    """With document ids and enough items, the masked forward and backward (at the head dims of
    schedule.DOCUMENTS_QUEUED_BACKWARD_HEAD_DIMS, both) run one program per SM (here 4), which take the plain grid's
    items (the forward: every query tile, each head's last ones first; the backward: every key block, each head's
    first ones first) from a work queue zeroed for the launch: its counter and a pair of ticket slots per program;
    K and V double-buffered at head_dim 64 alone. persistent=False keeps the plain grid; a backward at a head dim
    left out of the list (here 128 when not `listed`) keeps it too."""
    if not listed:
        monkeypatch.setattr(bwd, "DOCUMENTS_QUEUED_BACKWARD_HEAD_DIMS", (64,))
    q, k, v = _qkv(B=2, H=4, N=1000, D=D)
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    ids = torch.arange(1000).div(70, rounding_mode="floor").int().expand(2, -1).contiguous()
    n_qtiles = -(-1000 // 128)
    fwd.launch_forward_masked(q, k, v, o, lse, 0.2, 2, 128, 2, None, ids)
    call = kernels["fwd"].calls[-1]
    assert call["QUEUE"] and call["grid"] == (4,), call["grid"]
    assert call["WORK_START"].tolist() == [0] * (1 + 2 * 4)
    assert call["WORK"].tolist() == [bh * n_qtiles + t for bh in range(8) for t in reversed(range(n_qtiles))]
    fwd.launch_forward_masked(q, k, v, o, lse, 0.2, 2, 128, 2, None, ids, persistent=False)
    call = kernels["fwd"].calls[-1]
    assert not call["QUEUE"] and not call["PERSISTENT"] and call["grid"] == (8 * n_qtiles,)

    do, delta = torch.randn_like(q), torch.randn(q.shape[:3])
    dk, dv, dq_acc = torch.empty_like(k), torch.empty_like(v), torch.zeros(q.shape)
    n_kblocks = -(-1000 // 128)
    bwd.launch_dkdv_dq_masked(do, q, k, v, lse, 1000, delta, 1000, dk, dv, dq_acc, 0.125, 0.2, 64, 2, None, ids)
    call = kernels["dkdvdq"].calls[-1]
    if D in bwd.DOCUMENTS_QUEUED_BACKWARD_HEAD_DIMS:
        assert call["QUEUE"] and call["grid"] == (4,) and call["WORK_START"].tolist() == [0] * (1 + 2 * 4)
        assert call["WORK"].tolist() == [bh * n_kblocks + kb for bh in range(8) for kb in range(n_kblocks)]
        assert call["PERSISTENT"] and call["KV_BUFS"] == (2 if D == 64 else 1)
    else:
        assert not call["QUEUE"] and not call["PERSISTENT"] and call["grid"] == (8 * n_kblocks,)


def test_backward_launchers_bind_to_their_kernels(kernels):
    q, k, v = _qkv(D=128)
    B, H, N, D = q.shape
    do = torch.randn_like(q)
    lse, delta = torch.zeros(B, H, 304), torch.zeros(B, H, 304)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    acc = torch.zeros(B, H, N, D)
    args = (do, q, k, v, lse, 304, delta, 304, dk, dv, acc, 0.1, 0.14, 64, 2)
    bwd.launch_dkdv_dq(*args)
    bwd.launch_dkdv_dq_persistent(*args)
    bwd.launch_dkdv_dq_masked(*args, 200, None)
    bwd.launch_dkdv_dq_masked(do[:1], q[:1], k[:1, :1], v[:1, :1], lse[:1], 304, delta[:1], 304, dk[:1, :1],
                              dv[:1, :1], acc[:1], 0.1, 0.14, 64, 2, None, None)  # one K/V head: the MQA split
    bwd.launch_dkdv_dq_block(do, q[:, :, :256], k[:, :, :256], v[:, :, :256], lse, 304, delta, 304, dk[:, :, :256],
                             dv[:, :, :256], acc, ((B * H * 256, D), (H * 256, 256, 0)), 0.1, 0.14, 64, 2,
                             causal=False, accumulate_dkdv=False)
    bwd.launch_dq(do, q, k, v, torch.empty_like(q), lse, 304, delta, 304, torch.empty_like(q), 0.1, 0.14, 64, 2)
    calls = kernels["dkdvdq"].calls
    assert len(calls) == 5 and len(kernels["dq"].calls) == 1
    assert all(c["H"] == H for c in calls)
    split = calls[3]  # one K/V head, 3 key blocks for 4 SMs: split in two (group_splits), both reading the one head
    assert split["kv_splits"] == 2 and split["K"].shape[1] == 1 and split["group"] == H // 2
    assert split["ACCUMULATE_DKDV"] == bwd.DKDV_ATOMIC_ADD.value and split["DK"].dtype == torch.float32
    assert kernels["dq"].calls[0]["N"] == N and kernels["dq"].calls[0]["H"] == H


def test_dk_dv_leave_by_tma_only_where_the_kernel_can_stage_them(kernels):
    """DKDV_TMA (dK, dV staged in shared memory and copied out by TMA) at head_dim 64 for fresh 2-byte, TMA-aligned
    outputs; stores from registers for the MQA split's fp32 sums, fp32 or misaligned outputs, and head_dim 128."""
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(D=64))
    B, H, N, D = q.shape
    do = torch.randn_like(q)
    lse, delta = torch.zeros(B, H, 304), torch.zeros(B, H, 304)
    acc = torch.zeros(B, H, N, D)

    def launch(dk, dv, kv_heads=H):
        bwd.launch_dkdv_dq_masked(do, q, k[:, :kv_heads], v[:, :kv_heads], lse, 304, delta, 304, dk, dv, acc, 0.1,
                                  0.14, 64, 2, 128, None)
        return kernels["dkdvdq"].calls[-1]["DKDV_TMA"]

    assert launch(torch.empty_like(k), torch.empty_like(v))
    assert not launch(torch.empty_like(k)[:, :1], torch.empty_like(v)[:, :1], kv_heads=1)  # MQA split: fp32 sums
    assert not launch(torch.empty_like(k, dtype=torch.float32), torch.empty_like(v, dtype=torch.float32))
    shifted = torch.empty(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape)  # a base 2 bytes off 16-byte alignment
    assert not launch(shifted, torch.empty_like(v))
    assert staged_by_tma(64, k, v, accumulate=False) and not staged_by_tma(64, k, v, accumulate=True)
    assert not staged_by_tma(128, k, v, accumulate=False)


def test_o_leaves_by_tma_only_where_the_forward_can_stage_it(kernels):
    """O_TMA (O staged in shared memory and copied out by TMA) at head_dim 64 for a fresh 2-byte, TMA-aligned O;
    stores from registers for the ring's fp32 continuation, a misaligned O and head_dim 128."""
    q, k, v = (t.to(torch.bfloat16) for t in _qkv())
    lse = torch.empty(q.shape[:3])

    def launch(o, accumulate=False):
        fwd.launch_forward_pingpong(q, k, v, o, lse, 0.2, 2, 128, 2, causal=not accumulate, accumulate=accumulate)
        return kernels["fwd"].calls[-1]["O_TMA"]

    assert launch(torch.empty_like(q))
    assert not launch(torch.empty_like(q, dtype=torch.float32), accumulate=True)  # the ring's running fp32 o
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)  # a base 2 bytes off 16-byte alignment
    assert not launch(shifted)
    assert staged_by_tma(64, q, accumulate=False) and not staged_by_tma(128, q, accumulate=False)


def test_short_gqa_grids_of_small_groups_launch_one_kv_head_at_a_time():
    """The five-matmul backward's heads per launch: one K/V head's group where a one-launch grid of (batch, K/V head,
    key block) items would leave SMs idle (GQA 4:2 at 8K tokens: 128 items for 132 SMs) and the group is too small
    to hold its fp32 dK, dV in dq's memory (fewer than four query heads), so that each launch is split over programs
    (group_splits) with a dQ accumulator of the group's heads; groups of four or more keep one launch (split in it);
    otherwise as many heads as the accumulator's budget holds, in whole groups."""
    from minigpt_kernels.launch import FUSED_DQ_ACC_BYTES, fused_heads_per_launch

    assert fused_heads_per_launch(1, 4, 2, 8192, 128, 132) == 2  # 128 items < 132 SMs, groups of 2
    assert fused_heads_per_launch(1, 6, 2, 8192, 64, 132) == 3  # groups of 3
    assert fused_heads_per_launch(1, 8, 2, 8192, 128, 132) == 8  # groups of 4: one launch, split in it
    assert fused_heads_per_launch(1, 16, 4, 8192, 64, 132) == 16  # 256 items: one launch, as before
    assert fused_heads_per_launch(2, 4, 2, 8192, 128, 132) == 4  # batch 2: 256 items
    assert fused_heads_per_launch(1, 4, 2, 32768, 128, 132) == 4  # 512 items
    assert fused_heads_per_launch(1, 8, 8, 8192, 128, 132) == 8  # MHA
    assert fused_heads_per_launch(1, 16, 1, 8192, 64, 132) == 16  # MQA: one launch, split in it (group_splits)
    assert fused_heads_per_launch(4, 4, 2, 1024, 128, 132) == 4  # 64 items, but short rows: one launch
    assert fused_heads_per_launch(1, 4, 2, 8192, 128, 132, cut_short_gqa=False) == 4  # masks, fp32 dQ: one launch
    n = FUSED_DQ_ACC_BYTES // (2 * 128 * 4)  # the accumulator's budget holds 2 heads of n rows ...
    assert fused_heads_per_launch(1, 32, 8, n, 128, 16) == 4  # ... rounded up to a whole group of 4


def test_a_split_into_single_query_heads_launches_longest_first(kernels, monkeypatch):
    """An MQA split whose programs each take one query head (splits = the group: 4 heads at 8K tokens on 132 SMs, as
    one K/V head's launch of GQA 8:2 makes it) gets the plain grid's best order, the first key blocks (most query
    tiles) of every virtual head first, as GQA's grid does; head after head, the modelled finish was 194 tile-units
    against 130."""
    monkeypatch.setattr(bwd, "sm_count", lambda device: 132)
    q, k, v = _qkv(B=1, H=4, Hkv=1, N=8192, D=128)
    B, H, N, D = q.shape
    do = torch.randn_like(q)
    lse, delta = torch.zeros(B, H, N), torch.zeros(B, H, N)
    bwd.launch_dkdv_dq_masked(do, q, k, v, lse, N, delta, N, torch.empty_like(k), torch.empty_like(v),
                              torch.zeros(B, H, N, D), 0.1, 0.14, 64, 2, None, None)
    call = kernels["dkdvdq"].calls[-1]
    assert call["kv_splits"] == 4 and call["group"] == 1  # 64 key blocks: 4 programs each, a query head each
    items = call["WORK"].tolist()
    n_kblocks = N // 128
    assert sorted(items) == list(range(4 * n_kblocks))
    assert [i % n_kblocks for i in items[:4]] == [0, 0, 0, 0]  # every head's key block 0 first


def adding_dkdvdq(monkeypatch, stand_in) -> None:
    """Replace the dK/dV/dQ kernel by one that records its call (stand_in) and adds 1 to every dK, 2 to every dV and 3
    to every dQ it is given: a split's programs all add into one fp32 dK, dV, so the call's dk, dv come back exactly
    1 and 2 once rounded out of them."""

    def add(*args, **kw):
        stand_in[None](*args, **kw)
        call = stand_in.calls[-1]
        call["DK"].add_(1.0)
        call["DV"].add_(2.0)
        call["DQ_ACC"].add_(3.0)

    class Adding:
        def __getitem__(self, grid):
            return add

    monkeypatch.setattr(bwd, "dkdvdq_kernel", Adding())


@pytest.mark.parametrize("layout", ["heads", "tokens"])
def test_an_mqa_split_adds_dk_dv_inside_dq_before_dq_is_written(kernels, monkeypatch, layout):
    """MQA's split (group_splits) sums dK, dV in fp32 over its programs; launch_backward_fused gives it two fp32 views
    inside dq's memory (plain (B, H, N, D), or the model's (B, N, H, D) rows), which dq's copy from the accumulator
    overwrites only after dK, dV were rounded out of them, so the call takes no more memory than MHA's. The kernel's
    stand-in adds 1 to every dK, 2 to every dV and 3 to every dQ: dq, dk, dv must come back exactly that, from a dq
    that held NaN before (the scratch must be zeroed)."""
    from minigpt_kernels import dispatch, launch

    stand_in = kernels["dkdvdq"]
    adding_dkdvdq(monkeypatch, stand_in)
    monkeypatch.setattr(bwd, "sm_count", lambda device: 8)  # 6 items, 8 SMs: split (group_splits)
    monkeypatch.setattr(launch, "specialized_ready", lambda *a, **kw: True)  # as if on an H100/H200
    B, H, N, D = 2, 8, 300, 64
    shape = (B, H, N, D) if layout == "heads" else (B, N, H, D)
    q, do, o = (torch.randn(shape, dtype=torch.float16) for _ in range(3))
    if layout == "tokens":
        q, do, o = (t.transpose(1, 2) for t in (q, do, o))
    k, v = torch.randn(B, 1, N, D, dtype=torch.float16), torch.randn(B, 1, N, D, dtype=torch.float16)
    lse = torch.zeros(B, H, N)
    cfg = dispatch.TileConfig(64, 128, 4, 2, tma=True, specialized=True)
    out = (torch.full(shape, float("nan"), dtype=torch.float16), torch.empty_like(k), torch.empty_like(v))
    if layout == "tokens":
        out = (out[0].transpose(1, 2), *out[1:])
    dq, dk, dv = launch.launch_backward_fused(do, q, k, v, o, lse, 0.1, cfg, out=out)
    call = stand_in.calls[-1]
    assert call["kv_splits"] > 1 and call["ACCUMULATE_DKDV"] == bwd.DKDV_ATOMIC_ADD.value
    inside = dq.untyped_storage().data_ptr(), dq.untyped_storage().data_ptr() + dq.untyped_storage().nbytes()
    for t in (call["DK"], call["DV"]):
        assert t.dtype == torch.float32 and inside[0] <= t.data_ptr() < inside[1]
    assert call["DK"].data_ptr() != call["DV"].data_ptr()
    assert dq.stride() == q.stride()
    assert torch.equal(dk, torch.ones_like(dk)) and torch.equal(dv, torch.full_like(dv, 2.0))
    assert torch.equal(dq, torch.full_like(dq, 3.0))


def test_fp32_pairs_within_a_gradient_do_not_overlap():
    """_fp32_pair_within's two views cover disjoint bytes of the first four heads, in either layout, also of a head
    slice; it declines fewer than four heads, 4-byte gradients, other layouts, odd 2-byte offsets and batches that
    share memory."""
    from minigpt_kernels.launch import _fp32_pair_within

    B, H, N, D = 2, 5, 7, 16
    plain, rows = torch.zeros(B, H, N, D, dtype=torch.bfloat16), torch.zeros(B, N, H, D, dtype=torch.bfloat16)
    for t in (plain, rows.transpose(1, 2)):
        dk, dv = _fp32_pair_within(t)
        assert dk.shape == dv.shape == (B, 1, N, D) and dk.dtype == torch.float32
        dk.fill_(1.0)
        dv.fill_(2.0)
        assert torch.equal(dk, torch.ones_like(dk)) and torch.equal(dv, torch.full_like(dv, 2.0))
        assert (t[:, 4:] == 0).all() and (t[:, :4] != 0).any()  # only the first four heads' memory
    wide = torch.zeros(B, H + 2, N, D, dtype=torch.bfloat16)
    dk, dv = _fp32_pair_within(wide[:, 2:])  # a head slice: its own first four heads
    dk.fill_(1.0)
    dv.fill_(2.0)
    assert (wide[:, :2] == 0).all() and (wide[:, 6:] == 0).all() and (wide[:, 2:6] != 0).any()
    assert _fp32_pair_within(torch.zeros(B, 3, N, D, dtype=torch.bfloat16)) is None
    assert _fp32_pair_within(torch.zeros(B, H, N, D)) is None
    assert _fp32_pair_within(torch.zeros(B, H, D, N, dtype=torch.bfloat16).transpose(2, 3)) is None
    assert _fp32_pair_within(torch.zeros(H, B, N, D, dtype=torch.bfloat16).transpose(0, 1)) is None  # (H, B, ...)
    odd = torch.zeros(B * H * N * D + 1, dtype=torch.bfloat16)[1:].view(B, H, N, D)
    assert _fp32_pair_within(odd) is None  # fp32 views would start mid-element
    assert _fp32_pair_within(torch.zeros(1, H, N, D, dtype=torch.bfloat16).expand(B, H, N, D)) is None


@pytest.mark.parametrize("hq, hkv, launches", [(8, 2, 1), (4, 2, 2)])
def test_a_short_gqa_grid_splits_in_one_launch_where_dq_has_room(kernels, monkeypatch, hq, hkv, launches):
    """GQA without masks over a grid shorter than the GPU (8:2 at 8K tokens: 128 items for 132 SMs): with four query
    heads per K/V head or more, one launch splitting each group (kv_splits) whose fp32 dK, dV lie in dq's memory;
    with fewer (4:2), one launch per K/V head, each split. The stand-in adds 1 to dK, 2 to dV, 3 to dQ."""
    from minigpt_kernels import dispatch, launch

    stand_in = kernels["dkdvdq"]
    adding_dkdvdq(monkeypatch, stand_in)
    monkeypatch.setattr(bwd, "sm_count", lambda device: 132)
    monkeypatch.setattr(launch.gluon_backward, "sm_count", lambda device: 132)
    monkeypatch.setattr(launch, "specialized_ready", lambda *a, **kw: True)  # as if on an H100/H200
    B, N, D = 1, 8192, 64
    q, do, o = (torch.randn(B, hq, N, D, dtype=torch.float16) for _ in range(3))
    k, v = torch.randn(B, hkv, N, D, dtype=torch.float16), torch.randn(B, hkv, N, D, dtype=torch.float16)
    out = (torch.full_like(q, float("nan")), torch.empty_like(k), torch.empty_like(v))
    cfg = dispatch.TileConfig(64, 128, 4, 2, tma=True, specialized=True)
    dq, dk, dv = launch.launch_backward_fused(do, q, k, v, o, torch.zeros(B, hq, N), 0.1, cfg, out=out)
    calls = stand_in.calls
    assert len(calls) == launches
    if launches == 1:
        call = calls[0]
        assert call["K"].shape[1] == hkv and call["kv_splits"] > 1 and call["group"] * call["kv_splits"] == hq // hkv
        inside = dq.untyped_storage().data_ptr(), dq.untyped_storage().data_ptr() + dq.untyped_storage().nbytes()
        assert all(inside[0] <= t.data_ptr() < inside[1] for t in (call["DK"], call["DV"]))
    else:
        assert all(c["K"].shape[1] == 1 and c["kv_splits"] > 1 for c in calls)
    assert torch.equal(dk, torch.ones_like(dk)) and torch.equal(dv, torch.full_like(dv, 2.0))
    assert torch.equal(dq, torch.full_like(dq, 3.0))

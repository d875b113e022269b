"""GPU-only: launch.launch_backward_block, ring attention's per-launch backward (python -m pytest -m gpu
tests/test_gpu_ring_backward.py). On sm_90 an unmasked launch runs the five-matmul Gluon kernel (gluon/backward.py,
launch_dkdv_dq_block) once: the blocks off the diagonal without the causal mask and with N_Q != N_K (FULL), dK, dV
added into the travelling fp32 accumulator (ACCUMULATE_DKDV) or written (into fp32, or into the inputs' dtype: the
direct hop home), dQ reduce-added straight into the caller's fp32 rows; the local block causal and fresh. Checked on
the buffers as ring_backward lays them out (dq: fp32 rows of q's (B, N, H, D) layout; dk, dv: views of a
(2, B, N, Hkv, D) accumulator, fp32 or in the inputs' dtype, or for the local block k's dtype in k's layout) against float64 with the whole rows' lse and delta (tests/block_reference.py), against the Triton kernels'
error, and that the Gluon launcher ran (a spy) or, where the inputs do not qualify, the Triton kernels did.
Elsewhere than sm_90 the same tests check the Triton fallback. The CPU twin is tests/test_backward_block.py.
"""
import importlib

import pytest
import torch

from attention_reference import rel_err
from block_reference import ring_block_inputs
from minigpt.distributed.ring_attention import unstack_kv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
launch = importlib.import_module("minigpt_kernels.launch")
dispatch = importlib.import_module("minigpt_kernels.dispatch")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) \
    and launch.gluon_backward is not None
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative error against float64: 8 and 11 mantissa bits
KIND = {"2c_x_c": lambda c: (slice(0, 2 * c), slice(0, c)),  # a block before this rank: all rows, its first chunk
        "c_x_2c": lambda c: (slice(c, 2 * c), slice(0, 2 * c))}  # a block after it: the late rows, both chunks


def ring_buffers(x: dict, rows: slice, keys: slice, fill: str, dq_layout: str = "ring",
                 dkdv_dtype: torch.dtype = torch.float32):
    """(dq, dk, dv) as ring_backward holds them: the launch's rows of an fp32 dq in q's layout and the launch's keys of
    unstack_kv views of a (2, B, 2c, Hkv, D) accumulator (fp32; in the inputs' dtype where two ranks write the share
    straight into the message home); filled with NaN ("nan": every element must be written) or random values of the
    gradients' size ("random": to add to). dq_layout "scratch": a dq whose strides have no 2-D form for TMA (rows
    H·D + 1 elements apart: not 16-byte aligned), which takes the scratch path."""
    q, k = x["q"], x["k"]
    B, Hkv, n, D = k.shape
    dq_all = launch.empty_in_layout_of(q, torch.float32)
    kv = torch.empty(2, B, n, Hkv, D, dtype=dkdv_dtype, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(7)
    dq_rows = dq_all[:, :, rows]
    if dq_layout == "scratch":
        Bq, H, n_q, _ = dq_rows.shape
        base = torch.empty(Bq * n_q * (H * D + 1), dtype=torch.float32, device="cuda")
        dq_rows = torch.as_strided(base, dq_rows.shape, (n_q * (H * D + 1), D, H * D + 1, 1))
        assert launch.gluon_backward is None or launch.gluon_backward.dq_acc_geometry(dq_rows) is None
    dk_all, dv_all = unstack_kv(kv)
    out = (dq_rows, dk_all[:, :, keys], dv_all[:, :, keys])
    for t, ref in zip(out, x["refs"]):
        if fill == "nan":
            t.fill_(float("nan"))
        else:
            t.copy_(torch.randn(t.shape, device="cuda", generator=g) * ref.float().std())
    return out


def spies(monkeypatch) -> dict:
    """Count the launcher's kernels: the Gluon block launcher (with the dQ accumulator it was given) and the Triton
    pair."""
    seen = {"gluon": [], "triton": []}
    if launch.gluon_backward is not None:
        real = launch.gluon_backward.launch_dkdv_dq_block

        def gluon(*a, **kw):
            seen["gluon"].append(a[10])  # dq_acc
            return real(*a, **kw)
        monkeypatch.setattr(launch.gluon_backward, "launch_dkdv_dq_block", gluon)
    for name in ("launch_backward_dq", "launch_backward_dkdv"):
        real_t = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, real_t=real_t, name=name, **kw:
                            seen["triton"].append(name) or real_t(*a, **kw))
    return seen


def run_block(x: dict, causal: bool, bufs: tuple, accumulate_dq: bool, accumulate_dkdv: bool, **kw):
    return launch.launch_backward_block(x["dob"], x["qb"], x["kb"], x["vb"], x["lseb"], x["deltab"], causal,
                                        x["scale"], *bufs, accumulate_dq, accumulate_dkdv, **kw)


def errors(got: tuple, before: tuple | None, refs: tuple) -> dict:
    """Relative errors of the gradients added (got − before; before None: written) against float64."""
    out = {}
    for name, g, b, r in zip(("dq", "dk", "dv"), got, before or (None,) * 3, refs):
        added = g.double() - b if b is not None else g.double()
        assert torch.isfinite(added).all(), name
        out[name] = rel_err(added, r)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("c", [1024, 1280])
@pytest.mark.parametrize("kind", list(KIND))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_a_block_off_the_diagonal_adds_into_the_ring_buffers(kind, c, head_dim, dtype, heads, monkeypatch):
    """A block off the diagonal (non-causal, 2c rows × c keys or c rows × 2c keys), batch 2: written into NaN buffers,
    the block's float64 gradients; added into random ones (dq, dk, dv all fp32), those plus the gradients; written
    into NaN dk, dv in the inputs' dtype (two ranks' direct hop home), the same gradients rounded. On sm_90 one Gluon
    launch per call, dQ added straight into the caller's dq (no scratch), no Triton kernel; its errors within the
    dtype's and within 1.25× (+1e-5) of the Triton kernels' (MINIGPT_FLASH_PATH=triton) on the same call."""
    rows, keys = KIND[kind](c)
    x = ring_block_inputs(2, heads[0], heads[1], c, head_dim, dtype, "cuda", rows, keys, False, seed=c + head_dim)
    seen = spies(monkeypatch)
    fresh = ring_buffers(x, rows, keys, "nan")
    got = run_block(x, False, fresh, False, False)
    errs = errors(got, None, x["refs"])
    added = ring_buffers(x, rows, keys, "random")
    before = tuple(t.double().clone() for t in added)
    got = run_block(x, False, added, True, True)
    errs_added = errors(got, before, x["refs"])
    low = ring_buffers(x, rows, keys, "nan", dkdv_dtype=dtype)
    got = run_block(x, False, low, False, False)
    assert got[1].dtype == got[2].dtype == dtype
    errs_low = errors(got, None, x["refs"])
    if HOPPER:
        assert len(seen["gluon"]) == 3 and not seen["triton"], seen
        assert seen["gluon"][0].data_ptr() == fresh[0].data_ptr() and seen["gluon"][1].data_ptr() == added[0].data_ptr()
    else:
        assert not seen["gluon"] and len(seen["triton"]) == 6
    monkeypatch.setenv(dispatch.PATH_ENV, "triton")
    triton_errs = errors(run_block(x, False, ring_buffers(x, rows, keys, "nan"), False, False), None, x["refs"])
    triton_low = errors(run_block(x, False, ring_buffers(x, rows, keys, "nan", dkdv_dtype=dtype), False, False), None,
                        x["refs"])
    for name in ("dq", "dk", "dv"):
        for e, bound in ((errs[name], triton_errs[name]), (errs_added[name], triton_errs[name]),
                         (errs_low[name], triton_low[name])):
            assert e < TOL[dtype] and e <= 1.25 * bound + 1e-5, (name, errs, errs_added, errs_low, triton_errs,
                                                                 triton_low)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("c", [1024, 1280])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_the_local_block_writes_dq_and_a_fresh_dk_dv(c, head_dim, dtype, heads, monkeypatch):
    """The ring's local block: causal, 2c rows against their own 2c keys, fresh: dQ written into the fp32 rows of q's
    layout, dK, dV into k's dtype and layout (as _local_dkdv returns them), all over NaN; one Gluon launch on sm_90
    (the table's five-matmul tiles for 2c tokens, persistent where it says; with GQA the plain grid)."""
    rows = keys = slice(0, 2 * c)
    x = ring_block_inputs(2, heads[0], heads[1], c, head_dim, dtype, "cuda", rows, keys, True, seed=c + 1)
    seen = spies(monkeypatch)
    dq = launch.empty_in_layout_of(x["q"], torch.float32).fill_(float("nan"))
    dk, dv = (launch.empty_in_layout_of(t).fill_(float("nan")) for t in (x["kb"], x["vb"]))
    got = run_block(x, True, (dq, dk, dv), False, False)
    assert got[1].dtype == dtype and got[1].stride() == dk.stride()
    errs = errors(got, None, x["refs"])
    assert len(seen["gluon"]) == (1 if HOPPER else 0) and len(seen["triton"]) == (0 if HOPPER else 2), seen
    monkeypatch.setenv(dispatch.PATH_ENV, "triton")
    dq_t = launch.empty_in_layout_of(x["q"], torch.float32)
    dk_t, dv_t = launch.empty_in_layout_of(x["kb"]), launch.empty_in_layout_of(x["vb"])
    triton_errs = errors(run_block(x, True, (dq_t, dk_t, dv_t), False, False), None, x["refs"])
    for name in ("dq", "dk", "dv"):
        assert errs[name] < TOL[dtype] and errs[name] <= 1.25 * triton_errs[name] + 1e-5, (name, errs, triton_errs)


@pytest.mark.skipif(not HOPPER, reason="the five-matmul Gluon backward is written for sm_90 (wgmma)")
@pytest.mark.parametrize("head_dim,n", [(64, 2048), (64, 4096), (128, 2560)])
def test_a_lone_causal_block_is_the_five_matmul_backward(head_dim, n):
    """A causal block whose rows see nothing else (lse, delta its own): dK, dV bitwise those of launch_backward_fused
    (the same kernel, tiles and delta), dQ (fp32 here, added in place) within the fused backward's rounding of its
    own fp32 accumulator."""
    g = torch.Generator(device="cuda").manual_seed(n)
    qkv = torch.randn(2, n, 3, 4, head_dim, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    do = torch.randn(q.shape, device="cuda", generator=g).to(torch.bfloat16)
    scale = head_dim ** -0.5
    o, lse = launch.launch_forward(q, k, v, True, scale)
    fused = launch.launch_backward_fused(do, q, k, v, o, lse, scale)
    do_c, delta = launch.launch_backward_delta(do, o, lse)
    dq = launch.empty_in_layout_of(q, torch.float32)
    dk, dv = launch.empty_in_layout_of(k), launch.empty_in_layout_of(v)
    launch.launch_backward_block(do_c, q, k, v, lse, delta, True, scale, dq, dk, dv, False, False)
    assert torch.equal(dk, fused[1]) and torch.equal(dv, fused[2])
    assert (dq - fused[0].float()).abs().max().item() <= 1e-2 * fused[0].float().abs().max().item()


@pytest.mark.skipif(not HOPPER, reason="the five-matmul Gluon backward is written for sm_90 (wgmma)")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_other_tiles_and_a_persistent_schedule_give_the_same_dk_dv(head_dim, monkeypatch):
    """The non-causal block on other tiles (cfg): 2 and 3 stages and a persistent schedule on 3 programs (many
    items each: the ring, hand-over and K/V counters run on across items, every item from query 0): dK, dV bitwise
    the plain grid's (the same arithmetic per key block), dQ within its summation order."""
    c = 1024
    rows, keys = KIND["2c_x_c"](c)
    x = ring_block_inputs(2, 3, 3, c, head_dim, torch.bfloat16, "cuda", rows, keys, False, seed=head_dim)
    base = run_block(x, False, ring_buffers(x, rows, keys, "nan"), False, False)
    monkeypatch.setattr(launch.gluon_backward, "sm_count", lambda device: 3)
    for stages, persistent in ((2, False), (3, False), (2, True), (3, True)):
        cfg = dispatch.TileConfig(64, 128, 4, stages, tma=True, specialized=True, persistent=persistent)
        got = run_block(x, False, ring_buffers(x, rows, keys, "nan"), False, False, cfg=cfg)
        assert torch.equal(got[1], base[1]) and torch.equal(got[2], base[2]), cfg
        assert (got[0] - base[0]).abs().max().item() <= 1e-3 * base[0].abs().max().item(), cfg


@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "write"])
@pytest.mark.parametrize("case", ["scratch dq", "bf16 dq", "odd keys", "odd rows", "fp32 inputs", "deterministic",
                                  "triton path", "window", "unaligned q"])
def test_what_the_gluon_kernel_does_not_take_is_still_right(case, accumulate, monkeypatch):
    """Where the Gluon kernel does not take the call directly: a dq without a 2-D form for TMA (a zeroed scratch, then
    added into it) and a 16-bit dq written fresh (the scratch, copied) still run it; N_K not a multiple of 128
    (1000 keys), N_Q not a multiple of 64 (rows 1000), fp32 inputs, deterministic algorithms, MINIGPT_FLASH_PATH=
    triton, a window and a q whose rows are not 16-byte aligned run the Triton kernels. All against float64."""
    if case == "bf16 dq" and accumulate:
        pytest.skip("adding needs an fp32 dq")
    c, dtype, D = 1024, torch.bfloat16, 64
    rows, keys = KIND["2c_x_c"](c)
    if case == "odd keys":
        keys = slice(0, 1000)
    if case == "odd rows":
        rows = slice(24, 1024)
    if case == "fp32 inputs":
        dtype = torch.float32
    x = ring_block_inputs(1, 4, 2, c, D, dtype, "cuda", rows, keys, False, seed=11)
    if case == "unaligned q":  # q rows 8 bytes off 16-byte alignment: a copy with a 4-element head offset
        q_pad = torch.empty(x["qb"].shape[:-1] + (D + 4,), dtype=dtype, device="cuda")[..., 4:]
        q_pad.copy_(x["qb"])
        x["qb"] = q_pad
    window = 5000 if case == "window" else None  # wider than every distance: the Triton kernels drop it
    bufs = ring_buffers(x, rows, keys, "random" if accumulate else "nan", "scratch" if case == "scratch dq" else "ring")
    if case == "bf16 dq":
        bufs = (torch.full(bufs[0].shape, float("nan"), dtype=torch.bfloat16, device="cuda"), *bufs[1:])
    before = tuple(t.double().clone() for t in bufs) if accumulate else None
    if case == "triton path":
        monkeypatch.setenv(dispatch.PATH_ENV, "triton")
    seen = spies(monkeypatch)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(case == "deterministic")
    try:
        got = run_block(x, False, bufs, accumulate, accumulate, window=window)
    finally:
        torch.use_deterministic_algorithms(was)
    gluon = HOPPER and case in ("scratch dq", "bf16 dq")
    assert len(seen["gluon"]) == int(gluon) and len(seen["triton"]) == (0 if gluon else 2), (case, seen)
    if gluon:
        assert seen["gluon"][0].data_ptr() != bufs[0].data_ptr()  # the scratch
    errs = errors(got, before, x["refs"])
    tol = 5e-3 if dtype == torch.float32 else TOL[dtype]  # fp32: TF32 dots
    tols = {"dq": 1e-2 if case == "bf16 dq" else tol, "dk": tol, "dv": tol}  # a bf16 dq: its own rounding
    assert all(e < tols[name] for name, e in errs.items()), (case, errs)

"""Our Triton FlashAttention against a float64 reference: outputs and q/k/v gradients.

On CPU this runs in Triton's interpreter (fp32 and fp16; its bf16 dot is wrong). Inputs come from a qkv
split like the model's (non-contiguous), outputs are poisoned with NaN before the kernel writes them, and
sequence lengths are chosen to hit the ragged tail, one tile, several tiles and the causal diagonal.
"""
import importlib
import math

import pytest
import torch

from attention_reference import reference_attention, rel_err
from minigpt_kernels import flash_attention

fa = importlib.import_module("minigpt_kernels.flash_attention")  # the module (the package exports the function)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Make every tensor the kernels allocate start as NaN, so an element they fail to write fails the test."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(fa.torch, "empty", nan_empty)
    monkeypatch.setattr(fa.torch, "empty_like", lambda t, **kw: nan_empty(t.shape, dtype=kw.get("dtype", t.dtype), device=t.device))


def split_qkv(B, N, H, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, 3, H, D, generator=g, dtype=torch.float32).to(dtype).requires_grad_()
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # (B, H, N, D) strided views
    return qkv, q, k, v


SEQS, HEAD_DIMS = (1, 17, 64, 130, 257), (16, 32, 64)
# fp32: the whole grid. fp16 (slower in the interpreter): every head_dim at the ragged lengths, every length at 32.
CASES = [(s, d, torch.float32) for s in SEQS for d in HEAD_DIMS] + sorted(
    {(s, d, torch.float16) for s in SEQS for d in HEAD_DIMS if d == 32 or s in (17, 257)})


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("seq,head_dim,dtype", CASES, ids=[f"n{s}-d{d}-{str(t)[6:]}" for s, d, t in CASES])
def test_matches_float64_reference(seq, head_dim, causal, dtype):
    qkv, q, k, v = split_qkv(2, seq, 2, head_dim, dtype, seed=seq * 131 + head_dim)
    assert not q.is_contiguous() or seq == 1
    o = flash_attention(q, k, v, causal=causal)
    assert o.shape == q.shape and o.dtype == dtype and not o.isnan().any()

    qkv64 = qkv.detach().double().requires_grad_()
    ref = reference_attention(*(t.transpose(1, 2) for t in qkv64.unbind(2)), causal)
    assert rel_err(o, ref) < TOL[dtype]

    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seq), dtype=torch.float32).to(dtype)
    (grad,) = torch.autograd.grad(o, qkv, do)
    (grad_ref,) = torch.autograd.grad(ref, qkv64, do.double())
    assert not grad.isnan().any()
    for i, name in enumerate("qkv"):
        err = rel_err(grad[:, :, i], grad_ref[:, :, i])
        assert err < 2 * TOL[dtype], f"d{name} relative error {err:.2e}"


def check_against_reference(qkv, causal, seed):
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    o = flash_attention(q, k, v, causal=causal)
    qkv64 = qkv.detach().double().requires_grad_()
    ref = reference_attention(*(t.transpose(1, 2) for t in qkv64.unbind(2)), causal)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed))
    (grad,) = torch.autograd.grad(o, qkv, do)
    (grad_ref,) = torch.autograd.grad(ref, qkv64, do.double())
    assert rel_err(o, ref) < 1e-5 and rel_err(grad, grad_ref) < 2e-5


@pytest.fixture
def pointer_loads(monkeypatch):
    """Tiles loaded through pointers instead of TMA descriptors (the path for unaligned inputs and pre-Hopper)."""
    configs = {name: fa.TileConfig(c.block_m, c.block_n, c.num_warps, c.num_stages, tma=False)
               for name, c in fa._INTERPRET_CONFIGS.items()}
    monkeypatch.setattr(fa, "_INTERPRET_CONFIGS", configs)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq,head_dim", [(17, 16), (130, 64)])
def test_pointer_load_path(pointer_loads, seq, head_dim, causal):
    qkv, *_ = split_qkv(2, seq, 2, head_dim, torch.float32, seed=seq + head_dim)
    check_against_reference(qkv, causal, seed=seq)


@pytest.mark.parametrize("causal", [True, False])
def test_int64_offset_path(monkeypatch, pointer_loads, causal):
    """The int64 tile-offset variant (used when seq × row stride passes 2³¹) computes the same thing."""
    monkeypatch.setattr(fa, "_needs_int64", lambda n, *tensors: True)
    qkv, *_ = split_qkv(1, 77, 2, 32, torch.float32, seed=5)
    check_against_reference(qkv, causal, seed=6)


def test_unaligned_inputs_fall_back_to_pointer_loads():
    """A row stride that is not a multiple of 16 bytes cannot be a TMA descriptor: the launcher must notice."""
    g = torch.Generator().manual_seed(9)
    wide = torch.randn(1, 45, 3 * 2 * 16 + 1, generator=g)  # qkv rows padded by one float: stride 97 × 4 bytes
    qkv = wide[:, :, :96].unflatten(2, (3, 2, 16))
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    assert not fa._use_tma(fa.tile_config("fwd", 16), q, k, v)
    assert fa._use_tma(fa.tile_config("fwd", 16), *split_qkv(1, 45, 2, 16, torch.float32, 0)[1:])  # the default
    check_against_reference(qkv.detach().requires_grad_(), True, seed=10)


def test_outputs_are_laid_out_like_the_inputs():
    """Head-transposed views (the model's q/k/v) give (B, N, H, D)-row outputs and grads, so the model's
    transpose + reshape back to (B, N, H·D) is a view, not a copy; contiguous inputs give contiguous outputs."""
    qkv, q, k, v = split_qkv(2, 33, 3, 16, torch.float32, seed=4)
    o = flash_attention(q, k, v)
    assert o.transpose(1, 2).is_contiguous() and o.transpose(1, 2).reshape(2, 33, 48)._base is not None
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    assert all(t.transpose(1, 2).is_contiguous() for t in (dq, dk, dv))
    plain = [t.detach().contiguous() for t in (q, k, v)]
    assert flash_attention(*plain).is_contiguous()


def test_softmax_scale_and_contiguous_inputs():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 3, 45, 32, generator=g) for _ in range(3))
    o = flash_attention(q, k, v, causal=False, softmax_scale=0.3)
    assert rel_err(o, reference_attention(q, k, v, False, scale=0.3)) < 1e-5


def test_head_dim_128_and_256():
    for d in (128, 256):
        g = torch.Generator().manual_seed(d)
        q, k, v = (torch.randn(1, 1, 40, d, generator=g) for _ in range(3))
        assert rel_err(flash_attention(q, k, v), reference_attention(q, k, v, True)) < 1e-5


@pytest.mark.parametrize("make,match", [
    (lambda: [torch.randn(2, 8, 16)] * 3, "4-D"),
    (lambda: [torch.randn(1, 2, 8, 48)] * 3, "head_dim 48"),
    (lambda: [torch.randn(1, 2, 8, 16, dtype=torch.float64)] * 3, "dtype"),
    (lambda: [torch.randn(1, 2, 8, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 8, 16)], "same shape"),
    (lambda: [torch.randn(1, 2, 16, 8).transpose(-1, -2)] * 3, "contiguous"),
    (lambda: [torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16).half(), torch.randn(1, 2, 8, 16)], "one dtype"),
])
def test_unsupported_inputs_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        flash_attention(*make())


@pytest.mark.parametrize("offload", [False, True])
def test_kept_attention_gives_the_same_gradients(tiny_config, offload):
    """keep_attention reuses the forward's attention output in the checkpoint recompute: same loss and grads."""
    from minigpt.attention import get_attention
    from minigpt.model import GPT
    cfg = tiny_config("attention=flash").model
    x, y = torch.randint(0, 256, (2, 70)), torch.randint(0, 256, (2, 70))
    results = []
    for keep in (False, True):
        cfg.recompute_every, cfg.keep_attention, cfg.offload = 1, keep, offload
        torch.manual_seed(0)
        model = GPT(cfg, 256, get_attention("flash"))
        calls = {"fwd": 0}
        real = fa.launch_forward

        def counting(*args, **kwargs):
            calls["fwd"] += 1
            return real(*args, **kwargs)
        fa.launch_forward = counting
        try:
            loss = model(x, y)
            loss.backward()
        finally:
            fa.launch_forward = real
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()], calls["fwd"]))
    (l0, g0, f0), (l1, g1, f1) = results
    assert math.isclose(l0, l1, rel_tol=1e-6) and f0 == 2 * cfg.n_layer and f1 == cfg.n_layer
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_flash_backend_trains_the_model(tiny_config):
    """attention=flash through the trainer (interpreter on CPU): same loss as sdpa on the first step."""
    from minigpt.run import run
    import json
    from pathlib import Path
    losses = {}
    for name in ("flash", "sdpa"):
        cfg = tiny_config(f"attention={name}", "seq_len=112", "max_steps=2", "batch_size=2", "eval_batches=0")
        cfg.run_dir, cfg.ckpt_dir = cfg.run_dir + name, cfg.run_dir + name + "/checkpoints"
        assert run(cfg) == 0
        losses[name] = json.loads((Path(cfg.run_dir) / "summary.json").read_text())["final_train_loss"]
    assert math.isclose(losses["flash"], losses["sdpa"], rel_tol=1e-4)

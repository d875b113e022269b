"""kernels/rotary.py: the qkv split + RoPE kernel against a float64 rotation, its backward against autograd's, and the
model using it (under Triton's CPU interpreter here; tests/test_gpu.py checks bf16 on the GPU)."""
import importlib

import pytest
import torch

from attention_reference import rope64, rotate64
from minigpt.model import Rotary, apply_rotary

rotary = importlib.import_module("minigpt_kernels.rotary")
pytestmark = [pytest.mark.skipif(not rotary.INTERPRET, reason="runs the Triton kernel under TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("poison_outputs")]  # tests/conftest.py: unwritten outputs read as NaN




CASES = [(1, 1, 1, 8, torch.float32), (2, 37, 3, 16, torch.float32), (1, 70, 2, 64, torch.float16),
         (3, 33, 1, 32, torch.float32), (1, 5, 4, 128, torch.float16)]


@pytest.mark.parametrize("B,N,H,D,dtype", CASES, ids=[f"b{c[0]}-n{c[1]}-h{c[2]}-d{c[3]}-{str(c[4])[6:]}" for c in CASES])
def test_matches_a_float64_rotation_and_its_gradient(B, N, H, D, dtype):
    """The model's multi-head layout (B, N, 3, H, D)."""
    g = torch.Generator().manual_seed(N * D + H)
    qkv = torch.randn(B, N, 3, H, D, generator=g).to(dtype).requires_grad_()
    positions = torch.arange(N) * 3 + 1000  # a rank's share of a longer sequence (context parallelism)
    cos, sin = Rotary(D)(N, positions)
    angles = torch.outer(positions.double(), Rotary(D).inv_freq.double())  # float64 angles, as the model's tables
    q, k, v = rotary.qkv_rotary(qkv, cos, sin)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    for got, part in ((q, 0), (k, 1)):
        assert got.shape == (B, N, H, D) and got.dtype == dtype and got.is_contiguous()
        assert (got.double() - rotate64(qkv[:, :, part].detach(), angles)).abs().max() <= tol * 4
    assert torch.equal(v, qkv[:, :, 2]) and v.is_contiguous()
    # the gradient of the projection: rot⁻¹ of dq and dk, dv as it is; against autograd through the float64 rotation
    dq, dk, dv = (torch.randn(B, N, H, D, generator=g).to(dtype) for _ in range(3))
    (dqkv,) = torch.autograd.grad((q, k, v), qkv, (dq, dk, dv))
    ref = qkv.detach().double().requires_grad_()
    (want,) = torch.autograd.grad((rotate64(ref[:, :, 0], angles), rotate64(ref[:, :, 1], angles), ref[:, :, 2]),
                                  ref, (dq.double(), dk.double(), dv.double()))
    assert dqkv.dtype == dtype and (dqkv.double() - want).abs().max() <= tol * 4


# (B, N, Hq, Hkv, D, dtype, rope): group sizes 1, 2, 3, 4 and one K/V head, plain RoPE and YaRN
GQA_CASES = [(2, 37, 2, 2, 16, torch.float32, "none"), (1, 33, 4, 2, 32, torch.float16, "yarn"),
             (2, 45, 3, 1, 16, torch.float32, "yarn"), (1, 29, 6, 2, 64, torch.float32, "none"),
             (1, 1, 4, 1, 8, torch.float16, "none")]


@pytest.mark.parametrize("B,N,Hq,Hkv,D,dtype,rope", GQA_CASES,
                         ids=[f"b{c[0]}-n{c[1]}-hq{c[2]}-hkv{c[3]}-d{c[4]}-{str(c[5])[6:]}-{c[6]}" for c in GQA_CASES])
def test_grouped_heads_match_a_float64_rotation_and_its_gradient(B, N, Hq, Hkv, D, dtype, rope):
    """The packed layout (B, N, Hq + 2·Hkv, D): q's Hq heads and k's Hkv rotated, v's Hkv copied; the gradient
    rot⁻¹ of dq and dk, dv as it is, every packed head written exactly once (the poisoned buffers say so)."""
    g = torch.Generator().manual_seed(N * D + Hq * 7 + Hkv)
    qkv = torch.randn(B, N, Hq + 2 * Hkv, D, generator=g).to(dtype).requires_grad_()
    positions = torch.arange(N) * 2 + 3
    r = Rotary(D) if rope == "none" else Rotary(D, 10000.0, "yarn", 4.0, 16)
    cos, sin = r(N, positions)
    angles = torch.outer(positions.double(), r.inv_freq.double())  # float64 angles, as the model's tables
    cos64, sin64 = angles.cos() * r.attention_factor, angles.sin() * r.attention_factor
    q, k, v = rotary.qkv_rotary(qkv, cos, sin, n_kv_head=Hkv)
    assert q.shape == (B, N, Hq, D) and k.shape == v.shape == (B, N, Hkv, D)
    assert all(t.dtype == dtype and t.is_contiguous() for t in (q, k, v))
    xq, xk, xv = qkv.detach().split((Hq, Hkv, Hkv), dim=2)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert (q.double() - rope64(xq, cos64, sin64)).abs().max() <= tol * 4
    assert (k.double() - rope64(xk, cos64, sin64)).abs().max() <= tol * 4
    assert torch.equal(v, xv)
    dq = torch.randn(B, N, Hq, D, generator=g).to(dtype)
    dk, dv = (torch.randn(B, N, Hkv, D, generator=g).to(dtype) for _ in range(2))
    (dqkv,) = torch.autograd.grad((q, k, v), qkv, (dq, dk, dv))
    ref = qkv.detach().double().requires_grad_()
    rq, rk, rv = ref.split((Hq, Hkv, Hkv), dim=2)
    (want,) = torch.autograd.grad((rope64(rq, cos64, sin64), rope64(rk, cos64, sin64), rv), ref,
                                  (dq.double(), dk.double(), dv.double()))
    assert dqkv.shape == qkv.shape and dqkv.dtype == dtype and (dqkv.double() - want).abs().max() <= tol * 4


def test_equals_the_models_pytorch_rotary_and_takes_gradients_of_any_strides():
    """Same math as minigpt.model.apply_rotary (fp32, rounded once), so the model's eager path and its compiled
    regions (which keep apply_rotary) agree; autograd may hand the backward strided gradients."""
    g = torch.Generator().manual_seed(5)
    B, N, H, D = 2, 29, 3, 32
    qkv = torch.randn(B, N, 3, H, D, generator=g, dtype=torch.float16, requires_grad=True)
    cos, sin = Rotary(D)(N)
    q, k, v = rotary.qkv_rotary(qkv, cos, sin)
    want_q, want_k = apply_rotary(qkv[:, :, 0], cos, sin), apply_rotary(qkv[:, :, 1], cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    grads = [torch.randn(B, H, N, D, generator=g, dtype=torch.float16).transpose(1, 2) for _ in range(3)]  # strided
    (got,) = torch.autograd.grad((q, k, v), qkv, grads)
    (want,) = torch.autograd.grad((want_q, want_k, qkv[:, :, 2]), qkv, grads)
    assert torch.equal(got, want)


def test_inputs_it_does_not_take_are_refused_and_the_model_falls_back(monkeypatch):
    qkv = torch.randn(1, 4, 3, 2, 16)
    cos, sin = Rotary(16)(4)
    assert rotary._layout_fits(qkv, cos, sin) and not rotary.rotary_fits(qkv, cos, sin)  # the model: GPU tensors only
    assert not rotary._layout_fits(torch.randn(1, 4, 3, 2, 12), *Rotary(12)(4))  # D/2 not a power of two
    strided = torch.randn(1, 4, 2, 3, 16).transpose(2, 3)  # (3, H, D) not contiguous
    assert not rotary._layout_fits(strided, cos, sin)
    assert not rotary._layout_fits(qkv, cos.double(), sin.double())  # a float64 model's tables
    flat = cos.reshape(4, 8)  # the same angles as (N, D/2): taken; transposed to (D/2, N) (contiguous): refused
    assert rotary._layout_fits(qkv, flat, sin.reshape(4, 8))
    assert not rotary._layout_fits(qkv, flat.t().contiguous(), sin.reshape(4, 8).t().contiguous())
    assert not rotary._layout_fits(qkv, cos.reshape(1, 32), sin.reshape(1, 32))  # one row of N·D/2 angles
    # the packed layout: (B, N, Hq + 2·Hkv, D) with Hq a multiple of Hkv; the model's layout is MHA
    packed = qkv.view(1, 4, 6, 16)
    assert rotary._layout_fits(packed, cos, sin) and rotary._layout_fits(packed, cos, sin, 2)  # Hq = Hkv = 2
    assert rotary._layout_fits(packed, cos, sin, 1)  # Hq 4, Hkv 1
    assert not rotary._layout_fits(torch.randn(1, 4, 7, 16), cos, sin)  # not 3·H: n_kv_head needed
    assert not rotary._layout_fits(torch.randn(1, 4, 7, 16), cos, sin, 2)  # Hq 3, not a multiple of 2
    assert not rotary._layout_fits(qkv, cos, sin, 1)
    # tables that want a gradient: the kernel's backward gives none, the PyTorch rotation does, so they take that
    assert not rotary._layout_fits(qkv, cos.clone().requires_grad_(), sin)
    with pytest.raises(ValueError, match="no grad"):
        rotary.qkv_rotary(qkv, cos.clone().requires_grad_(), sin)
    with pytest.raises(ValueError, match="contiguous"):
        rotary.qkv_rotary(strided, cos, sin)
    with pytest.raises(ValueError, match="fp32"):
        rotary.qkv_rotary(qkv, cos.double(), sin.double())
    # the model takes its PyTorch code for such inputs instead of raising: a float64 model runs (with the kernel's
    # device condition lifted, as on a GPU)
    monkeypatch.setattr("minigpt.model.rotary_fits", rotary._layout_fits)
    from minigpt.attention import get_attention
    from minigpt.config import ModelConfig
    from minigpt.model import GPT
    model = GPT(ModelConfig(name="t", n_layer=1, n_head=2, n_embd=32), 64, get_attention("naive")).double()
    idx = torch.randint(0, 64, (1, 9))
    assert torch.isfinite(model(idx, idx))


@pytest.mark.parametrize("attention", ["naive", "flash"])
def test_the_model_trains_the_same_with_the_kernel_and_without(tiny_config, monkeypatch, attention):
    from minigpt.attention import get_attention
    from minigpt.model import GPT
    cfg = tiny_config(f"attention={attention}")

    def two_steps():
        torch.manual_seed(0)
        model = GPT(cfg.model, 256, get_attention(cfg.attention.name))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randint(0, 256, (2, 40)), torch.randint(0, 256, (2, 40))
        out = []
        for _ in range(2):
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    monkeypatch.setattr("minigpt.model.rotary_fits", rotary._layout_fits)  # on CPU too, under the interpreter
    calls = []
    real = rotary.qkv_rotary
    monkeypatch.setattr("minigpt.model.qkv_rotary", lambda *a: calls.append(1) or real(*a))
    with_kernel = two_steps()
    assert calls  # the model took the kernel ...
    monkeypatch.setattr("minigpt.model.rotary_fits", lambda *a: False)
    assert two_steps() == pytest.approx(with_kernel, rel=1e-6)  # ... and the PyTorch path gives the same losses

"""naive and sdpa compute the same function (outputs and gradients), and the registry rejects unknown names."""
import pytest
import torch

from attention_reference import reference_attention as reference
from minigpt.attention import BACKENDS, get_attention


@pytest.mark.parametrize("name", ["naive", "sdpa"])
@pytest.mark.parametrize("seq", [1, 17, 130])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_float64_reference_with_grads(name, seq, causal):
    torch.manual_seed(seq)
    B, H, D = 2, 3, 32
    qkv = torch.randn(B, seq, 3, H, D, requires_grad=True)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # strided views, as in the model
    out = get_attention(name)(q, k, v, causal=causal)
    qkv64 = qkv.detach().double().requires_grad_()
    ref = reference(*(t.transpose(1, 2) for t in qkv64.unbind(2)), causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    grad = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, qkv, grad)
    (g_ref,) = torch.autograd.grad(ref, qkv64, grad.double())
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-4, atol=1e-5)


def test_naive_and_sdpa_agree_on_odd_length():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 257, 16) for _ in range(3))
    torch.testing.assert_close(get_attention("naive")(q, k, v), get_attention("sdpa")(q, k, v), rtol=1e-4, atol=1e-5)


def test_sdpa_pinned_math_backend():
    q, k, v = (torch.randn(1, 2, 33, 16) for _ in range(3))
    out = get_attention("sdpa", sdpa_backend="math")(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), reference(q, k, v, True), rtol=1e-4, atol=1e-5)


def test_registry():
    assert set(BACKENDS) == {"naive", "sdpa", "flash", "flex"}
    with pytest.raises(ValueError, match="choose one of"):
        get_attention("bogus")

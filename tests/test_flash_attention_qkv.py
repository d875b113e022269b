"""kernels/flash_attention_qkv.py: attention straight from the qkv projection, RoPE's backward folded into the
attention's. Against the pair it replaces (qkv_rotary, then flash_attention) and against float64, under Triton's
CPU interpreter (the seven-matmul backward; tests/test_gpu.py checks the five-matmul one in bf16 on the GPU)."""
import importlib

import pytest
import torch

from attention_reference import reference_attention, rel_err, rotate64
from minigpt.attention import FlashAttention, SdpaAttention
from minigpt.config import ModelConfig
from minigpt.model import CausalSelfAttention, Rotary
from minigpt_kernels.flash_attention import flash_attention

fa = importlib.import_module("minigpt_kernels.flash_attention")
rotary = importlib.import_module("minigpt_kernels.rotary")
fqkv = importlib.import_module("minigpt_kernels.flash_attention_qkv")
interpreted = pytest.mark.skipif(not rotary.INTERPRET, reason="runs the Triton kernels under TRITON_INTERPRET=1")


pytestmark = pytest.mark.usefixtures("poison_outputs")  # tests/conftest.py: unwritten outputs read as NaN


CASES = [(1, 1, 1, 16, torch.float32), (2, 37, 3, 16, torch.float32), (1, 70, 2, 32, torch.float16),
         (1, 130, 1, 64, torch.float32), (2, 29, 2, 64, torch.float16)]


@interpreted
@pytest.mark.parametrize("B,N,H,D,dtype", CASES, ids=[f"b{c[0]}-n{c[1]}-h{c[2]}-d{c[3]}-{str(c[4])[6:]}" for c in CASES])
def test_equals_rotary_then_flash_attention_and_float64(B, N, H, D, dtype):
    g = torch.Generator().manual_seed(B * 1000 + N * D + H)
    qkv = torch.randn(B, N, 3, H, D, generator=g).to(dtype).requires_grad_()
    positions = torch.arange(N) * 2 + 7  # not 0..N-1: the tables are read at the tokens' own rows
    cos, sin = Rotary(D)(N, positions)
    do = torch.randn(B, H, N, D, generator=g).to(dtype)

    o = fqkv.flash_attention_qkv(qkv, cos, sin)
    (dqkv,) = torch.autograd.grad(o, qkv, do)
    q, k, v = rotary.qkv_rotary(qkv, cos, sin)
    want = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    (want_dqkv,) = torch.autograd.grad(want, qkv, do)
    # the same kernels in the same order (the seven-matmul backward here): bitwise the pair's results
    assert o.shape == (B, H, N, D) and o.dtype == dtype and torch.equal(o, want)
    assert dqkv.shape == qkv.shape and torch.equal(dqkv, want_dqkv)

    angles = torch.outer(positions.double(), Rotary(D).inv_freq.double())
    ref_qkv = qkv.detach().double().requires_grad_()
    ref = reference_attention(*(t.transpose(1, 2) for t in (rotate64(ref_qkv[:, :, 0], angles),
                                                             rotate64(ref_qkv[:, :, 1], angles), ref_qkv[:, :, 2])),
                              causal=True)
    (ref_dqkv,) = torch.autograd.grad(ref, ref_qkv, do.double())
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert rel_err(o, ref) <= tol
    for part in range(3):
        assert rel_err(dqkv[:, :, part], ref_dqkv[:, :, part]) <= tol * 2, "qkv"[part]


@interpreted
def test_refuses_what_it_cannot_take_and_a_second_derivative():
    qkv = torch.randn(1, 8, 3, 2, 16, requires_grad=True)
    cos, sin = Rotary(16)(8)
    with pytest.raises(ValueError, match="contiguous"):
        fqkv.flash_attention_qkv(qkv.transpose(2, 3).contiguous().transpose(2, 3), cos, sin)
    with pytest.raises(ValueError, match="head_dim 8"):
        fqkv.flash_attention_qkv(torch.randn(1, 8, 3, 2, 8), *Rotary(8)(8))
    o = fqkv.flash_attention_qkv(qkv, cos, sin)
    (g,) = torch.autograd.grad(o.sum(), qkv, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


def test_the_model_takes_the_backends_projection_path_where_it_has_one():
    """CausalSelfAttention hands the qkv projection to a backend's attend_projection, and rotates q, k itself and
    calls the backend where that returns None (CPU tensors, compiled regions) or the backend has none."""
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=32)
    x, (cos, sin) = torch.randn(2, 9, 32), Rotary(16)(9)
    calls = []

    class Recording(SdpaAttention):
        def attend_projection(self, qkv, cos, sin, *, n_kv_head, window=None, document_ids=None):
            calls.append((qkv.shape, n_kv_head, window, document_ids))
            return None if len(calls) == 1 else torch.full((2, 2, 9, 16), 7.0)

    torch.manual_seed(0)
    attn = CausalSelfAttention(cfg, Recording())
    want = SdpaAttention()(*(t.transpose(1, 2) for t in attn.heads(x, cos, sin)), causal=True)
    assert torch.equal(attn(x, cos, sin), want)  # None: the model's own RoPE, then the backend
    assert torch.equal(attn(x, cos, sin), torch.full((2, 2, 9, 16), 7.0))  # the backend's path
    assert calls == [((2, 9, 6, 16), 2, None, None)] * 2  # (B, N, H + 2·Hkv, D)
    assert FlashAttention().attend_projection(attn.project_qkv(x), cos, sin, n_kv_head=2) is None  # CPU: not taken

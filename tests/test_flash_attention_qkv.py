"""kernels/flash_attention_qkv.py: attention straight from the qkv projection (B, N, Hq + 2·Hkv, D), RoPE's backward
folded into the attention's. Against the pair it replaces (qkv_rotary, then flash_attention) and against float64
(PyTorch RoPE, then attention with explicit masks and K/V repeated per group), under Triton's CPU interpreter (the
seven-matmul backward; tests/test_gpu.py and tests/test_gpu_masks.py check bf16/fp16 on the GPU): group sizes 1-4,
one K/V head, sliding windows, document ids, YaRN tables, odd lengths; the model's (B, N, 3, H, D) layout; the
ValueErrors; and that no K/V of Hq heads is ever made."""
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attention_reference import masked_attention, reference_attention, rel_err, rope64, rotate64, visible_mask
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
    """The model's multi-head layout (B, N, 3, H, D)."""
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


def documents(B: int, N: int, seed: int) -> torch.Tensor:
    """(B, N) int64 non-decreasing ids of documents of random lengths 1 to 12 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 13, (B, N), generator=g)
    return torch.stack([torch.repeat_interleave(torch.arange(N), row)[:N] for row in lengths])


def tables(D: int, N: int, rope: str, positions: torch.Tensor) -> tuple[tuple, tuple]:
    """(cos, sin) as the model makes them (fp32, (N, 1, D/2)) and in float64 from the same float64 angles and
    temperature: plain RoPE, or YaRN ×4 over an original length of 16 (tests/test_rope_scaling.py)."""
    r = Rotary(D) if rope == "none" else Rotary(D, 10000.0, "yarn", 4.0, 16)
    angles = torch.outer(positions.double(), r.inv_freq.double())
    return r(N, positions), (angles.cos() * r.attention_factor, angles.sin() * r.attention_factor)


# (B, N, Hq, Hkv, D, dtype, window, documents, rope): group sizes 1, 2, 3, 4 (Hkv = 1 among them), odd lengths
GQA_CASES = [(1, 1, 2, 1, 16, torch.float32, None, False, "none"),
             (2, 37, 3, 3, 16, torch.float32, None, False, "yarn"),
             (1, 45, 2, 2, 32, torch.float16, 7, True, "none"),
             (2, 29, 4, 2, 16, torch.float32, None, False, "none"),
             (1, 61, 4, 2, 64, torch.float16, None, True, "yarn"),
             (1, 45, 6, 2, 32, torch.float32, 9, False, "yarn"),
             (2, 33, 3, 1, 16, torch.float32, 5, True, "none"),
             (1, 70, 4, 1, 32, torch.float16, 16, True, "yarn"),
             (1, 130, 2, 1, 64, torch.float32, None, False, "none")]


@interpreted
@pytest.mark.parametrize(
    "B,N,Hq,Hkv,D,dtype,window,docs,rope", GQA_CASES,
    ids=[f"b{c[0]}-n{c[1]}-hq{c[2]}-hkv{c[3]}-d{c[4]}-{str(c[5])[6:]}-w{c[6]}{'-docs' if c[7] else ''}-{c[8]}"
         for c in GQA_CASES])
def test_gqa_and_masks_equal_the_pair_and_float64(B, N, Hq, Hkv, D, dtype, window, docs, rope):
    """qkv (B, N, Hq + 2·Hkv, D): the output and dqkv bitwise those of qkv_rotary + flash_attention (the same
    kernels in the same order), and within the dtype's error of float64 PyTorch RoPE + masked attention over K/V
    repeated per group (dK/dV: the sums over each group)."""
    g = torch.Generator().manual_seed(N * D + Hq * 10 + Hkv)
    qkv = torch.randn(B, N, Hq + 2 * Hkv, D, generator=g).to(dtype).requires_grad_()
    positions = torch.arange(N) * 3 + 5
    (cos, sin), (cos64, sin64) = tables(D, N, rope, positions)
    ids = documents(B, N, seed=N) if docs else None
    do = torch.randn(B, Hq, N, D, generator=g).to(dtype)

    o = fqkv.flash_attention_qkv(qkv, cos, sin, n_kv_head=Hkv, window=window, document_ids=ids)
    (dqkv,) = torch.autograd.grad(o, qkv, do)
    q, k, v = rotary.qkv_rotary(qkv, cos, sin, n_kv_head=Hkv)
    assert q.shape == (B, N, Hq, D) and k.shape == v.shape == (B, N, Hkv, D)
    want = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window=window, document_ids=ids)
    (want_dqkv,) = torch.autograd.grad(want, qkv, do)
    assert o.shape == (B, Hq, N, D) and o.dtype == dtype and torch.equal(o, want)
    assert o.transpose(1, 2).is_contiguous()  # laid out like q: (B, N, Hq, D) rows, c_proj's input as a view
    assert dqkv.shape == qkv.shape and torch.equal(dqkv, want_dqkv)

    ref_qkv = qkv.detach().double().requires_grad_()
    rq, rk, rv = ref_qkv.split((Hq, Hkv, Hkv), dim=2)
    rq, rk = rope64(rq, cos64, sin64), rope64(rk, cos64, sin64)
    visible = visible_mask(N, N, True, window, ids, ids)
    ref, _ = masked_attention(rq.transpose(1, 2), rk.transpose(1, 2), rv.transpose(1, 2), visible)
    (ref_dqkv,) = torch.autograd.grad(ref, ref_qkv, do.double())
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert rel_err(o, ref) <= tol
    for name, heads in (("q", slice(0, Hq)), ("k", slice(Hq, Hq + Hkv)), ("v", slice(Hq + Hkv, None))):
        assert rel_err(dqkv[:, :, heads], ref_dqkv[:, :, heads]) <= tol * 2, name


@interpreted
def test_the_models_layout_is_the_packed_one_viewed():
    """(B, N, 3, H, D) is (B, N, 3H, D) with n_kv_head H: bitwise the same output, its gradient in its own shape;
    n_kv_head None or H, nothing else."""
    g = torch.Generator().manual_seed(11)
    B, N, H, D = 2, 23, 2, 16
    five = torch.randn(B, N, 3, H, D, generator=g).requires_grad_()
    four = five.detach().view(B, N, 3 * H, D).requires_grad_()
    cos, sin = Rotary(D)(N)
    ids = documents(B, N, seed=3)
    do = torch.randn(B, H, N, D, generator=g)
    o5 = fqkv.flash_attention_qkv(five, cos, sin, n_kv_head=H, window=6, document_ids=ids)
    o4 = fqkv.flash_attention_qkv(four, cos, sin, window=6, document_ids=ids)
    (d5,), (d4,) = torch.autograd.grad(o5, five, do), torch.autograd.grad(o4, four, do)
    assert torch.equal(o5, o4) and d5.shape == five.shape and torch.equal(d5.view(B, N, 3 * H, D), d4)
    with pytest.raises(ValueError, match="multi-head"):
        fqkv.flash_attention_qkv(five, cos, sin, n_kv_head=1)
    assert not fqkv.qkv_attention_fits(five, cos, sin, 1) and not rotary._layout_fits(five, cos, sin, 1)


class Allocations(TorchDispatchMode):
    """The storages of the tensors aten ops make, with their element counts: every op but views and those that write
    into a tensor given (in-place and out= ops, among them the interpreter's copies of the kernels' arguments)."""

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable or func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return out


@interpreted
def test_no_tensor_of_query_heads_holds_k_or_v():
    """With GQA no K, V, dK or dV of Hq heads (a repeat per group) is made: in the forward the tensors of Hq heads'
    size are q's buffer and o, in the backward only dqkv (Hq + 2·Hkv heads) is larger than K's."""
    B, N, Hq, Hkv, D = 1, 40, 4, 1, 16
    qkv = torch.randn(B, N, Hq + 2 * Hkv, D, requires_grad=True)
    cos, sin = Rotary(D)(N)
    do = torch.randn(B, Hq, N, D)
    big = B * Hq * N * D  # one tensor of Hq heads
    with Allocations() as fwd:
        o = fqkv.flash_attention_qkv(qkv, cos, sin, n_kv_head=Hkv, window=8)
    with Allocations() as bwd:
        (dqkv,) = torch.autograd.grad(o, qkv, do)
    assert sorted(n for n in fwd.sizes.values() if n >= big) == [big, big]  # q (rotated), o
    assert sorted(n for n in bwd.sizes.values() if n > B * Hkv * N * D) == [B * (Hq + 2 * Hkv) * N * D]  # dqkv


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


def _packed(heads: int, D: int = 16, N: int = 8) -> torch.Tensor:
    return torch.randn(1, N, heads, D)


# (qkv, n_kv_head, what the message says): heads that are not Hq + 2·Hkv, Hq not a multiple of Hkv, bad n_kv_head,
# shapes and strides the kernel does not read
BAD_LAYOUTS = [
    (lambda: _packed(7), None, "pass n_kv_head"),
    (lambda: _packed(7), 2, "not a multiple"),
    (lambda: _packed(8), 3, "not a multiple"),
    (lambda: _packed(4), 2, "Hq = 0"),
    (lambda: _packed(6), 0, "n_kv_head must be an int"),
    (lambda: _packed(6), True, "n_kv_head must be an int"),
    (lambda: _packed(6), 2.0, "n_kv_head must be an int"),
    (lambda: torch.randn(1, 8, 3, 2, 16), 1, "multi-head"),
    (lambda: torch.randn(1, 8, 4, 2, 16), None, r"\(B, N, 3, H, D\)"),
    (lambda: torch.randn(8, 6, 16), None, r"\(B, N, Hq \+ 2·Hkv, D\)"),
    (lambda: torch.randn(1, 8, 16, 6).transpose(2, 3), 2, "contiguous"),
    (lambda: _packed(6, D=12), 2, "power of two"),
]


def test_layouts_it_does_not_take_raise_a_value_error_naming_the_problem():
    """Every entry point says what is wrong (before any kernel runs); the fit checks the model asks say False
    instead of raising."""
    for make, n_kv_head, needle in BAD_LAYOUTS:
        qkv = make()
        cos, sin = Rotary(qkv.shape[-1])(qkv.shape[1] if qkv.dim() > 3 else 8)
        for call in (fqkv.flash_attention_qkv, rotary.qkv_rotary):
            with pytest.raises(ValueError, match=needle):
                call(qkv, cos, sin, n_kv_head=n_kv_head)
        assert not rotary._layout_fits(qkv, cos, sin, n_kv_head), needle
        assert not fqkv.qkv_attention_fits(qkv, cos, sin, n_kv_head), needle


@interpreted
def test_bad_tables_and_masks_raise_a_value_error():
    qkv = _packed(6)
    cos, sin = Rotary(16)(8)
    call = fqkv.flash_attention_qkv
    for kwargs, needle in (({"window": 0}, "window"), ({"window": True}, "window"),
                           ({"document_ids": torch.zeros(1, 7, dtype=torch.int64)}, "document_ids"),
                           ({"document_ids": torch.zeros(1, 8)}, "int32 or int64"),
                           ({"n_kv_head": 1, "document_ids": torch.zeros(2, 8, dtype=torch.int64)}, "document_ids")):
        with pytest.raises(ValueError, match=needle):
            call(qkv, cos, sin, **kwargs)
    for c, s, needle in ((cos.double(), sin.double(), "fp32"), (cos[:7], sin[:7], r"\(N, D/2\)"),
                         (cos.clone().requires_grad_(), sin, "no grad")):
        with pytest.raises(ValueError, match=needle):
            call(qkv, c, s, n_kv_head=2)


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

"""A GPT-2-style decoder with rotary position embeddings, in plain PyTorch.

Reads top to bottom: rotary embeddings, attention, MLP, block, the model and its loss. The attention backend
is chosen by name (minigpt/attention.py) and passed in. Rotary embeddings make seq_len a run-time choice
rather than a model size. The memory levers for very long contexts (recomputing blocks, chunking the MLP and
the loss) live in minigpt/levers.py; here they are three calls, each a no-op when its lever is off.
"""
from __future__ import annotations

import functools
import math
from types import ModuleType

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from minigpt.attention import AttentionBackend, AttentionFn
from minigpt.config import ModelConfig
from minigpt.levers import BlockRecompute, chunked, chunked_sum


# YaRN's ramp ends (Peng et al. 2023, "YaRN", section 3.2): a dimension whose wavelength fits fewer than BETA_SLOW
# times in the trained context is interpolated fully (frequency / s), more than BETA_FAST times kept as it is
YARN_BETA_SLOW, YARN_BETA_FAST = 1.0, 32.0
ROPE_CHUNK = 1 << 16  # positions per float64 piece of the RoPE tables (16 MiB of angles at head_dim 64)


def rope_inv_freq(head_dim: int, base: float = 10000.0, scaling: str = "none", factor: float = 1.0,
                  original_len: int | None = None) -> Tensor:
    """RoPE's inverse frequencies θ_d = base^(−2d/D), fp32, (D/2,), with the length extension applied:
    none: as they are; linear (position interpolation): θ_d / s; yarn (NTK-by-parts): with r_d = original_len / λ_d
    the number of wavelengths λ_d = 2π/θ_d in the trained context and γ the ramp from 0 (r_d < β_slow) to 1
    (r_d > β_fast), θ_d · ((1 − γ)/s + γ): long wavelengths interpolated, short ones kept. The scaling is done in
    float64 on the fp32 base frequencies and rounded once, so factor 1 gives plain RoPE's frequencies."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling == "none":
        return inv_freq
    theta = inv_freq.double()
    if scaling == "linear":
        return (theta / factor).float()
    if scaling != "yarn":
        raise ValueError(f"rope scaling {scaling!r}: must be none, linear or yarn")
    r = original_len * theta / (2 * math.pi)
    gamma = ((r - YARN_BETA_SLOW) / (YARN_BETA_FAST - YARN_BETA_SLOW)).clamp(0.0, 1.0)
    return (theta * ((1.0 - gamma) / factor + gamma)).float()


def rope_attention_factor(scaling: str = "none", factor: float = 1.0) -> float:
    """What q and k are each multiplied by: YaRN's √t = 0.1·ln(s) + 1 (the logits scaled by t), 1 otherwise. The
    model folds it into its cos and sin tables, so every path that rotates q and k with them (PyTorch, the fused
    Triton RoPE, flash_attention_qkv, ring attention) scales the logits alike, whatever softmax scale the backend uses."""
    return 0.1 * math.log(factor) + 1.0 if scaling == "yarn" else 1.0


class Rotary(nn.Module):
    """Rotary position embedding (RoFormer): rotate each (x_i, x_{i+d/2}) pair of q and k by angle pos·θ_i; with a
    length extension (model.rope_scaling) the θ_i of rope_inv_freq and the tables times rope_attention_factor."""

    def __init__(self, head_dim: int, base: float = 10000.0, scaling: str = "none", factor: float = 1.0,
                 original_len: int | None = None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, base, scaling, factor, original_len), persistent=False)
        self.attention_factor = rope_attention_factor(scaling, factor)

    def forward(self, seq_len: int, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin tables of shape (seq_len, 1, head_dim/2), made once per model forward; `positions` (seq_len,)
        are the tokens' global positions when a rank holds only part of the sequence (context parallelism).
        The angles pos·θ_i are made in float64 and rounded once, in ROPE_CHUNK positions at a time: an fp32 product
        is off by up to pos·2⁻²⁴ radians (0.03 at 1M tokens, measured on an H100), which blurs the relative
        positions RoPE encodes between far-apart tokens. With YaRN both are multiplied by √t (rope_attention_factor,
        in float64 too): q and k come out scaled by it."""
        device = self.inv_freq.device
        work = torch.device("cpu") if device.type == "mps" else device  # MPS has no float64
        pos = (torch.arange(seq_len, device=work, dtype=torch.float64) if positions is None
               else positions.to(work, torch.float64))
        theta = self.inv_freq.to(work, torch.float64)
        cos, sin = (torch.empty(len(pos), theta.numel(), device=work, dtype=torch.float32) for _ in range(2))
        for s in range(0, len(pos), ROPE_CHUNK):
            angles = torch.outer(pos[s : s + ROPE_CHUNK], theta)
            cos[s : s + ROPE_CHUNK] = angles.cos() * self.attention_factor  # float64 until here: one rounding
            sin[s : s + ROPE_CHUNK] = angles.sin() * self.attention_factor
        return cos.to(device)[:, None, :], sin.to(device)[:, None, :]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, N, H, D). Rotates the two halves of the last dim: [x1, x2] -> [x1 cos - x2 sin, x1 sin + x2 cos].

    In fp32, each half rounded back to x's dtype as soon as it is made, so at long context the fp32
    temporaries stay small; autograd keeps only cos and sin for the backward.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat(((x1 * cos - x2 * sin).to(x.dtype), (x1 * sin + x2 * cos).to(x.dtype)), dim=-1)


@functools.cache
def fused_rotary() -> ModuleType | None:
    """kernels/rotary.py (qkv split + RoPE in one Triton pass), imported at the first GPU forward; None without
    Triton (the model then keeps its PyTorch code)."""
    try:
        from minigpt_kernels import rotary
    except ImportError:
        return None
    return rotary


def rotary_fits(qkv: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether qkv_rotary takes these inputs: a GPU tensor of its layout, with Triton installed."""
    if not qkv.is_cuda:
        return False
    kernels = fused_rotary()
    return kernels is not None and kernels.rotary_fits(qkv, cos, sin)


def qkv_rotary(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k (rotated), v by kernels/rotary.py, for inputs that rotary_fits."""
    return fused_rotary().qkv_rotary(qkv, cos, sin)


class CausalSelfAttention(nn.Module):
    """Causal self-attention with n_head query heads over n_kv_head key/value heads (GQA; equal by default), within
    `window` (None: all earlier tokens) and, when the batch has them, within documents. forward: project_qkv, then
    rotate + attend_heads, or the backend's attend_projection where it takes the projection itself (flash); Block
    applies project (c_proj) to the result. A recomputed block calls heads (project_qkv + rotate) and attend_heads
    itself, to run the token-local part in chunks."""

    def __init__(self, cfg: ModelConfig, attend: AttentionFn, window: int | None = None):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.window = window
        self.c_attn = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.attend = attend

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, document_ids: Tensor | None = None) -> Tensor:
        """The heads' outputs y (B, H, N, D) for the block's normed input x: rotate, then attend_heads; or, where
        the backend takes the qkv projection itself (flash, eager, on a GPU), that path, which folds RoPE's
        backward into the attention's (kernels/flash_attention_qkv.py)."""
        qkv = self.project_qkv(x)
        from_projection = getattr(self.attend, "attend_projection", None)  # a plain function has none
        y = None if from_projection is None else from_projection(
            qkv, cos, sin, n_kv_head=self.n_kv_head, window=self.window, document_ids=document_ids)
        return y if y is not None else self.attend_heads(*self.rotate(qkv, cos, sin), document_ids)

    def project_qkv(self, x: Tensor) -> Tensor:
        """The qkv projection of x (B, N, C) as (B, N, H + 2·Hkv, D): the query heads, then the keys', the values'."""
        B, N, C = x.shape
        return self.c_attn(x).view(B, N, self.n_head + 2 * self.n_kv_head, self.head_dim)

    def heads(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k (rotated) and v of x: (B, N, H, D), (B, N, Hkv, D), (B, N, Hkv, D)."""
        return self.rotate(self.project_qkv(x), cos, sin)

    def rotate(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k (rotated) and v as (B, N, heads, D), each in its own buffer: the attention keeps all three for its
        backward, and views would keep the whole qkv matmul output alive with them (3 KB more per token
        and layer). RoPE is applied in this layout so the caller's transposes are free strided views.
        On a GPU, eager runs without GQA do the split and RoPE in one Triton pass each way (kernels/rotary.py: a
        dozen elementwise passes fewer); compiled regions keep the PyTorch code, which Inductor fuses itself."""
        H, Hkv = self.n_head, self.n_kv_head
        if H == Hkv and not torch.compiler.is_compiling():
            qkv3 = qkv.unflatten(2, (3, H))  # (B, N, 3, H, D), the fused kernel's layout
            if rotary_fits(qkv3, cos, sin):
                return qkv_rotary(qkv3, cos, sin)
        q, k, v = qkv.split((H, Hkv, Hkv), dim=2)  # whose backward joins the three gradients, with no zeros
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.contiguous()

    def attend_heads(self, q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor | None = None) -> Tensor:
        """Attention over (B, N, heads, D) q, k, v; the output y is (B, H, N, D), as the backends return it."""
        return self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, window=self.window,
                           document_ids=document_ids)

    def project(self, y: Tensor) -> Tensor:
        """c_proj of the heads' outputs y (B, H, N, D) joined per token. flash and SDPA's fused kernels lay y out
        as (B, N, H, D) like q, so the join is a view (naive's y is contiguous (B, H, N, D): a copy)."""
        B, H, N, D = y.shape
        return self.c_proj(y.transpose(1, 2).reshape(B, N, H * D))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig, attend: AttentionFn, window: int | None = None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg, attend, window)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)
        self.mlp_chunk = cfg.mlp_chunk

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, document_ids: Tensor | None = None) -> Tensor:
        return self.after_attention(x, self.attn(self.ln_1(x), cos, sin, document_ids))

    # The token-local pieces around the attention call, for a recomputed block (minigpt/levers.py), which runs each
    # a chunk of tokens at a time (forward itself lets attn take the backend's own path from the projection).
    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v (B, N, heads, D) of the block input x."""
        return self.attn.heads(self.ln_1(x), cos, sin)

    def after_attention(self, x: Tensor, y: Tensor) -> Tensor:
        """The block's output from its input x and the attention's output y (B, H, N, D)."""
        x = x + self.attn.project(y)
        # token-local, so it can run a chunk of tokens at a time (model.mlp_chunk; one piece when 0)
        return x + chunked(self.norm_mlp, x, self.mlp_chunk, self.mlp_params)

    @property
    def mlp_params(self) -> list[nn.Parameter]:
        return [*self.ln_2.parameters(), *self.mlp.parameters()]

    def norm_mlp(self, x: Tensor) -> Tensor:
        return self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, attention: AttentionBackend):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.wte = nn.Embedding(vocab_size, cfg.n_embd)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_base, cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_len)
        # model.window on the layers model.window_pattern marks S (every layer without a pattern)
        self.blocks = nn.ModuleList(Block(cfg, attention, window) for window in cfg.layer_windows())
        self.recompute = BlockRecompute(cfg, attention)  # which blocks keep only their input (memory lever)
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input/output embeddings, as in GPT-2

        # GPT-2 init: N(0, 0.02), residual projections scaled by 1/√(2·n_layer).
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def hidden(self, idx: Tensor, positions: Tensor | None = None, document_ids: Tensor | None = None) -> Tensor:
        """Residual stream after the last block, (B, N, C), for token ids (B, N) at `positions` (default 0..N-1);
        with `document_ids` (B, N) (non-decreasing ints, data.document_mask) a token attends within its document."""
        x = self.wte(idx)
        cos, sin = self.rotary(idx.shape[1], positions)
        for i, block in enumerate(self.blocks):
            x = (self.recompute(block, x, cos, sin, document_ids) if self.recompute.applies(i)
                 else block(x, cos, sin, document_ids))
        return x

    def head(self, h: Tensor) -> Tensor:
        """LM logits for residual states h (final norm + tied LM head)."""
        return self.lm_head(self.ln_f(h))

    def forward(self, idx: Tensor, targets: Tensor, document_ids: Tensor | None = None) -> Tensor:
        """Mean next-token cross-entropy of `targets` given `idx` (both (B, N)), within documents if given ids."""
        return self.loss(self.hidden(idx, document_ids=document_ids), targets)

    def loss(self, h: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of the LM head on residual states h (B, N, C) against targets (B, N)."""
        return self.summed_loss(h, targets) / targets.numel()

    def summed_loss(self, h: Tensor, targets: Tensor) -> Tensor:
        """Summed cross-entropy, model.loss_chunk tokens at a time (the chunks' logits are made, reduced and
        dropped, and remade in the backward)."""
        head_params = [*self.ln_f.parameters(), self.lm_head.weight]
        return chunked_sum(self.loss_sum, h, targets, self.cfg.loss_chunk, head_params)

    def loss_sum(self, h: Tensor, targets: Tensor) -> Tensor:
        """Summed cross-entropy, logits in fp32."""
        logits = self.head(h).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")

    def compile_regions(self, backend: str = "inductor") -> None:
        """torch.compile the token-local pieces of the model (regional compilation, as torchtitan compiles per
        block): each block's RoPE (run by sdpa and naive, and by flash in recomputed blocks; flash otherwise applies
        RoPE in its own kernels from the projection) and its LayerNorm + MLP, and the LM head + loss. The qkv
        projection is one matmul, no faster compiled.

        The attention call between them stays eager (flash's kernels; its custom ops only where Dynamo traces a
        whole model), so every memory lever wraps compiled code unchanged: recompute and kept attention rerun the
        same compiled pieces, chunking calls them per chunk. Shapes repeat from step to step, so each piece
        compiles once (once more for a ragged last chunk, and for the no-grad forward of a recomputed block) and
        never again.
        """
        # each region meets a handful of shapes and strides (chunks and a ragged last chunk, grad and no-grad,
        # recomputed or not, eval): room for all of them, where Dynamo's default (8) would fall back to eager
        limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 32))
        for block in self.blocks:
            block.attn.rotate = torch.compile(block.attn.rotate, backend=backend, dynamic=False)
            block.norm_mlp = torch.compile(block.norm_mlp, backend=backend, dynamic=False)
        self.loss_sum = torch.compile(self.loss_sum, backend=backend, dynamic=False)

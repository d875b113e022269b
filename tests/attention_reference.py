"""float64 references shared by the attention and kernel tests: attention, and RoPE's rotation."""
import math

import torch


def reference_attention(q, k, v, causal: bool, scale: float | None = None):
    """softmax(scale · q kᵀ [+ causal mask]) v computed in float64 on upcast inputs."""
    q, k, v = (t.double() for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def rel_err(x, ref) -> float:
    """‖x − ref‖ / ‖ref‖, with the denominator floored at 1 so an exactly-zero reference (dQ at seq 1) is an absolute check."""
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1.0)).item()


def rotate64(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """RoPE in float64, [x1, x2] -> [x1 cos - x2 sin, x1 sin + x2 cos]: x (B, N, H, D), angles (N, D/2)."""
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = angles.double().cos()[:, None], angles.double().sin()[:, None]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)


def rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in float64 from tables, [x1, x2] -> [x1 cos - x2 sin, x1 sin + x2 cos]: x (B, N, H, D), cos and sin
    (N, D/2) (or (N, 1, D/2)), e.g. a YaRN model's, whose temperature they carry."""
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = (t.double().reshape(x.shape[1], 1, -1) for t in (cos, sin))
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)


def visible_mask(n_q: int, n_k: int, causal: bool, window: int | None = None, q_ids=None, k_ids=None,
                 q_offset: int = 0, k_offset: int = 0) -> torch.Tensor:
    """The (n_q, n_k) boolean mask of which keys each query sees, or (B, n_q, n_k) with document ids ((B, n) each):
    queries at positions q_offset + i, keys at k_offset + j; causal j <= i; window: causal i − window < j, non-causal
    |i − j| < window; documents: equal ids."""
    i = torch.arange(n_q)[:, None] + q_offset
    j = torch.arange(n_k)[None, :] + k_offset
    vis = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        vis &= j <= i
    if window is not None:
        vis &= (i - j < window) if causal else ((i - j).abs() < window)
    if q_ids is not None:
        vis = vis & (q_ids.cpu()[:, :, None] == k_ids.cpu()[:, None, :])
    return vis


def masked_attention(q, k, v, visible, scale: float | None = None):
    """float64 (o, lse base 2) of softmax(scale · q kᵀ, keys where `visible` is False left out) v, with GQA (k, v with
    fewer heads: query head h reads K/V head h // group). visible: (Nq, Nk) or (B, Nq, Nk). Rows that see nothing:
    o = 0, lse = −inf."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    vis = visible if visible.dim() == 2 else visible[:, None]
    s = ((q @ k.transpose(-2, -1)) * scale).masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.clamp_min(-1e300)[..., None]).nan_to_num(0.0)
    return p @ v, lse / math.log(2)

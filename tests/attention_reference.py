"""float64 references shared by the attention and kernel tests: attention, and RoPE's rotation."""
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

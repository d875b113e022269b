"""float64 references for one block of ring attention's backward (launch.launch_backward_block): the query rows of a
rank against one block of keys, with the whole rows' LSE and delta, and the buffers laid out as the ring lays them out.
Shared by tests/test_backward_block.py (CPU) and tests/test_gpu_ring_backward.py."""
import math

import torch

from attention_reference import masked_attention
from minigpt.distributed.ring_attention import unstack_kv


def row_statistics(q, keys_and_values, do, scale, visible=None):
    """float64 (lse base 2, delta) of the rows of q over all the (k, v) pairs given (the ring's whole row: every block
    the rows see), delta = rowsum(dO ∘ O) with O the attention over all of them. visible: (Nq, ΣNk) or None (all)."""
    k = torch.cat([kv[0] for kv in keys_and_values], dim=2)
    v = torch.cat([kv[1] for kv in keys_and_values], dim=2)
    if visible is None:
        visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    o, lse2 = masked_attention(q, k, v, visible.to(q.device), scale)
    return lse2, (do.double() * o).sum(-1)


def block_gradients(q, k, v, do, lse2, delta, scale, visible=None):
    """float64 (dq, dk, dv) of one block, the kernels' formulas with the whole rows' lse (base 2) and delta:
    P = 2^(scale·log2(e)·q kᵀ − lse), dS = P ∘ (dO vᵀ − delta), dQ = scale · dS k, dK = scale · dSᵀ q, dV = Pᵀ dO,
    dK and dV summed over each K/V head's group of query heads (GQA). visible: (Nq, Nk) bool, P = 0 elsewhere."""
    q, k, v, do, lse2, delta = (t.double() for t in (q, k, v, do, lse2, delta))
    group = q.shape[1] // k.shape[1]
    kq, vq = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ kq.transpose(-2, -1)) * scale
    p = torch.exp(s - lse2[..., None] * math.log(2))
    if visible is not None:
        p = p.masked_fill(~visible.to(p.device), 0.0)
    ds = p * (do @ vq.transpose(-2, -1) - delta[..., None])
    dq = scale * ds @ kq
    dk = (scale * ds.transpose(-2, -1) @ q).unflatten(1, (k.shape[1], group)).sum(2)
    dv = (p.transpose(-2, -1) @ do).unflatten(1, (k.shape[1], group)).sum(2)
    return dq, dk, dv


def causal_mask(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def ring_block_inputs(B, H, Hkv, c, D, dtype, device, rows: slice, keys: slice, causal: bool, seed: int = 0):
    """A rank's view of one launch, as ring_backward has it: q, do (B, H, 2c, D) head-transposed views of
    (B, 2c, H, D) buffers (the model's layout), a key block's k, v as unstack_kv views of a (2, B, 2c, Hkv, D) message;
    the launch's rows and keys are slices of those. Its rows also see one more block of 2c keys (all of them; the
    local block causally where `causal`), so lse and delta (the whole rows', fp32 (B, H, 2c) contiguous, as the
    forward and launch_backward_delta leave them) are not the block's own. Returns a dict: q, k, v, do (full), the
    launch's views qb, kb, vb, dob, lseb, deltab, and float64 refs (dq, dk, dv) of the launch."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = 2 * c
    q = torch.randn(B, n, H, D, generator=g).to(dtype).to(device).transpose(1, 2)
    do = torch.randn(B, n, H, D, generator=g).to(dtype).to(device).transpose(1, 2)
    k, v = unstack_kv(torch.randn(2, B, n, Hkv, D, generator=g).to(dtype).to(device))
    other = [t.to(dtype).to(device) for t in (torch.randn(B, Hkv, n, D, generator=g),
                                              torch.randn(B, Hkv, n, D, generator=g))]
    scale = D ** -0.5
    kb, vb = k[:, :, keys], v[:, :, keys]
    n_q, n_k = rows.stop - rows.start, keys.stop - keys.start
    visible = causal_mask(n_q) if causal else None  # the launch's mask (causal: its rows are its keys)
    block = visible if causal else torch.ones(n_q, n_k, dtype=torch.bool)
    lse2, delta = row_statistics(q[:, :, rows], [(kb, vb), tuple(other)], do[:, :, rows], scale,
                                 torch.cat((block, torch.ones(n_q, n, dtype=torch.bool)), 1))
    lse = torch.full((B, H, n), float("nan"), dtype=torch.float32, device=device)
    delta_full = torch.full((B, H, n), float("nan"), dtype=torch.float32, device=device)
    lse[:, :, rows], delta_full[:, :, rows] = lse2.float(), delta.float()
    refs = block_gradients(q[:, :, rows], kb, vb, do[:, :, rows], lse2, delta, scale, visible)
    return dict(q=q, k=k, v=v, do=do, qb=q[:, :, rows], kb=kb, vb=vb, dob=do[:, :, rows], lseb=lse[:, :, rows],
                deltab=delta_full[:, :, rows], scale=scale, refs=refs)

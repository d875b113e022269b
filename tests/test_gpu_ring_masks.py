"""GPU-only: ring attention with document ids, sliding windows and GQA on 2 GPUs (NCCL), bf16 at 8K-16K tokens,
against the one-GPU kernel on the whole sequence and a float32 masked SDPA reference (outputs and q/k/v gradients)
(python -m pytest -m gpu tests/test_gpu_ring_masks.py). The CPU twin, in fp32 under Triton's interpreter on gloo,
is tests/test_ring_masks.py.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from attention_reference import rel_err, visible_mask
from minigpt.distributed.sharding import shard_document_ids, zigzag_shard, zigzag_unshard
from processes import launch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]
TOL = 1e-2  # relative error against float32: bf16 keeps 8 mantissa bits


def documents(kind: str | None, B: int, N: int, seed: int = 0) -> torch.Tensor | None:
    """(B, N) int32 ids: "ragged" random lengths of 1 to 3000 tokens, different per row."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed)
    rows = [torch.repeat_interleave(torch.arange(N), torch.randint(1, 3000, (N,), generator=g))[:N] for _ in range(B)]
    return torch.stack(rows).int()


def inputs(case: dict) -> dict:
    """The whole sequence (CPU, bf16): q (B, N, Hq, D), k, v (B, N, Hkv, D), dO, document ids."""
    g = torch.Generator().manual_seed(0)
    B, N, Hq, Hkv, D = case["B"], case["N"], case["Hq"], case["Hkv"], case["D"]
    shapes = {"q": (B, N, Hq, D), "k": (B, N, Hkv, D), "v": (B, N, Hkv, D), "do": (B, N, Hq, D)}
    return {**{n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()},
            "ids": documents(case.get("docs"), B, N)}


def _worker(rank, cases, out):
    from minigpt.distributed.ring_attention import ring_attention

    from minigpt.distributed.process import use_nccl_settings

    torch.cuda.set_device(rank)
    use_nccl_settings()  # as the trainer's processes run
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    results = []
    for case in cases:
        x = inputs(case)
        shard = [zigzag_shard(x[n], 2, rank, dim=1).cuda().requires_grad_() for n in ("q", "k", "v")]
        ids = None if x["ids"] is None else shard_document_ids(x["ids"], 2, rank).cuda()
        o = ring_attention(*(t.transpose(1, 2) for t in shard), None, window=case.get("window"), document_ids=ids)
        o.transpose(1, 2).backward(zigzag_shard(x["do"], 2, rank, dim=1).cuda())
        got = {"o": o.transpose(1, 2), "dq": shard[0].grad, "dk": shard[1].grad, "dv": shard[2].grad}
        gathered = [None] * 2
        dist.all_gather_object(gathered, {n: t.detach().cpu() for n, t in got.items()})
        results.append(gathered)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def one_gpu(case: dict) -> tuple[dict, dict]:
    """(float32 SDPA reference, our kernel on one GPU): o and the q/k/v gradients over the whole sequence."""
    from minigpt_kernels.flash_attention import flash_attention

    x = inputs(case)
    N, window, ids = case["N"], case.get("window"), x["ids"]
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (x[n].cuda().to(dtype).transpose(1, 2).requires_grad_() for n in ("q", "k", "v"))
        if dtype == torch.float32:
            mask = visible_mask(N, N, True, window, ids, ids).cuda()
            group = q.shape[1] // k.shape[1]
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                               attn_mask=mask if mask.dim() == 2 else mask[:, None])
        else:
            o = flash_attention(q, k, v, causal=True, window=window, document_ids=None if ids is None else ids.cuda())
        o.backward(x["do"].cuda().to(dtype).transpose(1, 2))
        out.append({n: t.detach().transpose(1, 2).float().cpu() for n, t in
                    {"o": o, "dq": q.grad, "dk": k.grad, "dv": v.grad}.items()})
    return out[0], out[1]


CASES = [
    dict(B=1, N=8192, Hq=8, Hkv=2, D=64, docs="ragged"),  # documents, GQA group 4
    dict(B=1, N=16384, Hq=4, Hkv=4, D=128, window=1024),  # a window inside a chunk
    dict(B=1, N=8190, Hq=6, Hkv=2, D=64, window=3000),  # more than a chunk, a padded sequence
    dict(B=2, N=8192, Hq=4, Hkv=1, D=128, window=700, docs="ragged"),  # everything, one K/V head
]


def test_ring_with_masks_on_2_gpus_matches_the_one_gpu_kernel(tmp_path):
    out = tmp_path / "ring.pt"
    launch(2, _worker, CASES, str(out))
    for case, ranks in zip(CASES, torch.load(out, weights_only=False)):
        ref, one = one_gpu(case)
        for name in ("o", "dq", "dk", "dv"):
            got = zigzag_unshard([r[name] for r in ranks], dim=1, n=case["N"]).float()
            err, kernel_err = rel_err(got, ref[name].double()), rel_err(one[name], ref[name].double())
            assert err < TOL and err < 2 * kernel_err + 1e-3, (case, name, err, kernel_err)

"""Ring attention (context parallelism) on CPU: 2 and 4 processes on gloo, the flash kernel in Triton's interpreter
(fp32), against a float64 reference of attention over the whole sequence; and the zigzag layout it runs on.

Tolerance: the ring's partial softmaxes are merged in another order than the single kernel sums them, so fp32
results agree to rounding (1e-5 of the reference).
"""
import pytest
import torch

from minigpt.distributed.ring_attention import RingFlashAttention, ring_attention
from minigpt.distributed.sharding import padded_len, zigzag_positions, zigzag_shard, zigzag_unshard
from processes import launch


def reference_attention(q, k, v):
    """Causal softmax(q kᵀ/√d) v in float64, and its base-2 row log-sum-exp."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    n = q.shape[2]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v, torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0, dtype=torch.float64))


def _ring_worker(rank, n, out):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    B, H, D = 1, 2, 16
    q, k, v, do = (torch.randn(B, n, H, D) for _ in range(4))  # the model's (B, N, H, D) layout
    shard = [zigzag_shard(t, world, rank, dim=1).requires_grad_() for t in (q, k, v)]
    o = ring_attention(*(t.transpose(1, 2) for t in shard), group=None)  # (B, H, N_local, D) views, as in the model
    o.transpose(1, 2).backward(zigzag_shard(do, world, rank, dim=1))  # short shards: with the forward's kept blocks
    import minigpt.distributed.ring_attention as ring_module
    received = []  # what the forward keeps: every other rank's block, in step order
    with torch.no_grad():
        ring_module.ring_forward(*(t.transpose(1, 2) for t in shard), None, 0.25, received=received)
    kept_blocks = [kv for kv, _ in received]
    # kept attention: forward_with_lse, then the saved forward made differentiable; and every accumulator hop
    # waited for at once (as for long shards), where above each one overlapped the next block's compute
    ring_module.SERIAL_HOP_BYTES = 0
    kept = [t.detach().clone().requires_grad_() for t in shard]
    backend = RingFlashAttention(None)
    o2, lse = backend.forward_with_lse(*(t.transpose(1, 2) for t in kept))
    backend.attend_saved(*(t.transpose(1, 2) for t in kept), o2, lse).transpose(1, 2).backward(
        zigzag_shard(do, world, rank, dim=1))
    gathered = [None] * world
    dist.all_gather_object(gathered, {"o": o.transpose(1, 2).detach(), "dq": shard[0].grad, "dk": shard[1].grad,
                                      "dv": shard[2].grad, "lse": lse.transpose(1, 2), "o_kept": o2.transpose(1, 2),
                                      "dq_kept": kept[0].grad, "dk_kept": kept[1].grad, "dv_kept": kept[2].grad,
                                      "kv": ring_module.stack_kv(shard[1].detach().transpose(1, 2),
                                                                 shard[2].detach().transpose(1, 2)),
                                      "kept_blocks": kept_blocks})
    if rank == 0:
        torch.save({"q": q, "k": k, "v": v, "do": do, "ranks": gathered}, out)
    dist.destroy_process_group()


@pytest.mark.parametrize("world,n", [(2, 64), (4, 60)])  # 60: not 8 equal chunks, padded at the end to 64
def test_ring_attention_equals_whole_sequence_attention(world, n, tmp_path):
    out = tmp_path / "ring.pt"
    launch(world, _ring_worker, n, str(out))
    got = torch.load(out, weights_only=False)
    q, k, v = (got[name].transpose(1, 2).double().requires_grad_() for name in ("q", "k", "v"))
    o_ref, lse_ref = reference_attention(q, k, v)
    o_ref.backward(got["do"].transpose(1, 2).double())
    expected = {"o": o_ref, "dq": q.grad, "dk": k.grad, "dv": v.grad, "lse": lse_ref}

    def full(name):  # every rank's shard put back in sequence order, as (B, H, N, D)
        return zigzag_unshard([r[name] for r in got["ranks"]], dim=1, n=n).transpose(1, 2).double()

    for name in ("o", "dq", "dk", "dv", "lse"):
        torch.testing.assert_close(full(name), expected[name], rtol=1e-5, atol=2e-6, msg=name)
    for name in ("o", "dq", "dk", "dv"):  # kept attention: the same, without rerunning the ring forward (its
        # backward sends the blocks again: no forward kept them)
        torch.testing.assert_close(full(f"{name}_kept"), expected[name], rtol=1e-5, atol=2e-6, msg=name)
    for rank, r in enumerate(got["ranks"]):  # the forward kept the K-1 blocks it received: rank - 1's first
        assert len(r["kept_blocks"]) == world - 1
        assert torch.equal(r["kept_blocks"][0], got["ranks"][(rank - 1) % world]["kv"])


def test_zigzag_layout():
    # 2 ranks, 8 tokens: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7] and zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    x = torch.arange(32).view(1, 32)
    shards = [zigzag_shard(x, 3, r, dim=1, pad=-1) for r in range(3)]  # padded to 36 = 6 chunks of 6
    assert padded_len(32, 3) == 36 and shards[0][0, -6:].tolist() == [30, 31, -1, -1, -1, -1]
    assert torch.equal(zigzag_unshard(shards, dim=1, n=32), x)
    with pytest.raises(ValueError, match="does not split into"):
        zigzag_positions(30, 4, 0)
    q = torch.zeros(1, 2, 7, 16)
    with pytest.raises(ValueError, match="two chunks"):
        ring_attention(q, q, q, group=None)



def test_a_recomputed_blocks_k_and_v_travel_the_ring_without_a_copy(tiny_config):
    """The block recompute makes k and v the halves of one buffer; the ring sends that buffer as it is."""
    from minigpt.attention import get_attention
    from minigpt.levers import _BlockPieces
    from minigpt.model import GPT
    from minigpt.distributed.ring_attention import stack_kv

    cfg = tiny_config().model
    model = GPT(cfg, 256, get_attention("sdpa"))
    x = torch.randn(2, 40, cfg.n_embd).to(torch.bfloat16)
    cos, sin = model.rotary(40)
    pieces = _BlockPieces(model.blocks[0], cos, sin, 16, torch.float32, x.device, None)
    with torch.no_grad():
        q, k, v = pieces.heads(x)
        ref = model.blocks[0].attn.heads(model.blocks[0].ln_1(x.float()), cos, sin)
    for got, want in zip((q, k, v), ref):
        torch.testing.assert_close(got, want)
    k, v = k.requires_grad_(), v.requires_grad_()  # as the recompute's backward makes them
    message = stack_kv(k.transpose(1, 2), v.transpose(1, 2))
    assert message.data_ptr() == k.data_ptr() and message[1].data_ptr() == v.data_ptr()
    separate = stack_kv(k.detach().clone().transpose(1, 2), v.detach().clone().transpose(1, 2))
    assert separate.data_ptr() != k.data_ptr() and torch.equal(separate, message)


def test_the_call_fence_waits_for_the_call_lag_calls_back():
    """The host waits, as a ring call starts, for the end of the call `lag` calls back (the memory NCCL pinned
    is reused only once the GPU is past it), and with lag 0 for the call itself as it ends; long shards take lag 0,
    short ones 2."""
    from minigpt.distributed.ring_attention import SERIAL_HOP_BYTES, CallFence, fence_lag

    log = []

    class Event:  # stands in for torch.cuda.Event: records what the fence asks of it
        made = 0

        def __init__(self):
            self.call, Event.made = Event.made, Event.made + 1

        def record(self):
            log.append(("end of call", self.call))

        def synchronize(self):
            log.append(("host waits for", self.call))

    def waits():
        return [call for what, call in log if what == "host waits for"]

    fence = CallFence(Event)
    for _ in range(4):  # calls 0-3, lag 2: call 2 waits for call 0, call 3 for call 1
        fence.enter(2)
        fence.leave(2)
    assert waits() == [0, 1]
    fence.enter(1)  # lag 1: calls 2 and 3 both done before it starts
    assert waits() == [0, 1, 2, 3]
    fence.leave(1)
    fence.enter(0)  # lag 0 after a lag-1 call: that call (4) done first
    assert waits() == [0, 1, 2, 3, 4]
    fence.leave(0)  # and lag 0 waits for its own end (call 5)
    assert waits() == [0, 1, 2, 3, 4, 5] and log[-2:] == [("end of call", 5), ("host waits for", 5)]
    fence.enter(2)  # nothing left in flight: no wait
    assert waits() == [0, 1, 2, 3, 4, 5]
    channels = 768  # a K/V message is 2 · N · channels bf16 values
    long_n = -(-SERIAL_HOP_BYTES // (2 * channels * 2))  # the shortest long shard
    assert fence_lag(torch.empty(1, 1, long_n, channels, dtype=torch.bfloat16)) == 0
    assert fence_lag(torch.empty(1, 1, long_n - 1, channels, dtype=torch.bfloat16)) == 2

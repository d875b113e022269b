"""The memory levers (minigpt/levers.py) on CPU: block recompute (+ bf16 stored inputs, offload, kept attention),
chunked MLP and chunked loss give the same loss and gradients as the plain model, and count what they keep."""
import json
import math
from pathlib import Path

import pytest
import torch

from minigpt.attention import get_attention
from minigpt.model import GPT
from minigpt.run import run


LEVERS = [  # (loss_chunk, recompute_every, recompute_dtype, mlp_chunk, offload)
    (16, 0, "float32", 0, False), (7, 1, "float32", 0, False), (0, 2, "float32", 0, False),
    (0, 0, "float32", 9, False), (0, 1, "float32", 0, True), (13, 1, "float32", 11, True),
]


@pytest.mark.parametrize("loss_chunk,every,dtype,mlp_chunk,offload", LEVERS)
def test_memory_levers_give_the_same_loss_and_gradients(tiny_config, loss_chunk, every, dtype, mlp_chunk, offload):
    cfg = tiny_config().model
    x, y = torch.randint(0, 256, (2, 50)), torch.randint(0, 256, (2, 50))

    def loss_and_grads(**levers):
        for key, value in levers.items():
            setattr(cfg, key, value)
        torch.manual_seed(0)
        model = GPT(cfg, 256, get_attention("sdpa"))
        loss = model(x, y)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    base_loss, base_grads = loss_and_grads(loss_chunk=0, recompute_every=0, recompute_dtype="float32", mlp_chunk=0, offload=False)
    loss, grads = loss_and_grads(loss_chunk=loss_chunk, recompute_every=every, recompute_dtype=dtype,
                                 mlp_chunk=mlp_chunk, offload=offload)
    assert math.isclose(loss, base_loss, rel_tol=1e-5)
    for a, b in zip(grads, base_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("every", [0, 1])
def test_chunking_gives_each_parameter_one_gradient_and_no_full_size_slice_gradients(tiny_config, every):
    """DDP's hooks must fire once per parameter and step, so the chunks' parameter gradients are summed inside
    the chunked node; and the input gradient is one buffer, not a full-size zero gradient per chunk."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = tiny_config("model.loss_chunk=16", "model.mlp_chunk=12", f"model.recompute_every={every}").model
    model = GPT(cfg, 256, get_attention("sdpa"))
    x, y = torch.randint(0, 256, (2, 50)), torch.randint(0, 256, (2, 50))
    calls = {name: 0 for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: calls.__setitem__(name, calls[name] + 1))

    class Ops(TorchDispatchMode):
        seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        model(x, y).backward()
    assert set(calls.values()) == {1}, calls
    assert "slice_backward" not in ops.seen


def test_bf16_checkpoints_round_the_stored_input_only(tiny_config):
    """bfloat16 block checkpoints: close to the fp32 model, and the gradient is exact for the rounded forward."""
    cfg = tiny_config().model
    x, y = torch.randint(0, 256, (2, 40)), torch.randint(0, 256, (2, 40))
    torch.manual_seed(0)
    model = GPT(cfg, 256, get_attention("sdpa"))
    plain = model(x, y).item()
    cfg.recompute_every, cfg.recompute_dtype = 1, "bfloat16"
    torch.manual_seed(0)
    model = GPT(cfg, 256, get_attention("sdpa"))  # the same weights, with the lever on
    loss = model(x, y)
    assert loss.item() != plain and math.isclose(loss.item(), plain, rel_tol=1e-2)
    # exact gradient of the rounded model: compare with autograd through an explicit rounding (straight-through)
    params = list(model.parameters())
    loss.backward()
    grads = [p.grad.clone() for p in params]

    def rounded_hidden(idx):
        h = model.wte(idx)
        cos, sin = model.rotary(idx.shape[1])
        for block in model.blocks:
            h = h + (h.to(torch.bfloat16).float() - h).detach()
            h = block(h, cos, sin)
        return h
    ref = model.loss(rounded_hidden(x), y)
    assert math.isclose(ref.item(), loss.item(), rel_tol=1e-6)
    for a, b in zip(grads, torch.autograd.grad(ref, params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("keep", [False, True])
def test_offloaded_host_memory_is_counted_and_released(tiny_config, keep):
    """HostMemory counts what offloading holds: each recomputed block's bf16 input (and with kept attention its
    output and fp32 LSE) until the backward frees it; summary.json reports the peak."""
    from minigpt.levers import HostMemory

    cfg = tiny_config("attention=flash" if keep else "attention=sdpa").model
    cfg.recompute_every, cfg.recompute_dtype, cfg.offload, cfg.keep_attention = 1, "bfloat16", True, keep
    model = GPT(cfg, 256, get_attention("flash" if keep else "sdpa"))
    B, N, C, H = 2, 48, cfg.n_embd, cfg.n_head
    x, y = torch.randint(0, 256, (B, N)), torch.randint(0, 256, (B, N))
    before = HostMemory.live
    HostMemory.reset_peak()
    loss = model(x, y)
    per_block = B * N * C * 2 + (B * N * C * 4 + B * H * N * 4 if keep else 0)  # fp32 compute: o is fp32 on CPU
    assert HostMemory.live - before == cfg.n_layer * per_block
    loss.backward()
    assert HostMemory.live == before and HostMemory.peak - before == cfg.n_layer * per_block


def test_summary_reports_the_offloaded_host_memory(tiny_config):
    cfg = tiny_config("model.recompute_every=1", "model.offload=true", "max_steps=2", "eval_batches=0")
    assert run(cfg) == 0
    summary = json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    expected = cfg.model.n_layer * cfg.batch_size * cfg.seq_len * cfg.model.n_embd * 4 / 2**30  # fp32 inputs
    assert summary["peak_host_offload_gib"] == pytest.approx(expected)


def test_a_recomputed_block_with_frozen_parameters_trains_the_others(tiny_config):
    cfg = tiny_config("model.mlp_chunk=7").model
    x, y = torch.randint(0, 256, (2, 30)), torch.randint(0, 256, (2, 30))
    grads = []
    for every in (0, 1):
        cfg.recompute_every = every
        torch.manual_seed(0)
        model = GPT(cfg, 256, get_attention("sdpa"))
        model.blocks[0].ln_1.weight.requires_grad_(False)
        model.blocks[-1].mlp.c_fc.weight.requires_grad_(False)
        model(x, y).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

"""Regional torch.compile with every documented lever combination: the eager losses, no graph break, and no
recompilation after the first step.

On CPU the regions are compiled with the `aot_eager` backend: Dynamo's tracing and AOTAutograd, which is where
graph breaks and recompiles come from, without Inductor's C++ code generation (minutes on 2 cores). Inductor
itself is checked on the GPU (tests/test_gpu.py).
"""
import math

import pytest
import torch
from torch._dynamo.utils import counters

from minigpt.attention import get_attention
from minigpt.model import GPT

LEVER_SETS = {  # docs/memory.md's levers and their combinations as the sweep names them
    "none": [],
    "ckpt": ["model.recompute_every=1"],
    "ckpt+losschunk": ["model.recompute_every=1", "model.loss_chunk=48"],
    "levers": ["model.recompute_every=1", "model.recompute_dtype=bfloat16", "model.loss_chunk=48", "model.mlp_chunk=40"],
    "levers+offload": ["model.recompute_every=1", "model.recompute_dtype=bfloat16", "model.loss_chunk=48",
                       "model.mlp_chunk=40", "model.offload=true"],
    "flash+levers+offload+keepattn": ["attention=flash", "model.recompute_every=1", "model.loss_chunk=48",
                                      "model.mlp_chunk=40", "model.offload=true", "model.keep_attention=true"],
}


def losses(cfg, compiled: bool, steps: int = 3) -> tuple[list[float], list[dict]]:
    torch.manual_seed(0)
    model = GPT(cfg.model, 256, get_attention(cfg.attention.name))
    if compiled:
        model.compile_regions(backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))  # chunks of 48 and 40: ragged tails
    out, stats = [], []
    for _ in range(steps):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
        stats.append(dict(counters["stats"]))
    return out, stats


@pytest.mark.parametrize("name", LEVER_SETS)
def test_compiled_regions_match_eager_with_every_lever(tiny_config, name):
    cfg = tiny_config(*LEVER_SETS[name])
    eager, _ = losses(cfg, compiled=False)
    torch._dynamo.reset()
    counters.clear()
    compiled, stats = losses(cfg, compiled=True)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(eager, compiled)), (eager, compiled)
    assert stats[0].get("unique_graphs", 0) > 0  # something was compiled ...
    assert stats[-1] == stats[0]  # ... in the first step only: no recompilation afterwards
    assert not counters["graph_break"], dict(counters["graph_break"])

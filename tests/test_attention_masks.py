"""GQA, sliding windows and document masks above the kernel (issue 33): the backends agree with a float64 reference,
the model attends within its windows and documents, batches carry document ids, and what cannot run is refused.

The backends (naive, sdpa, flash in Triton's interpreter in fp32, flex) are compared against
attention_reference.masked_attention, outputs and q/k/v gradients, over GQA groups 1, 2, 3 and one K/V head; windows
of 1, a few tokens and >= N; documents of one token, not aligned to anything, a single one; combined; causal and not.
FlexAttention has no backward on CPU: here it is checked forward only (each mask compiles once, ~10 s), its gradients
under `-m gpu`.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from attention_reference import masked_attention, visible_mask
from conftest import HAS_TRITON
from minigpt.attention import get_attention
from minigpt.checkpoint import find_and_load, restore
from minigpt.compose import compose
from minigpt.config import ConfigError, ModelConfig
from minigpt.data import PasskeyData, TokenData, document_ids
from minigpt.model import GPT
from minigpt.train import make_optimizer
from test_faults import cli, one_line_error

CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="flash needs Triton")


def documents(kind: str, B: int, N: int) -> torch.Tensor | None:
    """(B, N) int32 ids, as the data yields them: "tokens" one token each, "ragged" lengths aligned to nothing
    (different per row), "one" a single document, "none" no ids."""
    if kind == "none":
        return None
    if kind == "tokens":
        return torch.arange(N, dtype=torch.int32).repeat(B, 1)
    if kind == "one":
        return torch.zeros(B, N, dtype=torch.int32)
    lengths = ([4, 17, 1, 2, 60], [21, 3, 9, 1, 60])  # cut at N
    return torch.stack([torch.repeat_interleave(torch.arange(5), torch.tensor(ls))[:N] for ls in lengths[:B]]).int()


def inputs(B, N, Hq, Hkv, D, seed, device="cpu"):
    """q (B, Hq, N, D), k, v (B, Hkv, N, D): head-transposed views of one (B, N, Hq + 2·Hkv, D) leaf, as the model's
    projection lays them out."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, Hq + 2 * Hkv, D, generator=g).to(device).requires_grad_()
    q, k, v = qkv.split((Hq, Hkv, Hkv), dim=2)
    return qkv, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def reference(qkv, Hq, Hkv, causal, window, ids):
    """float64 output (B, Hq, N, D) of the same leaf, with an explicit boolean mask."""
    q, k, v = qkv.detach().double().cpu().split((Hq, Hkv, Hkv), dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    N = qkv.shape[1]
    return q, k, v, visible_mask(N, N, causal, window, ids, ids)


# (Hq, Hkv, N, causal, window, documents): odd lengths; flash's interpreter tiles are 16-32 tokens
CASES = [
    (3, 3, 37, True, None, "none"),      # plain multi-head
    (4, 2, 37, True, None, "none"),      # GQA, group 2
    (6, 2, 41, False, None, "none"),     # group 3, non-causal
    (4, 1, 41, True, None, "none"),      # one K/V head
    (2, 2, 37, True, 1, "none"),         # window 1: the diagonal
    (2, 1, 45, False, 4, "none"),        # a few tokens either side
    (2, 2, 40, True, 40, "none"),        # window >= N
    (2, 2, 33, False, 50, "none"),
    (2, 2, 37, True, None, "tokens"),    # documents of one token
    (4, 2, 45, False, None, "tokens"),
    (2, 2, 53, True, None, "ragged"),    # documents aligned to nothing
    (3, 1, 53, False, None, "ragged"),
    (2, 2, 37, True, None, "one"),       # a single document
    (6, 2, 53, True, 6, "ragged"),       # combined
    (4, 1, 53, False, 6, "ragged"),
    (3, 3, 53, True, 3, "tokens"),
]
BACKENDS = ["naive", "sdpa", pytest.param("flash", marks=needs_triton)]


def check_backend(name, Hq, Hkv, N, causal, window, docs, device="cpu", grads=True, tol=1e-5):
    B, D = 2, 16
    qkv, q, k, v = inputs(B, N, Hq, Hkv, D, seed=N * 7 + Hq + Hkv, device=device)
    ids = documents(docs, B, N)
    if not grads:
        q, k, v = (t.detach() for t in (q, k, v))
    o = get_attention(name)(q, k, v, causal=causal, window=window,
                            document_ids=None if ids is None else ids.to(device))
    q64, k64, v64, visible = reference(qkv, Hq, Hkv, causal, window, ids)
    q64, k64, v64 = (t.requires_grad_() for t in (q64, k64, v64))
    want, _ = masked_attention(q64, k64, v64, visible)
    assert o.shape == q.shape and o.dtype == q.dtype
    torch.testing.assert_close(o.double().cpu(), want, rtol=tol, atol=tol)
    if not grads:
        return
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(N))
    got = torch.autograd.grad(o, (q, k, v), do.to(device))
    ref = torch.autograd.grad(want, (q64, k64, v64), do.double())
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.double().cpu(), r, rtol=tol, atol=tol)


@pytest.mark.parametrize("Hq,Hkv,N,causal,window,docs", CASES)
@pytest.mark.parametrize("name", BACKENDS)
def test_backends_match_float64_with_gqa_windows_and_documents(name, Hq, Hkv, N, causal, window, docs):
    check_backend(name, Hq, Hkv, N, causal, window, docs)


@pytest.mark.parametrize("Hq,Hkv,N,causal,window,docs", [CASES[1], CASES[11], CASES[14]])
def test_flex_forward_on_cpu_matches_float64(Hq, Hkv, N, causal, window, docs):
    """FlexAttention runs on CPU without gradients (compiled): GQA, documents, window + documents, causal and not."""
    check_backend("flex", Hq, Hkv, N, causal, window, docs, grads=False)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("Hq,Hkv,N,causal,window,docs", CASES)
@pytest.mark.parametrize("name", ["sdpa", "flex"])
def test_gpu_backends_match_float64_with_gradients(name, Hq, Hkv, N, causal, window, docs):
    """On a GPU (fp32; flex's dots may take TF32): sdpa's explicit mask and GQA, flex's mask_mod, with gradients."""
    check_backend(name, Hq, Hkv, N, causal, window, docs, device="cuda", tol=2e-3)


@needs_triton
def test_flash_kept_attention_reuses_its_masked_forward():
    """forward_with_lse, then attend_saved (keep_attention's pair) with GQA, a window and documents: the output and
    gradients of the plain call."""
    flash = get_attention("flash")
    qkv, q, k, v = inputs(2, 45, 4, 2, 16, seed=3)
    masks = dict(window=7, document_ids=documents("ragged", 2, 45))
    o = flash(q, k, v, **masks)
    do = torch.randn_like(o)
    want = torch.autograd.grad(o, qkv, do)[0]
    with torch.no_grad():
        o_saved, lse = flash.forward_with_lse(q, k, v, **masks)
    saved = flash.attend_saved(q, k, v, o_saved, lse, **masks)
    torch.testing.assert_close(saved, o)
    torch.testing.assert_close(torch.autograd.grad(saved, qkv, do)[0], want)


def test_flex_block_masks_are_cached_without_documents_and_remade_with_new_ones():
    flex = get_attention("flex")
    one = flex.block_mask(40, True, 5, None, torch.device("cpu"))
    assert flex.block_mask(40, True, 5, None, torch.device("cpu")) is one
    assert flex.block_mask(40, True, None, None, torch.device("cpu")) is not one
    assert flex.block_mask(40, False, None, None, torch.device("cpu")) is None  # full attention: no mask
    ids = documents("ragged", 2, 40)
    first = flex.block_mask(40, True, 5, ids, torch.device("cpu"))
    assert flex.block_mask(40, True, 5, ids, torch.device("cpu")) is first  # the next layer of the same forward
    assert flex.block_mask(40, True, 5, ids.clone(), torch.device("cpu")) is not first  # the next batch


# ------------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------------
def masked_model(attention: str, **levers) -> GPT:
    cfg = ModelConfig(name="t", n_layer=3, n_head=4, n_embd=64, n_kv_head=2, window=6, window_pattern="SL", **levers)
    cfg.validate()
    torch.manual_seed(0)
    return GPT(cfg, 64, get_attention(attention))


def test_window_pattern_repeats_over_the_layers_and_is_cut():
    cfg = ModelConfig(name="t", n_layer=7, n_head=4, n_embd=64, window=32, window_pattern="SSL")
    assert cfg.layer_windows() == [32, 32, None, 32, 32, None, 32]
    assert ModelConfig(name="t", n_layer=3, n_head=4, n_embd=64, window=8).layer_windows() == [8, 8, 8]
    assert ModelConfig(name="t", n_layer=2, n_head=4, n_embd=64).layer_windows() == [None, None]
    model = GPT(ModelConfig(name="t", n_layer=3, n_head=4, n_embd=64, n_kv_head=1, window=5, window_pattern="LS"),
                64, get_attention("naive"))
    assert [b.attn.window for b in model.blocks] == [None, 5, None]
    assert model.blocks[0].attn.c_attn.weight.shape == ((4 + 2 * 1) * 16, 64)  # (n_head + 2·n_kv_head)·head_dim


@pytest.mark.parametrize("attention", ["naive", "sdpa", pytest.param("flash", marks=needs_triton)])
def test_a_packed_sequence_attends_within_its_documents(attention):
    """Documents packed into one row with their ids give each document's hidden states as it gives them alone
    (RoPE is relative, so a document's offset in the row does not matter): nothing leaks across a boundary, the
    windows hold inside each document, and GQA's shared heads serve every group."""
    model = masked_model(attention).eval()
    lengths = [9, 1, 14, 7]
    idx = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None].int()
    with torch.no_grad():
        packed = model.hidden(idx, document_ids=ids)
        alone = torch.cat([model.hidden(part) for part in idx.split(lengths, dim=1)], dim=1)
        plain = model.hidden(idx)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(packed[:, 9:], plain[:, 9:], atol=1e-3)  # without ids the later documents see earlier


@pytest.mark.parametrize("attention,levers", [
    ("sdpa", dict(recompute_every=1, mlp_chunk=16)),
    pytest.param("flash", dict(recompute_every=1, keep_attention=True, mlp_chunk=16), marks=needs_triton),
], ids=["recompute", "kept-attention"])
def test_recomputed_blocks_keep_the_masks(attention, levers):
    """Recomputed blocks (chunked; with flash, kept attention) give naive's loss and gradients under GQA, a window
    and documents: the levers hand the block's window and the batch's ids to the attention they rerun."""
    idx = torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(2))
    ids = documents("ragged", 2, 50)
    runs = []
    for model in (masked_model("naive"), masked_model(attention, **levers)):
        loss = model(idx, idx.roll(-1, 1), ids)
        loss.backward()
        runs.append((loss.item(), [p.grad for p in model.parameters()]))
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-5)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# batches carry document ids
# ------------------------------------------------------------------------------------------------
E = 9  # the separator in these tests


def test_document_ids_come_from_the_separators():
    """The separator belongs to the document it ends; a row that starts mid-document counts that part as id 0;
    consecutive separators are documents of one token; ids are int32 and never decrease."""
    x = torch.tensor([[5, E, 7, E, E, 3], [E, 1, 2, 3, E, 4], [1, 2, 3, 4, 5, 6]])
    ids = document_ids(x, E)
    assert ids.dtype == torch.int32
    assert ids.tolist() == [[0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]]


def test_token_batches_carry_ids_with_document_mask_and_keep_every_target():
    stream = np.array([1, 2, E, 3, 4, 5, E, 6, E, 7, 8, 1, 2, E] * 10, dtype=np.uint16)
    plain = TokenData(stream, stream, seq_len=12, seed=0, vocab_size=16, eot=E)
    masked = TokenData(stream, stream, seq_len=12, seed=0, vocab_size=16, eot=E, document_mask=True)
    x, y, none = plain.batch("train", 3, 4)
    mx, my, ids = masked.batch("train", 3, 4)
    assert none is None and torch.equal(x, mx) and torch.equal(y, my)  # the same tokens and targets
    assert torch.equal(ids, document_ids(x, E)) and ids.shape == (4, 12)
    assert (ids[:, 1:] >= ids[:, :-1]).all() and (ids[:, 0] == 0).all()
    assert PasskeyData(seq_len=128, seed=0).batch("train", 0, 2)[2] is None


def test_a_batch_whose_every_row_is_one_document_carries_no_ids():
    """Its mask is plain causal attention, which runs faster unmasked; one row with a boundary keeps them all."""
    long_docs = np.array(([1, 2, 3] * 20 + [E]) * 10, dtype=np.uint16)  # documents of 61 tokens
    data = TokenData(long_docs, long_docs, seq_len=8, seed=0, vocab_size=16, eot=E, document_mask=True)
    seen = {"none": 0, "ids": 0}
    for index in range(40):
        x, _, ids = data.batch("train", index, 2)
        crosses = bool(((x == E)[:, :-1]).any())  # a separator before a row's last token starts a new document
        assert (ids is None) == (not crosses)
        if ids is not None:
            assert torch.equal(ids, document_ids(x, E))
        seen["ids" if crosses else "none"] += 1
    assert seen["none"] > 0 and seen["ids"] > 0


def test_the_trainer_hands_each_layer_its_window_and_the_batchs_document_ids(tiny_config, tmp_path):
    """data=text with data.document_mask: a training step and an evaluation call every layer's attention with the
    ids of its batch's separators and the layer's window (model.window_pattern)."""
    from minigpt.summary import RunSummary
    from minigpt.train import build, evaluate, train_step
    from test_data import write_corpus

    corpus = write_corpus(tmp_path / "corpus", n_files=40, repeat=20)  # documents shorter than seq_len
    cfg = tiny_config("data=text", f"data.path={corpus}", "data.vocab_size=300", "data.val_fraction=0.2",
                      "data.document_mask=true", "model.n_kv_head=2", "model.window=8", "model.window_pattern=SL",
                      "seq_len=64", "attention=naive")
    t = build(cfg, {}, RunSummary(status="running"))
    calls = []
    for block in t.model.blocks:
        real = block.attn.attend

        def recording(q, k, v, causal=True, *, window=None, document_ids=None, real=real):
            calls.append((k.shape[1], window, document_ids))
            return real(q, k, v, causal, window=window, document_ids=document_ids)
        block.attn.attend = recording
    train_step(t, 0)
    x, _, ids = t.data.batch("train", 0, cfg.batch_size)
    assert (x == t.data.eot).any() and ids.max() > 0  # the batch holds a boundary
    assert [(h, w) for h, w, _ in calls] == [(2, 8), (2, None)]
    assert all(torch.equal(d, ids) for _, _, d in calls)
    calls.clear()
    evaluate(t)
    assert len(calls) == 2 and all(torch.equal(d, t.data.batch("val", 0, cfg.batch_size)[2]) for _, _, d in calls)


def test_sampling_a_document_masked_model_keeps_to_the_last_document():
    """A model trained with data.document_mask samples as it trained: after a separator, the next document's tokens
    see nothing before it (minigpt/sample.py's `separator`)."""
    from minigpt.sample import next_token_logits

    model = masked_model("sdpa").eval()
    with torch.no_grad():
        tail = next_token_logits(model, torch.tensor([[3, 4, 5, 6]]), 16, separator=E)
        after = next_token_logits(model, torch.tensor([[1, 2, 7, 8, E, 3, 4, 5, 6]]), 16, separator=E)
        unmasked = next_token_logits(model, torch.tensor([[1, 2, 7, 8, E, 3, 4, 5, 6]]), 16)
    torch.testing.assert_close(after, tail, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(unmasked, tail, atol=1e-3)


# ------------------------------------------------------------------------------------------------
# refusals: one line naming the setting and what to do
# ------------------------------------------------------------------------------------------------
TINY_CPU = ["model=tiny", "device=cpu"]


@pytest.mark.parametrize("overrides,expected,followed", [
    (["model.n_kv_head=3"], "model.n_kv_head=3: must divide model.n_head=4", [["model.n_kv_head=2"],
                                                                                ["model.n_kv_head=null"]]),
    (["model.n_kv_head=0"], "model.n_kv_head=0", []),
    (["model.window=0"], "model.window=0", []),
    (["model.window_pattern=SSL"], "model.window_pattern=SSL: needs model.window", [["model.window=256"]]),
    (["model.window=8", "model.window_pattern=SXL"], "model.window_pattern=SXL: must be letters S", []),
    (["data.document_mask=true"], "data.document_mask=true: data=passkey has no documents",
     [["data.document_mask=false"]]),
    (["model.window=8", "attention.sdpa_backend=flash"], "attention.sdpa_backend=flash takes no",
     [["attention.sdpa_backend=auto"], ["attention.sdpa_backend=math"]]),
    (["data=pycode", "attention.sdpa_backend=cudnn"], "attention.sdpa_backend=cudnn takes no",
     [["attention.sdpa_backend=auto"], ["attention.sdpa_backend=math"]]),
    (["attention=flex"], "attention=flex: PyTorch's FlexAttention has no backward on CPU",
     [["attention=sdpa"], ["attention=naive"]]),
    (["attention=sdpa", "parallel.context=2", "model.n_kv_head=2", "model.window=8", "data=pycode"],
     "attention=sdpa: context parallelism (parallel.context=2) needs attention=flash",
     [["attention=flash"], ["parallel.context=1"]]),  # the ring takes GQA, windows and documents together
], ids=["kv-divides", "kv-zero", "window-zero", "pattern-no-window", "pattern-letters", "passkey-documents",
        "sdpa-flash-mask", "sdpa-cudnn-mask", "flex-on-cpu", "ring-needs-flash"])
def test_a_setting_no_backend_can_run_is_refused_in_one_line_then_its_advice(overrides, expected, followed,
                                                                              monkeypatch):
    """Each refusal is one line naming the setting; each way out it names composes (docs/errors.md). Context
    parallelism as under torchrun with 2 processes."""
    monkeypatch.setattr("minigpt.validate.launched_world_size", lambda: 2)
    with pytest.raises(ConfigError) as info:
        compose([*TINY_CPU, *overrides])
    assert expected in str(info.value) and "\n" not in str(info.value)
    for fix in followed:
        keys = {f.partition("=")[0] for f in fix}
        compose([*TINY_CPU, *(o for o in overrides if o.partition("=")[0] not in keys), *fix])


@pytest.mark.parametrize("override,expected", [("model.window_pattern=SSL", "model.window_pattern=SSL"),
                                               ("attention=flex", "attention=flex")])
def test_the_cli_refuses_them_with_exit_2(tmp_path, override, expected):
    proc = cli(tmp_path, "model=tiny", "device=cpu", "logger=none", override)
    one_line_error(proc, 2, expected)


def test_a_tiny_run_with_gqa_windows_and_documents_trains_and_resumes_only_with_its_attention(tmp_path):
    """The CLI trains with n_kv_head, window_pattern and data.document_mask; a resume with another n_kv_head is
    refused (exit 2, one line), and so is one with another window or pattern, resume_extend or not."""
    from test_data import write_corpus

    corpus = write_corpus(tmp_path / "corpus", n_files=40, repeat=20)
    args = ["model=tiny", "device=cpu", "logger=none", "seq_len=64", "batch_size=2", "eval_batches=1", "warmup_steps=1",
            "data=text", f"data.path={corpus}", "data.vocab_size=300", "data.val_fraction=0.2",
            f"data.cache_dir={tmp_path / 'cache'}", "data.document_mask=true", "model.window=16", "model.window_pattern=SSL", "hydra.run.dir=run"]
    done = cli(tmp_path, *args, "model.n_kv_head=2", "max_steps=2")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["final_val_loss"] > 0
    refused = cli(tmp_path, *args, "model.n_kv_head=1", "max_steps=3", "resume=auto")
    one_line_error(refused, 2, "model.n_kv_head=2", "model.n_kv_head=1", "resume")

    path, state = find_and_load("auto", tmp_path / "run" / "checkpoints")
    saved = state["config"]["model"]
    model = GPT(ModelConfig(**{k: v for k, v in saved.items()}), state["model"]["wte.weight"].shape[0],
                get_attention("naive"))
    optimizer = make_optimizer(model, compose(["model=tiny", "device=cpu"]), torch.device("cpu"))
    assert restore(state, path, model, optimizer, dict(saved)) == 2
    same = {**saved, "n_kv_head": None, "n_head": 4}  # null is n_head: the tiny model's 4 heads differ from 2
    for changed, key in [({"window": 32}, "model.window=16"), ({"window_pattern": "SL"}, "model.window_pattern=SSL"),
                         ({"window": None, "window_pattern": None}, "model.window=16"), (same, "model.n_kv_head=2")]:
        with pytest.raises(ConfigError, match=key):
            restore(state, path, model, optimizer, {**saved, **changed}, extend=True)

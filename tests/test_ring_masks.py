"""Ring attention with document ids, sliding windows and GQA (context parallelism with masks) on CPU: 2 and 4
processes on gloo, the flash kernel in Triton's interpreter (fp32). Each rank runs the ring on its zigzag shard;
the gathered outputs, LSEs and q/k/v gradients must equal one process's kernel on the whole sequence and the
float64 reference with an explicit mask (attention_reference.py). Also: the blocks a mask empties cost no tile,
a window's ring sends only as far as it reaches, kept attention, and, end to end, training with the masks under
parallel.context=2 equals one process; the CLI under torchrun refuses a ring without flash in one line.

The plan itself (which launches, which steps) is checked by brute force in test_ring_plan.py.
Tolerance: fp32 in the interpreter; the ring merges partial softmaxes in another order than one kernel sums them.
"""
import pytest
import torch
import torch.distributed as dist

from attention_reference import masked_attention, rel_err, visible_mask
from minigpt.distributed.sharding import shard_document_ids, zigzag_shard, zigzag_unshard
from processes import launch

TOL = 1e-5


def documents(kind: str | None, B: int, N: int) -> torch.Tensor | None:
    """(B, N) int32 ids: "ragged" lengths of 1 to 23 tokens, one-token documents among them, crossing chunk and rank
    boundaries, different per row; "chunks" one document per chunk of `chunk` tokens (kind "chunks:<c>")."""
    if kind is None:
        return None
    if kind.startswith("chunks"):
        return (torch.arange(N) // int(kind.split(":")[1])).repeat(B, 1).int()
    lengths = ([5, 1, 1, 13, 2, 23, 1, 40], [11, 1, 7, 1, 1, 19, 40, 40])
    rows = [torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls))[:N] for ls in lengths]
    return torch.stack(rows[:B]).int()


def inputs(case: dict) -> dict:
    """The whole sequence's q (B, N, Hq, D), k, v (B, N, Hkv, D), dO and document ids, the same on every rank."""
    g = torch.Generator().manual_seed(case.get("seed", 0))
    B, N, Hq, Hkv, D, dtype = case["B"], case["N"], case["Hq"], case["Hkv"], 16, case.get("dtype", torch.float32)
    shapes = {"q": (B, N, Hq, D), "k": (B, N, Hkv, D), "v": (B, N, Hkv, D), "do": (B, N, Hq, D)}
    return {**{name: torch.randn(*shape, generator=g).to(dtype) for name, shape in shapes.items()},
            "ids": documents(case.get("docs"), B, N)}


def _worker(rank, cases, out):
    import minigpt.distributed.ring_attention as ring_module
    from minigpt.distributed.ring_attention import Ring, RingFlashAttention
    from minigpt_kernels.launch import count_tiles

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    sends, dtypes, landed = [], [], []
    send = Ring.send

    def counted(self, tensors, shift, into=None):  # count the hops, note what they carry and where they land
        sends.append(shift)
        dtypes.append([t.dtype for t in tensors if t is not None])
        landed.append(any(b is not None for b in into or ()))
        return send(self, tensors, shift, into)
    Ring.send = counted
    results, keep_default = [], ring_module.KEEP_BLOCKS_BYTES
    for case in cases:
        ring_module.KEEP_BLOCKS_BYTES = case.get("keep_blocks_bytes", keep_default)  # 0: the backward sends K/V again
        x = inputs(case)
        shard = [zigzag_shard(x[name], world, rank, dim=1).requires_grad_() for name in ("q", "k", "v")]
        ids = None if x["ids"] is None else shard_document_ids(x["ids"], world, rank)
        backend = RingFlashAttention(None)
        heads = [t.transpose(1, 2) for t in shard]  # (B, H, N_local, D) views, as the model calls it
        sends.clear()
        dtypes.clear()
        landed.clear()
        with count_tiles() as tiles:
            o = backend(*heads, window=case.get("window"), document_ids=ids)
            forward_sends = len(sends)
            o.transpose(1, 2).backward(zigzag_shard(x["do"], world, rank, dim=1))
        got = {"o": o.transpose(1, 2).detach(), "dq": shard[0].grad, "dk": shard[1].grad, "dv": shard[2].grad,
               "sends": (forward_sends, len(sends) - forward_sends), "backward_dtypes": dtypes[forward_sends:],
               "backward_landed": landed[forward_sends:],
               "tiles": [(kind, int(counts.sum())) for kind, counts, _ in tiles]}
        if case.get("kept"):  # kept attention: the forward with its LSE, then the saved forward made differentiable
            kept = [t.detach().clone().requires_grad_() for t in shard]
            o2, lse = backend.forward_with_lse(*(t.transpose(1, 2) for t in kept), window=case.get("window"),
                                               document_ids=ids)
            backend.attend_saved(*(t.transpose(1, 2) for t in kept), o2, lse, window=case.get("window"),
                                 document_ids=ids).transpose(1, 2).backward(zigzag_shard(x["do"], world, rank, dim=1))
            got.update(lse=lse.transpose(1, 2), o_kept=o2.transpose(1, 2), dq_kept=kept[0].grad,
                       dk_kept=kept[1].grad, dv_kept=kept[2].grad)
        gathered = [None] * world
        dist.all_gather_object(gathered, got)
        results.append(gathered)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def run_ring(world: int, cases: list[dict], tmp_path) -> list[list[dict]]:
    """Every case on `world` ranks; per case, what each rank returned."""
    out = tmp_path / "ring.pt"
    launch(world, _worker, cases, str(out))
    return torch.load(out, weights_only=False)


def references(case: dict) -> tuple[dict, dict]:
    """(float64 reference, one process's kernel): o, lse and the q/k/v gradients over the whole sequence, as
    (B, N, H, D) (lse (B, N, H))."""
    from minigpt_kernels.flash_attention import flash_attention, flash_attention_with_lse

    x = inputs(case)
    N, window, ids = case["N"], case.get("window"), x["ids"]
    q, k, v = (x[name].transpose(1, 2).double().requires_grad_() for name in ("q", "k", "v"))
    o, lse = masked_attention(q, k, v, visible_mask(N, N, True, window, ids, ids))
    o.backward(x["do"].transpose(1, 2).double())
    ref = {"o": o, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    q1, k1, v1 = (x[name].transpose(1, 2).requires_grad_() for name in ("q", "k", "v"))
    o1 = flash_attention(q1, k1, v1, causal=True, window=window, document_ids=ids)
    o1.backward(x["do"].transpose(1, 2))
    _, lse1 = flash_attention_with_lse(q1.detach(), k1.detach(), v1.detach(), causal=True, window=window,
                                       document_ids=ids)
    one = {"o": o1, "lse": lse1, "dq": q1.grad, "dk": k1.grad, "dv": v1.grad}
    as_rows = lambda t: t.detach().transpose(1, 2)  # (B, H, N, ...) -> (B, N, H, ...)
    return {n: as_rows(t) for n, t in ref.items()}, {n: as_rows(t) for n, t in one.items()}


def check(case: dict, ranks: list[dict]) -> None:
    """The ranks' shards, put back in sequence order, against the float64 reference and one process's kernel."""
    ref, one = references(case)

    def full(name):
        return zigzag_unshard([r[name] for r in ranks], dim=1, n=case["N"])

    names = ["o", "dq", "dk", "dv"] + (["lse", "o_kept", "dq_kept", "dk_kept", "dv_kept"] if case.get("kept") else [])
    for name in names:
        base = name.removesuffix("_kept")
        assert rel_err(full(name), ref[base]) < TOL, (case, name, rel_err(full(name), ref[base]))
        torch.testing.assert_close(full(name), one[base], rtol=TOL, atol=2e-6, msg=lambda m: f"{case} {name}: {m}")


CASES_2 = {  # N=46: padded to 48, chunks of 12 tokens
    "gqa-and-documents": [dict(B=1, N=46, Hq=4, Hkv=2),  # GQA alone, group 2
                          dict(B=2, N=46, Hq=3, Hkv=1, docs="ragged")],  # ragged documents, one K/V head
    "windows": [dict(B=1, N=46, Hq=2, Hkv=2, window=1),  # the diagonal only: no transfer
                dict(B=1, N=46, Hq=3, Hkv=1, window=5),  # a few tokens, across the chunk boundaries
                dict(B=1, N=46, Hq=2, Hkv=2, window=17),  # more than a chunk
                dict(B=1, N=46, Hq=2, Hkv=1, window=100)],  # more than N: causal
    "combined": [dict(B=2, N=46, Hq=6, Hkv=2, window=9, docs="ragged", kept=True)],  # group 3
}
CASES_4 = {  # N=60: padded to 64, chunks of 8 tokens
    "gqa-and-documents": [dict(B=2, N=60, Hq=3, Hkv=1, docs="ragged")],
    "windows": [dict(B=1, N=60, Hq=2, Hkv=2, window=1), dict(B=1, N=60, Hq=2, Hkv=1, window=3),
                dict(B=1, N=60, Hq=2, Hkv=2, window=11), dict(B=1, N=64, Hq=2, Hkv=2, window=64)],
    "combined": [dict(B=1, N=60, Hq=4, Hkv=2, window=13, docs="ragged", kept=True)],
}


@pytest.mark.parametrize("world,group", [(2, g) for g in CASES_2] + [(4, g) for g in CASES_4])
def test_ring_with_masks_equals_one_process_and_float64(world, group, tmp_path):
    cases = (CASES_2 if world == 2 else CASES_4)[group]
    for case, ranks in zip(cases, run_ring(world, cases, tmp_path)):
        check(case, ranks)
        forward_sends = {r["sends"][0] for r in ranks}
        assert len(forward_sends) == 1  # every rank issues the same transfers
        if case.get("window") == 1:  # each token sees itself only: the ring sends nothing
            assert forward_sends == {0}
        if world == 4 and case.get("window") == 3:  # neighbours on both sides: one hop each way, not K-1 = 3
            assert forward_sends == {2}
        if case.get("window") is None:
            assert forward_sends == {world - 1}


def test_blocks_of_other_documents_visit_no_tile(tmp_path):
    """One document per chunk: no query sees another rank's keys. The local block's launches visit tiles; the other
    rank's block's launches (forward, dQ, dK/dV) visit none: a block the documents empty costs nothing."""
    case = dict(B=1, N=48, Hq=2, Hkv=1, docs="chunks:12")
    (ranks,) = run_ring(2, [case], tmp_path)
    check(case, ranks)
    for r in ranks:
        # the forward: local block, then the other's; the backward: the other's block, then the local one's
        assert [kind for kind, _ in r["tiles"]] == ["fwd", "fwd", "dq", "dkdv", "dq", "dkdv"]
        visited = [n for _, n in r["tiles"]]
        assert visited[0] > 0 and visited[4] > 0 and visited[5] > 0  # the local block
        assert visited[1] == visited[2] == visited[3] == 0


def test_training_with_masks_under_context_parallelism_equals_one_process(tmp_path):
    """2 ranks split each 62-token sequence (padded to 64) of text with document ids, a window on one of two layers
    and one K/V head, with recompute + kept attention; one process runs the same model. Same losses and val loss;
    the summary lists both ranks' peak memory and the allocator setting."""
    from minigpt.summary import RunSummary
    from test_data import write_corpus
    from test_parallel import train_parallel, train_single

    corpus = write_corpus(tmp_path / "corpus", n_files=40, repeat=20)
    common = ["attention=flash", "seq_len=62", "max_steps=2", "model.n_layer=2", "model.n_kv_head=1",
              "model.window=20", "model.window_pattern=SL", "data=text", f"data.path={corpus}", "data.vocab_size=300",
              "data.val_fraction=0.2", "data.document_mask=true", f"data.cache_dir={tmp_path / 'cache'}"]
    levers = ["model.recompute_every=1", "model.keep_attention=true"]
    one = train_single(tmp_path / "one", *common)  # (first: it writes the tokenizer cache both runs read)
    ranks = train_parallel(tmp_path / "cp", 2, *common, *levers, "parallel.context=2")
    assert [r["code"] for r in ranks] == [0, 0] and one["code"] == 0
    for r in ranks:
        assert r["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert r["val"] == pytest.approx(one["val"], rel=1e-5)
    s = RunSummary.read(tmp_path / "cp" / "run" / "summary.json")
    assert s.status == "ok" and s.context_parallel == 2
    assert s.rank_peak_allocated_gib == [0.0, 0.0] and s.rank_peak_reserved_gib == [0.0, 0.0]  # CPU: no CUDA memory
    assert s.cuda_alloc_conf == "expandable_segments:True"


def test_the_cli_under_torchrun_refuses_a_ring_without_flash(tmp_path):
    """The masks are the ring's; another backend is not: one line on stderr, each worker exits 2, nothing written."""
    from test_parallel import torchrun

    done = torchrun(tmp_path, 2, "attention=sdpa", "parallel.context=2", "model.window=8", "model.n_kv_head=2")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: attention=sdpa: context parallelism (parallel.context=2) needs attention=flash "
                      "(ring attention over our kernel)"]
    assert "exitcode  : 2" in done.stderr and done.returncode != 0 and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("world,case", [(2, dict(B=1, N=46, Hq=4, Hkv=2)),  # one hop: straight home
                                        (4, dict(B=1, N=60, Hq=2, Hkv=2)),  # two hops on, then home
                                        (4, dict(B=1, N=60, Hq=2, Hkv=1, window=11))])  # homes from both sides
def test_accumulators_go_home_in_half_precision_and_stay_as_close_as_one_process(world, case, tmp_path):
    """In fp16 the dK/dV accumulators travel in fp32 and make their last hop home in k's dtype, landing in the buffer
    of the block their sender no longer needs (no new buffer of k's size); the ring's results stay as close to the
    float64 reference as one process's fp16 kernel (within 1.5x its error). The forward keeps no blocks here, so
    they travel again and free their buffers for the homes (kept blocks stay as the forward saved them)."""
    case = dict(case, dtype=torch.float16, keep_blocks_bytes=0)
    ranks = run_ring(world, [case], tmp_path)[0]
    ref, one = references(case)
    for name in ("o", "dq", "dk", "dv"):
        ring = zigzag_unshard([r[name] for r in ranks], dim=1, n=case["N"])
        assert rel_err(ring, ref[name]) <= 1.5 * rel_err(one[name], ref[name]), \
            (name, rel_err(ring, ref[name]), rel_err(one[name], ref[name]))
    # the backward's sends: the K/V messages (fp16), the accumulators' hops on to the next holder (fp32: a block
    # travelling d ranks one way hops on d - 1 times) and home (fp16; the last send is one)
    from minigpt.distributed.ring_plan import ring_schedule
    from minigpt.distributed.sharding import padded_len

    schedule = ring_schedule(world, padded_len(case["N"], world) // (2 * world), case.get("window"))
    onward_hops = sum(max(depth - 1, 0) for depth in (schedule.forward, schedule.backward))
    for r in ranks:
        sends = r["backward_dtypes"]
        assert sends[-1] == [torch.float16], sends
        assert sum(m == [torch.float32] for m in sends) == onward_hops, sends
        assert all(m in ([torch.float16], [torch.float32]) for m in sends), sends
        homes = sum(depth > 0 for depth in (schedule.forward, schedule.backward))
        assert sum(r["backward_landed"]) == homes and r["backward_landed"][-1], r["backward_landed"]

"""The attention benchmark's bookkeeping, without a GPU: timings are replaced by a script of numbers; and the mask
suite (issue 33): its visible-pair counts, its case list, its derived ratios, and a dry run of it on CPU."""
import itertools
import json

import pytest
import torch

from attention_reference import visible_mask
from minigpt.benchmarks import bench, mask_bench
from minigpt.benchmarks import mask_cases as mc


def test_each_row_keeps_its_fastest_pass(monkeypatch):
    """Two passes over the table: every (provider, shape, mode) row holds the faster of its two times, whichever pass
    it came from, and a cell that failed in one pass keeps the pass that ran."""
    times = itertools.count(1)
    calls = []

    def scripted(fn, q, k, v, do, causal, mode):
        calls.append(mode)
        t = float(next(times))
        if mode == "bwd" and len(calls) <= 3:  # the first pass's backward fails
            raise torch.OutOfMemoryError("scripted")
        return t if len(calls) > 3 else 100.0 + t  # the first pass is the slow one

    monkeypatch.setattr(bench, "_inputs", lambda B, H, N, D, dtype: (torch.zeros(1),) * 4)
    monkeypatch.setattr(bench, "time_attention", scripted)
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    rows = bench.bench_attention(head_dims=(64,), seq_lens=(1024,), providers=("flash",), progress=lambda r: None)
    assert len(calls) == 6 and len(rows) == 3
    by_mode = {r.mode: r for r in rows}
    assert by_mode["fwd"].ms == 4.0 and by_mode["bwd"].ms == 5.0 and by_mode["fwd+bwd"].ms == 6.0
    assert all(r.note == "" and r.tflops > 0 for r in rows)


def test_one_pass_reports_what_it_measured(monkeypatch):
    monkeypatch.setattr(bench, "_inputs", lambda B, H, N, D, dtype: (torch.zeros(1),) * 4)
    monkeypatch.setattr(bench, "time_attention", lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError("x")))
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    rows = bench.bench_attention(head_dims=(64,), seq_lens=(1024,), providers=("flash",), passes=1,
                                 progress=lambda r: None)
    assert [r.note for r in rows] == ["OOM"] * 3 and all(r.ms is None for r in rows)


@pytest.mark.parametrize("n, window, lengths", [
    (1, None, None), (37, None, None), (37, 1, None), (37, 5, None), (37, 36, None), (37, 37, None), (37, 80, None),
    (37, None, (5, 19, 1, 12)), (37, 4, (5, 19, 1, 12)), (37, 30, (5, 19, 1, 12)), (37, None, (1,) * 37),
    (64, 16, mc.mixed_doc_lengths(64)), (64, None, (2,) * 32)])
def test_visible_pairs_match_a_brute_force_count(n, window, lengths):
    """The closed form against the explicit mask the kernel tests use (causal, windows, documents, combined); the
    document ids come from the case, as the benchmark passes them."""
    case = mc.MaskCase("t", "t", n, 64, 1, 1, window=window, doc_lengths=lengths)
    ids = case.document_ids("cpu")
    assert case.pairs() == mc.visible_pairs(n, window, lengths) == int(visible_mask(n, n, True, window, ids, ids).sum())
    assert case.flops("fwd+bwd") == 3.5 * case.flops("fwd") == 3.5 * 4 * case.pairs() * 64


def test_the_case_list_holds_the_issues_cases():
    cases = mc.mask_cases(mc.FULL)
    keys = {(c.name, c.seq_len, c.head_dim, c.q_heads, c.kv_heads) for c in cases}
    assert len(keys) == len(cases)
    K = 1024
    for D, H in ((64, 32), (128, 16)):  # hidden 2048
        assert {("causal", 32 * K, D, H, H), ("causal", 128 * K, D, H, H)} <= keys
        assert {("docs 32x1K", 32 * K, D, H, H), ("docs 8x4K", 32 * K, D, H, H)} <= keys
        assert {(f"window {w}", n, D, H, H) for w in ("1K", "4K") for n in (32 * K, 128 * K)} <= keys
    mix = mc.mixed_doc_lengths(32 * K)
    assert mix == mc.mixed_doc_lengths(32 * K, seed=0) and sum(mix) == 32 * K and len(mix) > 8
    assert all(256 <= n <= 8 * K for n in mix[:-1]) and 1 <= mix[-1] <= 8 * K
    assert [c.doc_lengths for c in cases if c.name.startswith("docs mix")] == [mix, mix, mix]
    # documents at gpt2-small's 12 heads too (a schedule can balance 32 heads and not 12), with their reference
    assert {("causal", 32 * K, 64, 12, 12), ("docs 1x32K", 32 * K, 64, 12, 12),
            (f"docs mix of {len(mix)}", 32 * K, 64, 12, 12)} <= keys
    for N in (8 * K, 32 * K):
        for D, Hq, Hkv in ((64, 16, 4), (64, 16, 1), (128, 8, 2)):
            assert {(f"GQA {Hq}/{Hkv}", N, D, Hq, Hkv), ("MHA", N, D, Hq, Hq)} <= keys
    assert all(c.batch == 1 and c.window in (None, 1024, 4096) for c in cases)
    refs = {c.ref_key for c in cases if c.dense}
    assert all(c.ref_key in refs for c in cases)  # every ideal has its dense causal reference
    order = mc.run_order(cases)
    assert sorted(order, key=lambda c: not c.dense) == order and len(order) == len(cases)
    windows = mc.select(cases, ["window"])  # a part of the suite keeps the references it needs
    assert {c.group for c in windows} == {"window", "causal"} and all(c.dense for c in windows if c.group == "causal")
    assert {c.seq_len for c in windows if c.dense} == {32 * K, 128 * K}
    assert mc.select(cases, ["GQA"]) == [c for c in cases if c.group == "GQA"] and mc.select(cases, mc.GROUPS) == cases
    tiny = mc.mask_cases(mc.TINY)  # the dry run's: the same cases, scaled down
    assert [(c.group, c.head_dim, c.kv_heads == c.q_heads) for c in tiny] == \
        [(c.group, c.head_dim, c.kv_heads == c.q_heads) for c in cases]


def test_ideals_ratios_and_the_time_limit_bookkeeping(monkeypatch, tmp_path):
    """Derived fields from scripted times: the ideal is the visible pairs at ours' dense rate for the same (N, D,
    Hq); ours/flex is a speed ratio; GQA's peak is compared with MHA's. Cases past the time limit are recorded as
    skipped, and the table and JSON are still written."""
    dense = mc.MaskCase("causal", "causal", 64, 64, 2, 2)
    window = mc.MaskCase("window 16", "window", 64, 64, 2, 2, window=16)
    mha, gqa = mc.MaskCase("MHA", "GQA", 64, 64, 4, 4), mc.MaskCase("GQA 4/1", "GQA", 64, 64, 4, 1)
    rows = [mask_bench.MaskRow.of(c, impl) for c in (dense, window, mha, gqa) for impl in mask_bench.IMPLS]
    ms = {("causal", "ours"): 10.0, ("causal", "flex"): 20.0, ("window 16", "ours"): 10.0,
          ("window 16", "flex"): 20.0, ("MHA", "ours"): 8.0, ("GQA 4/1", "ours"): 12.0}
    for r in rows:
        r.ms_fwd_bwd = ms.get((r.case, r.impl))
        r.peak_extra_mib = {"MHA": 100.0, "GQA 4/1": 50.0}.get(r.case)
    mask_bench.add_derived(rows)
    get = {(r.case, r.impl): r for r in rows}
    assert get["causal", "ours"].vs_ideal_fwd_bwd == 1.0 and get["causal", "flex"].vs_ideal_fwd_bwd == 2.0
    ideal = 10.0 * window.pairs() / dense.pairs()
    assert get["window 16", "ours"].ideal_ms_fwd_bwd == pytest.approx(ideal)
    assert get["window 16", "ours"].vs_ideal_fwd_bwd == pytest.approx(10.0 / ideal)
    assert get["window 16", "ours"].ours_over_flex == get["window 16", "flex"].ours_over_flex == 2.0
    assert get["GQA 4/1", "ours"].vs_ideal_fwd_bwd == pytest.approx(1.5) and get["GQA 4/1", "ours"].peak_vs_mha == 0.5
    assert get["GQA 4/1", "flex"].vs_ideal_fwd_bwd is None and get["GQA 4/1", "ours"].ours_over_flex is None

    monkeypatch.setattr(mask_bench, "run_case", lambda *a: pytest.fail("a case ran past the time limit"))
    skipped = mask_bench.run_suite([dense, window], torch.device("cpu"), torch.float32, mask_bench.TINY_TIMING,
                                   flex=None, time_limit_s=-1.0, progress=lambda line: None)
    assert [r.error for r in skipped] == ["skipped: time limit -1 s reached"] * 4
    env = mask_bench.environment(torch.device("cpu"), torch.float32)
    js, md = mask_bench.write_results(skipped, env, tmp_path, complete=True)
    assert json.loads(js.read_text())["complete"] and "skipped: time limit" in md.read_text()


def test_the_references_keep_their_faster_times_queued_too():
    """keep_faster (a dense reference timed at the start and the end of a run) keeps each mode's faster time, the
    queued fwd+bwd included, each on its own; and queued_ms is a GPU measurement only."""
    case = mc.MaskCase("causal", "causal", 64, 64, 2, 2)
    row, again = mask_bench.MaskRow.of(case, "ours"), mask_bench.MaskRow.of(case, "ours")
    row.ms_fwd_bwd, row.ms_fwd, row.ms_fwd_bwd_queued = 2.0, 1.0, 1.5
    again.ms_fwd_bwd, again.ms_fwd, again.ms_fwd_bwd_queued = 3.0, 0.5, 1.2
    mask_bench.keep_faster(row, again, case)
    assert (row.ms_fwd_bwd, row.ms_fwd, row.ms_fwd_bwd_queued) == (2.0, 0.5, 1.2)
    assert mask_bench.queued_ms(lambda: None, torch.device("cpu"), 1.0) is None


def test_reps_fill_the_time_budget_within_their_bounds():
    """After the warm-up, at least min_reps, then as many as the budget holds at their median, at most max_reps."""
    import time

    calls = []

    def two_ms():
        calls.append(1)
        time.sleep(0.002)

    ms = mask_bench.time_ms(two_ms, torch.device("cpu"), mask_bench.Timing(warmup=1, min_reps=3, max_reps=30,
                                                                           budget_ms=20.0))
    assert ms >= 2.0 and 1 + 3 <= len(calls) <= 1 + 10
    calls.clear()
    mask_bench.time_ms(two_ms, torch.device("cpu"), mask_bench.Timing(warmup=0, min_reps=3, max_reps=5, budget_ms=1e6))
    assert len(calls) == 5


@pytest.mark.parametrize("suite", ["--masks", "--accuracy"])
def test_the_suites_need_a_gpu_or_the_tiny_dry_run(monkeypatch, capsys, suite):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exit_:
        bench.main([suite, "--tiny"])
    assert exit_.value.code == 2 and f"{suite} needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run; on a GPU run the suite itself")
def test_the_whole_mask_suite_dry_runs_on_cpu(tmp_path, capsys):
    """Every case at TINY sizes in fp32 through the CLI, our kernel in Triton's interpreter: each case has a row
    for ours (timed, with its ideal) and one for flex, whose backward PyTorch does not support on CPU: that is
    recorded as its error, and its forward alone still matches ours (the same mask both ways). The JSON is complete
    and the table, printed last, names the machine, the versions and the commit."""
    from minigpt.metrics import git_commit

    assert bench.main(["--masks", "--tiny", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "masks_cpu.json").read_text())
    assert data["complete"] and data["env"]["dtype"] == "float32"
    rows = {(r["case"], r["seq_len"], r["head_dim"], r["q_heads"], r["kv_heads"], r["impl"]): r for r in data["rows"]}
    cases = mc.mask_cases(mc.TINY)
    assert len(rows) == len(data["rows"]) == 2 * len(cases)
    for c in cases:
        o, f = (rows[(c.name, c.seq_len, c.head_dim, c.q_heads, c.kv_heads, impl)] for impl in ("ours", "flex"))
        assert o["error"] == "" and o["ms_fwd_bwd"] > 0 and o["ms_fwd"] > 0 and o["tflops_fwd_bwd"] > 0, o
        assert o["ms_fwd_bwd_queued"] is None  # the GPU's time alone: measured on a GPU only
        assert o["pairs"] == c.pairs() and o["vs_ideal_fwd_bwd"] > 0 and o["ideal_ms_fwd"] > 0
        assert c.dense == (o["vs_ideal_fwd_bwd"] == pytest.approx(1.0))
        assert f["error"].startswith("NotImplementedError") and "backward" in f["error"] and f["ms_fwd_bwd"] is None
        assert f["flex_vs_ours"] < 1e-4, (c, f["flex_vs_ours"])
    table = (tmp_path / "masks_cpu.md").read_text()
    assert out.rstrip().endswith(table.rstrip())
    assert f"cpu, torch {torch.__version__}" in table and f"commit {git_commit()}" in table
    assert table.count("\n| ") == len(cases) + 1 and "docs mix at 64" in table

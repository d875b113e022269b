"""The attention benchmark's bookkeeping, without a GPU: timings are replaced by a script of numbers."""
import itertools

import torch

from minigpt.benchmarks import bench


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

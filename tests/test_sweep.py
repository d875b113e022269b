"""Context-length search logic (with a fake trial runner) and one real sweep on CPU through the trainer."""
import json

import pytest

from minigpt.sweep import SweepConfig, Trial, best, derive_from_probes, run_sweep, search_max_seq_len, variant_overrides


class FakeRunner:
    """Trials succeed below `limit` (or per a custom rule); records what was asked."""

    def __init__(self, ok=None, limit=None, status="oom"):
        self.ok = ok or (lambda n: n <= limit)
        self.status, self.calls = status, []

    def __call__(self, variant, n):
        self.calls.append(n)
        layers = int(variant.partition("@L")[2] or 12)
        if self.ok(n):
            return Trial(variant, n, "ok", peak_allocated_gib=layers * n / 1e6, tokens_per_s=1e5 / n,
                         step_time_s=layers * n / 1e5, n_layer=layers)
        return Trial(variant, n, self.status, peak_allocated_gib=80.0)


def test_doubles_then_bisects_to_granularity():
    run = FakeRunner(limit=100_000)
    trials = search_max_seq_len(run, "sdpa", start=4096, granularity=128)
    assert run.calls[:6] == [4096, 8192, 16384, 32768, 65536, 131072]
    b = best(trials)
    # first bracket 65536..131072 -> stop at 1/16 of it (4096) or finer
    assert b.seq_len <= 100_000 and 100_000 - b.seq_len <= 65536 // 16 and b.seq_len % 128 == 0
    assert all(n % 128 == 0 for n in run.calls) and len(run.calls) == len(set(run.calls))


def test_start_that_fails_halves_down():
    run = FakeRunner(limit=1000)
    b = best(search_max_seq_len(run, "naive", start=8192, granularity=128))
    assert run.calls[:4] == [8192, 4096, 2048, 1024] and b.seq_len <= 1000 and b.seq_len >= 1000 - 128


def test_nothing_fits():
    run = FakeRunner(limit=10)
    assert best(search_max_seq_len(run, "naive", start=1024, granularity=128)) is None
    assert run.calls == [1024, 512, 256, 128]


def test_non_monotone_failures_report_only_a_success():
    # fails at 24K..28K (fragmentation, say) but works at 30K; true wall at 40K
    run = FakeRunner(ok=lambda n: n <= 40_000 and not 24_000 <= n <= 28_000)
    trials = search_max_seq_len(run, "x", start=4096, granularity=128)
    b = best(trials)
    assert b.ok and b.seq_len <= 40_000 and run.ok(b.seq_len)
    assert len(trials) < 20


def test_timeouts_count_as_failures_and_budget_stops_search():
    run = FakeRunner(limit=20_000, status="timeout")
    trials = search_max_seq_len(run, "x", start=4096, granularity=128)
    assert best(trials).seq_len <= 20_000 and any(t.status == "timeout" for t in trials)
    calls = iter(range(100))
    few = search_max_seq_len(FakeRunner(limit=10**9), "x", start=128, granularity=128, out_of_time=lambda: next(calls) >= 3)
    assert len(few) == 3


def test_max_seq_len_caps_doubling():
    run = FakeRunner(limit=10**9)
    trials = search_max_seq_len(run, "x", start=128, granularity=64, max_seq_len=512)
    assert run.calls == [128, 256, 512] and best(trials).seq_len == 512


def test_variants_and_probe_derivation():
    assert variant_overrides("flash+levers@L2")[-1] == "model.n_layer=2"
    assert "model.offload=true" in variant_overrides("sdpa+offload")
    with pytest.raises(ValueError, match="unknown lever"):
        variant_overrides("flash+turbo")
    probes = [Trial("f@L1", 1000, "ok", peak_allocated_gib=10.0, step_time_s=2.0, n_layer=1),
              Trial("f@L2", 1000, "ok", peak_allocated_gib=12.0, step_time_s=3.0, n_layer=2)]
    d = derive_from_probes(probes, 12)
    assert d["derived"] and d["variant"] == "f" and d["peak_allocated_gib"] == pytest.approx(32.0)
    assert d["step_time_s"] == pytest.approx(13.0) and d["per_layer_gib"] == pytest.approx(2.0)


def test_sweep_reports_and_resumes_with_a_fake_runner(tmp_path):
    cfg = SweepConfig(variants=["naive", "sdpa"], out_dir=tmp_path / "s", start={"naive": 1024}, default_start=4096,
                      logger="none")
    md = run_sweep(cfg, runner=FakeRunner(limit=50_000), log=lambda s: None)
    text = md.read_text()
    assert "| naive |" in text and "| sdpa |" in text
    data = json.loads((tmp_path / "s" / "results.json").read_text())
    assert data["max"]["sdpa"]["seq_len"] <= 50_000 and data["max"]["naive"]["status"] == "ok"
    assert (tmp_path / "s" / "memory_vs_seq_len.png").stat().st_size > 1000
    assert (tmp_path / "s" / "tokens_per_s_vs_seq_len.png").stat().st_size > 1000
    assert (tmp_path / "s" / "results.csv").read_text().count("\n") == len(data["trials"]) + 1


def test_combine_merges_sweeps_and_derived_probes(tmp_path):
    from minigpt.sweep import combine
    a = SweepConfig(variants=["sdpa"], out_dir=tmp_path / "a", default_start=4096, logger="none")
    run_sweep(a, runner=FakeRunner(limit=50_000), log=lambda s: None)
    b = SweepConfig(variants=["flash+levers"], out_dir=tmp_path / "b", search=False, logger="none",
                    probe_seq_lens=[2_000_000])
    fake = FakeRunner(limit=10**9)
    run_sweep(b, runner=fake, log=lambda s: None)
    assert fake.calls == [2_000_000, 2_000_000]  # only the two probes, no search
    md = combine([tmp_path / "a", tmp_path / "b"], tmp_path / "out", "all", "header line")
    text = md.read_text()
    assert text.startswith("header line") and "| sdpa |" in text and "**derived**" in text and "@L" not in text
    assert "| 2,000,000 | 24.0 GiB |" in text  # 2 + (12 − 1)·2 GiB from the 1- and 2-layer probes
    assert (tmp_path / "out" / "all_memory_vs_seq_len.png").exists()


def test_real_cpu_sweep_through_the_trainer_resumes(tmp_path, monkeypatch):
    """Subprocess trials of the tiny model on CPU, W&B offline: trials, summary run, resume without re-running."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "cpu"
    cfg = SweepConfig(variants=["sdpa"], out_dir=out, base_overrides=["model=tiny", "device=cpu"], default_start=128,
                      granularity=64, max_seq_len=256, steps=1, trial_time_limit_s=120, logger="wandb")
    lines = []
    run_sweep(cfg, log=lines.append)
    trials = [json.loads(x) for x in (out / "trials.jsonl").read_text().splitlines()]
    assert [(t["seq_len"], t["status"]) for t in trials] == [(128, "ok"), (256, "ok")]
    assert all(t["tokens_per_s"] > 0 for t in trials)
    assert not list(out.glob("trials/*/checkpoints"))  # sweep trials write no checkpoints
    assert json.loads((out / "results.json").read_text())["max"]["sdpa"]["seq_len"] == 256
    # every trial is a W&B run in the sweep's group, plus the summary run
    from wandb_records import offline_run
    run = offline_run(out / "trials" / "sdpa-n128")
    assert run["group"] == f"sweep-{out.name}" and run["name"] == "sdpa-n128" and "perf/tokens_per_s" in run["history"]
    summary = offline_run(out)
    assert summary["name"] == f"sweep-{out.name}-summary" and summary["group"] == f"sweep-{out.name}"
    for logged in ("sweep/trials/_type", "sweep/peak_allocated_gib_vs_seq_len_table/_type",
                   "sweep/tokens_per_s_vs_seq_len_table/_type", "sweep/memory_vs_seq_len/_type"):
        assert logged in summary["history"], logged  # the W&B Table, both line plots and the PNG
    assert json.loads(summary["summary"]["max_seq_len/sdpa"]) == 256
    # resume: the same sweep again runs no new trial
    lines.clear()
    run_sweep(cfg, log=lines.append)
    assert len((out / "trials.jsonl").read_text().splitlines()) == 2 and any("from trials.jsonl" in x for x in lines)


def test_real_trial_classifies_bad_config_as_error(tmp_path):
    from minigpt.sweep import SubprocessRunner
    runner = SubprocessRunner(tmp_path, ["model=tiny", "device=cpu", "model.n_head=5"], "s", steps=1, logger="none",
                              log=lambda s: None)
    t = runner("sdpa", 128)
    assert t.status == "error" and "n_head" in t.error

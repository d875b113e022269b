"""The context-length sweep: search logic and reports with a fake trial runner, the trial runner against a stub
trainer, and the command line from another directory (bad arguments, a real tiny CPU sweep, a config error)."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minigpt.attention import BACKENDS, FlashAttention
from minigpt.sweep.report import combine
from minigpt.sweep.runner import SubprocessRunner, TrialStore
from minigpt.sweep.search import (LEVERS, Trial, best, derive_from_probes, search_max_seq_len, variant_of,
                                  variant_overrides)
from minigpt.sweep.sweep import SweepConfig, build_parser, main, run_sweep, sweep_config
from minigpt.summary import RunSummary

ROOT = Path(__file__).resolve().parent.parent
QUIET = {"log": lambda s: None}


class FakeRunner:
    """Trials succeed below `limit` (or per a custom rule) and fail with `status`; `error(n)` makes n an error."""

    def __init__(self, ok=None, limit=None, status="oom", error=lambda n: False):
        self.ok = ok or (lambda n: n <= limit)
        self.status, self.error, self.calls = status, error, []

    def __call__(self, variant, n):
        self.calls.append(n)
        layers = int(variant.partition("@L")[2] or 12)
        if self.error(n):
            return Trial(variant, n, "error", error="model.n_head=5: bad setting", exit_code=2)
        if self.ok(n):
            return Trial(variant, n, "ok", peak_allocated_gib=layers * n / 1e6, tokens_per_s=1e5 / n,
                         step_time_s=layers * n / 1e5, n_layer=layers, exit_code=0)
        return Trial(variant, n, self.status, peak_allocated_gib=80.0, exit_code=3)


def lines(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


# ------------------------------------------------------------------------------------------------
# Search
# ------------------------------------------------------------------------------------------------
def test_doubles_then_bisects_to_granularity():
    run = FakeRunner(limit=100_000)
    trials = search_max_seq_len(run, "sdpa", start=4096, granularity=128)
    assert run.calls[:6] == [4096, 8192, 16384, 32768, 65536, 131072]
    b = best(trials)
    # first bracket 65536..131072 -> stop at 1/16 of it (4096) or finer
    assert b.seq_len <= 100_000 and 100_000 - b.seq_len <= 65536 // 16 and b.seq_len % 128 == 0
    assert all(n % 128 == 0 for n in run.calls) and len(run.calls) == len(set(run.calls))


def test_without_bisection_the_search_is_the_doubling_grid_up_to_the_first_failure():
    run = FakeRunner(limit=100_000)
    trials = search_max_seq_len(run, "sdpa", start=1024, granularity=128, bisect=False)
    assert run.calls == [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    assert [t.status for t in trials] == ["ok"] * 7 + ["oom"] and best(trials).seq_len == 65536


def test_grid_sweep_reports_every_power_of_two_and_its_oom(tmp_path):
    run = FakeRunner(limit=5000)
    cfg = SweepConfig(variants=["sdpa"], out_dir=tmp_path / "grid", default_start=1024, bisect=False, logger="none")
    run_sweep(cfg, runner=run, **QUIET)
    assert run.calls == [1024, 2048, 4096, 8192]
    assert [(t["seq_len"], t["status"]) for t in lines(tmp_path / "grid" / "trials.jsonl")] == [
        (1024, "ok"), (2048, "ok"), (4096, "ok"), (8192, "oom")]


def test_grid_on_the_command_line_starts_at_1k_and_takes_powers_of_two_only(capsys, tmp_path):
    parser = build_parser()
    cfg = sweep_config(parser, parser.parse_args(["--grid", "--allow-cpu", "--logger", "none"]))
    assert (cfg.default_start, cfg.bisect, cfg.search) == (1024, False, True)
    cfg = sweep_config(parser, parser.parse_args(["--grid", "--cpu", "--logger", "none"]))
    assert (cfg.default_start, cfg.bisect) == (128, False)  # --cpu keeps its own start
    assert sweep_config(parser, parser.parse_args(["--allow-cpu", "--logger", "none"])).bisect
    cfg = sweep_config(parser, parser.parse_args(["--allow-cpu", "--logger", "none", "--gpu-memory-gib", "79.2",
                                                  "--host-memory-gib", "128"]))
    assert (cfg.gpu_memory_gib, cfg.host_memory_gib) == (79.2, 128.0)  # the frontier's capacities


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
    few = search_max_seq_len(FakeRunner(limit=10**9), "x", start=128, granularity=128,
                             out_of_time=lambda: next(calls) >= 3)
    assert len(few) == 3


def test_max_seq_len_caps_doubling():
    run = FakeRunner(limit=10**9)
    trials = search_max_seq_len(run, "x", start=128, granularity=64, max_seq_len=512)
    assert run.calls == [128, 256, 512] and best(trials).seq_len == 512


def test_an_error_ends_the_search_instead_of_bounding_it():
    first = FakeRunner(limit=10**9, error=lambda n: True)
    assert [t.status for t in search_max_seq_len(first, "x", start=4096)] == ["error"] and first.calls == [4096]
    later = FakeRunner(limit=10**9, error=lambda n: n == 16384)  # no bisection between 8192 and an error
    trials = search_max_seq_len(later, "x", start=4096)
    assert later.calls == [4096, 8192, 16384] and best(trials).seq_len == 8192


# ------------------------------------------------------------------------------------------------
# Variants and probes
# ------------------------------------------------------------------------------------------------
def test_variant_grammar():
    assert variant_overrides("flash+levers@L2")[-1] == "model.n_layer=2"
    assert "model.offload=true" in variant_overrides("sdpa+offload")
    assert "model.keep_attention=true" in variant_overrides("flash+keepattn")
    for bad, why in (("flash+turbo", "unknown lever 'turbo'"), ("bogus", "unknown backend 'bogus'"),
                     ("sdpa+keepattn", "log-sum-exp"), ("flash@Lx", "layer count")):
        with pytest.raises(ValueError, match=why):
            variant_overrides(bad)


@pytest.mark.parametrize("variant", ["naive", "sdpa+compile", "flash+ckpt", "flash+bf16ckpt+losschunk",
                                     "flash+offload", "flash+keepattn+mlpchunk", "flash+levers",
                                     "flash+levers+offload+keepattn+compile", "sdpa+ckpt+losschunk"])
def test_a_summarys_setting_names_the_variant_back(variant):
    """variant_of reads the setting a run recorded; its name gives the same trainer overrides as the variant's."""
    from minigpt.config import ModelConfig
    from minigpt.sweep.search import NO_LEVERS, lever_settings
    assert NO_LEVERS == ModelConfig().levers()  # what a run without levers records
    overrides = variant_overrides(variant)
    summary = {"attention": variant.split("+")[0], "compile": "compile=true" in overrides,
               "levers": lever_settings(variant)}
    assert sorted(variant_overrides(variant_of(summary))) == sorted(overrides)


def test_variant_backends_come_from_the_registry(monkeypatch):
    monkeypatch.setitem(BACKENDS, "mine", type("Mine", (FlashAttention,), {"name": "mine"}))
    assert variant_overrides("mine+keepattn")[0] == "attention=mine"
    monkeypatch.delitem(BACKENDS, "naive")
    with pytest.raises(ValueError, match="unknown backend 'naive'"):
        variant_overrides("naive")


def test_probe_derivation():
    probes = [Trial("f@L1", 1000, "ok", peak_allocated_gib=10.0, step_time_s=2.0, n_layer=1),
              Trial("f@L2", 1000, "ok", peak_allocated_gib=12.0, step_time_s=3.0, n_layer=2)]
    d = derive_from_probes(probes, 12)
    assert d["derived"] and d["variant"] == "f" and d["peak_allocated_gib"] == pytest.approx(32.0)
    assert d["step_time_s"] == pytest.approx(13.0) and d["per_layer_gib"] == pytest.approx(2.0)
    assert derive_from_probes([probes[0], Trial("f@L2", 1000, "oom", n_layer=2)], 12) is None
    assert d["host_offload_gib"] is None  # the probes recorded no offloading


def test_the_frontier_judges_a_derived_figure_against_gpu_and_host_memory():
    """Offloaded block inputs grow with the layers too: host memory is derived like the GPU peak, and a figure fits
    only where both fit (the frontier of issue 35); a capacity not given is said, not assumed."""
    from minigpt.sweep.search import judge_fit
    probes = [Trial("f@L1", 1000, "ok", peak_allocated_gib=10.0, step_time_s=2.0, n_layer=1, host_offload_gib=3.0),
              Trial("f@L2", 1000, "ok", peak_allocated_gib=12.0, step_time_s=3.0, n_layer=2, host_offload_gib=6.0)]
    d = derive_from_probes(probes, 12)
    assert d["host_offload_gib"] == pytest.approx(36.0)
    assert judge_fit(d, 40.0, 64.0)["fits"] is True and judge_fit(d, 40.0, 64.0)["limit"] == "fits"
    over = judge_fit(d, 30.0, 32.0)
    assert over["fits"] is False and over["limit"] == "GPU 32.0 > 30.0 GiB; host 36.0 > 32.0 GiB"
    unknown = judge_fit(d, 40.0, None)
    assert unknown["fits"] is None and unknown["limit"] == "host memory not given"
    assert judge_fit(d, 20.0, None)["fits"] is False  # over the GPU whatever the host holds


# ------------------------------------------------------------------------------------------------
# Sweeps with a fake runner: reports, resume, errors
# ------------------------------------------------------------------------------------------------
def test_sweep_reports_and_resumes_with_a_fake_runner(tmp_path):
    cfg = SweepConfig(variants=["naive", "sdpa"], out_dir=tmp_path / "s", start={"naive": 1024}, default_start=4096,
                      logger="none")
    result = run_sweep(cfg, runner=FakeRunner(limit=50_000), **QUIET)
    text = result.report.read_text()
    assert result.exit_code == 0 and "| naive |" in text and "| sdpa |" in text and "Errors" not in text
    data = json.loads((tmp_path / "s" / "results.json").read_text())
    assert data["max"]["sdpa"]["seq_len"] <= 50_000 and data["max"]["naive"]["status"] == "ok"
    assert (tmp_path / "s" / "memory_vs_seq_len.png").stat().st_size > 1000
    assert (tmp_path / "s" / "tokens_per_s_vs_seq_len.png").stat().st_size > 1000
    assert (tmp_path / "s" / "results.csv").read_text().count("\n") == len(data["trials"]) + 1
    assert len(lines(tmp_path / "s" / "trials.jsonl")) == len(data["trials"])
    again = FakeRunner(limit=50_000)
    run_sweep(cfg, runner=again, **QUIET)
    assert again.calls == [] and result.report.read_text() == text  # everything reused


def test_error_variant_is_reported_as_error_and_retried_on_resume(tmp_path):
    cfg = SweepConfig(variants=["naive", "sdpa"], out_dir=tmp_path / "s", default_start=4096, logger="none")
    flaky = FakeRunner(limit=50_000, error=lambda n: n == 4096)  # every variant's first trial errs
    log = []
    result = run_sweep(cfg, runner=flaky, log=log.append)
    assert flaky.calls == [4096, 4096] and result.exit_code == 1 and result.no_result == ["naive", "sdpa"]
    text = result.report.read_text()
    assert "**none: every trial failed with an error**" in text and "(oom)" not in text
    assert "- naive at n=4,096 (exit code 2): model.n_head=5: bad setting" in text
    data = json.loads((tmp_path / "s" / "results.json").read_text())
    assert [t["status"] for t in data["trials"]] == ["error", "error"] and data["only_errors"] == ["naive", "sdpa"]
    assert any("no result, every trial failed with an error" in x for x in log)
    fixed = FakeRunner(limit=50_000)
    result = run_sweep(cfg, runner=fixed, **QUIET)
    assert fixed.calls[:1] == [4096] and fixed.calls.count(4096) == 2  # both errors ran again
    assert result.exit_code == 0 and "Errors" not in result.report.read_text()


def test_resume_reuses_oom_and_timeouts_within_the_limit(tmp_path):
    store = TrialStore(tmp_path / "trials.jsonl")
    store.add(Trial("sdpa", 4096, "oom"))
    store.add(Trial("sdpa", 2048, "timeout", wall_s=610.0))
    store.add(Trial("sdpa", 1024, "error"))
    store = TrialStore(tmp_path / "trials.jsonl")
    assert store.reusable("sdpa", 4096, 600).status == "oom" and store.reusable("sdpa", 2048, 600).status == "timeout"
    assert store.reusable("sdpa", 2048, 1200) is None and store.reusable("sdpa", 1024, 600) is None
    store.add(Trial("sdpa", 1024, "ok"))
    assert store.reusable("sdpa", 1024, 600).ok and len(store.latest()) == 3


def test_a_torn_trials_line_is_ignored_with_a_warning(tmp_path):
    (tmp_path / "trials.jsonl").write_text(json.dumps({"variant": "sdpa", "seq_len": 128, "status": "ok"}) + '\n{"var')
    warnings = []
    store = TrialStore(tmp_path / "trials.jsonl", warn=warnings.append)
    assert len(store.trials) == 1 and "trials.jsonl:2" in warnings[0]


def test_fewer_variants_keep_the_earlier_variants_in_the_reports(tmp_path):
    run_sweep(SweepConfig(variants=["naive", "sdpa"], out_dir=tmp_path / "s", logger="none"),
              runner=FakeRunner(limit=50_000), **QUIET)
    result = run_sweep(SweepConfig(variants=["flash"], out_dir=tmp_path / "s", logger="none"),
                       runner=FakeRunner(limit=80_000), **QUIET)
    text = result.report.read_text()
    assert "| naive |" in text and "| sdpa |" in text and "| flash |" in text
    data = json.loads((tmp_path / "s" / "results.json").read_text())
    assert set(data["max"]) == {"naive", "sdpa", "flash"}
    assert {r.split(",")[0] for r in (tmp_path / "s" / "results.csv").read_text().splitlines()[1:]} == set(data["max"])


def test_combine_merges_sweeps_and_derived_probes(tmp_path):
    a = SweepConfig(variants=["sdpa"], out_dir=tmp_path / "a", default_start=4096, logger="none")
    run_sweep(a, runner=FakeRunner(limit=50_000), **QUIET)
    b = SweepConfig(variants=["flash+levers"], out_dir=tmp_path / "b", search=False, logger="none",
                    probe_seq_lens=[2_000_000])
    fake = FakeRunner(limit=10**9)
    run_sweep(b, runner=fake, **QUIET)
    assert fake.calls == [2_000_000, 2_000_000]  # only the two probes, no search
    md = combine([tmp_path / "a", tmp_path / "b"], tmp_path / "out", "all", "header line")
    text = md.read_text()
    assert text.startswith("header line") and "| sdpa |" in text and "**derived**" in text and "@L" not in text
    assert "| 2,000,000 | 24.0 GiB |" in text  # 2 + (12 − 1)·2 GiB from the 1- and 2-layer probes
    assert (tmp_path / "out" / "all_memory_vs_seq_len.png").exists()


def test_summary_run_in_wandb(tmp_path, monkeypatch):
    """One W&B run for the sweep in its group: the Table, both line plots, a PNG, the maximums."""
    from wandb_records import offline_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "w"
    run_sweep(SweepConfig(variants=["sdpa"], out_dir=out, default_start=4096, logger="wandb"),
              runner=FakeRunner(limit=20_000), **QUIET)
    summary = offline_run(out)
    assert summary["name"] == "sweep-w-summary" and summary["group"] == "sweep-w" and summary["exit_code"] == 0
    for logged in ("sweep/trials/_type", "sweep/peak_allocated_gib_vs_seq_len_table/_type",
                   "sweep/tokens_per_s_vs_seq_len_table/_type", "sweep/memory_vs_seq_len/_type"):
        assert logged in summary["history"], logged
    assert json.loads(summary["summary"]["max_seq_len/sdpa"]) == json.loads((out / "results.json").read_text())[
        "max"]["sdpa"]["seq_len"]


# ------------------------------------------------------------------------------------------------
# The trial runner, against a stub trainer (a few lines of Python, no torch): how outcomes are read
# ------------------------------------------------------------------------------------------------
def test_a_trial_counts_the_host_memory_of_every_rank(tmp_path):
    """Each rank pins its own offloaded blocks in the one host's RAM: the trial's host figure is theirs together."""
    from minigpt.sweep.runner import read_trial
    RunSummary(status="ok", exit_code=0, peak_allocated_gib=5.0, step_time_s=1.0, n_layer=1, seq_len=4096,
               world_size=2, context_parallel=2, peak_host_offload_gib=18.0).write(tmp_path)
    t = read_trial("flash+offload@L1", 4096, tmp_path, 0, "", 1.0, 10.0)
    assert t.ok and t.host_offload_gib == pytest.approx(36.0)


STUB = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from minigpt.summary import RunSummary
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    run_dir = Path(args["hydra.run.dir"].strip("'").replace("\\\\'", "'"))
    n = int(args["seq_len"])
    if n == 128:
        RunSummary(status="ok", exit_code=0, peak_allocated_gib=1.5, tokens_per_s=900.0, step_time_s=0.5,
                   n_layer=2, seq_len=n).write(run_dir)
    elif n in (256, 1024):
        if n == 256:
            RunSummary(status="oom", exit_code=3, error="CUDA out of memory", peak_allocated_gib=79.0).write(run_dir)
        sys.exit(3)
    elif n == 384:
        print("error: model.n_embd=128: must be divisible by model.n_head=5", file=sys.stderr)
        sys.exit(2)
    elif n == 512:
        RunSummary(status="error", exit_code=2, error="attention=flash: needs a CUDA GPU").write(run_dir)
        sys.exit(2)
    elif n == 640:
        raise RuntimeError("boom")
    elif n == 768:
        time.sleep(60)
    elif n == 896:
        (run_dir / "summary.json").write_text('{"status": "ok", "steps_done": 1}')
""")


@pytest.fixture
def stub_runner(tmp_path):
    (tmp_path / "stub.py").write_text(STUB)
    return SubprocessRunner(tmp_path / "out", ["model=tiny"], "sweep-out", steps=1, time_limit_s=5, logger="none",
                            trainer=(sys.executable, str(tmp_path / "stub.py")))


@pytest.mark.parametrize("n, status, says", [
    (128, "ok", None),
    (256, "oom", None),
    (1024, "oom", None),  # exit code 3 alone is out of memory
    (384, "error", "model.n_embd=128: must be divisible by model.n_head=5"),  # refused before the run: no summary
    (512, "error", "attention=flash: needs a CUDA GPU"),  # a bad setting found in the run: exit 2, not OOM
    (640, "error", "RuntimeError: boom"),
    (896, "error", "unreadable summary.json"),
])
def test_runner_classifies_the_trainer_outcome(stub_runner, n, status, says):
    t = stub_runner("sdpa", n)
    assert t.status == status and (says is None and t.error is None or says in t.error)
    assert t.run_dir == f"trials/sdpa-n{n}"  # relative to the sweep's --out: results name no machine paths
    if n == 128:
        assert (t.peak_allocated_gib, t.tokens_per_s, t.n_layer, t.exit_code) == (1.5, 900.0, 2, 0)
    if n == 256:
        assert t.peak_allocated_gib == 79.0


def test_runner_stops_a_trial_at_the_time_limit(stub_runner):
    stub_runner.time_limit_s = 1
    t = stub_runner("sdpa", 768)
    assert t.status == "timeout" and t.exit_code is None and t.wall_s < 30


def test_runner_never_reads_a_stale_summary(stub_runner):
    stale = stub_runner.run_dir("sdpa", 384)  # a last attempt's summary; this attempt writes none
    RunSummary(status="oom", exit_code=3).write(stale)
    assert stub_runner("sdpa", 384).status == "error" and not (stale / "summary.json").exists()


def test_trial_command(tmp_path):
    runner = SubprocessRunner(tmp_path / "a b", ["model=tiny", "device=cpu"], "sweep-x", steps=1, logger="wandb")
    cmd = runner.command("sdpa+ckpt", 256)
    assert cmd[:3] == [sys.executable, "-m", "minigpt"]
    assert f"hydra.run.dir='{tmp_path / 'a b' / 'trials' / 'sdpa+ckpt-n256'}'" in cmd
    for o in ("attention=sdpa", "model.recompute_every=1", "seq_len=256", "batch_size=1", "save_checkpoints=false",
              "logger=wandb", "logger.group=sweep-x", "logger.run_name=sdpa+ckpt-n256", "logger.tags=[context-sweep]"):
        assert o in cmd, o


def test_trial_command_under_torchrun(tmp_path):
    runner = SubprocessRunner(tmp_path, ["model=tiny"], "sweep-x", steps=1, logger="none", nproc=4, context=2)
    cmd = runner.command("flash+ckpt", 1024)
    assert cmd[:8] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", "-m",
                       "minigpt"]
    assert "parallel.context=2" in cmd and "attention=flash" in cmd and "seq_len=1024" in cmd
    assert "parallel.context=1" not in SubprocessRunner(tmp_path, [], "s", nproc=2).command("flash", 64)


def test_a_torchrun_trial_takes_the_failed_worker_exit_code():
    from minigpt.sweep.runner import worker_exit_code

    report = ("Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 7)\n"
              "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 3 (pid: 8)\n")
    assert worker_exit_code(1, report) == 3  # out of memory on rank 1: an oom trial, not an error
    assert worker_exit_code(0, report) == 0 and worker_exit_code(None, report) is None and worker_exit_code(1, "") == 1


def test_context_must_divide_nproc(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--nproc", "2", "--context", "4", "--logger", "none", "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "error: argument --context: 4 must divide --nproc 2" in capsys.readouterr().err
    parser = build_parser()
    cfg = sweep_config(parser, parser.parse_args(["--nproc", "4", "--context", "2", "--logger", "none",
                                                  "--allow-cpu"]))
    assert (cfg.nproc, cfg.context) == (4, 2)


# ------------------------------------------------------------------------------------------------
# The command line
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def no_wandb_login(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc


@pytest.mark.parametrize("argv, argument", [
    (["--variants", "flash+turbo"], "--variants"),
    (["--variants", "bogus"], "--variants"),
    (["--variants", "sdpa+keepattn"], "--variants"),
    (["--start", "flash"], "--start"),
    (["--start", "flash=abc"], "--start"),
    (["--start", "nope=4096"], "--start"),
    (["--variants", "sdpa", "--start", "flash=4096"], "--start"),
    (["--start", "flash=0"], "--start"),
    (["--start", "flash=-4096"], "--start"),
    (["--granularity", "0"], "--granularity"),
    (["--default-start", "-1"], "--default-start"),
    (["--steps", "0"], "--steps"),
    (["--max-seq-len", "0"], "--max-seq-len"),
    (["--budget", "0"], "--budget"),
    (["--trial-time-limit", "-5"], "--trial-time-limit"),
    (["--probe-layers", "2", "2"], "--probe-layers"),
    (["--max-seq-len", "1024", "--default-start", "4096"], "--default-start"),
    (["--no-search"], "--no-search"),
    (["--grid", "--default-start", "3000"], "--grid"),
    (["--grid", "--variants", "sdpa", "--start", "sdpa=1536"], "--grid"),
    (["--grid", "--no-search", "--probe-seq-lens", "4096"], "--grid"),
    (["--grid", "--max-seq-len", "100000"], "--grid"),
    (["--set", "model.n_layer"], "--set"),
    (["--combine", "/no/such/sweep"], "--combine"),
    (["--logger", "wandb"], "--logger"),  # WANDB_MODE=online without credentials
])
def test_bad_arguments_end_with_usage_and_one_line(argv, argument, capsys, tmp_path, no_wandb_login):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 2 and err[0].startswith("usage:")
    assert f"error: argument {argument}:" in err[1]
    assert not (tmp_path / "o").exists()


def test_bad_arguments_from_another_directory(tmp_path):
    script = ROOT / "scripts" / "context_sweep.py"
    p = subprocess.run([sys.executable, str(script), "--variants", "flash+turbo"], cwd=tmp_path, capture_output=True,
                       text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    usage, error = p.stderr.strip().splitlines()
    assert usage.startswith("usage:") and error.endswith("error: argument --variants: variant flash+turbo: "
                                                        "unknown lever 'turbo'; known: " + ", ".join(LEVERS))


def test_cpu_only_supplies_defaults_for_what_is_not_given():
    parser = build_parser()
    cfg = sweep_config(parser, parser.parse_args(["--cpu", "--default-start", "256", "--granularity", "32"]))
    assert (cfg.default_start, cfg.granularity, cfg.max_seq_len) == (256, 32, 512)
    assert cfg.base_overrides == ["model=tiny", "device=cpu"] and cfg.out_dir.is_absolute()
    cfg = sweep_config(parser, parser.parse_args(["--cpu", "--default-start", "1024", "--set", "model.n_layer=1"]))
    assert (cfg.default_start, cfg.granularity, cfg.full_n_layer) == (1024, 64, 2)  # a start above --cpu's cap is tried
    assert cfg.base_overrides[-1] == "model.n_layer=1"
    cfg = sweep_config(parser, parser.parse_args(["--allow-cpu"]))
    assert (cfg.default_start, cfg.granularity, cfg.max_seq_len) == (4096, 128, None)
    assert cfg.base_overrides == ["model=gpt2-small"]


def sweep_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "minigpt.sweep.sweep", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_real_cpu_sweep_from_another_directory(tmp_path):
    """Real trials of the tiny model on CPU, --out relative to a directory that is not the repo; then a run of
    another variant into the same --out whose setting the trainer refuses: an error (not OOM), exit code 1,
    the first variant kept in the report; run again, the error trial runs again and the ok ones do not."""
    first = ["--cpu", "--variants", "sdpa", "--max-seq-len", "256", "--steps", "1", "--logger", "none", "--out", "rel"]
    p = sweep_cli(*first, cwd=tmp_path)
    out, md = tmp_path / "rel", tmp_path / "rel" / "results.md"
    assert p.returncode == 0, p.stdout + p.stderr
    trials = lines(out / "trials.jsonl")
    assert [(t["seq_len"], t["status"]) for t in trials] == [(128, "ok"), (256, "ok")], [t["error"] for t in trials]
    assert all(t["tokens_per_s"] > 0 for t in trials) and not list(out.glob("trials/*/checkpoints"))
    assert p.stdout.strip().splitlines()[-1] == f"results: {md}" and "| sdpa | 256 |" in md.read_text()
    written = [out / "trials.jsonl", out / "results.json", out / "results.csv", md]
    assert not [f for f in written if str(tmp_path) in f.read_text()]  # every path the sweep records is relative

    bad = ["--cpu", "--variants", "naive", "--set", "model.n_head=5", "--logger", "none", "--out", "rel"]
    p = sweep_cli(*bad, cwd=tmp_path)
    assert p.returncode == 1 and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    error = lines(out / "trials.jsonl")[2:]  # the first trial's error ended naive's search
    assert [(t["variant"], t["status"], t["exit_code"]) for t in error] == [("naive", "error", 2)]
    assert "model.n_head=5" in error[0]["error"] and "no result for naive" in p.stderr
    text = md.read_text()
    assert "| sdpa | 256 |" in text and "every trial failed with an error" in text and "oom" not in text
    assert p.stdout.strip().splitlines()[-1] == f"results: {md}"

    p = sweep_cli(*bad, cwd=tmp_path)
    assert p.returncode == 1 and [t["status"] for t in lines(out / "trials.jsonl")[2:]] == ["error", "error"]


def test_probes_of_one_depth_each_into_one_out_derive_the_full_model(tmp_path):
    """Two calls (e.g. on two GPUs at once), each probing one depth into the same --out: the second derives."""
    def probe(layers):
        cfg = SweepConfig(variants=["flash+levers"], out_dir=tmp_path / "p", search=False, logger="none",
                          probe_seq_lens=[2_000_000], probe_layers=layers)
        fake = FakeRunner(limit=10**9)
        result = run_sweep(cfg, runner=fake, **QUIET)
        return fake.calls, result.report.read_text()
    calls, text = probe((1,))
    assert calls == [2_000_000] and "**derived**" not in text
    calls, text = probe((2,))
    assert calls == [2_000_000] and "| 2,000,000 | 24.0 GiB |" in text and "**derived**" in text
    cfg = SweepConfig(variants=["flash+levers"], out_dir=tmp_path / "p", search=False, logger="none",
                      probe_seq_lens=[2_000_000], probe_layers=(1, 2), gpu_memory_gib=20.0, host_memory_gib=100.0)
    text = run_sweep(cfg, runner=FakeRunner(limit=10**9), **QUIET).report.read_text()
    assert "GPU 24.0 > 20.0 GiB" in text  # the derived row says what it does not fit

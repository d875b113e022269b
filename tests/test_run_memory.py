"""What a run records about memory: every rank's peak allocated and reserved GiB gathered into the summary (from
per-rank figures given to RankStats on 2 gloo processes: no GPU needed), and the CUDA allocator settings the trainer
sets in one place before CUDA starts (cuda_alloc_conf -> PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF, recorded in
the summary).
"""
import json
import os
from pathlib import Path

import pytest
import torch

from minigpt.compose import compose
from minigpt.config import ConfigError
from minigpt.cuda_allocator import ALLOC_CONF_ENV, allocator_settings, use_allocator_settings
from minigpt.summary import RunSummary
from processes import launch

# each rank's (step time s, peak allocated GiB, peak reserved GiB) at two steps
FIGURES = {0: [(1.0, 3.0, 4.0), (1.0, 5.0, 6.0)], 1: [(2.0, 7.5, 9.0), (2.0, 1.0, 2.0)]}


def _rank_stats(rank, out):
    import torch.distributed as dist

    from minigpt.distributed.mesh import Mesh
    from minigpt.rank_stats import RankStats

    dist.init_process_group("gloo")
    mesh = Mesh.setup(1, "cpu")
    stats = RankStats(mesh, tokens_per_step=400)
    metrics = [stats.step(*figures) for figures in FIGURES[rank]]
    summary = RunSummary()
    stats.fill(summary, skip=0)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"metrics": metrics, "summary": summary.__dict__}))
    dist.destroy_process_group()


def test_the_summary_holds_every_ranks_peak_memory(tmp_path):
    launch(2, _rank_stats, str(tmp_path))
    for rank in (0, 1):  # every rank gathers the same figures
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        s = got["summary"]
        assert s["rank_peak_allocated_gib"] == [5.0, 7.5] and s["rank_peak_reserved_gib"] == [6.0, 9.0]
        assert (s["rank_peak_allocated_gib_max"], s["rank_peak_allocated_gib_sum"]) == (7.5, 12.5)
        assert s["rank_peak_reserved_gib_max"] == 9.0
        assert (s["rank_tokens_per_s_max"], s["rank_tokens_per_s_sum"]) == (200.0, 300.0)  # 200 tokens a rank
        first = got["metrics"][0]  # each step's metrics: that step's figures of every rank
        assert (first["memory/rank_peak_allocated_gib_max"], first["memory/rank_peak_reserved_gib_max"]) == (7.5, 9.0)
    summary = RunSummary(**got["summary"])  # a summary with the lists writes and reads back
    assert RunSummary.read(summary.write(tmp_path)).rank_peak_reserved_gib == [6.0, 9.0]


def test_an_older_summary_without_the_new_fields_still_reads(tmp_path):
    data = {k: v for k, v in RunSummary().__dict__.items()
            if k not in ("rank_peak_allocated_gib", "rank_peak_reserved_gib", "cuda_alloc_conf")}
    (tmp_path / "summary.json").write_text(json.dumps(data))
    s = RunSummary.read(tmp_path / "summary.json")
    assert s.rank_peak_allocated_gib is None and s.cuda_alloc_conf is None


@pytest.fixture
def clean_env(monkeypatch):
    """No allocator setting in the environment; whatever a test sets is undone after it."""
    for name in ALLOC_CONF_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_setting_goes_into_both_variables_and_null_keeps_the_environments(clean_env):
    assert use_allocator_settings(None) is None and allocator_settings() is None
    clean_env.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    assert use_allocator_settings(None) == "max_split_size_mb:64"  # null: the environment's, untouched
    assert use_allocator_settings("expandable_segments:True") == "expandable_segments:True"
    assert [os.environ[n] for n in ALLOC_CONF_ENV] == ["expandable_segments:True"] * 2


def test_where_cuda_already_runs_the_setting_changes_at_runtime(clean_env):
    changed = []
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "is_initialized", lambda: True)
    clean_env.setattr(torch._C, "_accelerator_setAllocatorSettings", changed.append, raising=False)
    use_allocator_settings("expandable_segments:False")
    assert changed == ["expandable_segments:False"]


def test_a_run_sets_it_before_the_mesh_starts_cuda_and_records_it(clean_env, tiny_config):
    """run() gives the allocator its setting before Mesh.setup (which takes the GPU, starting CUDA), the same for
    one process and for torchrun's; the summary records it; null records the environment's."""
    from minigpt.distributed.mesh import Mesh
    from minigpt.run import run

    seen = []
    setup = Mesh.setup
    clean_env.setattr(Mesh, "setup", classmethod(lambda cls, *a: seen.append(allocator_settings()) or setup(*a)))
    cfg = tiny_config("max_steps=1", "save_checkpoints=false", "eval_batches=0")
    assert cfg.cuda_alloc_conf == "expandable_segments:True"  # the default
    assert run(cfg) == 0 and seen == ["expandable_segments:True"]
    assert RunSummary.read(Path(cfg.run_dir) / "summary.json").cuda_alloc_conf == "expandable_segments:True"

    clean_env.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")
    for name in ("PYTORCH_ALLOC_CONF",):
        clean_env.delenv(name, raising=False)
    cfg = tiny_config("max_steps=1", "save_checkpoints=false", "eval_batches=0", "cuda_alloc_conf=null")
    cfg.run_dir = str(Path(cfg.run_dir).with_name("run_null"))
    assert run(cfg) == 0
    assert RunSummary.read(Path(cfg.run_dir) / "summary.json").cuda_alloc_conf == "garbage_collection_threshold:0.6"


@pytest.mark.parametrize("value", ["expandable_segments:False", "'max_split_size_mb:128,expandable_segments:True'",
                                   "'roundup_power2_divisions:[256:1,512:2,>:8]'"])
def test_the_key_takes_pytorchs_forms(value):
    assert compose(["model=tiny", "device=cpu", f"cuda_alloc_conf={value}"]).cuda_alloc_conf == value.strip("'")


def test_a_malformed_setting_is_one_line_before_the_run():
    with pytest.raises(ConfigError) as info:
        compose(["model=tiny", "device=cpu", "cuda_alloc_conf=expandable_segments"])
    assert str(info.value).startswith("cuda_alloc_conf=expandable_segments: must be key:value pairs joined by commas")

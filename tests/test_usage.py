"""`minigpt-train --help` (groups, options, every setting with a line from config.py), `--cfg job` (the config as it
runs on this machine), and GPU-sized jobs on a machine without a GPU: training warns and runs, the sweep refuses."""
from dataclasses import fields

import pytest
import torch
import yaml

from minigpt.cli import train_main
from minigpt.config import CPU_DEFAULTS, DataConfig, LoggerConfig, ModelConfig, TrainConfig, gpu_sized
from minigpt.summary import RunSummary
from minigpt.usage import config_groups, field_comments


@pytest.fixture
def no_gpu(monkeypatch):
    """This machine as one without a GPU, whatever it has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_help_lists_groups_options_and_every_setting_with_its_line(capsys):
    assert train_main(["--help"]) == 0
    out = capsys.readouterr().out
    for group, options in config_groups().items():
        assert f"  {group} " in out and all(option in out for option, _ in options)
    assert "sdpa*" in out and "gpt2-small*" in out and "passkey*" in out  # the defaults marked
    comments = field_comments(TrainConfig)
    assert comments["seq_len"].startswith("tokens per training sequence") and f"seq_len=1024" in out
    for section in (TrainConfig, ModelConfig, DataConfig, LoggerConfig):  # every setting documented beside its field
        missing = [f.name for f in fields(section) if not field_comments(section).get(f.name)
                   and f.name not in ("attention", "model", "data", "logger", "parallel")]
        assert not missing, f"{section.__name__}: fields without a comment: {missing}"
    for key in ("batch_size=4", "max_steps=500", "device=auto", "dtype=auto", "compile=null", "resume=none",
                "model.loss_chunk=0", "--cfg job"):
        assert key in out, key


def test_cfg_job_prints_what_runs_on_this_machine(no_gpu, capsys):
    assert train_main(["--cfg", "job"]) == 0
    out = capsys.readouterr().out
    job = yaml.safe_load(out)
    assert (job["model"]["name"], job["seq_len"], job["batch_size"], job["max_steps"]) == (
        "tiny", 256, 8, 300)  # config.CPU_DEFAULTS, not gpt2-small/1024/500
    assert (job["device"], job["dtype"], job["compile"]) == ("cpu", "float32", False)
    assert job["run_dir"].startswith("outputs/") and job["ckpt_dir"] == job["run_dir"] + "/checkpoints"
    assert out.startswith("# no GPU: using CPU-sized defaults " + " ".join(CPU_DEFAULTS))

    assert train_main(["--cfg", "job", "model=gpt2-small", "seq_len=4096", "hydra.run.dir=runs/x"]) == 0
    out = capsys.readouterr().out
    job = yaml.safe_load(out)
    assert (job["model"]["name"], job["seq_len"], job["run_dir"]) == ("gpt2-small", 4096, "runs/x")
    assert "# warning: GPU-sized job on the CPU (model=gpt2-small, seq_len=4096)" in out

    assert train_main(["--cfg", "job", "seq_len=-1"]) == 2
    assert capsys.readouterr().err.strip() == "error: seq_len=-1: must be an integer >= 1"


def test_a_gpu_sized_training_run_on_cpu_says_so_in_one_line_first(no_gpu, tmp_path, capsys):
    assert gpu_sized("tiny", 256) is None and gpu_sized("small-6l", 2048) is None
    assert gpu_sized("gpt2-small", 256) == "model=gpt2-small" and gpu_sized("tiny", 4096) == "seq_len=4096"
    RunSummary(status="ok").write(tmp_path)  # another run's directory: refused after the warning, nothing trains
    code = train_main(["model=gpt2-small", "device=cpu", "logger=none", f"hydra.run.dir={tmp_path}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 2, err
    assert err[0].startswith("warning: GPU-sized job on the CPU (model=gpt2-small)") and "model=tiny" in err[0]
    assert "holds another run's summary.json" in err[1]


def test_a_gpu_sized_sweep_without_a_gpu_is_refused_unless_allowed(no_gpu, tmp_path, capsys):
    from minigpt.sweep.sweep import build_parser, main, sweep_config

    with pytest.raises(SystemExit) as e:
        main(["--logger", "none", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 2 and err[0].startswith("usage:")
    assert "no GPU, and this sweep is GPU-sized (model=gpt2-small, seq_len=4096)" in err[1] and "--cpu" in err[1]
    assert not (tmp_path / "o").exists()
    parser = build_parser()
    for argv in (["--allow-cpu"], ["--cpu"]):
        cfg = sweep_config(parser, parser.parse_args([*argv, "--logger", "none", "--out", str(tmp_path / "o")]))
        assert cfg.variants
    with pytest.raises(SystemExit):  # --cpu with a GPU-sized model asked for
        sweep_config(parser, parser.parse_args(["--cpu", "--set", "model=gpt2-small", "--logger", "none"]))

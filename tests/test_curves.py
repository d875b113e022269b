"""metrics.jsonl in every run directory, and the curves drawn from it across stages."""
import json
from pathlib import Path

from conftest import RecordingLogger
from minigpt.sweep.curves import main as curves_main
from minigpt.loggers import read_history
from minigpt.run import run


def test_metrics_jsonl_holds_what_the_logger_got_and_a_resume_appends(tiny_config, tmp_path):
    logger = RecordingLogger()
    cfg = tiny_config("max_steps=4", "eval_every=2")
    assert run(cfg, logger=logger) == 0
    rows = read_history(cfg.run_dir)
    assert [r["step"] for r in rows] == [step for step, _ in logger.metrics]
    assert [r["train/loss"] for r in rows if "train/loss" in r] == logger.series("train/loss")
    assert [r["step"] for r in rows if "eval/val_loss" in r] == [2, 4]
    later = tiny_config("max_steps=6", "eval_every=2", "resume=auto")
    assert run(later) == 0
    assert [r["step"] for r in read_history(cfg.run_dir) if "eval/val_loss" in r] == [2, 4, 6]
    with (Path(cfg.run_dir) / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "train/lo')  # a run killed mid-line
    assert read_history(cfg.run_dir)[-1]["step"] == 6


def test_curves_of_two_stages(tiny_config, tmp_path):
    first = tiny_config("max_steps=2", "eval_every=1")
    assert run(first) == 0
    second = tiny_config("max_steps=4", "eval_every=1", "seq_len=256", f"resume={first.ckpt_dir}")
    second.run_dir, second.ckpt_dir = str(tmp_path / "stage2"), str(tmp_path / "stage2" / "checkpoints")
    assert run(second) == 0
    out = tmp_path / "curve"
    assert curves_main([first.run_dir, second.run_dir, "--out", str(out),
                        "--metrics", "eval/val_loss", "eval/passkey_acc"]) == 0
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    table = out.with_suffix(".md").read_text()
    assert [line.split("|")[3].strip() for line in table.splitlines()[2:]] == ["1", "2", "3", "4"]
    assert "| stage2 | 256 | 3 |" in table
    assert curves_main([str(tmp_path / "nothing"), "--out", str(out)]) == 1


def test_a_metrics_file_that_cannot_be_written_stops_the_run_with_one_line(tiny_config, capsys):
    cfg = tiny_config("max_steps=3")
    (Path(cfg.run_dir) / "metrics.jsonl").mkdir(parents=True)  # appending to it fails like a full disk would
    assert run(cfg) == 1
    err = capsys.readouterr().err
    assert "cannot write" in err and "metrics.jsonl" in err and "Traceback" not in err
    summary = json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    assert summary["status"] == "error" and summary["steps"] == 1 and "metrics.jsonl" in summary["error"]

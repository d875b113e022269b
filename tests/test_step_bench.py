"""minigpt/benchmarks/step_bench.py on CPU: the trainer's step per backend in alternating rounds, its table and files
(the tiny model; on a GPU the same code times gpt2-small, scripts/bench_attention.py --step)."""
import json

import pytest

from minigpt.benchmarks.bench import main as bench_main
from minigpt.benchmarks.step_bench import StepRow, step_bench, step_table, write_step_results


def test_each_backend_gets_its_rounds_at_each_length_and_the_table_divides_by_sdpa(tmp_path):
    lines = []
    rows = step_bench([128, 256], ["naive", "sdpa"], tokens=512, model="tiny", rounds=3, steps=1, warmup=1,
                      progress=lines.append)
    assert [(r.backend, r.seq_len, r.batch) for r in rows] == [("naive", 128, 4), ("sdpa", 128, 4),
                                                               ("naive", 256, 2), ("sdpa", 256, 2)]
    for r in rows:
        assert len(r.rounds) == 3 and all(ms > 0 for ms in r.rounds)
        assert r.min_ms == min(r.rounds) <= r.median_ms <= max(r.rounds)
    assert len(lines) == 4 and "naive" in lines[0]
    md = write_step_results(rows, tmp_path, "tiny", 512, "python scripts/bench_attention.py --step").read_text()
    data = json.loads((tmp_path / "step_cpu.json").read_text())
    assert [r["backend"] for r in data["rows"]] == ["naive", "sdpa", "naive", "sdpa"]
    assert data["env"]["commit"] and data["env"]["command"].endswith("--step")
    naive_128 = rows[0].median_ms / rows[1].median_ms
    assert f"| 128 | 4 | naive | {rows[0].median_ms:.2f} |" in md and f"{naive_128:.3f} |" in md
    paired = [a / b for a, b in zip(rows[0].rounds, rows[1].rounds)]
    assert f"{naive_128:.3f} | {min(paired):.2f}–{max(paired):.2f} |" in md


def test_a_table_without_sdpa_leaves_the_ratio_empty():
    env = dict(model="tiny", tokens=64, device="cpu", torch="t", triton=None, date="d", commit="c", command="x")
    md = step_table([StepRow("naive", 128, 1, 2.0, 1.5, [2.0, 1.5, 2.5])], env)
    assert md.splitlines()[-1] == "| 128 | 1 | naive | 2.00 | 1.50 | 3 | – | – |"  # markdown_table: – for none


def test_a_setting_the_trainer_refuses_is_one_line_and_exit_code_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["--step", "--step-model", "tiny", "--seq", "64", "--step-backends", "sdpa", "--out",
                    str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("bench_attention: error: --step: seq_len=64: data=passkey needs seq_len >= ")
    assert not list(tmp_path.iterdir())


def test_the_recorded_command_leaves_out_the_output_folder():
    from minigpt.benchmarks.bench import without_out

    assert without_out(["--step", "--out", "/root/out", "--seq", "1024"]) == ["--step", "--seq", "1024"]
    assert without_out(["--out=/tmp/x", "--step"]) == ["--step"]

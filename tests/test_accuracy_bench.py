"""The long-row accuracy suite (minigpt/benchmarks/accuracy.py) on CPU: its measures on made-up errors, and the whole
suite through the CLI in fp32, our kernel in Triton's interpreter, where every method agrees with float64."""
import json

import pytest
import torch

from minigpt.benchmarks import accuracy, bench


def test_the_measures_tell_a_shrunk_output_from_noise():
    """o shrunk by 1e-3 is all bias, toward zero by 1e-3 · mean |mean over rows of o| / RMS; zero-mean noise of the
    same size has next to no bias over 64 rows."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 4, 16, generator=g, dtype=torch.float64) * 0.3 + 0.5
    rms, bias, toward_zero = accuracy.measure(ref * (1 - 1e-3), ref)
    expected = -1e-3 * ref.mean(0).abs().mean() / ref.pow(2).mean().sqrt()
    assert toward_zero == pytest.approx(expected.item(), rel=1e-6) and toward_zero < 0
    assert bias == pytest.approx(1e-3 * ref.mean(0).pow(2).mean().sqrt().item() / ref.pow(2).mean().sqrt().item())
    noise = torch.randn(ref.shape, generator=g, dtype=torch.float64) * 1e-3 * ref.abs().mean()
    n_rms, n_bias, n_toward = accuracy.measure(ref + noise, ref)
    assert n_rms == pytest.approx(rms, rel=0.3)  # errors of the same size
    assert n_bias < bias / 3 and abs(n_toward) < abs(toward_zero) / 3  # but no bias to speak of


def test_periodic_inputs_repeat_and_random_ones_do_not():
    q, k, v = accuracy.make_inputs("periodic", 2 * accuracy.PERIOD + 5, 2, 8, torch.device("cpu"), torch.float32)
    p = accuracy.PERIOD
    assert torch.equal(k[:, :, :p], k[:, :, p:2 * p]) and torch.equal(v[:, :, 3], v[:, :, p + 3])
    assert v.mean().item() == pytest.approx(0.5, abs=0.05)
    q, k, v = accuracy.make_inputs("random", 2 * p, 2, 8, torch.device("cpu"), torch.float32)
    assert not torch.equal(k[:, :, :p], k[:, :, p:]) and abs(v.mean().item()) < 0.05


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run; on a GPU run the suite itself")
def test_the_suite_dry_runs_on_cpu_and_agrees_with_float64(tmp_path, capsys):
    """Through the CLI at tiny sizes: a row per input kind, keys, provider and split; in fp32 every one is within
    1e-5 of float64 (so a split's merge is right), and the table, printed last, names the machine and commit."""
    from minigpt.metrics import git_commit

    assert bench.main(["--accuracy", "--tiny", "--head-dim", "16", "--out", str(tmp_path)]) == 0  # 512 keys
    data = json.loads((tmp_path / "accuracy_cpu.json").read_text())
    rows = data["rows"]
    assert {(r["inputs"], r["provider"], r["calls"]) for r in rows} == \
        {(kind, "flash", c) for kind in accuracy.KINDS for c in accuracy.SPLITS} | \
        {(kind, "sdpa", 1) for kind in accuracy.KINDS}
    assert all(r["keys"] == 512 and r["rms"] < 1e-5 and abs(r["toward_zero"]) < 1e-6 for r in rows), rows
    assert data["env"]["dtype"] == "float32" and data["env"]["commit"] == git_commit()
    table = (tmp_path / "accuracy_cpu.md").read_text()
    assert capsys.readouterr().out.rstrip().endswith(table.rstrip())
    assert table.count("\n| ") == len(rows) + 1


def test_keys_that_do_not_split_are_refused(tmp_path):
    with pytest.raises(ValueError, match="multiple of 8"):
        accuracy.run_accuracy([100], head_dim=16, heads=2, out=tmp_path, tiny=True)
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--accuracy", "--tiny", "--keys", "256", "--out", str(tmp_path)])  # 32 keys a part, under 64
    assert exit_.value.code == 2 and not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run")
def test_a_kernel_that_shrinks_its_output_shows_as_a_bias_toward_zero(tmp_path, monkeypatch):
    """End to end: a provider whose output is SDPA's times (1 − 1e-3) reads as a bias toward zero of about 1e-3 on
    the periodic inputs (o's mean over rows is far from 0 there), far beyond the fp32 rows of everything else."""
    real = accuracy.get_provider

    def shrunk(name):
        fn = real("sdpa")
        return lambda q, k, v, causal: fn(q, k, v, causal=causal) * (1 - 1e-3)

    monkeypatch.setattr(accuracy, "get_provider", shrunk)
    rows, _ = accuracy.run_accuracy([512], head_dim=16, heads=2, providers=["shrunk"], out=tmp_path, tiny=True,
                                    progress=lambda line: None)
    by = {(r.inputs, r.provider, r.calls): r for r in rows}
    periodic = by[("periodic", "shrunk", 1)]
    assert -1.5e-3 < periodic.toward_zero < -3e-4 and periodic.bias > 3e-4
    assert all(abs(r.toward_zero) < 1e-6 for r in rows if r.provider == "flash")


@pytest.mark.skipif(torch.cuda.is_available(), reason="cuDNN runs there")
def test_a_provider_that_cannot_run_is_recorded_with_its_error(tmp_path):
    rows, md = accuracy.run_accuracy([512], head_dim=16, heads=2, providers=["sdpa-cudnn"], out=tmp_path, tiny=True,
                                     progress=lambda line: None)
    failed = [r for r in rows if r.provider == "sdpa-cudnn"]
    assert len(failed) == 2 and all(r.error and r.rms is None and r.toward_zero is None for r in failed)
    assert all(not r.error and r.rms < 1e-5 for r in rows if r.provider == "flash")
    assert failed[0].error in md.read_text() and "NaN" not in (tmp_path / "accuracy_cpu.json").read_text()


def test_a_truncating_accumulator_loses_in_proportion_to_its_additions():
    """The emulation behind kernels/NOTES.md's explanation: truncating each fp32 addition shrinks o by about
    0.36 · 2⁻²⁴ per addition (each loses 0.72 ulp-fractions on average, over a sum that grows linearly), on top of what
    rounding to nearest gives; twice the additions (4 keys each instead of 8), twice the loss."""
    nearest = accuracy.emulate_accumulation(16384, heads=2, step=8, truncate=False)
    by8 = accuracy.emulate_accumulation(16384, heads=2, step=8) - nearest
    by4 = accuracy.emulate_accumulation(16384, heads=2, step=4) - nearest
    expected = -0.36 * 2 ** -24 * 16384 / 8
    assert expected * 1.6 < by8 < expected * 0.6, (by8, expected)
    assert by4 / by8 == pytest.approx(2, rel=0.3)
    x = torch.tensor([1 + 0.75 * 2 ** -23, -(1 + 0.75 * 2 ** -23)], dtype=torch.float64)  # 3/4 of fp32's unit at 1
    assert x.float().double().tolist() == [1 + 2 ** -23, -(1 + 2 ** -23)]  # nearest rounds away from zero
    assert accuracy.truncate_to_fp32(x).tolist() == [1.0, -1.0]  # truncation toward it

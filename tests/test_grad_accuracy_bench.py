"""The backward's accuracy suite (minigpt/benchmarks/grad_accuracy.py) on CPU: its periodic float64 reference against
autograd over the whole L × L attention, and the suite through the CLI in fp32 with our kernel in Triton's
interpreter, where every gradient agrees with float64."""
import json
import math

import pytest
import torch

from minigpt.benchmarks import accuracy, bench, grad_accuracy


@pytest.mark.parametrize("L", [accuracy.PERIOD // 4, 2 * accuracy.PERIOD + 37])
def test_the_periodic_reference_equals_autograd_over_all_rows(L):
    """One period's scores weighted by each residue's count give dq, dk, dv of the whole L × L attention: against
    float64 autograd of softmax(q kᵀ / √D) v over every row (L shorter than a period too: counts of 1)."""
    q, k, v, do = grad_accuracy.make_grad_inputs("dO centred", L, 2, 8, torch.device("cpu"), torch.float32)
    rows = torch.linspace(0, L - 1, 16).long()
    ref = grad_accuracy.periodic_reference(q, k, v, do, rows)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    o = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1) @ v
    o.backward(do.double())
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        exact = t.grad[0, :, rows].transpose(0, 1)
        assert torch.allclose(ref[name], exact, rtol=1e-10, atol=1e-12), name


def test_do_kinds_are_periodic_and_centred_as_named():
    p = accuracy.PERIOD
    *_, do = grad_accuracy.make_grad_inputs("dO centred", 2 * p + 5, 2, 8, torch.device("cpu"), torch.float32)
    assert torch.equal(do[:, :, :p], do[:, :, p:2 * p]) and do.mean().item() == pytest.approx(0.5, abs=0.05)
    *_, do = grad_accuracy.make_grad_inputs("dO zero-mean", 2 * p, 2, 8, torch.device("cpu"), torch.float32)
    assert abs(do.mean().item()) < 0.05


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run; on a GPU run the suite itself")
def test_the_grad_suite_dry_runs_on_cpu_and_agrees_with_float64(tmp_path, capsys):
    """Through the CLI at tiny sizes: dq, dk, dv for each dO kind, our kernel and sdpa; in fp32 each within 1e-5 of
    float64, the table printed last."""
    assert bench.main(["--accuracy", "--grads", "--tiny", "--head-dim", "16", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "grad_accuracy_cpu.json").read_text())["rows"]
    kinds, grads = grad_accuracy.GRAD_KINDS, grad_accuracy.GRADS
    expected = [(kind, p, t) for kind in kinds for p in ("flash", "sdpa") for t in grads]
    assert sorted((r["grads"], r["provider"], r["tensor"]) for r in rows) == sorted(expected)
    assert all(not r["error"] and r["rms"] < 1e-5 and abs(r["toward_zero"]) < 1e-6 for r in rows), rows
    table = (tmp_path / "grad_accuracy_cpu.md").read_text()
    assert capsys.readouterr().out.rstrip().endswith(table.rstrip())


def test_the_gradient_measure_reads_a_shrink_whatever_the_signs():
    """Rows of either sign (as dK's): a gradient shrunk by 1e-3 reads −1e-3 · mean|ref| / RMS toward zero, noise of
    the same size next to nothing."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 4, 16, generator=g, dtype=torch.float64)
    rms, _, toward_zero = grad_accuracy.measure_grad(ref * (1 - 1e-3), ref)
    assert toward_zero == pytest.approx(-1e-3 * (ref.abs().mean() / ref.pow(2).mean().sqrt()).item(), rel=1e-6)
    noise = torch.randn(ref.shape, generator=g, dtype=torch.float64) * 1e-3 * ref.abs().mean()
    n_rms, _, n_toward = grad_accuracy.measure_grad(ref + noise, ref)
    assert n_rms == pytest.approx(rms, rel=0.3) and abs(n_toward) < abs(toward_zero) / 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run")
@pytest.mark.parametrize("shrunk", ["dk", "dv"])
def test_a_backward_that_shrinks_a_gradient_shows_as_a_bias_toward_zero(tmp_path, monkeypatch, shrunk):
    """A provider whose dK or dV comes out (1 − 1e-3) too small (the gradient scaled on its way back to k or v only)
    reads as a bias toward zero of about 1e-3 in that gradient, with dO centred and zero-mean alike, while the
    provider's other gradients keep none."""
    real = grad_accuracy.get_provider

    class Shrink(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad * (1 - 1e-3)

    def wrapped(name):
        fn = real("sdpa")
        if shrunk == "dk":
            return lambda q, k, v, causal: fn(q, Shrink.apply(k), v, causal=causal)
        return lambda q, k, v, causal: fn(q, k, Shrink.apply(v), causal=causal)

    monkeypatch.setattr(grad_accuracy, "get_provider", wrapped)
    rows, _ = grad_accuracy.run_grad_accuracy([512], head_dim=16, heads=2, providers=["shrunk"], out=tmp_path,
                                              tiny=True, progress=lambda line: None)
    by = {(r.grads, r.provider, r.tensor): r for r in rows}
    for kind in grad_accuracy.GRAD_KINDS:
        assert -1.5e-3 < by[(kind, "shrunk", shrunk)].toward_zero < -3e-4, (kind, shrunk)
        for other in set(grad_accuracy.GRADS) - {shrunk}:
            assert abs(by[(kind, "shrunk", other)].toward_zero) < 1e-6, (kind, other)


def test_grads_without_accuracy_are_refused(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--grads", "--out", str(tmp_path)])
    assert exit_.value.code == 2 and not list(tmp_path.iterdir())

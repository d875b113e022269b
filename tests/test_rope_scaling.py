"""RoPE length extension (model.rope_scaling): the inverse frequencies of linear and YaRN against their formulas in
float64, plain RoPE at factor 1, YaRN's temperature, the backends and the fused Triton RoPE agreeing on a scaled
model, the config's checks, and a length-extension stage (resume_extend=true) resumed from a checkpoint."""
import json
import math
from pathlib import Path

import pytest
import torch

from minigpt.attention import get_attention
from minigpt.config import ConfigError, ModelConfig
from minigpt.model import GPT, Rotary, apply_rotary, rope_attention_factor, rope_inv_freq
from minigpt.run import run
from minigpt.summary import ExitCode

D, BASE, L = 64, 10000.0, 1024  # head_dim 64, trained context 1024: r_d spans ~163 down to ~0.02


def theta64(head_dim=D, base=BASE):
    return base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def ramp64(original_len, theta):
    """YaRN's γ(r), r = original_len / (2π/θ), written out case by case."""
    out = []
    for t in theta.tolist():
        r = original_len / (2 * math.pi / t)
        out.append(0.0 if r < 1 else 1.0 if r > 32 else (r - 1) / (32 - 1))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scaling", ["none", "yarn"])
def test_rope_tables_are_the_float64_angles_rounded_once_far_into_the_sequence(scaling, monkeypatch):
    """cos and sin at positions up to 8M (given as a context-parallel rank's positions, and as a whole table cut into
    pieces) are float64's cos(pos·θ) rounded to fp32: an fp32 product pos·θ would be off by ~0.25 rad there."""
    import minigpt.model as model

    r = Rotary(D) if scaling == "none" else Rotary(D, BASE, "yarn", 4.0, L)
    positions = torch.tensor([0, 1, 4095, 2**20 - 1, 2**20 + 12345, 3 * 2**21 + 7, 2**23 - 1])
    cos, sin = r(len(positions), positions)
    angles = torch.outer(positions.double(), r.inv_freq.double())
    for got, want in ((cos, angles.cos()), (sin, angles.sin())):
        assert got.dtype == torch.float32 and got.shape == (len(positions), 1, D // 2)
        assert (got[:, 0].double() - want * r.attention_factor).abs().max().item() < 1e-7
    monkeypatch.setattr(model, "ROPE_CHUNK", 300)  # pieces that do not divide the length
    whole_cos, whole_sin = r(1000)
    picked = torch.tensor([0, 299, 300, 999])
    part_cos, part_sin = r(len(picked), picked)
    assert torch.equal(whole_cos[picked], part_cos) and torch.equal(whole_sin[picked], part_sin)


@pytest.mark.parametrize("factor", [2.0, 4.0, 16.0])
def test_linear_divides_every_frequency_by_the_factor(factor):
    got = rope_inv_freq(D, BASE, "linear", factor).double()
    assert torch.allclose(got, theta64() / factor, rtol=1e-6, atol=0)


@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_yarn_interpolates_long_wavelengths_keeps_short_ones_and_ramps_between(factor):
    theta, gamma = theta64(), ramp64(L, theta64())
    got = rope_inv_freq(D, BASE, "yarn", factor, L).double()
    want = (1 - gamma) * theta / factor + gamma * theta
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    # all three regimes are there: kept (r > 32), interpolated (r < 1) and the ramp's middle
    kept, interpolated, middle = gamma == 1, gamma == 0, (gamma > 0) & (gamma < 1)
    assert kept.any() and interpolated.any() and middle.sum() >= 2
    assert torch.allclose(got[kept], theta[kept], rtol=1e-6)
    assert torch.allclose(got[interpolated], theta[interpolated] / factor, rtol=1e-6)
    assert ((got[middle] < theta[middle]) & (got[middle] > theta[middle] / factor)).all()
    # one middle dimension by hand: d = 14 (θ = 10000^(-28/64)), r = 1024·θ/2π ≈ 29.9
    t14 = BASE ** (-28 / 64)
    r14 = L * t14 / (2 * math.pi)
    g14 = (r14 - 1) / 31
    assert 1 < r14 < 32 and got[14].item() == pytest.approx(((1 - g14) / factor + g14) * t14, rel=1e-6)


@pytest.mark.parametrize("scaling", ["linear", "yarn"])
def test_factor_one_is_plain_rope(scaling):
    plain, scaled = Rotary(D), Rotary(D, BASE, scaling, 1.0, L)
    assert torch.equal(scaled.inv_freq, plain.inv_freq) and scaled.attention_factor == 1.0
    pos = torch.arange(0, 3000, 7)
    for a, b in zip(plain(len(pos), pos), scaled(len(pos), pos)):
        assert (a - b).abs().max() <= 1e-7


@pytest.mark.parametrize("factor", [1.0, 2.0, 8.0, 32.0])
def test_yarn_temperature_scales_the_logits_by_t(factor):
    sqrt_t = 0.1 * math.log(factor) + 1
    assert rope_attention_factor("yarn", factor) == pytest.approx(sqrt_t, rel=1e-12)
    assert rope_attention_factor("linear", factor) == 1.0 and rope_attention_factor("none", factor) == 1.0
    yarn = Rotary(16, BASE, "yarn", factor, 64)
    cos, sin = yarn(20)
    assert torch.allclose(cos ** 2 + sin ** 2, torch.full_like(cos, sqrt_t ** 2), rtol=1e-5)
    # q·k of the rotated vectors: t times what the same frequencies give without the temperature
    plain = Rotary(16)
    plain.inv_freq = yarn.inv_freq
    q, k = torch.randn(1, 20, 2, 16, dtype=torch.float64), torch.randn(1, 20, 2, 16, dtype=torch.float64)
    pc, ps = (x.double() for x in plain(20))
    yc, ys = cos.double(), sin.double()
    logits = torch.einsum("bnhd,bmhd->bhnm", apply_rotary(q, yc, ys), apply_rotary(k, yc, ys))
    plain_logits = torch.einsum("bnhd,bmhd->bhnm", apply_rotary(q, pc, ps), apply_rotary(k, pc, ps))
    assert torch.allclose(logits, sqrt_t ** 2 * plain_logits, rtol=1e-5, atol=1e-6)


def yarn_model(attention: str, scaling: str = "yarn") -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(name="t", n_layer=2, n_head=2, n_embd=32, rope_scaling=scaling, rope_factor=4.0,
                      rope_original_len=16)
    cfg.validate()
    return GPT(cfg, 64, get_attention(attention))


def test_a_yarn_models_attention_output_is_the_same_through_naive_and_sdpa():
    idx = torch.randint(0, 64, (2, 48))  # 3× the original length

    def attention_output(model):
        with torch.no_grad():
            model.blocks[0].attn.c_attn.weight.normal_(0, 0.5)  # logits large enough for RoPE to matter
        x = model.blocks[0].ln_1(model.wte(idx))
        return model.blocks[0].attn(x, *model.rotary(48))

    naive = attention_output(yarn_model("naive"))
    assert torch.allclose(naive, attention_output(yarn_model("sdpa")), rtol=1e-5, atol=1e-5)
    assert (naive - attention_output(yarn_model("naive", "linear"))).abs().max() > 1e-3  # the scaling acts
    assert torch.allclose(yarn_model("sdpa").hidden(idx), yarn_model("naive").hidden(idx), rtol=1e-5, atol=1e-5)


def test_the_fused_rope_kernel_and_flash_qkv_match_the_pytorch_path_with_yarn():
    rotary = pytest.importorskip("minigpt_kernels.rotary")
    if not rotary.INTERPRET:
        pytest.skip("runs the Triton kernel under TRITON_INTERPRET=1")
    fqkv = pytest.importorskip("minigpt_kernels.flash_attention_qkv")
    N, H, Dh = 40, 2, 16
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(1, N, 3, H, Dh, generator=g).requires_grad_()
    cos, sin = Rotary(Dh, BASE, "yarn", 4.0, 16)(N)
    assert not torch.allclose(cos ** 2 + sin ** 2, torch.ones_like(cos))  # the temperature is in the tables
    q, k, v = rotary.qkv_rotary(qkv, cos, sin)
    ref = qkv.detach().clone().requires_grad_()
    rq, rk = apply_rotary(ref[:, :, 0], cos, sin), apply_rotary(ref[:, :, 1], cos, sin)
    assert torch.allclose(q, rq, atol=1e-6) and torch.allclose(k, rk, atol=1e-6)
    dq, dk, dv = (torch.randn(1, N, H, Dh, generator=g) for _ in range(3))
    (got,) = torch.autograd.grad((q, k, v), qkv, (dq, dk, dv))
    (want,) = torch.autograd.grad((rq, rk, ref[:, :, 2]), ref, (dq, dk, dv), retain_graph=True)
    assert torch.allclose(got, want, atol=1e-5)
    # the flash path from the projection: RoPE + attention + their folded backward, against the PyTorch RoPE + sdpa
    o = fqkv.flash_attention_qkv(qkv, cos, sin)
    sdpa = get_attention("sdpa")
    o_ref = sdpa(rq.transpose(1, 2), rk.transpose(1, 2), ref[:, :, 2].transpose(1, 2), causal=True)
    assert torch.allclose(o, o_ref, atol=1e-5)
    do = torch.randn(o.shape, generator=g)
    (got,) = torch.autograd.grad(o, qkv, do)
    (want,) = torch.autograd.grad(o_ref, ref, do)
    assert torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("overrides,needle", [
    (("model.rope_factor=0.5",), "model.rope_factor=0.5"),
    (("model.rope_scaling=yarn", "model.rope_factor=2"), "model.rope_original_len"),
    (("model.rope_scaling=ntk",), "model.rope_scaling=ntk"),
])
def test_bad_rope_settings_are_refused_in_one_line(tiny_config, overrides, needle):
    with pytest.raises(ConfigError) as e:
        tiny_config(*overrides).validate()
    assert needle in str(e.value) and "\n" not in str(e.value)


# a length-extension stage: 2 steps at 128 tokens, then on at 256 with YaRN ×2
EXTEND = ("seq_len=256", "model.rope_scaling=yarn", "model.rope_factor=2", "model.rope_original_len=128")


@pytest.fixture
def first_stage(tiny_config, tmp_path):
    cfg = tiny_config("seq_len=128", "max_steps=2", "batch_size=2", "eval_batches=0")
    assert run(cfg) == 0
    return cfg


def stage(tiny_config, tmp_path, first, name, *overrides):
    cfg = tiny_config("max_steps=3", "batch_size=2", "eval_batches=0", f"resume={first.ckpt_dir}", *overrides)
    cfg.run_dir, cfg.ckpt_dir = str(tmp_path / name), str(tmp_path / name / "checkpoints")
    return cfg


def test_resume_extend_continues_with_new_rope_and_seq_len(tiny_config, tmp_path, first_stage, capsys):
    cfg = stage(tiny_config, tmp_path, first_stage, "extend", *EXTEND, "resume_extend=true")
    assert run(cfg) == 0
    s = json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    assert s["status"] == "ok" and s["steps"] == 3 and s["seq_len"] == 256
    assert s["resume_extend"] == {
        "from": {"model.rope_scaling": "none", "model.rope_factor": 1.0, "model.rope_original_len": None, "seq_len": 128},
        "to": {"model.rope_scaling": "yarn", "model.rope_factor": 2.0, "model.rope_original_len": 128, "seq_len": 256}}
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("resume_extend:")]
    assert len(line) == 1 and "model.rope_scaling=none -> yarn" in line[0] and "seq_len=128 -> 256" in line[0]


def test_without_resume_extend_new_rope_settings_are_refused_but_seq_len_alone_is_not(tiny_config, tmp_path,
                                                                                       first_stage, capsys):
    capsys.readouterr()
    refused = stage(tiny_config, tmp_path, first_stage, "refused", *EXTEND)
    assert run(refused) == ExitCode.BAD_SETTING
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "model.rope_scaling=none" in err[0] and "resume_extend=true" in err[0]
    longer = stage(tiny_config, tmp_path, first_stage, "longer", "seq_len=256")  # as before: seq_len may change
    assert run(longer) == 0
    assert json.loads((Path(longer.run_dir) / "summary.json").read_text())["resume_extend"] is None


def test_resume_extend_still_refuses_another_architecture_key(tiny_config, tmp_path, first_stage, capsys):
    capsys.readouterr()
    cfg = stage(tiny_config, tmp_path, first_stage, "wider", *EXTEND, "resume_extend=true", "model.n_layer=3")
    assert run(cfg) == ExitCode.BAD_SETTING
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "model.n_layer=" in err[0] and "rope" not in err[0]


def test_the_eval_takes_a_length_extension_of_its_own(tiny_config, tmp_path, first_stage, capsys):
    from minigpt.eval.cli import main
    from minigpt.eval.passkey_grid import FILES

    out = tmp_path / "grid"
    args = [first_stage.ckpt_dir, "--no-loss", "--passkey-grid", "--passkey-lengths", "256", "--depths", "0.5",
            "--keys", "1", "--device", "cpu", "--out", str(out)]
    assert main([*args, "--rope-scaling", "yarn", "--rope-factor", "2", "--rope-original-len", "128"]) == 0
    run_info = json.loads((out / "passkey_filler" / FILES[0]).read_text())["run"]
    assert run_info["rope"] == {"scaling": "yarn", "factor": 2.0, "original_len": 128}
    assert "rope=yarn×2" in (out / "passkey_filler" / FILES[1]).read_text()
    with pytest.raises(SystemExit) as e:  # yarn needs the original length: a bad argument
        main([*args, "--rope-scaling", "yarn", "--rope-factor", "2"])
    assert e.value.code == 2 and "model.rope_original_len" in capsys.readouterr().err
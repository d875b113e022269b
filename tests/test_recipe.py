"""The long-context recipe (minigpt/recipe/): its plan from the presets (stages, segments within the budget, the
length extension between stages, the passkey share), how segments are filled, and the tiny recipe on the CPU: segment
by segment, each on a fresh directory from the last export, to its evaluations; a re-run that finds nothing left;
a run late for its budget stopped at a checkpoint and resumed."""
import json
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from minigpt.checkpoint import list_checkpoints, step_of
from minigpt.compose import compose
from minigpt.config import ConfigError
from minigpt.recipe.cli import main, run
from minigpt.recipe.plan import FULL, TINY, Evaluation, Plan, Prepare, Run, Train, build_plan
from minigpt.recipe.state import STATE_FILE, RecipeState

GPU_COMMAND_MINUTES = 10  # what the GPU machine allows a command


def pieces(state: RecipeState) -> dict[str, list[tuple[int, int]]]:
    """Each run's pieces, in the order the segments did them: [(first step, step reached), ...]."""
    out: dict[str, list[tuple[int, int]]] = {}
    for segment in state.segments:
        for did in segment["did"]:
            if m := re.match(r"(\S+) (\d+) -> (\d+)", did):
                out.setdefault(m[1], []).append((int(m[2]), int(m[3])))
    return out


def test_segments_fill_the_budget_in_order_and_split_a_run_where_it_ends():
    variant = replace(TINY, tokens_per_s={1024: 1024.0}, start_s=10.0, reserve_s=5.0)
    run_ = Run("r", "p", "r", None, 1024, 1, 0, 100, {}, (), "")
    plan = Plan(variant, Path("/x"), [run_])
    assert plan.step_seconds(run_, {}) == pytest.approx(1.05) and plan.step_seconds(run_, {"1024": 2048.0}) == \
        pytest.approx(0.525)  # a measured rate wins
    segments = plan.segments([Prepare(20.0), Train(run_, 0, 100), Evaluation("e", "r", (), 70.0, "")], {}, 65.0)
    shape = [[(i.name, getattr(i, "first", None), getattr(i, "last", None)) for i, _ in s] for s in segments]
    # 60 s a segment (65 less the reserve): prepare, then as many 1.05 s steps as fit after the 10 s start
    assert shape == [[("prepare", None, None), ("r", 0, 28)], [("r", 28, 75)], [("r", 75, 100)], [("e", None, None)]]
    assert all(sum(s for _, s in seg) <= 60 for seg in segments[:-1])  # the last: alone, longer than any segment


def test_the_plan_trains_small_6l_to_64k_in_stages_beside_a_2k_baseline_of_the_same_tokens(tmp_path, capsys):
    plan = build_plan(FULL, tmp_path / "lc")
    runs = {r.name: r for r in plan.runs}
    chain = [runs[n] for n in ("2k", "8k", "32k", "64k")]
    assert [r.seq_len for r in chain] == [2048, 8192, 32768, 65536] and runs["baseline"].seq_len == 2048
    assert chain[0].start == 0 and all(a.end == b.start and b.after == a.name for a, b in zip(chain, chain[1:]))
    assert runs["baseline"].end == chain[-1].end and {r.tokens_per_step for r in plan.runs} == {131072}
    assert chain[1].rope["rope_base"] > chain[0].rope["rope_base"] == runs["baseline"].rope["rope_base"]
    for r in plan.runs:
        cfg = compose([f"+recipe={r.preset}"], machine=False)
        assert (cfg.model.name, cfg.model.head_dim, cfg.data.name, cfg.lr_decay_steps) == \
            ("small-6l", 64, "pycode", chain[-1].end)
        assert 0 < cfg.data.passkey_fraction <= 0.1  # <= 10% of the training tokens

    state = RecipeState(plan.fingerprint())
    budget = FULL.budget_minutes * 60
    segments = plan.segments(state.todo(plan, "a machine"), {}, budget)
    assert budget + 60 <= GPU_COMMAND_MINUTES * 60  # the budget, and a minute for the wheels and the import
    assert all(sum(s for _, s in seg) <= budget - FULL.reserve_s for seg in segments)
    assert sum(s for seg in segments for _, s in seg) <= 75 * 60  # the whole recipe on one H100, estimated
    done = {r.name: r.start for r in plan.runs}
    for seg in segments:
        for item, _ in seg:
            if isinstance(item, Train):
                assert item.first == done[item.name]
                done[item.name] = item.last
    assert done == {r.name: r.end for r in plan.runs}
    evals = [i.name for seg in segments for i, _ in seg if isinstance(i, Evaluation)]
    assert evals == ["baseline-sliding", "final-loss", *(f"passkey-{h}-{p}" for h in ("filler", "pycode") for p in
                                                         ("16K-32K-64K", "128K-depths-0-0.5", "128K-depths-0.6-1",
                                                          "merge"))]

    assert main(["--out", str(tmp_path / "lc"), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    commands = [line.strip() for line in printed.splitlines() if line.strip().startswith("$ python -m minigpt ")]
    firsts = {r: next(c for c in commands if f"+recipe=long_context_{r} " in c) for r in ("8k", "32k", "64k")}
    assert all(f"resume={plan.out}/stages/" in c and "resume_extend=true" in c for c in firsts.values())
    assert f"segment {len(segments)}," in printed and "total: ~" in printed and not (tmp_path / "lc").exists()
    assert "model.rope_base=10000 -> 1e+06" in printed

    # the evaluations log to W&B where the trainer does (FULL composes logger=wandb; TINY and logger=none: no W&B)
    assert all("--wandb" in argv for e in plan.evaluations for argv in e.argvs) and plan.runs[-1].logger == "wandb"
    for quiet in (build_plan(TINY, tmp_path / "lc"), build_plan(FULL, tmp_path / "lc", ("logger=none",))):
        assert not any("--wandb" in argv for e in quiet.evaluations for argv in e.argvs)

    tiny = build_plan(TINY, tmp_path / "lc").fingerprint()
    with pytest.raises(ConfigError, match="started by another plan .its variant: tiny, now: full.; continue it with "
                                          "--tiny as it was started"):
        RecipeState(tiny, runs={"baseline": 4}).check(plan, plan.out)
    untouched = RecipeState(tiny)  # nothing trained or evaluated there yet: the new plan is taken
    untouched.check(plan, plan.out)
    assert untouched.plan == plan.fingerprint()
    assert main(["--out", str(tmp_path / "lc"), "--budget-minutes", "0.5"]) == 2  # less than the reserve
    assert "--budget-minutes 0.5: must leave more than the 60 s" in capsys.readouterr().err


def test_a_state_file_of_an_earlier_recipe_loads_and_drops_what_is_no_longer_kept(tmp_path):
    plan = build_plan(TINY, tmp_path)
    old = {"plan": plan.fingerprint(), "revision": 4, "runs": {"baseline": 20}, "evaluations": {},
           "prepared": ["m"], "tokens": {"train": 28400000, "val": 3000000}, "measured": {}, "segments": []}
    (tmp_path / STATE_FILE).write_text(json.dumps(old))
    state = RecipeState.read(tmp_path / STATE_FILE)
    assert (state.revision, state.runs, state.prepared) == (4, {"baseline": 20}, ["m"])
    state.save(tmp_path)
    assert "tokens" not in json.loads((tmp_path / STATE_FILE).read_text())


@pytest.fixture
def cache(tmp_path):
    return f"data.cache_dir={tmp_path / 'cache'}"


def test_the_tiny_recipe_goes_segment_by_segment_on_fresh_directories_to_its_evaluations(tmp_path, cache, capsys):
    handoff = tmp_path / "handoff"
    common = ["--tiny", "--export", str(handoff), "--", cache]
    assert main(["--out", str(tmp_path / "a"), "--budget-minutes", "0.75", *common]) == 0
    assert RecipeState.read(tmp_path / "a" / STATE_FILE).segments[0]["did"][0] == "prepare"
    plan = build_plan(TINY, tmp_path / "a", (cache,))
    outs = []
    for i in range(10):  # each segment on a fresh directory ("machine"), from the last export
        outs.append(tmp_path / f"b{i}")
        assert main(["--out", str(outs[-1]), "--import", str(handoff), "--budget-minutes", "1.5", *common]) == 0
        state = RecipeState.read(outs[-1] / STATE_FILE)
        if not state.todo(plan, "another machine"):
            break
    out = outs[-1]
    printed = capsys.readouterr().out
    assert len(state.segments) >= 2 and "continues from" in printed and "recipe done" in printed
    # every step of every run trained once, in pieces that continue each other; every evaluation done once
    for r in plan.runs:
        ps = pieces(state)[r.name]
        assert ps[0][0] == r.start and ps[-1][1] == r.end and all(a[1] == b[0] for a, b in zip(ps, ps[1:]))
    did = [d for s in state.segments for d in s["did"]]
    assert sorted(e.name for e in plan.evaluations) == sorted(d for d in did if " -> " not in d and d != "prepare")
    # the results, every command in the log, the trainer's loss by position
    final = json.loads((out / "eval" / "final" / "loss_by_position.json").read_text())
    assert len(final["curves"]) == 2 and final["goals"]["paired_difference"]
    for haystack in ("filler", "pycode"):  # merged from its parts: every cell once, with the plan's keys
        grid = json.loads((out / "eval" / "passkey" / f"passkey_{haystack}" / "passkey_grid.json").read_text())
        assert sorted((c["length"], c["depth"], c["keys"]) for c in grid["cells"]) == \
            [(n, d, TINY.keys) for n in TINY.passkey_lengths for d in TINY.depths]
    log = (out / "recipe.log").read_text()
    assert log.count("$ python -m minigpt ") == sum(len(p) for p in pieces(state).values())
    assert log.count("$ python -m minigpt.eval ") >= sum(len(e.argvs) for e in plan.evaluations)  # or again, if stopped
    metrics = [json.loads(line) for line in (out / "stages" / "64k" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/loss_by_position/512-1024" in m for m in metrics)
    # nothing left: a re-run says so and changes nothing
    revision = state.revision
    assert main(["--out", str(out), *common]) == 0
    assert RecipeState.read(out / STATE_FILE).revision == revision and "recipe done" in capsys.readouterr().out


def test_a_run_late_for_its_budget_is_stopped_at_a_checkpoint_and_resumed(tmp_path, cache):
    endless = ("seq_len=128", "batch_size=16", "max_steps=100000")
    late = replace(TINY, tokens_per_s={n: 1e9 for n in TINY.tokens_per_s},  # planned as if it were instant
                   run_overrides={**TINY.run_overrides, "baseline": endless})
    plan = build_plan(late, tmp_path / "late", (cache,))
    assert run(plan, None, None, "m", budget_s=90.0) == 0
    ckpts = [step_of(p) for p in list_checkpoints(plan.out / "baseline" / "checkpoints") if p.suffix == ".pt"]
    state = RecipeState.read(plan.out / STATE_FILE)
    reached = state.runs["baseline"]
    assert 0 < reached < 100000 and ckpts[-1] == reached and state.segments[-1]["ended"] == "stopped"
    assert json.loads((plan.out / "baseline" / "summary.json").read_text())["status"] == "interrupted"
    assert run(plan, None, None, "m", budget_s=60.0) == 0
    assert f"resumed from {plan.out}/baseline/checkpoints/ckpt_{reached:08d}.pt at step {reached}" in \
        (plan.out / "logs" / "02-baseline.log").read_text()
    assert RecipeState.read(plan.out / STATE_FILE).runs["baseline"] > reached


def test_weights_cross_a_handoff_in_bf16_and_come_back_as_a_checkpoint_the_trainer_resumes(tmp_path, tiny_config):
    from minigpt.attention import get_attention
    from minigpt.checkpoint import load_checkpoint, restore, save_checkpoint
    from minigpt.model import GPT
    from minigpt.recipe.handoff import export_weights, pack_weights, rebuild_checkpoint, unpack_weights
    from minigpt.train import make_optimizer

    cfg = tiny_config("max_steps=7")
    model = GPT(cfg.model, 300, get_attention("sdpa"))
    trained = make_optimizer(model, cfg, torch.device("cpu"))
    for _ in range(3):  # moments to hand off
        model(torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))).backward()
        trained.step()
        trained.zero_grad()
    blob, tensors, tied = pack_weights(model.state_dict())
    back = unpack_weights(blob, tensors, tied)
    assert tied == {"lm_head.weight": "wte.weight"} and back["lm_head.weight"] is back["wte.weight"]
    assert all(torch.equal(back[k], v.bfloat16().float()) for k, v in model.state_dict().items())

    run_ = Run("r", "p", "r", None, 128, 4, 0, 7, {}, (), "")
    save_checkpoint(tmp_path / "out" / "r" / "checkpoints", 7, model, trained, asdict(cfg))
    export_weights(tmp_path / "out", run_, tmp_path / "h")
    manifest = json.loads((tmp_path / "h" / "weights.json").read_text())
    path = rebuild_checkpoint(tmp_path / "h", manifest, tmp_path / "fresh" / "checkpoints")
    state = load_checkpoint(path)
    again = GPT(cfg.model, 300, get_attention("sdpa"))
    optimizer = make_optimizer(again, cfg, torch.device("cpu"))
    assert restore(state, path, again, optimizer, asdict(cfg)["model"]) == 7
    assert all(torch.equal(a, b.bfloat16().float()) for a, b in zip(again.parameters(), model.parameters()))
    # AdamW restarts from its step and each tensor's mean second moment, with a first moment of zero
    for p, q in zip(again.parameters(), model.parameters()):
        new, old = optimizer.state[p], trained.state[q]
        assert float(new["step"]) == float(old["step"]) == 3 and not new["exp_avg"].any()
        assert torch.allclose(new["exp_avg_sq"], old["exp_avg_sq"].mean().expand_as(p))
    (tmp_path / "h" / "weights.00").write_bytes(b"damaged")
    with pytest.raises(RuntimeError, match="weights.00 is missing or damaged"):
        rebuild_checkpoint(tmp_path / "h", manifest, tmp_path / "other")


def test_a_signal_during_the_budgets_stop_still_stops_the_command(tmp_path, monkeypatch):
    """A command past its budget gets SIGTERM and a grace period; a stop signal arriving in that grace period must
    not leave it running while the recipe records and exports: the command is stopped with that signal too, and the
    signal goes on up."""
    import signal
    import sys
    from types import SimpleNamespace

    from minigpt.recipe import runner
    from minigpt.signals import Interrupted

    sent = []

    def stop_group(proc, signum, grace_s):
        sent.append(signum)
        if len(sent) == 1:  # SIGINT arrives while the budget's SIGTERM is being waited out
            raise Interrupted(signal.SIGINT)
        proc.kill()
        return proc.wait()

    monkeypatch.setattr(runner, "stop_group", stop_group)
    fake = SimpleNamespace(out=tmp_path, number=1, log=lambda *a, **k: None, say=lambda *a, **k: None)
    with pytest.raises(Interrupted):
        runner.Invocation.command(fake, [sys.executable, "-c", "import time; time.sleep(60)"], "sleeper", 0.5)
    assert sent == [signal.SIGTERM, signal.SIGINT]

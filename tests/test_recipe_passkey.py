"""The long-context recipe's passkey grid in parts (minigpt/recipe/plan.py grid_parts): the full plan scores every
cell once with 20 keys in parts that each fit a segment; on a tiny pycode model, the parts merged are the grid one
command gives, and a part stopped in one segment is done again, alone, in the next, on a fresh directory from the
export."""
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from minigpt.eval.cli import main as eval_main
from minigpt.eval.passkey_grid import HAYSTACKS
from minigpt.eval.retrieval import DEFAULT_DEPTHS
from minigpt.recipe import runner
from minigpt.recipe.cli import run
from minigpt.recipe.handoff import export_weights, rebuild_checkpoint
from minigpt.recipe.plan import FINAL, FULL, TINY, Evaluation, Plan, build_plan, grid_parts, shown
from minigpt.recipe.state import STATE_FILE, RecipeState
from test_eval import pycode_run  # noqa: F401 - the tiny pycode run (a BPE model)

SLEEP_60 = [sys.executable, "-c", "import time; time.sleep(60)"]


def size(text: str) -> int:
    return int(text[:-1]) << 10 if text.endswith("K") else int(text)


def part_cells(e: Evaluation) -> list[tuple[str, int, float, int]]:
    """(haystack, length, depth, keys) of every cell a part's command scores, read from its arguments."""
    (argv,) = e.argvs
    after = lambda flag: argv[argv.index(flag) + 1]  # noqa: E731
    at = argv.index("--depths") + 1
    depths = [float(d) for d in argv[at : next(i for i in range(at, len(argv)) if argv[i].startswith("--"))]]
    return [(after("--haystack"), size(n), d, int(after("--keys"))) for n in after("--passkey-lengths").split(",")
            for d in depths]


def passkey_items(plan: Plan) -> dict[str, tuple[list[Evaluation], Evaluation]]:
    """Per haystack: its parts and their merge, in the plan's order."""
    out = {}
    for h in HAYSTACKS:
        items = [e for e in plan.evaluations if e.place == f"passkey-{h}"]
        out[h] = (items[:-1], items[-1])
    return out


def test_the_full_plan_scores_every_cell_once_with_20_keys_in_parts_that_each_fit_a_segment(tmp_path):
    plan = build_plan(FULL, tmp_path / "lc")
    usable = FULL.budget_minutes * 60 - FULL.reserve_s
    for h, (parts, merge) in passkey_items(plan).items():
        cells = [c for e in parts for c in part_cells(e)]
        assert sorted(cells) == sorted((h, n, d, 20) for n in FULL.passkey_lengths for d in DEFAULT_DEPTHS)
        assert FULL.keys >= 20 and len(parts) >= 2  # issue 34: >= 20 keys a cell
        assert all(e.seconds <= min(usable, FULL.passkey_part_s + FULL.passkey_start_s[h]) for e in parts)
        # the merge reads exactly the parts' files and writes where one command over the grid would (its W&B run
        # too, as the trainer's logger is W&B)
        (argv,) = merge.argvs
        assert merge.reads is None and list(argv) == [*(str(e.output) for e in parts), "--wandb", "--out",
                                                      str(plan.out / "eval" / "passkey")]
        assert merge.output == plan.out / "eval" / "passkey" / f"passkey_{h}" / "passkey_grid.json"
        assert all(e.output.parent.parent == Path(e.argvs[0][-1]) for e in parts)
    assert [(p.lengths, p.depths) for p in grid_parts(FULL, "filler")] == [
        ((16384, 32768, 65536), DEFAULT_DEPTHS), ((131072,), DEFAULT_DEPTHS[:6]), ((131072,), DEFAULT_DEPTHS[6:])]
    # at most a part's seconds each, whatever they are: a depth a part when one depth is more than that
    for cap in (1.0, 60.0, 1e9):
        parts = grid_parts(replace(FULL, passkey_part_s=cap), "pycode")
        cells = [(n, d) for p in parts for n in p.lengths for d in p.depths]
        assert sorted(cells) == sorted((n, d) for n in FULL.passkey_lengths for d in DEFAULT_DEPTHS)
        assert all(len(p.depths) == 1 or sum(p.keys * len(p.depths) * FULL.passkey_key_s[n] for n in p.lengths)
                   <= cap for p in parts)
    assert len(grid_parts(replace(FULL, passkey_part_s=1e9), "filler")) == 1
    # the test plan stays small: a key a cell, two parts a haystack
    assert TINY.keys == 1 and all(len(parts) == 2 for parts, _ in passkey_items(build_plan(TINY, tmp_path)).values())


def plant_final_model(pycode_run, plan: Plan, tmp_path: Path) -> None:  # noqa: F811
    """The tiny pycode run as the recipe's final model at the chain's last step, its weights through bf16 (what an
    import rebuilds, so a fresh directory evaluates the same numbers); runs and loss evaluations recorded done."""
    final = plan.run(FINAL)
    shutil.copytree(pycode_run, plan.out / final.folder, ignore=shutil.ignore_patterns("checkpoints"))
    export_weights(pycode_run.parent, replace(final, folder=pycode_run.name), tmp_path / "weights")
    manifest = json.loads((tmp_path / "weights" / "weights.json").read_text())
    rebuild_checkpoint(tmp_path / "weights", {**manifest, "step": final.end}, plan.out / final.folder / "checkpoints")
    state = RecipeState(plan.fingerprint(), runs={r.name: r.end for r in plan.runs})
    for e in plan.evaluations[:2]:  # baseline-sliding, final-loss
        e.output.parent.mkdir(parents=True, exist_ok=True)
        e.output.write_text("{}")
        state.evaluations[e.name] = {"seconds": 1.0}
    state.save(plan.out)


def test_parts_merge_into_the_grid_of_one_command_and_a_stopped_part_runs_again_on_a_fresh_directory(
        pycode_run, tmp_path, monkeypatch):  # noqa: F811
    # one length in one part, the other in two runs of depths
    variant = replace(TINY, passkey_lengths=(128, 256), keys=2, passkey_key_s={128: 0.1, 256: 1.0}, passkey_part_s=4.0)
    first = build_plan(variant, tmp_path / "a")
    plant_final_model(pycode_run, first, tmp_path)
    parts, _ = passkey_items(first)["filler"]
    assert [part_cells(e)[0][1:3] for e in parts] == [(128, 0.0), (256, 0.0), (256, 1.0)]

    # segment 1: the first part, then the second stopped by the budget. Its process sleeps instead of scoring, so
    # the stop always comes before it writes anything (a real eval can write its grid within the 1 s floor).
    command, popen = runner.Invocation.command, subprocess.Popen
    calls = []

    def stopped_second(self, argv, name, limit_s):
        calls.append(name)
        if len(calls) != 2:
            return command(self, argv, name, limit_s)
        monkeypatch.setattr(subprocess, "Popen", lambda _argv, **kw: popen(SLEEP_60, **kw))
        try:
            return command(self, argv, name, 0.5)
        finally:
            monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(runner.Invocation, "command", stopped_second)
    handoff = tmp_path / "handoff"
    assert run(first, None, handoff, "m1", budget_s=600.0) == 0
    monkeypatch.undo()
    state = RecipeState.read(first.out / STATE_FILE)
    assert calls == [parts[0].name, parts[1].name] and state.segments[-1]["ended"] == "stopped"
    assert set(state.evaluations) == {"baseline-sliding", "final-loss", parts[0].name}
    assert parts[0].output.is_file() and not parts[1].output.exists()

    # segment 2, on a fresh directory: the rest, each part once, the stopped one again
    plan = build_plan(variant, tmp_path / "b")
    assert run(plan, handoff, None, "m2", budget_s=600.0) == 0
    state = RecipeState.read(plan.out / STATE_FILE)
    assert not state.todo(plan, "m2")
    did = [d for s in state.segments for d in s["did"]]
    assert sorted(did) == sorted(e.name for e in plan.evaluations[2:])  # every part and merge once
    log = (plan.out / "recipe.log").read_text()  # segment 1's lines too, carried by the export
    ran = lambda p, e: log.count(f"$ {shown(p.eval_commands(e)[0])}\n")  # noqa: E731
    assert [ran(first, e) for e in first.evaluations[2:5]] == [1, 1, 0]
    assert [ran(plan, e) for e in plan.evaluations[2:]] == [0] + [1] * (len(plan.evaluations) - 3)
    first_part = json.loads((plan.out / parts[0].output.relative_to(first.out)).read_text())
    assert "/a/stages/" in first_part["run"]["checkpoint"]  # scored in segment 1, carried by the export

    # the merged grids are the grids of one command over every cell, on the same model and seed
    whole = tmp_path / "whole"
    assert eval_main([str(plan.out / plan.run(FINAL).folder), "--no-loss", "--passkey-grid", "--haystack", "both",
                      "--passkey-lengths", "128,256", "--depths", *map(str, variant.depths), "--keys", "2",
                      "--out", str(whole)]) == 0
    for h in HAYSTACKS:
        merged = json.loads((plan.out / "eval" / "passkey" / f"passkey_{h}" / "passkey_grid.json").read_text())
        one = json.loads((whole / f"passkey_{h}" / "passkey_grid.json").read_text())
        one["run"].pop("checkpoint")  # b's; the merge's is its first part's: filler's from segment 1, in a
        assert ("/a/stages/" in merged["run"].pop("checkpoint")) == (h == "filler")
        assert merged == one and len(merged["cells"]) == 6 and all(c["keys"] == 2 for c in merged["cells"])
        assert [c["answers"] for c in merged["cells"]] == [c["answers"] for c in one["cells"]]


def test_a_done_evaluation_whose_file_is_gone_is_done_again_and_an_unsplit_grid_counts_for_nothing(tmp_path):
    plan = build_plan(TINY, tmp_path / "lc")
    state = RecipeState(plan.fingerprint(), runs={r.name: r.end for r in plan.runs})
    for e in plan.evaluations:
        e.output.parent.mkdir(parents=True, exist_ok=True)
        e.output.write_text("{}")
        state.evaluations[e.name] = {"seconds": 1.0}
    assert state.todo(plan, "m") == []
    parts, merge = passkey_items(plan)["pycode"]
    for gone in (parts[1], merge):
        gone.output.unlink()
        assert [e.name for e in state.todo(plan, "m")] == [parts[1].name, merge.name][: 1 + (gone is merge)]
    # a directory whose grids ran unsplit (5 keys, before the parts): every part and merge is still to do
    for e in plan.evaluations[2:]:
        del state.evaluations[e.name]
    state.evaluations.update({"passkey-filler": {"seconds": 107.0}, "passkey-pycode": {"seconds": 119.0}})
    assert state.todo(plan, "m") == plan.evaluations[2:]

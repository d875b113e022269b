"""The long-context recipe's advice works when followed (docs/errors.md, `minigpt-long-context`): each line that says
what to do is provoked on a tiny recipe's directory, the advice is followed to the letter, and the recipe reaches exit
code 0 (or the next state the advice promises).

The directories are copies of one tiny recipe built once for the module, in three stages, each with its export:
`prepared` (the data), `baseline` (its run trained; next: the baseline's evaluation), `2k` (that evaluation done and
2k trained; next: 8k, which starts from 2k's last checkpoint). Each invocation gets a budget that leaves room for
about one item. All slow: the trainer and minigpt-eval run as subprocesses.
"""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT
from minigpt import runlock
from minigpt.recipe.cli import main
from minigpt.recipe.handoff import FILES_TAR, WEIGHTS, export
from minigpt.recipe.plan import TINY, Train, build_plan
from minigpt.recipe.runner import Invocation
from minigpt.recipe.state import STATE_FILE, RecipeState, machine_id

STOP = 0.1  # minutes: the first item's command is stopped after a second
EVAL = 0.25  # an evaluation and nothing after it
TRAIN = 0.75  # a tiny run's piece, with time to start on a busy machine


@dataclass
class Built:
    root: Path
    cache: str  # the data.cache_dir override every invocation gives (it is part of the plan)

    def copy(self, stage: str, to: Path) -> Path:
        return Path(shutil.copytree(self.root / stage, to))

    def export(self, stage: str) -> Path:
        return self.root / f"export-{stage}"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    """The tiny recipe in its three stages (module docstring), item by item through the runner."""
    root = tmp_path_factory.mktemp("recipe")
    cache = f"data.cache_dir={root / 'cache'}"
    plan = build_plan(TINY, root / "work", (cache,))
    plan.out.mkdir()
    state = RecipeState(plan.fingerprint())
    invocation = Invocation(plan, state, machine_id(), budget_s=3600.0)
    invocation.number = 1

    def stage(name: str) -> None:
        invocation.record("budget", 1.0)
        shutil.copytree(plan.out, root / name)
        export(plan.out, root / f"export-{name}", state, plan)

    invocation.prepare()
    stage("prepared")
    invocation.train(Train(plan.run("baseline"), 0, plan.run("baseline").end))
    stage("baseline")
    invocation.evaluate(plan.evaluations[0])  # the baseline's, read by sliding windows
    invocation.train(Train(plan.run("2k"), 0, plan.run("2k").end))
    stage("2k")
    return Built(root, cache)


def recipe(built: Built, capsys, out: Path, *args: str, budget: float) -> tuple[int, str]:
    """`minigpt-long-context --tiny --out OUT --budget-minutes B ARGS -- CACHE`: its exit code and last line."""
    capsys.readouterr()
    code = main(["--tiny", "--out", str(out), "--budget-minutes", str(budget), *args, "--", built.cache])
    printed = capsys.readouterr()
    lines = [line for line in (printed.out + printed.err).splitlines() if line.strip()]
    last = [line for line in printed.err.splitlines() if line.strip()][-1:] if code else lines[-1:]
    return code, (last or [""])[0]


def refused(result: tuple[int, str], code: int, *needles: str) -> str:
    assert result[0] == code, result
    for needle in needles:
        assert needle in result[1], (needle, result[1])
    return result[1]


def ok(result: tuple[int, str]) -> None:
    assert result[0] == 0 and ("segment" in result[1] or "recipe done" in result[1]), result


def state(out: Path) -> RecipeState:
    return RecipeState.read(out / STATE_FILE)


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ------------------------------------------------------------------------------------------------
# A segment: stopped by a signal, by its budget, by a command that failed
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_segment_stopped_by_a_signal_advice(built, tmp_path):
    """`segment N stopped by SIGTERM after T: its progress is kept; run the recipe again to continue` (128 + 15)."""
    out = built.copy("prepared", tmp_path / "out")
    command = [sys.executable, "scripts/long_context_recipe.py", "--tiny", "--out", str(out), "--budget-minutes",
               str(TRAIN), "--", built.cache]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log, deadline = out / "logs" / "02-baseline.log", time.time() + 120
    while proc.poll() is None and time.time() < deadline and \
            not (log.is_file() and "step 4:" in log.read_text(errors="replace")):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("segment 2 stopped by SIGTERM after ") and \
        err.strip().endswith("its progress is kept; run the recipe again to continue"), err[-2000:]
    kept = state(out).runs["baseline"]
    assert kept >= 4  # the trainer finished its step and wrote a checkpoint
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)  # the same command
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"at step {kept}" in (out / "logs" / "03-baseline.log").read_text() and state(out).runs["baseline"] > kept


@pytest.mark.slow
def test_no_step_within_the_budget_advice(built, tmp_path, capsys):
    out = built.copy("prepared", tmp_path / "out")
    refused(recipe(built, capsys, out, budget=STOP), 1, "baseline steps 0 -> ", ": no step done within the budget",
            "raise --budget-minutes")
    ok(recipe(built, capsys, out, budget=TRAIN))
    assert state(out).runs["baseline"] > 0


@pytest.mark.slow
def test_an_evaluation_stopped_at_the_budget_advice(built, tmp_path, capsys):
    out = built.copy("baseline", tmp_path / "out")
    refused(recipe(built, capsys, out, budget=STOP), 1, "baseline-sliding: stopped at the budget after",
            "before it finished; raise --budget-minutes")
    ok(recipe(built, capsys, out, budget=EVAL))
    assert "baseline-sliding" in state(out).evaluations


@pytest.mark.slow
def test_a_failed_command_advice(built, tmp_path, capsys):
    """The trainer refuses a run folder that another process holds (two recipes on one --out): its log says to wait
    until that one ends."""
    out = built.copy("prepared", tmp_path / "out")
    runlock.lock(out / "baseline")
    try:
        line = refused(recipe(built, capsys, out, budget=TRAIN), 2, "baseline steps 0 -> ", "failed (exit 2): see ",
                       "fix what it says, then run the recipe again to continue")
        log = Path(re.search(r"see (\S+);", line)[1])
        assert "in use by another run" in log.read_text() and "wait until it ends" in log.read_text()
    finally:
        runlock.unlock(out / "baseline")  # it ended
    ok(recipe(built, capsys, out, budget=TRAIN))
    assert state(out).runs["baseline"] > 0


# ------------------------------------------------------------------------------------------------
# A model that is not there (a fresh machine given only part of an export, or checkpoints removed)
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("way", ["import", "start-over"])
def test_a_run_without_the_checkpoint_it_starts_from_advice(built, tmp_path, capsys, way):
    out = built.copy("2k", tmp_path / "out")
    shutil.rmtree(out / "stages" / "2k" / "checkpoints")
    refused(recipe(built, capsys, out, budget=TRAIN), 1, "8k starts from 2k's last checkpoint", "has none",
            "--import the export that holds it, or start over in a new --out")
    if way == "import":
        ok(recipe(built, capsys, out, "--import", str(built.export("2k")), budget=TRAIN))
        assert state(out).runs["8k"] > state(built.root / "2k").runs["2k"]
    else:  # the same as for every line here that says it: a new recipe begins
        ok(recipe(built, capsys, tmp_path / "new", budget=EVAL))
        assert state(tmp_path / "new").segments[0]["did"][0] == "prepare"


@pytest.mark.slow
def test_an_evaluation_without_its_model_advice(built, tmp_path, capsys):
    out = built.copy("baseline", tmp_path / "out")
    shutil.rmtree(out / "baseline" / "checkpoints")
    refused(recipe(built, capsys, out, budget=EVAL), 1, "baseline-sliding reads baseline's model", "no checkpoint",
            "--import the export that holds it, or start over in a new --out")
    ok(recipe(built, capsys, out, "--import", str(built.export("baseline")), budget=EVAL))
    assert "baseline-sliding" in state(out).evaluations


@pytest.mark.slow
def test_an_export_without_the_live_runs_checkpoint_advice(built, tmp_path, capsys):
    """The export is refused before the earlier export in that folder is touched, so that one can be imported."""
    out = built.copy("baseline", tmp_path / "out")
    shutil.rmtree(out / "baseline" / "checkpoints")
    handoff = Path(shutil.copytree(built.export("baseline"), tmp_path / "handoff"))
    before = files(handoff)
    refused(recipe(built, capsys, out, "--export", str(handoff), budget=EVAL), 1, "no checkpoint of baseline to export",
            "--import the export that holds it, or start over in a new --out")
    assert files(handoff) == before
    ok(recipe(built, capsys, out, "--import", str(handoff), "--export", str(handoff), budget=EVAL))
    assert "baseline-sliding" in state(out).evaluations and state(handoff).revision == state(out).revision


@pytest.mark.slow
def test_an_unreadable_state_advice(built, tmp_path, capsys):
    """`restore it`: from a copy, here the one the export beside it holds."""
    out = built.copy("baseline", tmp_path / "out")
    (out / STATE_FILE).write_text('{"plan": {"variant"')  # cut short
    refused(recipe(built, capsys, out, budget=EVAL), 1, "recipe_state.json is unreadable",
            "restore it, or start over in a new --out")
    shutil.copy(built.export("baseline") / STATE_FILE, out / STATE_FILE)
    ok(recipe(built, capsys, out, budget=EVAL))


# ------------------------------------------------------------------------------------------------
# An --import of something that is not a whole export
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_an_import_of_a_folder_without_a_state_advice(built, tmp_path, capsys):
    (tmp_path / "elsewhere").mkdir()
    refused(recipe(built, capsys, tmp_path / "out", "--import", str(tmp_path / "elsewhere"), budget=EVAL), 1,
            "no recipe_state.json there; give the folder an --export wrote")
    ok(recipe(built, capsys, tmp_path / "out", "--import", str(built.export("baseline")), budget=EVAL))
    assert "baseline-sliding" in state(tmp_path / "out").evaluations


@pytest.mark.slow
@pytest.mark.parametrize("missing", [FILES_TAR, WEIGHTS])
def test_an_export_missing_a_file_advice(built, tmp_path, capsys, missing):
    handoff = Path(shutil.copytree(built.export("baseline"), tmp_path / "handoff"))
    (handoff / missing).unlink()
    refused(recipe(built, capsys, tmp_path / "out", "--import", str(handoff), budget=EVAL), 1, f"no {missing}",
            "copy every file of the export")
    shutil.copy(built.export("baseline") / missing, handoff / missing)
    ok(recipe(built, capsys, tmp_path / "out", "--import", str(handoff), budget=EVAL))
    assert "baseline-sliding" in state(tmp_path / "out").evaluations


@pytest.mark.slow
def test_a_damaged_weights_part_advice(built, tmp_path, capsys):
    handoff = Path(shutil.copytree(built.export("baseline"), tmp_path / "handoff"))
    (handoff / "weights.00").write_bytes((handoff / "weights.00").read_bytes()[:100])  # a copy cut short
    refused(recipe(built, capsys, tmp_path / "out", "--import", str(handoff), budget=EVAL), 1,
            "weights.00 is missing or damaged", "copy every weights.* file of the export")
    for part in built.export("baseline").glob("weights.*"):
        shutil.copy(part, handoff / part.name)
    ok(recipe(built, capsys, tmp_path / "out", "--import", str(handoff), budget=EVAL))


@pytest.mark.slow
def test_a_damaged_weights_manifest_advice(built, tmp_path, capsys):
    """`export again`: on the machine that has the run (here a copy of its directory), whose next segment runs and
    then exports."""
    handoff = Path(shutil.copytree(built.export("baseline"), tmp_path / "handoff"))
    (handoff / WEIGHTS).write_text((handoff / WEIGHTS).read_text()[:200])
    refused(recipe(built, capsys, tmp_path / "out", "--import", str(handoff), budget=EVAL), 1,
            "weights.json is damaged or of another plan", "export again")
    source = built.copy("baseline", tmp_path / "source")
    ok(recipe(built, capsys, source, "--export", str(handoff), budget=EVAL))
    ok(recipe(built, capsys, tmp_path / "out", "--import", str(handoff), budget=TRAIN))
    assert state(tmp_path / "out").runs["2k"] > 0

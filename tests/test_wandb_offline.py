"""W&B offline runs in the long-context recipe: the export carries them and an import puts them back byte for byte,
the largest left out (in one line) when the tar would pass its cap, and one is published into results/ with no
machine path, within the results/ rules, still a run `wandb sync` takes. On a real offline run that minigpt's
WandbLogger writes here (config, history, summary and console output holding this machine's paths)."""
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from minigpt import wandb_offline
from minigpt.recipe import handoff
from minigpt.recipe.cli import main
from minigpt.recipe.plan import TINY, build_plan
from minigpt.recipe.state import RecipeState
from minigpt.wandb_offline import PublishError, frame_payloads, publish_run, read_payloads
from test_results_rules import rule_violations, tracked_files
from wandb_records import read_records

WRITE_RUN = """
import sys
from minigpt.loggers import WandbLogger

run_dir, cache = sys.argv[1:]
ckpt = run_dir + "/checkpoints/ckpt_00000004.pt"
logger = WandbLogger(project="minigpt", name="64k", directory=run_dir, mode="offline",
                     config={"run_dir": run_dir, "data": {"cache_dir": cache},
                             "python": "/opt/torch/.venv/bin/python3", "source": "https://example.org/docs/x"})
print(f"done: 4 steps; checkpoint {ckpt}")
for step in range(1, 61):  # over 32 KiB: records cut across the file's blocks
    logger.log({"train/loss": 5.0 - step, "note": "x" * 600}, step=step)
logger.finish({"checkpoint": ckpt}, exit_code=0)
"""


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A recipe directory (the tiny plan's state, a log) whose final run has one W&B offline run."""
    out = tmp_path_factory.mktemp("lc") / "lc"
    RecipeState(build_plan(TINY, out).fingerprint()).save(out)
    (out / "recipe.log").write_text("$ python -m minigpt ...\n")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("WANDB_DIR", None)
    p = subprocess.run([sys.executable, "-c", WRITE_RUN, str(out / "stages" / "64k"), str(out.parent / "cache")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.fixture
def out(made, tmp_path) -> Path:
    """A copy of it: the run's paths are those of the directory it was written in, as after an --import."""
    return Path(shutil.copytree(made, tmp_path / "lc", symlinks=True))


def wandb_run(out: Path) -> Path:
    (run,) = (out / "stages" / "64k" / "wandb").glob("offline-run-*")
    return run


def run_files(run: Path) -> dict[str, bytes]:
    """The files a run is (its .wandb file and files/), by path under the run folder."""
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.relative_to(run).parts[0] not in ("logs", "tmp")}


def test_the_export_carries_the_wandb_runs_and_an_import_puts_them_back_byte_for_byte(out, tmp_path):
    plan = build_plan(TINY, out)
    run = wandb_run(out)
    assert {"logs", "tmp", "files"} <= {p.name for p in run.iterdir()} and (run.parent / "latest-run").is_symlink()
    original = next(run.glob("*.wandb")).read_bytes()
    assert len(original) > 32768 and frame_payloads(read_payloads(original)) == original  # framed as W&B frames
    said: list[str] = []
    handoff.export(out, tmp_path / "handoff", RecipeState.read(out / "recipe_state.json"), plan, say=said.append)
    with tarfile.open(tmp_path / "handoff" / handoff.FILES_TAR) as t:
        members = t.getmembers()
    names = {m.name for m in members}
    rel = run.relative_to(out).as_posix()
    assert {f"{rel}/{name}" for name in run_files(run)} | {"recipe.log"} == names  # no logs/, tmp/ or symlink
    assert all(m.isfile() for m in members) and not any("left out" in line for line in said)

    back = tmp_path / "fresh"
    handoff.import_handoff(tmp_path / "handoff", back, plan, say=said.append)
    assert run_files(back / rel) == run_files(run) and len(run_files(run)) >= 3  # .wandb, output.log, requirements


def test_the_largest_wandb_runs_are_left_out_whole_when_the_tar_would_pass_its_cap(out, tmp_path, monkeypatch):
    big = out / "baseline" / "wandb" / "offline-run-20261126_000000-big"
    (big / "files" / "media").mkdir(parents=True)
    (big / "run-big.wandb").write_bytes(record := frame_payloads([b"\x08\x01"]))
    (big / "files" / "media" / "noise.bin").write_bytes(os.urandom(300_000))  # does not compress
    monkeypatch.setattr(handoff, "TAR_BYTES", 2**17)
    said: list[str] = []
    handoff.export(out, tmp_path / "handoff", RecipeState.read(out / "recipe_state.json"), build_plan(TINY, out),
                   say=said.append)
    tar = tmp_path / "handoff" / handoff.FILES_TAR
    with tarfile.open(tar) as t:
        names = set(t.getnames())
    assert tar.stat().st_size <= 2**17
    assert not any("offline-run-20261126_000000-big" in n for n in names)  # the largest run, whole
    assert any(n.startswith(wandb_run(out).relative_to(out).as_posix()) for n in names) and "recipe.log" in names
    assert [line for line in said if "left out" in line] == [
        "export: left out 1 W&B run(s) to keep recipe_files.tar.gz within 0.125 MiB: "
        f"baseline/wandb/offline-run-20261126_000000-big ({300_000 + len(record):,} bytes)"]


def test_a_published_run_holds_no_machine_path_and_wandb_sync_still_takes_it(out, tmp_path, capsys, monkeypatch):
    run = wandb_run(out)
    raw = tmp_path / "raw" / "results" / "recipe" / "wandb_offline" / run.name
    shutil.copytree(run, raw, ignore=shutil.ignore_patterns("logs", "tmp"))
    assert any("machine path" in line for line in rule_violations(raw.parents[3], tracked_files(raw.parents[3])))

    results = tmp_path / "repo" / "results" / "recipe"
    assert main(["--tiny", "--out", str(out), "--publish-wandb", str(results)]) == 0
    published = results / "wandb_offline" / run.name
    assert f"published stages/64k/wandb/{run.name} as {published}" in capsys.readouterr().out
    assert sorted(run_files(published)) == sorted(run_files(run)) and not (published / "logs").exists()
    assert rule_violations(tmp_path / "repo", tracked_files(tmp_path / "repo")) == []

    before, after = read_records(next(run.glob("*.wandb"))), read_records(next(published.glob("*.wandb")))
    assert [r.WhichOneof("record_type") for r in after] == [r.WhichOneof("record_type") for r in before]
    changed = [a for a, b in zip(after, before) if a != b]
    assert {r.WhichOneof("record_type") for r in changed} <= {"run", "environment", "summary", "output_raw"}
    config = {u.key: u.value_json for r in after if r.HasField("run") for u in r.run.config.update}
    assert config["run_dir"] == '"stages/64k"' and config["data"] == '{"cache_dir":"cache"}'
    assert config["python"] == '"python3"' and config["source"] == '"https://example.org/docs/x"'  # any path; not URLs
    hosts = [(r.environment.host, r.environment.username) for r in before if r.HasField("environment")]
    assert hosts and hosts[0][0], hosts  # W&B named the machine (and, where it knows one, the user)...
    assert all(not (r.environment.host or r.environment.username) for r in after if r.HasField("environment"))
    data = next(run.glob("*.wandb")).read_bytes()
    assert read_payloads(data[:-5]) == read_payloads(data)[:-1]  # a run cut off mid-write: read up to the cut
    assert b"checkpoint stages/64k/checkpoints/ckpt_00000004.pt" in (published / "files" / "output.log").read_bytes()

    p = subprocess.run([sys.executable, "-m", "wandb", "sync", "--dry-run", str(results / "wandb_offline")],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "WANDB_SILENT": "false"})
    assert f"{run.name}/{next(published.glob('*.wandb')).name}" in p.stdout + p.stderr, p.stdout + p.stderr
    assert "Would sync 1 run(s)" in p.stdout + p.stderr

    monkeypatch.setattr(wandb_offline, "RUN_BYTES", 1000)
    with pytest.raises(PublishError, match="over the 1,000 a published run may hold"):
        publish_run(run, tmp_path / "other", out)
    assert not (tmp_path / "other").exists()
    shutil.rmtree(run.parent)
    assert main(["--tiny", "--out", str(out), "--publish-wandb", str(results)]) == 1
    assert "stages/64k/wandb: no W&B offline run" in capsys.readouterr().err

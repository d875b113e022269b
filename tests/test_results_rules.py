"""results/ holds current results only, and every results/ path the docs cite exists.

Rules for each tracked file under results/: at most 1 MB, at most 5 MB in all, no `wandb/` folder, no symlink, no
machine path (/home/, /root/, /tmp/, /work/, /Users/ or a drive letter such as C:\\). A published W&B offline run
is the one exception to the `wandb/` ban: results/<subject>/wandb_offline/offline-run-*/, at most 1 MB in all, with
its `.wandb` file (what `wandb sync` reads; `--publish-wandb` of the recipe writes it). Citations: a `results/...` path
in README.md, docs/**/*.md, kernels/NOTES.md or a markdown file under results/ must exist in the tree; one written
`<commit>:results/...` (e668b53:, the old lab notebook) points into the history (`git show <commit>:<path>`) and is
not checked. The checks are functions, run on the repository and on a planted bad tree.
"""
from __future__ import annotations

import itertools
import os
import re
import subprocess
from pathlib import Path

from minigpt.wandb_offline import MACHINE_DIRS

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE = 1_000_000
MAX_TOTAL = 5_000_000
MAX_WANDB_RUN = 1_000_000
WANDB_OFFLINE = "wandb_offline"  # results/<subject>/wandb_offline/offline-run-*/
MACHINE_PATH = re.compile(MACHINE_DIRS.encode())  # the same list a W&B run is published against
DRIVE_LETTER = re.compile(rb"(?<![A-Za-z0-9])[A-Za-z]:\\")  # checked in text files only (binary bytes may match)
CITATION = re.compile(r"(?<![\w:/.-])results/[\w./*{},+@<>=-]*")


def tracked_files(root: Path, folder: str = "results") -> list[str]:
    """Paths under `folder` that git tracks, relative to root; the folder's files if git cannot say."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", folder], capture_output=True, check=True,
                             timeout=60).stdout.decode()
        return [p for p in out.split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        files = []
        for dirpath, dirnames, filenames in os.walk(root / folder):
            for name in filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]:
                files.append((Path(dirpath) / name).relative_to(root).as_posix())
        return files


def wandb_offline_run(rel: str) -> str | None:
    """The published W&B offline run folder `rel` is in (results/<subject>/wandb_offline/offline-run-*), else None."""
    parts = Path(rel).parts
    if len(parts) >= 5 and parts[2] == WANDB_OFFLINE and parts[3].startswith("offline-run-"):
        return "/".join(parts[:4])
    return None


def rule_violations(root: Path, files: list[str]) -> list[str]:
    """One line per broken rule."""
    bad, total, run_bytes, with_records = [], 0, {}, set()
    for rel in files:
        path = root / rel
        run = wandb_offline_run(rel)
        if "wandb" in Path(rel).parts:
            bad.append(f"{rel}: W&B run folder")
        if WANDB_OFFLINE in Path(rel).parts and run is None:
            bad.append(f"{rel}: not in a results/<subject>/{WANDB_OFFLINE}/offline-run-*/ folder")
        if run is not None:
            run_bytes.setdefault(run, 0)
            if Path(rel).parent.as_posix() == run and rel.endswith(".wandb"):
                with_records.add(run)
        if path.is_symlink():
            bad.append(f"{rel}: symlink")
            continue
        if not path.is_file():
            continue  # tracked but deleted in the work tree
        data = path.read_bytes()
        total += len(data)
        if run is not None:
            run_bytes[run] += len(data)
        if len(data) > MAX_FILE:
            bad.append(f"{rel}: {len(data):,} bytes (over {MAX_FILE:,})")
        if m := MACHINE_PATH.search(data):
            bad.append(f"{rel}: machine path {m.group().decode()!r}")
        elif b"\0" not in data and (m := DRIVE_LETTER.search(data)):
            bad.append(f"{rel}: machine path {m.group().decode()!r}")
    for run, size in run_bytes.items():
        if size > MAX_WANDB_RUN:
            bad.append(f"{run}: W&B run of {size:,} bytes (over {MAX_WANDB_RUN:,})")
        if run not in with_records:
            bad.append(f"{run}: no .wandb file (what wandb sync reads)")
    if total > MAX_TOTAL:
        bad.append(f"results/ holds {total:,} bytes (over {MAX_TOTAL:,})")
    return bad


def citing_documents(root: Path) -> list[Path]:
    docs = [root / "README.md", root / "kernels" / "NOTES.md"]
    docs += sorted((root / "docs").rglob("*.md")) + sorted((root / "results").rglob("*.md"))
    return [d for d in docs if d.is_file()]


def cited_paths(text: str) -> list[str]:
    """`results/...` paths in a text, not those behind a `<commit>:` (or `<tag>:`)."""
    out = []
    for m in CITATION.finditer(text):
        path = m.group().rstrip(".,")
        if "<" not in path and ">" not in path:  # placeholders such as results/sweeps/<date>
            out.append(path)
    return out


def _expand(path: str) -> list[str]:
    """results/a.{md,json} -> [results/a.md, results/a.json]."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def missing_citations(root: Path, docs: list[Path]) -> list[str]:
    bad = []
    for doc in docs:
        for cited in cited_paths(doc.read_text(encoding="utf-8")):
            for path in _expand(cited):
                found = any(root.glob(path)) if "*" in path else (root / path).exists()
                if not found:
                    bad.append(f"{doc.relative_to(root).as_posix()}: {cited} does not exist")
    return bad


def test_results_follow_the_rules():
    files = tracked_files(ROOT)
    assert files, "results/ is empty"
    assert rule_violations(ROOT, files) == []


def test_cited_results_exist():
    assert missing_citations(ROOT, citing_documents(ROOT)) == []


def test_the_checks_catch_a_bad_tree(tmp_path):
    res = tmp_path / "results"
    (res / "sweep" / "wandb").mkdir(parents=True)
    (res / "sweep" / "wandb" / "run.wandb").write_bytes(b"x")
    (res / "big.json").write_bytes(b"0" * (MAX_FILE + 1))
    (res / "summary.json").write_text('{"run_dir": "/home/me/runs/x"}')
    (res / "win.md").write_text("saved to C:\\Users\\me")
    (res / "ok.md").write_text("fine")
    (res / "link.md").symlink_to(res / "ok.md")
    for i in range(5):  # pushes the total over 5 MB, each file under 1 MB
        (res / f"part{i}.bin").write_bytes(b"\1" * (MAX_FILE - 10))
    files = tracked_files(tmp_path)  # not a git repository: the walk
    bad = "\n".join(rule_violations(tmp_path, files))
    for expected in ["sweep/wandb/run.wandb: W&B run folder", "big.json: 1,000,001 bytes",
                     "summary.json: machine path '/home/'", "win.md: machine path", "link.md: symlink",
                     "results/ holds"]:
        assert expected in bad
    assert "ok.md" not in bad and "part0.bin" not in bad

    (tmp_path / "README.md").write_text(
        "See `results/ok.md`, `results/gone.md`, results/ok.{md,json}, results/part*.bin, results/nothing*.png,\n"
        "`e668b53:results/old/run.json` and results/sweeps/<date>.\n")
    missing = missing_citations(tmp_path, citing_documents(tmp_path))
    assert missing == ["README.md: results/gone.md does not exist",
                       "README.md: results/ok.{md,json} does not exist",
                       "README.md: results/nothing*.png does not exist"]


def test_a_published_wandb_offline_run_passes_and_the_bad_ones_fail(tmp_path):
    res = tmp_path / "results"
    good = res / "recipe" / WANDB_OFFLINE / "offline-run-20261126_120000-good"
    (good / "files").mkdir(parents=True)
    (good / "run-good.wandb").write_bytes(b":W&B\xe1\xbe\0" + b"\1" * 600_000)  # binary, as the real one
    (good / "files" / "output.log").write_text("step 2: val_loss 4.7 (stages/64k/checkpoints)\n")
    assert rule_violations(tmp_path, tracked_files(tmp_path)) == []

    big = res / "big" / WANDB_OFFLINE / "offline-run-20261126_120000-big"
    (big / "files").mkdir(parents=True)
    (big / "run-big.wandb").write_bytes(b"\0" * 600_000)
    (big / "files" / "media.bin").write_bytes(b"\0" * 400_001)  # each file under 1 MB, the run over
    paths = res / "paths" / WANDB_OFFLINE / "offline-run-20261126_120000-paths"
    paths.mkdir(parents=True)
    (paths / "run-paths.wandb").write_bytes(b"\0\x12\x0c/work/runs/lc\0")
    (paths / "link.wandb").symlink_to(good / "run-good.wandb")
    records = res / "records" / WANDB_OFFLINE / "offline-run-20261126_120000-records" / "files"
    records.mkdir(parents=True)
    (records / "requirements.txt").write_text("torch\n")
    (res / "plain" / "wandb" / "offline-run-20261126_120000-x").mkdir(parents=True)
    (res / "plain" / "wandb" / "offline-run-20261126_120000-x" / "run-x.wandb").write_bytes(b"\0")
    (res / "deep" / "a" / WANDB_OFFLINE / "offline-run-1").mkdir(parents=True)
    (res / "deep" / "a" / WANDB_OFFLINE / "offline-run-1" / "run-1.wandb").write_bytes(b"\0")
    (res / "loose" / WANDB_OFFLINE).mkdir(parents=True)
    (res / "loose" / WANDB_OFFLINE / "run-y.wandb").write_bytes(b"\0")
    bad = rule_violations(tmp_path, tracked_files(tmp_path))
    run = "results/{0}/wandb_offline/offline-run-20261126_120000-{0}".format
    assert sorted(bad) == sorted([
        f"{run('big')}: W&B run of 1,000,001 bytes (over 1,000,000)",
        f"{run('paths')}/run-paths.wandb: machine path '/work/'",
        f"{run('paths')}/link.wandb: symlink",
        f"{run('records')}: no .wandb file (what wandb sync reads)",
        "results/plain/wandb/offline-run-20261126_120000-x/run-x.wandb: W&B run folder",
        "results/deep/a/wandb_offline/offline-run-1/run-1.wandb: not in a results/<subject>/wandb_offline/"
        "offline-run-*/ folder",
        "results/loose/wandb_offline/run-y.wandb: not in a results/<subject>/wandb_offline/offline-run-*/ folder"])


def test_citations_are_read_as_written():
    text = "`results/a.md`. (results/b/) e668b53:results/c.json x/results/d see results/e.{md,json}."
    assert cited_paths(text) == ["results/a.md", "results/b/", "results/e.{md,json}"]

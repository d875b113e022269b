"""Without Triton (macOS, Windows, or a Linux machine without it): the package imports, attention=naive|sdpa
train, attention=flash is refused before the run starts with one line saying what it needs, and the kernel
tests are skipped with that reason. Each case runs in a fresh interpreter whose `import triton` fails as it
does where Triton is not installed (a sitecustomize.py that blocks it)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

BLOCKER = '''
import importlib.abc
import sys


class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoTriton())
'''


@pytest.fixture
def no_triton(tmp_path):
    """run(*args) -> CompletedProcess: `python *args` in tmp_path, with `import triton` failing."""
    site = tmp_path / "no_triton_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}

    def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=timeout)

    return run


def test_the_package_imports_without_triton(no_triton):
    proc = no_triton("-c", "import sys\n"
                     "try:\n    import triton\nexcept ImportError:\n    pass\nelse:\n    sys.exit('triton imported')\n"
                     "import minigpt.model, minigpt.train, minigpt.attention, minigpt.run, minigpt.cli\n"
                     "import minigpt.sweep.sweep, minigpt.eval.cli, minigpt.benchmarks.bench\n"
                     "assert 'triton' not in sys.modules and 'minigpt_kernels' not in sys.modules, sorted(sys.modules)\n"
                     "print('ok')")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_naive_trains_on_cpu_without_triton(no_triton, tmp_path):
    proc = no_triton("-m", "minigpt", "model=tiny", "device=cpu", "attention=naive", "seq_len=128", "batch_size=2",
                     "max_steps=2", "eval_batches=1", "logger=none", f"data.cache_dir={tmp_path / 'cache'}",
                     "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 2 steps" in proc.stdout and (tmp_path / "run" / "summary.json").is_file()


def test_flash_without_triton_is_one_line_and_exit_2(no_triton, tmp_path):
    proc = no_triton("-m", "minigpt", "model=tiny", "device=cpu", "attention=flash", "logger=none",
                     "hydra.run.dir=run")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: attention=flash: needs Triton") and \
        "pip install triton" in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_kernel_tests_are_skipped_without_triton(no_triton):
    proc = no_triton("-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_rotary.py"),
                     str(ROOT / "tests" / "test_sm90_build.py"))
    assert proc.returncode in (0, 5), proc.stdout[-3000:]  # 5: every test of the run skipped at collection
    assert "2 skipped" in proc.stdout and "needs Triton" in proc.stdout, proc.stdout[-3000:]

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("WANDB_SILENT", "true")
# Without a GPU, Triton kernels run in Triton's CPU interpreter. It must be set before triton.jit runs.
try:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
NO_TRITON = "needs Triton, which is not installed (Linux: pip install triton)"
# Test files of the kernels (they import minigpt_kernels, hence triton, at the top): skipped whole without Triton.
KERNEL_TEST_FILES = ("test_flash_attention", "test_rotary", "test_sm90_build", "test_dispatch", "test_gpu",
                     "test_ring_attention")


class NeedsTriton(pytest.Module):
    """A kernel test file on a machine without Triton: reported as skipped, never imported."""

    def collect(self):
        raise pytest.skip.Exception(NO_TRITON, allow_module_level=True)


def pytest_pycollect_makemodule(module_path, parent):
    if not HAS_TRITON and module_path.stem.startswith(KERNEL_TEST_FILES):
        return NeedsTriton.from_parent(parent, path=module_path)
    return None


@pytest.fixture
def tiny_config(tmp_path):
    """A validated TrainConfig for a tiny CPU run writing into tmp_path."""
    from minigpt.compose import compose

    def make(*overrides: str):
        cfg = compose(["model=tiny", "seq_len=128", "batch_size=4", "max_steps=4", "eval_every=0", "eval_batches=1",
                       "logger=none", "device=cpu", "warmup_steps=2", f"data.cache_dir={tmp_path / 'cache'}", *overrides])
        cfg.run_dir = str(tmp_path / "run")
        cfg.ckpt_dir = str(tmp_path / "run" / "checkpoints")
        return cfg

    return make


class RecordingLogger:
    """A logger that keeps what it is given, so tests can look at the metrics of a run."""

    location = None

    def __init__(self):
        self.metrics: list[tuple[int, dict]] = []
        self.finished: tuple[dict, int] | None = None

    def log(self, metrics, step):
        self.metrics.append((step, dict(metrics)))

    def finish(self, summary, exit_code):
        self.finished = (summary, exit_code)

    def series(self, key):
        return [m[key] for _, m in self.metrics if key in m]

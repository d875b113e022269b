import os
import signal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The stop signals start with their default action, unblocked, in the processes the tests start, also where this pytest
# was started with them ignored (nohup) or blocked (some CI runners): the lifecycle and sweep tests send them and
# expect them to arrive. The header of the test report says how they were found.
STOP_SIGNALS = [getattr(signal, name) for name in ("SIGINT", "SIGHUP", "SIGTERM") if hasattr(signal, name)]
FOUND_BLOCKED = sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, []) if s in STOP_SIGNALS) \
    if hasattr(signal, "pthread_sigmask") else []
FOUND_IGNORED = sorted(s.name for s in STOP_SIGNALS if signal.getsignal(s) == signal.SIG_IGN)
for _sig in STOP_SIGNALS:
    if _sig != signal.SIGINT and signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, signal.SIG_DFL)
if FOUND_BLOCKED:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
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
                     "test_ring_attention", "test_ring_masks")


class NeedsTriton(pytest.Module):
    """A kernel test file on a machine without Triton: reported as skipped, never imported."""

    def collect(self):
        raise pytest.skip.Exception(NO_TRITON, allow_module_level=True)


@pytest.fixture(autouse=True)
def stop_signals_as_found():
    """Each test leaves the stop signals' handlers as it found them: one that stops an in-process run must not leave
    them ignored for the processes later tests start (a SIGHUP ignored by the parent reads as nohup in its child)."""
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    yield
    for s, handler in before.items():
        if handler is not None and signal.getsignal(s) != handler:
            signal.signal(s, handler)


def pytest_report_header(config):
    return (f"stop signals found blocked: {', '.join(FOUND_BLOCKED) or 'none'}; "
            f"found ignored: {', '.join(FOUND_IGNORED) or 'none'} (both undone for the tests)")


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


@pytest.fixture
def poison_outputs(monkeypatch):
    """Every float tensor torch.empty / empty_like allocates starts as NaN (the kernel test files use this), so an
    element the kernels or their launchers fail to write fails the test."""
    import torch

    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch, "empty_like",
                        lambda t, **kw: nan_empty(t.shape, dtype=kw.get("dtype", t.dtype), device=t.device))


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


# The fast tier: what `python -m pytest` runs by default (≤ 60 s on 2 cores). It covers the kernel's forward and
# backward in the interpreter (one small shape), one CLI training run, checkpoint → resume equality, a bad override's
# exit 2, fault paths (an unsafe checkpoint, a live run folder, an unquoted value), each data source, the config,
# the layout rules, the tools' help and the mask benchmark's pair counts. Everything else is marked `slow` here (run
# it with `python -m pytest -m slow`; .ci/run runs both).
# A new test is slow until it is named here: keep this tier fast.
FAST_FILES = {"test_config.py", "test_data.py", "test_dispatch.py", "test_figures.py", "test_imports.py",
              "test_relaunch.py", "test_results_rules.py", "test_ring_plan.py", "test_usage.py",
              "test_gluon_launch_args.py"}
FAST_TESTS = (
    "test_flash_attention.py::test_matches_float64_reference[n130-d32-float16-causal]",
    "test_flash_attention_qkv.py::test_layouts_it_does_not_take_raise_a_value_error_naming_the_problem",
    "test_train.py::test_resume_gives_the_same_losses",
    "test_checkpoint.py::test_resume_through_the_python_api_refuses_a_planted_checkpoint",
    "test_train.py::test_the_cli_trains_and_its_last_line_says_where_the_run_is",
    "test_sample.py::test_generate_greedy_crop_and_a_missing_path",
    "test_lifecycle.py::test_a_live_runs_directory_is_refused_and_left_untouched",
    "test_lifecycle.py::test_the_lock_counts_takes_and_reclaims_a_dead_owners_lock",
    "test_lifecycle.py::test_an_unquoted_value_says_how_to_quote_it",
    "test_lifecycle.py::test_blocked_stop_signals_are_unblocked_where_handled_and_in_started_children",
    "test_lifecycle.py::test_a_stop_inside_the_python_api_leaves_the_handlers_as_found_and_a_command_ignores_later_ones",
    "test_ring_attention.py::test_the_call_fence_waits_for_the_call_lag_calls_back",
    "test_rope_scaling.py::test_yarn_interpolates_long_wavelengths_keeps_short_ones_and_ramps_between",
    "test_rope_scaling.py::test_factor_one_is_plain_rope",
    "test_rope_scaling.py::test_resume_extend_continues_with_new_rope_and_seq_len",
    "test_bench.py::test_visible_pairs_match_a_brute_force_count",
    "test_eval.py::test_bin_means_docs_per_bin_and_an_interval_of_width_0_when_documents_agree",
    "test_attention_masks.py::test_document_ids_come_from_the_separators",
    "test_attention_masks.py::test_window_pattern_repeats_over_the_layers_and_is_cut",
    "test_recipe.py::test_segments_fill_the_budget_in_order_and_split_a_run_where_it_ends",
)
SLOW_IN_FAST_FILES = ("test_figures.py::test_cli_writes_three_pictures_and_their_readme",
                      "test_config.py::test_cli_bad_override_is_one_line_and_nonzero[attention",
                      "test_config.py::test_cli_bad_override_is_one_line_and_nonzero[batch_size")


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        name = f"{Path(str(item.fspath)).name}::{item.name}"
        fast = (Path(str(item.fspath)).name in FAST_FILES and not name.startswith(SLOW_IN_FAST_FILES)) \
            or name.startswith(FAST_TESTS)
        if not fast and item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.slow)

"""kernels/relaunch.py: a launch reuses the compiled kernel only where Triton would have chosen the same one, and hands
it the arguments in the kernel's parameter order. On CPU a stand-in kernel (a real JITFunction's parameters, a fake
compile and launch) records what each call did; the GPU test in test_gpu.py compares real launches bitwise."""
import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

pytest.importorskip("triton")

from minigpt_kernels import relaunch  # noqa: E402


def _scale(x, out, n, factor, stride=1, BLOCK: tl.constexpr = 16, FLIP: tl.constexpr = False):
    pass


class _Compiled:
    """What kernel[grid] returns: records the launches handed to it directly."""

    def __init__(self, calls):
        self.calls, self.function, self.packed_metadata = calls, "fn", "meta"

    def run(self, gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter, exit_, *values):
        self.calls.append(("direct", (gx, gy, gz), values))


class _Kernel(JITFunction):
    """A JITFunction (whatever TRITON_INTERPRET says) with a fake kernel[grid]: each call through Triton's path is
    recorded."""

    def __init__(self):
        super().__init__(_scale)
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("triton", grid, args, kwargs))
            return _Compiled(self.calls)
        return run


@pytest.fixture
def on_gpu(monkeypatch):
    """launch_kernel as it runs on a GPU (not the interpreter's pass-through), with a stand-in stream."""
    monkeypatch.setattr(relaunch, "INTERPRET", False)
    monkeypatch.setattr(relaunch, "_compiled", {})  # the stand-ins are not module-level: their ids may repeat
    monkeypatch.setattr(relaunch, "_stream", lambda device: 7)
    monkeypatch.setattr(relaunch, "_device", lambda: 0)


def test_a_repeated_call_goes_straight_to_the_compiled_kernel_in_parameter_order(on_gpu):
    kernel, x, out = _Kernel(), torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        relaunch.launch_kernel(kernel, (4,), x, out, 64, 0.5, BLOCK=32, num_warps=4)
    assert [c[0] for c in kernel.calls] == ["triton", "direct", "direct"]
    assert kernel.calls[0][2:] == ((x, out, 64, 0.5), {"BLOCK": 32, "num_warps": 4})
    _, grid, values = kernel.calls[1]
    # positional, then the keyword BLOCK, then the defaults (stride=1, FLIP=False); num_warps is an option, not passed
    assert grid == (4, 1, 1) and values[:4] == (x, out, 64, 0.5) and values[4:] == (1, 32, False)
    assert relaunch.cached_launches(kernel) == 1


@pytest.mark.parametrize("change", ["unaligned tensor", "dtype", "int", "float", "constexpr", "option", "grid only"])
def test_a_call_that_triton_might_compile_differently_goes_through_triton(on_gpu, change):
    kernel, x, out = _Kernel(), torch.zeros(64), torch.zeros(64)
    args, kwargs = [x, out, 64, 0.5], dict(BLOCK=32, num_warps=4)
    relaunch.launch_kernel(kernel, (4,), *args, **kwargs)
    grid = (4,)
    if change == "unaligned tensor":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary: Triton drops the alignment specialization
    elif change == "dtype":
        args[1] = out.half()
    elif change == "int":
        args[2] = 48
    elif change == "float":
        args[3] = 0.25
    elif change == "constexpr":
        kwargs["BLOCK"] = 64
    elif change == "option":
        kwargs["num_warps"] = 8
    else:
        grid = (5,)  # the same kernel: launched directly on the new grid
    relaunch.launch_kernel(kernel, grid, *args, **kwargs)
    assert kernel.calls[1][0] == ("direct" if change == "grid only" else "triton")
    if change == "grid only":
        assert kernel.calls[1][1] == (5, 1, 1)


def test_disabled_or_hooked_launches_always_go_through_triton(on_gpu, monkeypatch):
    kernel, x = _Kernel(), torch.zeros(64)
    monkeypatch.setattr(relaunch, "ENABLED", False)
    for _ in range(2):
        relaunch.launch_kernel(kernel, (1,), x, x, 64, 1.0)
    monkeypatch.setattr(relaunch, "ENABLED", True)
    monkeypatch.setattr(relaunch.knobs.runtime, "launch_enter_hook", lambda *a: None)  # a profiler's
    for _ in range(2):
        relaunch.launch_kernel(kernel, (1,), x, x, 64, 1.0)
    assert [c[0] for c in kernel.calls] == ["triton"] * 4


def test_a_spy_standing_in_for_a_kernel_sees_every_launch(on_gpu):
    seen, kernel, x = [], _Kernel(), torch.zeros(64)

    class Spy:  # as test_gpu_ring_kernels.py counts the Triton forward's launches
        def __getitem__(self, grid):
            seen.append(grid)
            return kernel[grid]

    for _ in range(3):
        relaunch.launch_kernel(Spy(), (2,), x, x, 64, 1.0)
    assert len(seen) == 3 and [c[0] for c in kernel.calls] == ["triton"] * 3


def test_a_missing_argument_raises_like_triton(on_gpu):
    kernel, x = _Kernel(), torch.zeros(64)
    with pytest.raises(TypeError, match="factor"):
        relaunch.launch_kernel(kernel, (1,), x, x, 64)


def test_tensors_count_by_dtype_and_alignment_not_identity_positional_or_keyword(on_gpu):
    kernel = _Kernel()
    for _ in range(3):  # fresh tensors each call, one by keyword: the key keeps no tensor and still hits
        relaunch.launch_kernel(kernel, (2,), torch.zeros(64), out=torch.zeros(64), n=64, factor=0.5, BLOCK=32)
    assert [c[0] for c in kernel.calls] == ["triton", "direct", "direct"]
    assert relaunch.cached_launches(kernel) == 1
    key = next(iter(relaunch._compiled[id(kernel)]))
    parts = [p for item in key for p in (item if isinstance(item, tuple) else (item,))]
    assert not any(isinstance(p, torch.Tensor) for p in parts)

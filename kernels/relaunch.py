"""Launch a Triton (or Gluon) kernel again without Triton's per-call argument binding.

`kernel[grid](*args, **kwargs)` spends tens of microseconds of Python on every call before the GPU sees anything: it
binds the arguments to the signature, specializes each one (dtype, 16-byte alignment, ints equal to 1 or divisible by
16), hashes that into the compiled-kernel cache's key, checks the globals the kernel read, and builds launch metadata.
A training step calls the same few kernels with the same shapes every layer, so that work repeats unchanged; at 1K
tokens it is part of what makes gpt2-small's step host-bound (kernels/NOTES.md, session 22).

`launch_kernel(kernel, grid, *args, **kwargs)` does the same launch. The first call with a given key goes through
`kernel[grid]` and keeps the CompiledKernel it returns; later calls with the same key hand the arguments straight to
it. The key is stricter than Triton's own: the current device, every non-tensor argument by type and value (ints,
floats, bools, constexprs, launch options), every tensor by dtype and whether its address is 16-byte aligned, which
is all Triton specializes a pointer on. So a hit is always a call that Triton would have served from the same
compiled kernel. (Triton's check that the globals a kernel read still hold their values is skipped with the rest:
ours read module constants only.) Under the interpreter, with a launch hook set (a profiler), for anything but a
JITFunction (a test's spy) or with ENABLED off, every call goes through `kernel[grid]`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from minigpt_kernels.device import INTERPRET

ENABLED = True  # False: every launch through kernel[grid] (an A/B of the host time, a suspected stale entry)

# per kernel: key -> (compiled kernel, how to order a call's arguments as the kernel's parameters)
_compiled: dict[int, dict[tuple, tuple[Any, tuple[tuple[int, Any], ...]]]] = {}


# The current CUDA device, as Triton keys its compiled kernels: torch.cuda.current_device without its lazy-init check
# (a CUDA tensor exists, so CUDA is up); a CPU build has only the latter.
_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def _stream(device: int) -> int:
    """The device's current CUDA stream, as Triton's own launches ask for it."""
    return driver.active.get_current_stream(device)


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is set: None, or an empty chain of them (triton 3.6's default), is none."""
    return bool(getattr(hook, "calls", hook))


def _order(kernel: Any, n_args: int, kwargs: dict[str, Any]) -> tuple[tuple[int, Any], ...]:
    """Each parameter of the kernel, in order: (0, i) the i-th positional argument, (1, name) a keyword argument,
    (2, value) its default. Keywords that are not parameters (num_warps, num_stages, maxnreg) are launch options."""
    order = []
    for i, param in enumerate(kernel.params):
        if i < n_args:
            order.append((0, i))
        elif param.name in kwargs:
            order.append((1, param.name))
        elif param.has_default:
            order.append((2, param.default))
        else:
            raise TypeError(f"{kernel.fn.__name__}: no value for parameter {param.name!r}")
    return tuple(order)


def launch_kernel(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """kernel[grid](*args, **kwargs), reusing the compiled kernel of an earlier call with the same key."""
    if not (ENABLED and isinstance(kernel, JITFunction)) or INTERPRET or _hooked(knobs.runtime.launch_enter_hook) \
            or _hooked(knobs.runtime.launch_exit_hook):  # a test's stand-in for a kernel, or a profiler's hook
        kernel[grid](*args, **kwargs)
        return
    cache = _compiled.setdefault(id(kernel), {})  # kernels are module-level: their ids live as long as they do
    # Triton keeps a cache per current device; a tensor counts by dtype and 16-byte alignment, anything else by type
    # and value (True, 1 and 1.0 compile differently)
    device = _device()
    key = (device,
           *[(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else (a.__class__, a) for a in args],
           *[(n, a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else (n, a.__class__, a)
             for n, a in kwargs.items()])
    try:
        hit = cache.get(key)
    except TypeError:  # an argument that cannot be a key (not one of ours today): Triton's own path
        kernel[grid](*args, **kwargs)
        return
    if hit is None:
        compiled = kernel[grid](*args, **kwargs)
        cache[key] = (compiled, _order(kernel, len(args), kwargs))
        return
    compiled, order = hit
    values = [args[where] if kind == 0 else kwargs[where] if kind == 1 else where for kind, where in order]
    stream = _stream(device)
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, None, None, None, *values)


def cached_launches(kernel: Callable) -> int:
    """How many compiled kernels `launch_kernel` keeps for this kernel (for the tests)."""
    return len(_compiled.get(id(kernel), {}))

"""minigpt's attention kernels, installed as `minigpt_kernels` (the folder is kernels/ in the source tree).

    flash_attention.py     the face: flash_attention, flash_attention_with_lse, input checks, custom ops, autograd
    dispatch.py            which kernel and tiles run a call: one table, plan() -> Plan; MINIGPT_FLASH_PATH forces a path
    launch.py              the launchers (forward, backward and its kernels one by one, for ring attention)
    relaunch.py            a kernel's later launches straight to its compiled form (Triton's per-call binding skipped)
    triton_kernels.py      the Triton kernels: forward with online softmax, FlashAttention-2 backward, dQ from stored dS
                           (masks: sliding window, document ids, blocks at offsets; GQA; their tile spans)
    gluon/                 the Hopper (sm_90) kernels in Gluon: forward.py (ping-pong, persistent), backward.py
                           (five-matmul dK/dV/dQ, dQ), common.py (their shared helpers), schedule.py (persistent lists)
    device.py              interpreter or GPU, compute capability, TMA alignment (no triton import)
    rotary.py              the model's qkv split + RoPE in one pass
    flash_attention_qkv.py attention from the qkv projection, RoPE's backward folded into flash's
    sm90_build.py          the Gluon kernels compiled for sm_90 without a GPU: do they build, how many instructions
    NOTES.md               what was measured, and why the table says what it says

`import minigpt_kernels` needs triton only where triton is installed: there the two public functions are bound at
import (so `from minigpt_kernels import flash_attention` is the function whatever was imported first); without triton
(macOS, Windows) the package still imports and the functions fail on first use with triton's ImportError."""
from __future__ import annotations

import importlib
import importlib.util

__all__ = ["flash_attention", "flash_attention_with_lse"]


def __getattr__(name: str):
    """flash_attention and flash_attention_with_lse, imported (with torch and triton) on first use. Importing the
    module flash_attention.py binds its name here to the module; the function takes the name back, as before."""
    if name in __all__:
        face = importlib.import_module("minigpt_kernels.flash_attention")
        globals().update(flash_attention=face.flash_attention, flash_attention_with_lse=face.flash_attention_with_lse)
        return globals()[name]
    raise AttributeError(f"module 'minigpt_kernels' has no attribute {name!r}")


if importlib.util.find_spec("triton") is not None:  # bind the functions now, before any import of the module by name
    __getattr__("flash_attention")

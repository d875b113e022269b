"""The Gluon kernels build for sm_90 with the installed triton, on a machine without a GPU (minigpt_kernels.sm90_build).

CI runs a newer triton than the GPU machines (3.6): these tests are what tells us that Gluon's API moved under the
kernels (triton 3.9 renamed the TMA load) before a GPU user finds out. They compile, they do not run.
"""
import json
import os
import subprocess
import sys

import pytest

from minigpt_kernels import sm90_build

VARIANTS = {v.name: v for v in sm90_build.table_variants()}
NAMES = list(VARIANTS)


@pytest.fixture(scope="module")
def reports():
    """Every variant compiled once, in a process without TRITON_INTERPRET (which the test session sets, and under
    which Gluon cannot compile for a GPU): ~5 s a kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "minigpt_kernels.sm90_build", "--json"], env=env, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["name"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("name", NAMES)
def test_every_table_variant_builds_for_sm90(reports, name):
    """Each kernel variant the dispatch table can pick compiles to sm_90 code with wgmmas inside a loop."""
    r = reports[name]
    assert r["error"] is None, f"{name}: {r['error']}"
    assert r["HGMMA"] > 0 and r["wgmma_loops"], f"{name}: no wgmma loop in its SASS"


@pytest.mark.parametrize("name", ["fwd persistent D64 C3", "fwd plain D64 C3", "fwd persistent D64 C3 fp16",
                                  "fwd non-causal persistent D64 C3 continue", "fwd plain D64 C3 fp32 o"])
def test_three_consumer_forward_packs_p_without_prmt(reports, name):
    """At three consumers P is rounded into packed registers by hand (gluon/forward.py, _p_operand): with the
    compiler's own conversion ptxas swaps the halves of each register back before the P·V wgmma, 32 PRMT per key
    tile (kernels/NOTES.md Z; 128–192 in the kernel under triton 3.6 and 3.9). If this fails after a triton upgrade,
    compare the loops with `python -m minigpt_kernels.sm90_build --only fwd` before measuring on a GPU."""
    assert reports[name]["error"] is None and reports[name]["PRMT"] == 0, reports[name]


RING = [n for n in NAMES if n.startswith("fwd") and any(w in n for w in ("non-causal", "continue", "fp32 o"))
        and not n.endswith(" stores")]


def _base(name: str) -> str:
    """The causal fresh variant of the same tiles and the same way out for o: what a ring form is held to."""
    base = name
    for word in ("non-causal ", " continue", " GQA", " fp32 o"):
        base = base.replace(word, "")
    if VARIANTS[base].constexprs["O_TMA"] and not VARIANTS[name].constexprs["O_TMA"]:
        return f"{base} stores"  # the same epilogue: o stored from registers (at head_dim 64 a fresh o leaves by TMA)
    return base


def test_ring_attention_forward_variants_are_built():
    """The forward's forms in ring attention's launches, at head_dim 64 and 128: the local block causal into an fp32
    o (fp32 o), the other ranks' blocks without the causal mask, continuing the running fp32 (o, lse) (non-causal
    ... continue), with GQA too, and the non-causal forward in the inputs' dtype."""
    for d in (64, 128):
        for kind in ("fwd non-causal persistent D{d} C2 continue", "fwd non-causal persistent D{d} C2",
                     "fwd persistent D{d} C2 fp32 o", "fwd non-causal persistent D{d} C2 continue GQA",
                     "fwd masked D{d} C2 fp32 o"):
            assert kind.format(d=d) in RING, kind.format(d=d)
    assert all(_base(n) in NAMES for n in RING)


# Spills a ring form's key-tile loop may keep where the causal form's loops lost theirs: the three-consumer non-causal
# plain loops reload 9 loop-invariant scalars (10 before the TMA descriptors were made once, when the causal loops
# spilled 12 and this rule compared the sums; kernels/NOTES.md, session 16).
RING_LOOP_SPILLS = 10


@pytest.mark.parametrize("name", RING)
def test_ring_forward_variants_keep_the_causal_key_tile_loop(reports, name):
    """Each ring form's key-tile loops (the shortest loops holding wgmmas, one per consumer) are no longer than the
    causal fresh variant's of the same tiles, and spill no more there (or at most RING_LOOP_SPILLS a loop): the
    continued state is read and written in the epilogue, and without the causal mask the only masked tile is a
    ragged last one. The causal continued form of the three-consumer persistent kernel (no ring launch takes it) is
    held to building only."""
    r, base = reports[name], reports[_base(name)]
    assert r["error"] is None and r["HGMMA"] > 0 and r["wgmma_loops"], (name, r["error"])
    if name.startswith("fwd persistent D64 C3 continue"):
        return
    consumers = int(name.split(" C")[1][0])
    ours, theirs = r["inner_loops"][:consumers], base["inner_loops"][:consumers]
    assert max(n for n, _ in ours) <= max(n for n, _ in theirs) + 4, (name, ours, theirs)
    assert (sum(s for _, s in ours) <= sum(s for _, s in theirs)
            or max(s for _, s in ours) <= RING_LOOP_SPILLS), (name, ours, theirs)


LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR24], R24 ;
        /*0020*/                   PRMT R120, R121, 0x5432, R121 ;
        /*0030*/               @P0 BRA 0x10 ;
        /*0040*/                   FADD R2, R2, R3 ;
        /*0050*/                   BRA 0x40 ;
        /*0060*/                   EXIT ;
"""


def test_loops_are_read_from_backward_branches():
    """Two loops: 0x10–0x30 (a wgmma, a PRMT, its branch) and 0x40–0x50; a branch forward is no loop."""
    assert [(a, op) for a, op, _ in sm90_build.instructions(LISTING)][:3] == [(0, "MOV"), (0x10, "HGMMA.64x128x16.F32.BF16"),
                                                                             (0x20, "PRMT")]
    found = sm90_build.loops(LISTING)
    assert [(loop.start, loop.end, loop.length) for loop in found] == [(0x40, 0x50, 2), (0x10, 0x30, 3)]
    assert found[1].opcodes == {"HGMMA": 1, "PRMT": 1, "BRA": 1}


ROTARY_BUILD = """
import inspect, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from minigpt_kernels.rotary import _qkv_rotary_kernel as kernel
for backward, with_v, dq in ((False, True, "*bf16"), (True, True, "*bf16"), (True, False, "*bf16"), (True, False, "*fp32")):
    const = dict(BACKWARD=backward, WITH_V=with_v, GROUP=2, HALF=32, BLOCK=32)
    ptrs = dict(PACKED="*bf16", Q=dq, K="*bf16", V="*bf16", COS="*fp32", SIN="*fp32")
    sig = {n: ptrs.get(n, "constexpr" if n in const else "i64") for n in inspect.signature(kernel.fn).parameters}
    triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32))
"""


def test_qkv_rotary_kernel_builds_for_sm90_with_an_fp32_dq():
    """The rotary kernel in each form its launchers use, dQ in fp32 (flash_attention_qkv's accumulator) beside a
    16-bit dK included. The interpreter does not type-check a name rebound to another pointer type; the compiler
    does, and this failed on a GPU before (kernels/rotary.py keeps one name per head kind)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", ROTARY_BUILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

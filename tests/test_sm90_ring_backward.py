"""Ring attention's block backward (the dK/dV/dQ kernel with FULL and ACCUMULATE_DKDV, sm90_build.block_variants)
builds for sm_90 on a machine without a GPU, with no elementwise mask and no more spills than the causal kernel it is
made from (minigpt_kernels.sm90_build). Compiled, not run: tests/test_gpu_ring_backward.py runs it.

Each variant is built three ways, in one process without TRITON_INTERPRET (which the test session sets, and under
which Gluon cannot compile for a GPU): as the ring launches it; without ACCUMULATE_DKDV, writing dK, dV in the
inputs' dtype (what the accumulating epilogue costs, and the form two ranks launch to write the other rank's share
straight into its message home); and with neither flag (the causal kernel of the same tiles, the code the ring's
diagonal block and the single-GPU backward run). tests/test_sm90_build.py's fixture compiles every table variant at once, more than
needed here, so this file has its own (12 builds, ~2.5 minutes on two cores with a cold triton cache).
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
sm90_build = pytest.importorskip("minigpt_kernels.sm90_build")

NAMES = [v.name for v in sm90_build.block_variants()]
FORMS = {"ring": {}, "no accumulate": {"ACCUMULATE_DKDV": False}, "causal": {"FULL": False, "ACCUMULATE_DKDV": False}}

BUILD = """
import dataclasses, json, sys
from collections import Counter
from minigpt_kernels import sm90_build as s
forms = json.loads(sys.argv[1])
out = {}
for v in s.block_variants():
    for form, flags in forms.items():  # dK, dV in the inputs' dtype where they are written, not accumulated
        w = dataclasses.replace(v, constexprs=dict(v.constexprs, **flags),
                                fp32=v.fp32 if flags.get("ACCUMULATE_DKDV", True) else ())
        try:
            listing = s.sass(s.compile_sm90(w))
        except Exception as e:  # reported per form, so one broken build does not hide the others
            out[f"{v.name} | {form}"] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
            continue
        ops = Counter(op.split(".")[0] for _, op, _ in s.instructions(listing))
        out[f"{v.name} | {form}"] = {"error": None, "instructions": sum(ops.values()), "STL": ops["STL"],
                                     "LDL": ops["LDL"], "FSEL": ops["FSEL"], "HGMMA": ops["HGMMA"],
                                     "wgmma_loops": sorted({l.length for l in s.loops(listing) if l.opcodes["HGMMA"]})}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def reports() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", BUILD, json.dumps(FORMS)], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_there_are_block_variants_at_both_head_dims_with_and_without_gqa():
    assert sorted(NAMES) == sorted(["dkdvdq block D64 s3", "dkdvdq block GQA D64 s3", "dkdvdq block D128 s2",
                                    "dkdvdq block GQA D128 s2"])
    for v in sm90_build.block_variants():
        assert v.constexprs["FULL"] and v.constexprs["ACCUMULATE_DKDV"] and set(v.fp32) == {"DK", "DV"}


@pytest.mark.parametrize("name", NAMES)
def test_the_block_backward_builds_for_sm90(reports, name):
    """Each form compiles to sm_90 code with wgmmas inside a loop."""
    for form in FORMS:
        r = reports[f"{name} | {form}"]
        assert r["error"] is None, f"{name} ({form}): {r['error']}"
        assert r["HGMMA"] > 0 and r["wgmma_loops"], f"{name} ({form}): no wgmma loop in its SASS"


@pytest.mark.parametrize("name", NAMES)
def test_no_query_tile_of_a_block_off_the_diagonal_is_masked(reports, name):
    """FULL compiles the elementwise mask out (no FSEL: the causal form has one per masked score)."""
    assert reports[f"{name} | ring"]["FSEL"] == 0 and reports[f"{name} | causal"]["FSEL"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_the_block_backward_spills_no_more_than_the_causal_kernel(reports, name):
    """Spill stores (STL): the ring's form no more than the causal kernel of the same tiles, and the accumulating
    epilogue (a load, an add and a store of dK, dV) adds none. If this fails after a triton upgrade, compare the
    forms with `python -m minigpt_kernels.sm90_build --only block` before measuring on a GPU."""
    ring, plain, causal = (reports[f"{name} | {form}"] for form in FORMS)
    assert ring["STL"] <= causal["STL"], (ring, causal)
    assert ring["STL"] <= plain["STL"], (ring, plain)  # with GQA ptxas spills a few fewer with it (since 21d0829)

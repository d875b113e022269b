"""Build the Gluon kernels for sm_90 (H100/H200) on a machine without a GPU, and read their machine code.

Two uses, both from kernels/NOTES.md Z, where GPU time is the scarce thing:
- a check that every kernel variant the dispatch table can pick still compiles with the installed triton (Gluon's
  API moves between releases: triton 3.9 renamed the TMA load that 3.6 has);
- instruction counts per loop of the SASS, to compare variants before spending GPU time on them (a key tile of the
  three-consumer forward went from 618 to 585 instructions when P was packed by hand).

    python -m minigpt_kernels.sm90_build              # every variant: instructions, spills, PRMTs, inner loops
    python -m minigpt_kernels.sm90_build --only fwd   # those whose name contains "fwd"
    python -m minigpt_kernels.sm90_build --only block # ring attention's block backward (block_variants)

It compiles with `triton.compile(GluonASTSource(...), target=GPUTarget("cuda", 90, 32))` and disassembles with the
cuobjdump that ships with triton. What ptxas does under another triton can differ from the GPU machines' 3.6.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
from collections import Counter
from dataclasses import dataclass
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from minigpt_kernels.dispatch import FOLD_FROM_KEYS, TABLE, fold_tiles
from minigpt_kernels.gluon import backward as bwd
from minigpt_kernels.gluon import common
from minigpt_kernels.gluon import forward as fwd

SM90 = GPUTarget("cuda", 90, 32)
FP32_POINTERS = {"LSE", "DELTA", "DQ_ACC"}
INT32_POINTERS = {"WORK", "WORK_START", "DOC_STARTS", "DOC_ENDS"}


@dataclass(frozen=True)
class Variant:
    """One compiled form of a kernel: its constexprs as the launcher passes them, the input dtype, and the tensors
    given in fp32 beside FP32_POINTERS (the forward's O in ring attention's launches)."""
    name: str
    kernel: Any  # a gluon.jit function
    constexprs: dict[str, Any]
    dtype: str = "bf16"
    fp32: tuple[str, ...] = ()  # tensors that are fp32 in this variant beside FP32_POINTERS (O, DK, DV)


def table_variants() -> list[Variant]:
    """The Gluon variants dispatch.TABLE can pick, read from the table (constexprs as the launchers in gluon/forward.py
    and gluon/backward.py derive them from a TileConfig), plus fp16 where the forward has three consumers (the
    hand-packed P of NOTES.md Z), and the forward's forms in ring attention's launches: each causal row's with an fp32
    o written fresh ("fp32 o", the local block) and continued ("continue") and with GQA (GQA alone takes the dense
    rows, folded on long rows too), each non-causal row's fresh (o in the
    input dtype) and continued (fp32 o: the other ranks' blocks; also with GQA), the masked one's with an fp32 o and
    persistent (a window alone)."""
    out = []
    for kind, d, cfg, masks, when in ((e.kernel, d, e.tiles, e.masks, e.when) for e in TABLE if e.tiles.specialized
                                      for d in e.head_dims):
        mode = "persistent" if cfg.persistent else "plain"
        if kind == "fwd":
            consumers = cfg.block_m // 64
            causal = when != "sm90-non-causal"
            c = dict(HEAD_DIM=d, NUM_CONSUMERS=consumers, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages,
                     CONSUMER_REGS=common.CONSUMER_REGS[consumers], PRODUCER_REGS=common.PRODUCER_REGS,
                     SKIP=causal and cfg.persistent and fwd.consumers_can_stop_early(consumers, cfg.block_n),
                     PERSISTENT=cfg.persistent, GQA=False, WINDOWED=False, DOCS=False, CAUSAL=causal,
                     CONTINUE=False, FOLD=0, O_TMA=d == 64, QUEUE=False)  # 2-byte o: device.staged_by_tma
            # long rows fold their accumulator (dispatch.fold_tiles), with two stages at head_dim 128
            folded = dict(c, FOLD=fold_tiles(FOLD_FROM_KEYS, cfg.block_n),
                          STAGES=min(cfg.num_stages, 2) if d == 128 else cfg.num_stages)
            kernel = fwd.pingpong_fwd_kernel  # one kernel; plain and persistent differ in their work lists
            if masks:  # the masked launch (launch_forward_masked): a plain grid or persistent, GQA, windows, documents
                masked = dict(c, SKIP=False, PERSISTENT=False, GQA=True, WINDOWED=True, DOCS=True)
                out.append(Variant(f"fwd masked D{d} C{consumers}", kernel, masked))
                out.append(Variant(f"fwd masked D{d} C{consumers} fp32 o", kernel, dict(masked, O_TMA=False), fp32=("O",)))
                if c["O_TMA"]:  # o stored from registers (not TMA-aligned): what the fp32 o form is held against
                    out.append(Variant(f"fwd masked D{d} C{consumers} stores", kernel, dict(masked, O_TMA=False)))
                out.append(Variant(f"fwd masked persistent D{d} C{consumers}", kernel,  # a window alone
                                   dict(masked, PERSISTENT=True, DOCS=False)))
                out.append(Variant(f"fwd masked queue D{d} C{consumers} documents", kernel,
                                   dict(masked, PERSISTENT=True, QUEUE=True)))
                masked_folded = dict(masked, FOLD=folded["FOLD"], STAGES=folded["STAGES"])
                out.append(Variant(f"fwd masked D{d} C{consumers} fold", kernel, masked_folded))
                out.append(Variant(f"fwd masked persistent D{d} C{consumers} fold", kernel,
                                   dict(masked_folded, PERSISTENT=True, DOCS=False)))
                out.append(Variant(f"fwd masked queue D{d} C{consumers} documents fold", kernel,
                                   dict(masked_folded, PERSISTENT=True, QUEUE=True)))
                continue
            name = f"fwd {mode} D{d} C{consumers}" if causal else f"fwd non-causal {mode} D{d} C{consumers}"
            out.append(Variant(name, kernel, c))
            out.append(Variant(f"{name} fold", kernel, folded))
            if c["O_TMA"]:  # o stored from registers (not TMA-aligned): what the ring forms are held against
                out.append(Variant(f"{name} stores", kernel, dict(c, O_TMA=False)))
                out.append(Variant(f"{name} fold stores", kernel, dict(folded, O_TMA=False)))
            out.append(Variant(f"{name} continue fold", kernel, dict(folded, CONTINUE=True, O_TMA=False), fp32=("O",)))
            if consumers == 3 and causal:
                out.append(Variant(f"{name} fp16", kernel, c, "fp16"))
            if causal:
                out.append(Variant(f"{name} fp32 o", kernel, dict(c, O_TMA=False), fp32=("O",)))
                out.append(Variant(f"{name} GQA", kernel, dict(c, GQA=True)))  # GQA alone (launch.launch_forward)
                out.append(Variant(f"{name} GQA fold", kernel, dict(folded, GQA=True)))
            out.append(Variant(f"{name} continue", kernel, dict(c, CONTINUE=True, O_TMA=False), fp32=("O",)))
            if not causal:
                out.append(Variant(f"{name} continue GQA", kernel, dict(c, CONTINUE=True, GQA=True, O_TMA=False), fp32=("O",)))
        elif kind == "dkdvdq":
            c = dict(HEAD_DIM=d, BLOCK_M=cfg.block_m, STAGES=cfg.num_stages, PRODUCER_REGS=common.PRODUCER_REGS,
                     REDUCER_REGS=bwd.REDUCER_REGS,
                     CONSUMER_REGS=bwd.SPLIT_CONSUMER_REGS if d > 64 else bwd.FUSED_CONSUMER_REGS,
                     KV_BUFS=2 if cfg.persistent and d == 64 else 1, PERSISTENT=cfg.persistent,
                     GQA=False, WINDOWED=False, DOCS=False, FULL=False,
                     ACCUMULATE_DKDV=bwd.DKDV_WRITE.value, DKDV_TMA=d == 64, QUEUE=False)  # as the launchers
            if masks:  # the masked launch (launch_dkdv_dq_masked): plain (GQA too) or persistent, windows, documents
                out.append(Variant(f"dkdvdq masked D{d} s{cfg.num_stages}", bwd.dkdvdq_kernel,
                                   dict(c, GQA=True, WINDOWED=True, DOCS=True)))
                out.append(Variant(f"dkdvdq masked MQA split D{d} s{cfg.num_stages}", bwd.dkdvdq_kernel,
                                   dict(c, GQA=True, WINDOWED=True, DOCS=True, DKDV_TMA=False,
                                        ACCUMULATE_DKDV=bwd.DKDV_ATOMIC_ADD.value), fp32=("DK", "DV")))  # group_splits
                out.append(Variant(f"dkdvdq masked persistent D{d} s{cfg.num_stages}", bwd.dkdvdq_kernel,
                                   dict(c, PERSISTENT=True, KV_BUFS=2 if d == 64 else 1, WINDOWED=True)))  # MHA window
                # MHA documents (and a window) on the work queue (K/V double-buffered at head_dim 64 alone), and on
                # the plain grid (launches of fewer than MASKED_PERSISTENT_WAVES waves), the queue's comparison
                out.append(Variant(f"dkdvdq masked queue documents D{d} s{cfg.num_stages}", bwd.dkdvdq_kernel,
                                   dict(c, PERSISTENT=True, KV_BUFS=2 if d == 64 else 1, WINDOWED=True, DOCS=True,
                                        QUEUE=True)))
                out.append(Variant(f"dkdvdq masked documents D{d} s{cfg.num_stages}", bwd.dkdvdq_kernel,
                                   dict(c, WINDOWED=True, DOCS=True)))
            else:
                out.append(Variant(f"dkdvdq {mode} D{d} s{cfg.num_stages}", bwd.dkdvdq_kernel, c))
        else:  # "dq": the head_dim-128 dQ kernel of the deterministic backward
            c = dict(HEAD_DIM=d, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages, PRODUCER_REGS=common.PRODUCER_REGS,
                     CONSUMER_REGS=common.CONSUMER_REGS[bwd.CONSUMERS.value])
            out.append(Variant(f"dq D{d}", bwd.dq_kernel, c))
    return list({v.name: v for v in out}.values())  # a row over several head_dims may repeat another's variant


def block_variants() -> list[Variant]:
    """Ring attention's block backward (launch.launch_backward_block, gluon/backward.launch_dkdv_dq_block) where no
    table row names it: a block off the diagonal (FULL: no causal mask, N_Q != N_K) adding dK, dV into the travelling
    fp32 accumulator (ACCUMULATE_DKDV), with and without GQA, on the plain grid with launch.BLOCK_BACKWARD_TILES'
    stages (3 at head_dim 64, 2 at 128). The diagonal block (causal, fresh) compiles to the table's dense variants."""
    out = []
    for d, stages in ((64, 3), (128, 2)):
        c = dict(HEAD_DIM=d, BLOCK_M=64, STAGES=stages, PRODUCER_REGS=common.PRODUCER_REGS,
                 REDUCER_REGS=bwd.REDUCER_REGS,
                 CONSUMER_REGS=bwd.SPLIT_CONSUMER_REGS if d > 64 else bwd.FUSED_CONSUMER_REGS, KV_BUFS=1,
                 PERSISTENT=False, GQA=False, WINDOWED=False, DOCS=False, FULL=True,
                 ACCUMULATE_DKDV=bwd.DKDV_ADD.value, DKDV_TMA=False, QUEUE=False)
        for gqa in (False, True):
            out.append(Variant(f"dkdvdq block{' GQA' if gqa else ''} D{d} s{stages}", bwd.dkdvdq_kernel,
                               dict(c, GQA=gqa), fp32=("DK", "DV")))
    return out


def all_variants() -> list[Variant]:
    """Every variant main() builds: the table's, then the ring's block backward."""
    return table_variants() + block_variants()


def signature(kernel: Any, constexprs: dict[str, Any], dtype: str, fp32: tuple[str, ...] = ()) -> dict[str, str]:
    """Argument types by the kernels' naming: capitals are tensors (LSE, DELTA, DQ_ACC and those in fp32 fp32; WORK
    lists int32; the rest the input dtype) except the sizes B, H, N and N_K; *scale is fp32; every other argument an
    int32."""
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in FP32_POINTERS or name in fp32:
            sig[name] = "*fp32"
        elif name in INT32_POINTERS:
            sig[name] = "*i32"
        elif name.isupper() and name not in ("B", "H", "N", "N_K"):
            sig[name] = f"*{dtype}"
        elif name.endswith("scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_sm90(v: Variant) -> Any:
    """The variant compiled for sm_90 (pointers and strides assumed 16-divisible, as the launchers' inputs are)."""
    sig = signature(v.kernel, v.constexprs, v.dtype, v.fp32)
    names = list(sig)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n][0] == "*" or n.startswith("stride")}
    source = GluonASTSource(v.kernel, sig, {(names.index(k),): val for k, val in v.constexprs.items()}, aligned)
    return triton.compile(source, target=SM90, options={"num_warps": 4})


def sass(compiled: Any, workdir: str = "/tmp") -> str:
    """The compiled kernel's SASS, by the cuobjdump that ships with triton."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    path = os.path.join(workdir, f"minigpt_sm90_{os.getpid()}.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)


@dataclass
class Loop:
    """Instructions from a backward branch's target to the branch: a loop body (or a loop with the loops it holds)."""
    start: int
    end: int
    opcodes: Counter

    @property
    def length(self) -> int:
        return sum(self.opcodes.values())


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")


def instructions(listing: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of each instruction of a cuobjdump listing."""
    return [(int(a, 16), op, rest) for a, op, rest in _INSTRUCTION.findall(listing)]


def loops(listing: str) -> list[Loop]:
    """Every backward branch's loop, innermost (shortest) first; opcodes counted by their first part (HGMMA, PRMT)."""
    code = instructions(listing)
    found = []
    for address, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            found.append(Loop(start, address, Counter(o.split(".")[0] for a, o, _ in code if start <= a <= address)))
    return sorted(found, key=lambda loop: loop.length)


def report(v: Variant) -> dict[str, Any]:
    """What one variant compiles to: instructions, STL (spill stores), PRMT, HGMMA, the lengths of the loops that hold
    wgmmas (innermost first), the four shortest of them as [length, spill loads and stores (LDL + STL)] (a
    forward's key-tile loops, one per consumer, come first), or the error that stopped it."""
    try:
        listing = sass(compile_sm90(v))
    except Exception as e:  # noqa: BLE001 - reported per variant, so one broken kernel does not hide the others
        return {"name": v.name, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"}
    ops = Counter(op.split(".")[0] for _, op, _ in instructions(listing))
    found = loops(listing)
    return {"name": v.name, "error": None, "instructions": sum(ops.values()), "STL": ops["STL"], "PRMT": ops["PRMT"],
            "HGMMA": ops["HGMMA"], "wgmma_loops": sorted({loop.length for loop in found if loop.opcodes["HGMMA"]}),
            "inner_loops": [[loop.length, loop.opcodes["LDL"] + loop.opcodes["STL"]]
                            for loop in found if loop.opcodes["HGMMA"]][:4]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="variants whose name contains this")
    parser.add_argument("--json", action="store_true", help="one JSON list of the reports instead of a table")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("sm90_build: unset TRITON_INTERPRET (under the interpreter Gluon cannot compile for a GPU)")
    reports = []
    if not args.json:
        print(f"triton {triton.__version__}, sm_90")
        print("| variant | instructions | STL | PRMT | loops holding wgmmas (instructions) | shortest four "
              "(instructions/LDL+STL) |\n|---|---|---|---|---|---|")
    for v in all_variants():
        if args.only in v.name:
            reports.append(report(v))
            r = reports[-1]
            if not args.json:
                print(f"| {v.name} | {r['error']} |" if r["error"] else f"| {v.name} | {r['instructions']} | "
                      f"{r['STL']} | {r['PRMT']} | {', '.join(map(str, r['wgmma_loops'][:4]))} | "
                      f"{', '.join(f'{n}/{spills}' for n, spills in r['inner_loops'])} |", flush=True)
    if args.json:
        print(json.dumps(reports))


if __name__ == "__main__":
    main()

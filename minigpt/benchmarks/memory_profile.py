"""Where one training step's GPU memory goes: the peak of each phase and the tensors alive at the step's peak.

    minigpt-memory --out results/memory/1m -- attention=flash seq_len=1048576 batch_size=1 \\
        model.recompute_every=1 model.recompute_dtype=bfloat16 model.loss_chunk=4096 model.mlp_chunk=65536 \\
        model.offload=true model.keep_attention=true
    (= python -m minigpt.benchmarks.memory_profile ...; everything after `--` is a trainer override)

It builds the run as the trainer does (same config, model, levers, compile), takes one warm-up step (so the
optimizer state exists, the allocator has grown and the regions are compiled), then one
step at the full length in three phases (forward + loss, backward, optimizer), with the CUDA caching
allocator's history recorded (`torch.cuda.memory._record_memory_history`). Replaying that history gives the
moment of the step's peak and every allocation alive then; they are grouped by where they were made (the
op that made it and the innermost frame in minigpt/ or the kernel package calling it, attached to each
allocation by a dispatch mode) and by their size per token, so "3.0 KB/token made in levers.py backward" reads as one fp32 768-wide tensor per token.

The same history gives what the allocator reserved (`replay_reserved`): at the reserved peak, how much was
allocated, how much was freed but still waiting for another stream's work (a block NCCL used, say), and how much
was free but too fragmented for the requests made.

Under torchrun (`torchrun --nproc_per_node 2 -m minigpt.benchmarks.memory_profile --out DIR -- ...
parallel.context=2`) every rank profiles its own GPU in the same step and writes memory_profile.rank<r>.*.

Writes memory_profile.json and memory_profile.md to --out (and with --snapshot the raw allocator snapshot,
for https://pytorch.org/memory_viz). The replay (`replay_peak`, `replay_reserved`, `group_live`) is plain Python
over the snapshot's event list, tested on CPU; recording needs a CUDA GPU.
Exit codes: 0 done, 1 no GPU or a failure, 2 bad arguments or settings, 3 out of memory.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import pickle
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

GIB = float(1 << 30)
OUR_CODE = ("/minigpt/", "/minigpt_kernels/", "/kernels/")  # frames that say where in our code a tensor was made
# a torch op's name in a C++ frame: autograd nodes, ATen natives and ops
CPP_OP = re.compile(r"torch::autograd::generated::(\w+)::apply|at::native::(?:\w+::)?(\w+)\(|at::_ops::(\w+)::")


# ---------------------------------------------------------------------------------------------------------------
# the replay (pure Python: a snapshot's events in, the live allocations at the peak out)
# ---------------------------------------------------------------------------------------------------------------
def replay_peak(events: Sequence[dict[str, Any]], baseline: int) -> tuple[int, list[dict[str, Any]], int]:
    """(peak bytes, allocations alive at the peak, bytes still alive from before the recording at the peak).

    `events` are one device's trace entries in order ('alloc', 'free_completed', others ignored); `baseline` is
    the memory allocated when recording began. A free of an address the trace never allocated releases memory
    from before the recording (e.g. last step's gradients).
    """
    def walk(stop: int | None) -> tuple[int, int, dict[int, dict[str, Any]], int, int]:
        live: dict[int, dict[str, Any]] = {}
        old, current, peak, at = baseline, baseline, baseline, -1
        for i, e in enumerate(events[:stop] if stop is not None else events):
            if e["action"] == "alloc":
                live[e["addr"]] = e
                current += e["size"]
            elif e["action"] == "free_completed":
                if live.pop(e["addr"], None) is None:
                    old -= e["size"]
                current -= e["size"]
            else:
                continue
            if current > peak:
                peak, at = current, i
        return peak, at, live, old, current

    peak, at, _, _, _ = walk(None)
    if at < 0:  # nothing in the trace went above the baseline
        return baseline, [], baseline
    _, _, live, old, current = walk(at + 1)
    assert current == peak
    return peak, list(live.values()), old


SEGMENT_GROWS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def replay_reserved(events: Sequence[dict[str, Any]], reserved_baseline: int, allocated_baseline: int
                    ) -> dict[str, Any]:
    """What the allocator reserved over the trace, and what that memory held at its peak.

    Reserved memory grows by 'segment_alloc' (or 'segment_map', with expandable segments) and shrinks by
    'segment_free' ('segment_unmap'). A block the program has freed ('free_requested') returns to the allocator
    only at 'free_completed'; in between it still waits for work on another stream that used it (record_stream,
    e.g. NCCL's), and the allocator cannot hand it out. At the reserved peak the memory therefore splits into
    allocated (as torch.cuda.memory_allocated counts it: up to 'free_requested'), pending (freed, still waiting)
    and free but unusable for the requests made (fragmentation). Returns those bytes at the peak (the first moment
    it is reached) and the pending blocks themselves."""
    reserved = peak = reserved_baseline
    allocated, at = allocated_baseline, -1
    pending: dict[int, dict[str, Any]] = {}
    snapshot: tuple[int, dict[int, dict[str, Any]]] = (allocated, {})
    for i, e in enumerate(events):
        action = e["action"]
        if action in SEGMENT_GROWS:
            reserved += SEGMENT_GROWS[action] * e["size"]
            if reserved > peak:
                peak, at, snapshot = reserved, i, (allocated, dict(pending))
        elif action == "alloc":
            allocated += e["size"]
        elif action == "free_requested":  # torch's allocated stat drops here; the block may still be pending
            allocated -= e["size"]
            pending[e["addr"]] = e
        elif action == "free_completed":
            pending.pop(e["addr"], None)
    allocated_then, pending_then = snapshot
    pending_bytes = sum(e["size"] for e in pending_then.values())
    return {"peak_reserved": peak, "at_event": at, "allocated": allocated_then,
            "pending_free": pending_bytes, "unused": peak - allocated_then,
            "fragmented": peak - allocated_then - pending_bytes, "pending_blocks": list(pending_then.values())}


def describe(entry: dict[str, Any]) -> tuple[str, str]:
    """(where in our code, torch op) of one allocation: from the label OpLabels attached ('op @ where'), else
    from its recorded stack (innermost frame first); '' when not found."""
    label = entry.get("user_metadata") or ""
    if " @ " in label:
        op, _, where = label.partition(" @ ")
        return where, op
    where, op = "", ""
    for f in entry.get("frames", []):
        name, filename = f.get("name", ""), f.get("filename", "")
        if not op and (m := CPP_OP.search(name)):
            op = next(g for g in m.groups() if g)
        if not where and any(root in filename for root in OUR_CODE):
            where = f"{Path(filename).name}:{f.get('line', 0)} {name}"
        if where:
            break
    return where or "(outside minigpt: torch internals)", op


def group_live(live: Sequence[dict[str, Any]], tokens: int) -> list[dict[str, Any]]:
    """The live allocations grouped by (where, op, KB per token), largest total first."""
    groups: dict[tuple[str, str, float], list[int]] = defaultdict(list)
    for e in live:
        where, op = describe(e)
        groups[(where, op, round(e["size"] / tokens / 1024, 2))].append(e["size"])
    rows = [{"where": w, "op": op, "kb_per_token_each": kb, "count": len(sizes), "gib": sum(sizes) / GIB,
             "kb_per_token": sum(sizes) / tokens / 1024} for (w, op, kb), sizes in groups.items()]
    return sorted(rows, key=lambda r: -r["gib"])


def report_table(result: dict[str, Any]) -> str:
    """Markdown: the phases, the allocations alive at the peak, then what the reserved memory held at its peak."""
    from minigpt.files import markdown_table

    tokens = result["tokens"]
    rank = f" (rank {result['rank']} of {result['world']})" if result.get("world", 1) > 1 else ""
    lines = [f"# GPU memory of one training step{rank}: {result['device']}, {tokens:,} tokens per step, commit "
             f"{result['commit']}\n", f"overrides: `{' '.join(result['overrides'])}`\n",
             markdown_table(["phase", "peak allocated GiB", "KB/token", "time s"],
                            [[p["phase"], f"{p['peak_gib']:.2f}", f"{p['peak_gib'] * GIB / tokens / 1024:.2f}",
                              f"{p['time_s']:.1f}"] for p in result["phases"]]),
             f"\nAt the step's peak ({result['peak_gib']:.2f} GiB by the replay, "
             f"{result['max_memory_allocated_gib']:.2f} GiB by torch.cuda.max_memory_allocated):\n",
             markdown_table(["where it was made", "op", "KB/token each", "count", "GiB", "KB/token"],
                            [["live before the step (parameters, optimizer state, ...)", "", "", "",
                              f"{result['before_step_gib']:.2f}",
                              f"{result['before_step_gib'] * GIB / tokens / 1024:.2f}"]] +
                            [[g["where"], g["op"], f"{g['kb_per_token_each']:.2f}", g["count"], f"{g['gib']:.2f}",
                              f"{g['kb_per_token']:.2f}"] for g in result["live_at_peak"]])]
    r = result.get("reserved")
    if r:
        lines += [f"\nReserved at its peak in the step: {r['peak_reserved_gib']:.2f} GiB by the replay "
                  f"({result['max_memory_reserved_gib']:.2f} by torch.cuda.max_memory_reserved): allocated "
                  f"{r['allocated_gib']:.2f}, freed but waiting for another stream's work {r['pending_free_gib']:.2f}, "
                  f"free but not used for the requests made (fragmentation) {r['fragmented_gib']:.2f}.\n"]
        if r["pending_at_peak"]:
            lines += ["Freed and waiting at that moment:\n",
                      markdown_table(["where it was made", "op", "KB/token each", "count", "GiB", "KB/token"],
                                     [[g["where"], g["op"], f"{g['kb_per_token_each']:.2f}", g["count"],
                                       f"{g['gib']:.2f}", f"{g['kb_per_token']:.2f}"] for g in r["pending_at_peak"]])]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# the measurement (CUDA)
# ---------------------------------------------------------------------------------------------------------------
def our_frame() -> str:
    """'file:line function' of the innermost caller in minigpt/ or the kernel package (this file excluded)."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if any(root in name for root in OUR_CODE) and not name.endswith("memory_profile.py"):
            return f"{Path(name).name}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "(autograd engine)"


def op_labels() -> Any:
    """A TorchDispatchMode that labels each allocation with the op making it and our code calling it ('op @
    where', the allocator's per-allocation metadata). Used instead of recorded Python stacks: capturing those
    inside torch.utils.checkpoint's recompute failed on torch 2.11 (SystemError from the op being recorded; the
    chunked levers used it until 93f305c)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpLabels(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            previous = torch.cuda.memory._get_memory_metadata()
            torch.cuda.memory._set_memory_metadata(f"{func.overloadpacket.__name__} @ {our_frame()}")
            try:
                return func(*args, **(kwargs or {}))
            finally:
                torch.cuda.memory._set_memory_metadata(previous)

    return OpLabels()


def _step(t: Any, x: Any, y: Any, ids: Any, phases: list[dict[str, Any]] | None) -> None:
    """One training step on (x, y, document ids or None) as train_step takes it; with `phases`, each phase's peak and time appended."""
    import torch

    def mark(name: str, t0: float) -> float:
        torch.cuda.synchronize()
        if phases is not None:
            phases.append({"phase": name, "peak_gib": torch.cuda.max_memory_allocated() / GIB,
                           "time_s": time.perf_counter() - t0})
        torch.cuda.reset_peak_memory_stats()
        return time.perf_counter()

    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=t.dtype, enabled=t.dtype != torch.float32):
        loss = t.forward.loss(x, y, ids)
    t0 = mark("forward + loss", t0)
    t.scaler.scale(loss).backward()
    t0 = mark("backward", t0)
    t.scaler.step(t.optimizer)
    t.scaler.update()
    t.optimizer.zero_grad(set_to_none=True)
    mark("optimizer", t0)


def profile(overrides: list[str], warmup_tokens: int, cpp_stacks: bool, snapshot_path: Path | None
            ) -> dict[str, Any]:
    """One rank's profile; under torchrun (parallel.context=K) every rank profiles its own GPU in the same step."""
    import torch

    from minigpt.compose import compose
    from minigpt.cuda_allocator import use_allocator_settings
    from minigpt.distributed.mesh import Mesh
    from minigpt.distributed.sharding import shard_batch
    from minigpt.metrics import git_commit
    from minigpt.summary import RunSummary
    from minigpt.train import build, to_device

    cfg = compose([*overrides, "logger=none", "save_checkpoints=false", "eval_batches=0"], run_dir=".")
    if cfg.torch_device().type != "cuda":
        raise RuntimeError("the memory profile records the CUDA caching allocator: it needs a CUDA GPU")
    use_allocator_settings(cfg.cuda_alloc_conf)  # as the trainer does, before CUDA starts
    mesh = Mesh.setup(cfg.parallel.context, "cuda")  # under torchrun (the caller joined the group), else one process
    t = build(cfg, {}, RunSummary(status="running"), mesh)
    x, y, ids = to_device(shard_batch(t.mesh, t.data, "train", 0, cfg.batch_size), t.device)
    # the warm-up makes the optimizer state, grows the allocator and compiles the regions for every shape the
    # measured step uses (compiling while the allocator history is recorded failed on torch 2.11: a SystemError
    # from the compiled loss inside a recomputed chunk), so by default it is a whole step at the full length
    w = warmup_tokens or x.shape[1]
    _step(t, x[:, :w], y[:, :w], None if ids is None else ids[:, :w], None)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline, reserved_baseline = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    labels = not cpp_stacks and hasattr(torch.cuda.memory, "_set_memory_metadata")
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="all" if cpp_stacks else None,
                                             stacks="all")
    phases: list[dict[str, Any]] = []
    step_peak = 0.0
    try:
        with op_labels() if labels else contextlib.nullcontext():
            _step(t, x, y, ids, phases)
        step_peak = max(p["peak_gib"] for p in phases)
        reserved_peak = torch.cuda.max_memory_reserved()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    if snapshot_path is not None:
        snapshot_path.write_bytes(pickle.dumps(snap))
    events = snap["device_traces"][torch.cuda.current_device()]
    peak, live, old = replay_peak(events, baseline)
    reserved = replay_reserved(events, reserved_baseline, baseline)
    tokens = x.numel()
    return {"device": torch.cuda.get_device_name(), "commit": git_commit(), "overrides": overrides,
            "rank": mesh.rank, "world": mesh.world, "tokens": tokens, "phases": phases,
            "max_memory_allocated_gib": step_peak, "peak_gib": peak / GIB, "before_step_gib": old / GIB,
            "trace_events": len(events), "live_at_peak": group_live(live, tokens),
            "max_memory_reserved_gib": reserved_peak / GIB,
            "reserved": {**{f"{k}_gib": reserved[k] / GIB for k in ("peak_reserved", "allocated", "pending_free",
                                                                      "unused", "fragmented")},
                         "pending_at_peak": group_live(reserved["pending_blocks"], tokens)}}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                usage="minigpt-memory --out DIR [options] -- <trainer overrides>")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--warmup-tokens", type=int, default=0,
                   help="the warm-up step's tokens per sequence (0 = the full length; fewer only with compile=false)")
    p.add_argument("--cpp-stacks", action="store_true",
                   help="record Python and C++ stacks instead of labelling allocations by op (failed on torch 2.11 "
                        "inside recomputed chunks)")
    p.add_argument("--snapshot", action="store_true", help="also write the raw snapshot (memory_snapshot.pickle)")
    args = p.parse_args(own)
    if args.warmup_tokens < 0:
        p.error(f"--warmup-tokens={args.warmup_tokens}: must be >= 0")

    import torch

    from minigpt.config import ConfigError
    from minigpt.files import WriteError, atomic_write_text

    from minigpt.distributed.process import TorchrunProcess, env_rank, launched_world_size

    # under torchrun each rank writes its own files (memory_profile.rank<r>.*); rank 0 prints its table
    suffix = f".rank{env_rank()}" if launched_world_size() > 1 else ""
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        with TorchrunProcess() as process:
            result = profile(overrides, args.warmup_tokens, args.cpp_stacks,
                             args.out / f"memory_snapshot{suffix}.pickle" if args.snapshot else None)
            table = report_table(result)
            atomic_write_text(args.out / f"memory_profile{suffix}.json", json.dumps(result, indent=1))
            atomic_write_text(args.out / f"memory_profile{suffix}.md", table)
            process.ok = True
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError:
        print(f"error: out of memory at {' '.join(overrides)}: profile a shorter seq_len or add levers",
              file=sys.stderr)
        return 3
    except (RuntimeError, OSError, WriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

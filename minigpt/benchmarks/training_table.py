"""The training table: runs' summaries side by side, flash over sdpa at each setting.

    python -m minigpt.benchmarks.training_table outputs/*        # prints a markdown table
"""
from __future__ import annotations

import sys
from pathlib import Path

from minigpt.files import markdown_table
from minigpt.summary import SUMMARY_FILE, RunSummary


def training_table(summaries: list[RunSummary]) -> str:
    """One row per run (setting, attention); tokens/s, step time, MFU, memory, and flash / sdpa at that setting."""
    def setting(s: RunSummary) -> tuple:
        return s.seq_len, s.batch_size, s.world_size, s.context_parallel, s.compile, tuple(sorted(s.levers.items()))

    tokens = {(setting(s), s.attention): s.tokens_per_s for s in summaries}
    rows = []
    for s in sorted(summaries, key=lambda s: (setting(s), s.attention)):
        sdpa, flash = tokens.get((setting(s), "sdpa")), tokens.get((setting(s), "flash"))
        ratio = f"{flash / sdpa:.3f}" if s.attention == "flash" and flash and sdpa else None
        gpus = f"{s.world_size} (cp {s.context_parallel})" if s.world_size > 1 else "1"
        rows.append([s.attention, f"{s.seq_len:,}", s.batch_size, gpus, "on" if s.compile else "off", s.status,
                     None if s.tokens_per_s is None else f"{s.tokens_per_s:,.0f}",
                     None if s.step_time_s is None else f"{s.step_time_s:.3f} s",
                     None if s.mfu is None else f"{100 * s.mfu:.1f}%", f"{s.peak_allocated_gib:.1f} GiB",
                     None if s.compile_time_s is None else f"{s.compile_time_s:.0f} s", ratio])
    first = summaries[0] if summaries else None
    head = (f"{first.device}, torch {first.torch}, triton {first.triton}, commit {first.commit}\n\n" if first else "")
    return head + markdown_table(["attention", "seq_len", "batch", "GPUs", "compile", "status", "tokens/s", "step time", "MFU",
                                  "peak allocated", "compile time", "flash/sdpa"], rows)


def main(argv: list[str] | None = None) -> int:
    dirs = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    summaries = [RunSummary.read(d / SUMMARY_FILE) for d in dirs if (d / SUMMARY_FILE).exists()]
    print(training_table(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())

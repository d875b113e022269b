"""The memory profile's replay of an allocator trace (CPU: synthetic traces; recording itself needs a GPU)."""
import pytest

from minigpt.benchmarks.memory_profile import describe, group_live, replay_peak, report_table

OURS = {"filename": "/x/site-packages/minigpt/levers.py", "line": 118, "name": "backward"}
MODEL = {"filename": "/x/minigpt/model.py", "line": 40, "name": "apply_rotary"}
TORCH = {"filename": "/x/torch/autograd/__init__.py", "line": 9, "name": "backward"}
CPP = {"filename": "", "line": 0, "name": "torch::autograd::generated::SliceBackward0::apply(...)"}


def ev(action, addr, size, *frames):
    return {"action": action, "addr": addr, "size": size, "frames": list(frames)}


def test_replay_finds_the_peak_and_what_is_alive_then():
    events = [ev("alloc", 1, 100, MODEL), ev("alloc", 2, 300, CPP, TORCH, OURS), ev("segment_alloc", 9, 4096),
              ev("free_requested", 1, 100), ev("free_completed", 1, 100), ev("alloc", 3, 50, MODEL),
              ev("free_completed", 2, 300), ev("alloc", 4, 200, MODEL)]
    peak, live, old = replay_peak(events, baseline=1000)
    assert peak == 1000 + 100 + 300  # after the second alloc; later totals are lower (1350, 1050, 1250)
    assert sorted(e["addr"] for e in live) == [1, 2]
    assert old == 1000


def test_replay_counts_frees_of_memory_from_before_the_recording():
    events = [ev("free_completed", 77, 400), ev("alloc", 1, 100, MODEL), ev("alloc", 2, 450, MODEL)]
    peak, live, old = replay_peak(events, baseline=1000)
    assert (peak, old) == (1150, 600) and len(live) == 2
    peak, live, old = replay_peak([ev("free_completed", 77, 400)], baseline=1000)
    assert (peak, live, old) == (1000, [], 1000)  # the peak is before the trace's first event


def test_describe_names_our_frame_and_the_torch_op():
    assert describe(ev("alloc", 1, 1, CPP, TORCH, OURS, MODEL)) == ("levers.py:118 backward", "SliceBackward0")
    assert describe(ev("alloc", 1, 1, TORCH)) == ("(outside minigpt: torch internals)", "")
    labelled = {**ev("alloc", 1, 1, TORCH), "user_metadata": "mm @ model.py:60 forward"}
    assert describe(labelled) == ("model.py:60 forward", "mm")


def test_our_frame_finds_the_innermost_minigpt_caller():
    from minigpt.benchmarks.memory_profile import our_frame
    from minigpt.levers import chunked

    seen = []
    chunked(lambda x: seen.append(our_frame()) or x, __import__("torch").zeros(1, 4, 2), 0, [])
    assert seen[0].startswith("levers.py:") and seen[0].endswith(" chunked")


def test_group_live_sums_by_place_and_size_per_token():
    tokens = 1024
    live = [ev("alloc", i, 3 * 1024 * tokens, OURS) for i in range(3)] + [ev("alloc", 9, 1536 * tokens, MODEL)]
    rows = group_live(live, tokens)
    assert [(r["where"], r["count"], r["kb_per_token_each"]) for r in rows] == \
        [("levers.py:118 backward", 3, 3.0), ("model.py:40 apply_rotary", 1, 1.5)]
    assert rows[0]["kb_per_token"] == pytest.approx(9.0)
    result = {"device": "X", "commit": "abc", "overrides": ["seq_len=1024"], "tokens": tokens,
              "phases": [{"phase": "backward", "peak_gib": 1.0, "time_s": 2.0}], "peak_gib": 2.0,
              "max_memory_allocated_gib": 2.0, "before_step_gib": 0.5, "live_at_peak": rows}
    table = report_table(result)
    assert "| levers.py:118 backward |  | 3.00 | 3 |" in table and "live before the step" in table


def test_replay_reserved_splits_the_reserved_peak_into_allocated_pending_and_fragmented():
    from minigpt.benchmarks.memory_profile import replay_reserved

    nccl_used = {**ev("alloc", 2, 300, OURS), "stream": 7}
    events = [ev("segment_map", 0, 1000), ev("alloc", 1, 400, MODEL), nccl_used,
              ev("free_requested", 2, 300),       # freed by the program; NCCL's stream still uses it
              ev("alloc", 3, 500, MODEL),         # cannot reuse block 2: the segment grows
              ev("segment_map", 0, 600),
              ev("free_requested", 1, 400), ev("free_completed", 1, 400), ev("free_completed", 2, 300),
              ev("segment_unmap", 0, 800)]
    r = replay_reserved(events, reserved_baseline=200, allocated_baseline=100)
    assert r["peak_reserved"] == 200 + 1000 + 600
    assert r["allocated"] == 100 + 400 + 500  # torch's count: block 2 left it at free_requested
    assert r["pending_free"] == 300 and [b["addr"] for b in r["pending_blocks"]] == [2]
    assert r["fragmented"] == r["peak_reserved"] - r["allocated"] - r["pending_free"] == 500
    assert r["unused"] == 800


def test_replay_reserved_without_segment_events_keeps_the_baseline():
    from minigpt.benchmarks.memory_profile import replay_reserved

    r = replay_reserved([ev("alloc", 1, 10, MODEL), ev("free_requested", 1, 10), ev("free_completed", 1, 10)],
                        reserved_baseline=64, allocated_baseline=32)
    assert (r["peak_reserved"], r["allocated"], r["pending_free"], r["at_event"]) == (64, 32, 0, -1)


def test_the_report_says_what_the_reserved_peak_held():
    reserved = {"peak_reserved_gib": 21.0, "allocated_gib": 6.0, "pending_free_gib": 12.5, "unused_gib": 15.0,
                "fragmented_gib": 2.5, "pending_at_peak": [{"where": "ring_attention.py:120 send", "op": "empty_like",
                                                            "kb_per_token_each": 3.0, "count": 4, "gib": 12.5,
                                                            "kb_per_token": 100.0}]}
    result = {"device": "GPU", "commit": "abc", "overrides": ["seq_len=8"], "tokens": 8, "rank": 1, "world": 2,
              "phases": [{"phase": "backward", "peak_gib": 1.0, "time_s": 0.1}], "peak_gib": 1.0,
              "max_memory_allocated_gib": 1.0, "before_step_gib": 0.5, "live_at_peak": [],
              "max_memory_reserved_gib": 21.0, "reserved": reserved}
    md = report_table(result)
    assert "(rank 1 of 2)" in md
    assert "freed but waiting for another stream's work 12.50" in md and "fragmentation) 2.50" in md
    assert "ring_attention.py:120 send" in md

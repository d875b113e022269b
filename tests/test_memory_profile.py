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

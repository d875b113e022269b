"""The headline figures (minigpt/figures.py) on small synthetic data: files written, one colour and one marker per
variant, an out-of-memory mark where a grid length failed, lengths off the grid left out, derived bars apart."""
import json

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from minigpt import figures  # noqa: E402


def _trial(variant, n, status="ok", peak=None, tps=None, kind="measured"):
    return {"variant": variant, "seq_len": n, "status": status, "peak_allocated_gib": peak, "tokens_per_s": tps,
            "kind": kind}


@pytest.fixture
def data_file(tmp_path):
    data = {"gpu": "Fake GPU", "gpu_memory_gib": 10.0, "model": "tiny", "groups": [
        {"name": "a", "commit": "abc1234", "date": "2030-01-01", "gpus": 1, "searched_to_oom": True,
         "trials": [_trial("naive", 1024, peak=1.0, tps=900), _trial("naive", 2048, peak=4.0, tps=800),
                    _trial("naive", 3072, peak=9.0, tps=700),            # off the grid: tables only
                    _trial("naive", 4096, "oom", peak=9.9),
                    _trial("flash", 1024, peak=0.5, tps=1000), _trial("flash", 4096, peak=2.0, tps=950),
                    _trial("flash", 8192, "oom", peak=9.8)]},
        {"name": "b", "commit": "def5678", "date": "2030-01-02", "gpus": 1, "searched_to_oom": False,
         "trials": [_trial("flash+levers", 8192, peak=1.0, tps=500),
                    _trial("flash+levers@L1", 65536, peak=3.0, tps=100, kind="probe"),
                    _trial("flash+levers", 65536, peak=7.0, tps=60, kind="derived")]},
        {"name": "c", "commit": "0123abc", "date": "2030-01-02", "gpus": 2, "searched_to_oom": False,
         "trials": [_trial("flash+levers", 16384, peak=1.5, tps=900)]},
    ]}
    path = tmp_path / "data.json"
    path.write_text(json.dumps(data))
    return path


def test_cli_writes_three_pictures_and_their_readme(data_file, tmp_path):
    out = tmp_path / "figs"
    assert figures.main(["--data", str(data_file), "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["README.md", "longest_context_Fake_GPU.png", "memory_vs_seq_len_Fake_GPU.png",
                     "tokens_per_s_vs_seq_len_Fake_GPU.png"]
    for name in names[1:]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    readme = (out / "README.md").read_text()
    assert "abc1234" in readme and "2030-01-01" in readme
    # naive trained 1K and 2K, ran out at 4K: nothing missing; flash never ran 2K
    assert "| naive | 1K, 2K | 4K | – |" in readme
    assert "| flash | 1K, 4K | 8K | 2K |" in readme


def test_missing_data_file_exits_2(tmp_path):
    assert figures.main(["--data", str(tmp_path / "none.json"), "--out", str(tmp_path)]) == 2


def test_series_get_distinct_colours_and_markers(data_file):
    meta, points = figures.load(data_file)
    order = figures.series_order(points)
    assert order == ["naive", "flash", "flash+levers", "flash+levers, 2 GPUs (context 2)"]  # probes left out
    style = figures.styles(order)
    assert len({c for c, _ in style.values()}) == len(order)
    assert len({m for _, m in style.values()}) == len(order)
    assert figures.OOM_MARKER not in {m for _, m in style.values()}
    assert len(set(figures.COLORS)) == len(figures.COLORS) and len(set(figures.MARKERS)) == len(figures.MARKERS)
    with pytest.raises(ValueError):
        figures.styles([f"v{i}" for i in range(len(figures.COLORS) + 1)])


@pytest.mark.parametrize("metric", ["memory", "tokens_per_s"])
def test_line_figure_marks_oom_and_keeps_to_the_grid(data_file, metric):
    meta, points = figures.load(data_file)
    fig = figures.plot_vs_seq_len(meta, points, metric)
    ax = fig.axes[0]
    lines = [ln for ln in ax.get_lines() if ln.get_linestyle() != "--"]  # not the GPU-memory line
    ooms = [ln for ln in lines if ln.get_marker() == figures.OOM_MARKER]
    assert len(ooms) == 2                                 # naive at 4K, flash at 8K
    assert sorted(ln.get_color() for ln in ooms) == sorted(figures.styles(figures.series_order(points))[s][0]
                                                           for s in ["naive", "flash"])
    xs = {x for ln in lines if ln.get_marker() != figures.OOM_MARKER for x in ln.get_xdata()}
    assert 3072 not in xs and all(figures.is_grid(int(x)) for x in xs)
    series_lines = [ln for ln in lines if ln.get_linestyle() == "-"]
    assert len({ln.get_color() for ln in series_lines}) == len(series_lines)
    assert len({ln.get_marker() for ln in series_lines}) == len(series_lines)
    # the legend sits right of the data, not on it
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1
    # provenance in the footer
    footer = " ".join(t.get_text() for t in fig.texts)
    assert "Fake GPU" in footer and "abc1234" in footer and "2030-01-01" in footer


def test_longest_context_bars_mark_derived_apart(data_file):
    meta, points = figures.load(data_file)
    fig = figures.plot_longest(meta, points)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["naive", "flash", "flash+levers", "flash+levers (derived)",
                      "flash+levers, 2 GPUs (context 2)"]
    bars = ax.patches
    widths = [b.get_width() for b in bars]
    assert widths == [3072, 4096, 8192, 65536, 16384]   # the longest that trained, on or off the grid
    hatches = [b.get_hatch() for b in bars]
    assert hatches[0] is None and hatches[1] is None    # searched to an OOM
    assert hatches[3] == "//" and hatches[2] == ".."    # derived, and only run at that length
    assert len({h for h in hatches}) == 3


def _sweep_dir(root, name, device="Fake GPU", commit="abc1234", world_size=1):
    """A minigpt-sweep output directory as the sweep writes it: results.json and each trial's summary.json."""
    d = root / name
    trials = []
    for variant, n, status, peak in [("sdpa", 1024, "ok", 1.0), ("sdpa", 2048, "ok", 2.0), ("sdpa", 4096, "oom", 9.9),
                                     ("flash+levers", 1024, "ok", 0.5), ("flash+levers@L1", 65536, "ok", 3.0)]:
        run_dir = f"trials/{variant}-n{n}"
        (d / run_dir).mkdir(parents=True)
        (d / run_dir / "summary.json").write_text(json.dumps(
            {"device": device, "commit": commit, "world_size": world_size, "model": "tiny", "n_params": 4.2e5,
             "torch": "9.9", "triton": "9.9"}))
        trials.append({"variant": variant, "seq_len": n, "status": status, "peak_allocated_gib": peak,
                       "tokens_per_s": 100.0, "step_time_s": 0.1, "n_layer": 1 if "@L" in variant else 12,
                       "run_dir": run_dir})
    derived = [{"variant": "flash+levers", "seq_len": 65536, "peak_allocated_gib": 7.0, "step_time_s": 2.0,
                "tokens_per_s": 32768.0, "n_layer": 12, "derived": True}]
    (d / "results.json").write_text(json.dumps({"header": f"sweep {name}", "trials": trials, "derived": derived}))
    return d


def test_data_from_sweep_directories(tmp_path):
    data = figures.from_sweeps([_sweep_dir(tmp_path, "grid")])
    assert (data["gpu"], data["model"], data["torch"]) == ("Fake GPU", "tiny (0.4M)", "9.9")
    (group,) = data["groups"]
    assert (group["commit"], group["gpus"], group["command"]) == ("abc1234", 1, "sweep grid")
    assert group["searched_to_oom"] is False  # flash+levers has no failure above its longest length
    kinds = {(t["variant"], t["seq_len"]): t["kind"] for t in group["trials"]}
    assert kinds[("sdpa", 4096)] == "measured" and kinds[("flash+levers@L1", 65536)] == "probe"
    assert kinds[("flash+levers", 65536)] == "derived"
    meta, points = figures.load_data(data)
    assert figures.grid_gaps(points)["sdpa"] == {"measured": [1024, 2048, 4096], "trained": [1024, 2048],
                                                 "first_oom": 4096, "missing": [], "searched": False}


def test_data_from_sweeps_of_two_gpu_kinds_is_refused(tmp_path):
    dirs = [_sweep_dir(tmp_path, "a"), _sweep_dir(tmp_path, "b", device="Other GPU")]
    with pytest.raises(ValueError, match="2 kinds of GPU"):
        figures.from_sweeps(dirs)
    with pytest.raises(ValueError, match="no results.json"):
        figures.from_sweeps([tmp_path])


def test_cli_from_sweep_writes_the_data_then_the_pictures_and_never_overwrites(tmp_path, capsys):
    sweep, data, out = _sweep_dir(tmp_path, "grid"), tmp_path / "data" / "grid.json", tmp_path / "figs"
    assert figures.main(["--from-sweep", str(sweep), "--data", str(data), "--out", str(out)]) == 0
    assert json.loads(data.read_text())["groups"][0]["name"] == "grid-abc1234"
    assert (out / "memory_vs_seq_len_Fake_GPU.png").is_file()
    assert "| sdpa | 1K, 2K | 4K |" in (out / "README.md").read_text()
    before = data.read_text()
    assert figures.main(["--from-sweep", str(sweep), "--data", str(data), "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err and data.read_text() == before


def test_from_sweep_leaves_out_trials_without_a_summary_and_names_groups_apart(tmp_path):
    a, b = _sweep_dir(tmp_path / "one", "grid"), _sweep_dir(tmp_path / "two", "grid")
    results = json.loads((a / "results.json").read_text())
    results["trials"].append({"variant": "sdpa", "seq_len": 8192, "status": "timeout", "run_dir": "trials/gone"})
    (a / "results.json").write_text(json.dumps(results))
    data = figures.from_sweeps([a, b])
    assert [g["name"] for g in data["groups"]] == ["grid-abc1234", "grid-abc1234-1"]
    first = data["groups"][0]["trials"]
    assert all(t["seq_len"] != 8192 for t in first) and sum(t["kind"] == "derived" for t in first) == 1


def test_another_gpus_readme_in_out_is_kept(tmp_path, data_file):
    out = tmp_path / "figs"
    out.mkdir()
    (out / "README.md").write_text("# Figures: gpt2-small on Some Other GPU\n")
    figures.main(["--data", str(data_file), "--out", str(out)])
    assert (out / "README.md").read_text() == "# Figures: gpt2-small on Some Other GPU\n"
    assert (out / "README_Fake_GPU.md").read_text().startswith("# Figures: tiny on Fake GPU")



def test_a_lone_training_run_joins_as_its_own_group(tmp_path):
    run = tmp_path / "scale_n2"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(
        {"status": "ok", "device": "Fake GPU", "commit": "fedcba9", "world_size": 2, "context_parallel": 2,
         "batch_size": 1, "grad_accum": 1,
         "seq_len": 1 << 20, "attention": "flash", "compile": True, "peak_allocated_gib": 16.8, "tokens_per_s": 14e3,
         "step_time_s": 74.9, "n_layer": 12, "model": "tiny", "n_params": 4.2e5,
         "levers": {"recompute_every": 1, "recompute_dtype": "bfloat16", "offload": True, "keep_attention": True,
                    "mlp_chunk": 65536, "loss_chunk": 4096}}))
    data = figures.from_sweeps([_sweep_dir(tmp_path, "grid"), run])
    lone = data["groups"][-1]
    assert (lone["commit"], lone["gpus"], lone["searched_to_oom"]) == ("fedcba9", 2, False)
    (trial,) = lone["trials"]
    assert (trial["variant"], trial["seq_len"], trial["status"], trial["kind"]) == \
        ("flash+levers+offload+keepattn+compile", 1 << 20, "ok", "measured")
    _, points = figures.load_data(data)
    assert figures.series_order(points)[-1] == "flash+levers+offload+keepattn+compile, 2 GPUs (context 2)"
    summary = json.loads((run / "summary.json").read_text())
    for change, why in (({"status": "interrupted"}, "did not finish ok"), ({"batch_size": 2}, "not batch 1"),
                        ({"context_parallel": 1}, "data parallel"),
                        ({"levers": {**summary["levers"], "recompute_every": 2}}, "no variant name")):
        (run / "summary.json").write_text(json.dumps({**summary, **change}))
        with pytest.raises(ValueError, match=why):
            figures.from_sweeps([run])


def test_series_run_from_least_to_most_memory_saved():
    points = [figures.Point(v, 1, 1024, "ok", "measured", True, 1.0, 1.0, "c", "d")
              for v in ["flash+levers", "naive+compile", "naive", "flash", "flash+levers+offload+keepattn",
                        "flash+compile", "made-up"]]
    assert figures.series_order(points) == ["naive", "flash", "made-up", "naive+compile", "flash+compile",
                                            "flash+levers", "flash+levers+offload+keepattn"]

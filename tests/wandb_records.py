"""Read back what a W&B offline run wrote, for tests.

wandb keeps an offline run in a `.wandb` file of framed protobuf `Record`s; wandb 0.31 no longer ships a Python
reader, so minigpt/wandb_offline.py's decodes it.
"""
from __future__ import annotations

import glob
from pathlib import Path


def read_records(path: str | Path) -> list:
    """The protobuf `Record`s of a .wandb file (minigpt.wandb_offline reads and frames them)."""
    from minigpt.wandb_offline import parse_records, read_payloads

    return parse_records(read_payloads(Path(path).read_bytes(), str(path)))


def offline_run(run_dir: str | Path) -> dict:
    """history keys, summary keys and config keys of the single offline run under run_dir/wandb."""
    files = glob.glob(str(Path(run_dir) / "wandb" / "offline-run-*" / "*.wandb"))
    assert len(files) == 1, f"expected one offline run in {run_dir}, found {files}"
    out = {"history": set(), "summary": {}, "config": set(), "name": None, "group": None, "exit_code": None}
    for r in read_records(files[0]):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            out["history"] |= {i.key or "/".join(i.nested_key) for i in r.history.item}
        elif kind == "summary":
            out["summary"].update({i.key or "/".join(i.nested_key): i.value_json for i in r.summary.update})
        elif kind == "config":
            out["config"] |= {i.key or "/".join(i.nested_key) for i in r.config.update}
        elif kind == "run":
            out["name"], out["group"] = r.run.display_name, r.run.run_group
            out["config"] |= {i.key or "/".join(i.nested_key) for i in r.run.config.update}
        elif kind == "exit":
            out["exit_code"] = r.exit.exit_code
    return out

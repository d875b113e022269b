"""Read back what a W&B offline run wrote, for tests.

wandb keeps an offline run in a `.wandb` file: a 7-byte header (":W&B", magic, version) followed by
LevelDB-log framed records (crc32c:4, length:2, type:1, payload) in 32 KiB blocks, each payload a
protobuf `Record`. wandb 0.31 no longer ships a Python reader, so this small one decodes it.
"""
from __future__ import annotations

import glob
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

_BLOCK, _HEADER, _FRAME = 32768, 7, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: str | Path) -> list:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pending, pos = [], b"", _HEADER
    while pos + _FRAME <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _FRAME:  # the block's tail is zero padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _FRAME])
        payload = data[pos + _FRAME : pos + _FRAME + length]
        pos += _FRAME + length
        if kind == 0 and length == 0:
            break
        pending = payload if kind in (_FULL, _FIRST) else pending + payload
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


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

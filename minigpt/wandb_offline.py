"""W&B offline runs as files: which of them a hand-off carries, and one run published into results/.

wandb 0.31 writes an offline run into `<dir>/wandb/offline-run-<date>_<time>-<id>/`:

    run-<id>.wandb    every record of the run (config, metadata, history, summary, console output): what
                      `wandb sync` replays
    files/            the files its records name: requirements.txt, output.log, the media of tables and images
    logs/             W&B's debug logs (debug-core.log a symlink into ~/.cache/wandb); tmp/ (empty)

beside the symlinks `wandb/latest-run`, `wandb/debug.log` and `wandb/debug-internal.log`. The run is its .wandb file
and files/ (run_folder says which paths those are); the logs, tmp/ and the symlinks stay behind.

The .wandb file is a 7-byte header (":W&B", magic 0xBEE1, version 0) then LevelDB-log frames in blocks of 32 KiB
(the header counts in the first): crc32 (zlib's, seeded with the crc of the type byte), length (2 bytes), type
(full, first, middle, last), payload; a block's tail too short for a frame's header is zeros. The payloads joined
are protobuf `Record`s.

publish_run copies a run into results/<subject>/wandb_offline/, all `wandb sync` needs (it replays the .wandb file
and uploads the files/ its records name), with its machine paths rewritten: the recipe's directory dropped (paths
relative to it, as everywhere in results/; also as it was on the machine that wrote the run, from the environment
record's root), any other absolute path (or a Windows drive's) cut to its last name; URLs stay. W&B writes them
into the .wandb file (the run record's config: run_dir, ckpt_dir, data.cache_dir; the environment record: the
command's arguments, the W&B directory, the Python executable; the summary: the checkpoint's path; the console
output's records), files/output.log (the console output) and logs/ (left out); offline, no files/wandb-metadata.json
or config.yaml is written. What the records say of the machine and its user beyond paths (host, user name, e-mail,
disks, GPU serials: PRIVATE_FIELDS) is dropped. A .wandb file whose last frame was cut short (a run stopped while
writing) is read up to it.
"""
from __future__ import annotations

import os
import re
import shutil
import struct
import zlib
from pathlib import Path, PurePath

from google.protobuf.message import Message

RUN_NAME = re.compile(r"offline-run-.+")
PUBLISHED_DIR = "wandb_offline"  # results/<subject>/wandb_offline/offline-run-*/
RUN_BYTES = 1_000_000  # a published run's most bytes (the results/ rules: tests/test_results_rules.py)
HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK, FRAME = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
# a path into a home, root, temporary or work folder, or (in text) a Windows drive: what results/ may not hold
MACHINE_DIRS = r"/home/|/root/|/tmp/|/work/|/Users/"
MACHINE_PATH = MACHINE_DIRS + r"|(?<![A-Za-z0-9])[A-Za-z]:\\"
PATH_TOKEN = re.compile(r"[^\s\"'`<>|,;=(){}\[\]]+")


class PublishError(RuntimeError):
    """A run that cannot be published as it is; the message says why."""


def run_folder(rel: PurePath) -> PurePath | None:
    """The offline run folder (`.../wandb/offline-run-*`) whose .wandb file or files/ `rel` is in, else None."""
    parts = rel.parts
    for i in range(len(parts) - 2):
        if parts[i] == "wandb" and RUN_NAME.fullmatch(parts[i + 1]):
            rest = parts[i + 2:]
            if (len(rest) == 1 and rest[0].endswith(".wandb")) or (len(rest) > 1 and rest[0] == "files"):
                return PurePath(*parts[: i + 2])
    return None


# --------------------------------------------------------------------------------------------
# the .wandb file
# --------------------------------------------------------------------------------------------
def read_payloads(data: bytes, name: str = "the .wandb file") -> list[bytes]:
    """The records' payloads of a .wandb file's bytes; PublishError for a damaged one."""
    if data[: len(HEADER)] != HEADER:
        raise PublishError(f"{name}: not a W&B run file (its header is {data[:7]!r})")
    payloads, pending, pos = [], b"", len(HEADER)
    while pos + FRAME <= len(data):
        left = BLOCK - pos % BLOCK
        if left < FRAME:  # the block's zero tail
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + FRAME])
        if kind == 0 and length == 0:  # zeros: the end of what was written
            break
        chunk = data[pos + FRAME : pos + FRAME + length]
        if len(chunk) != length:  # the last frame cut short: a run stopped while writing; what came before stands
            break
        if crc != zlib.crc32(chunk, zlib.crc32(bytes([kind]))):
            raise PublishError(f"{name}: a damaged record at byte {pos}")
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            payloads.append(pending)
        pos += FRAME + length
    return payloads


def frame_payloads(payloads: list[bytes]) -> bytes:
    """A .wandb file's bytes holding these payloads, framed as W&B (and LevelDB) frame them."""
    out = bytearray(HEADER)
    for payload in payloads:
        first = True
        while True:
            left = BLOCK - len(out) % BLOCK
            if left < FRAME:
                out += bytes(left)
                left = BLOCK
            chunk, payload = payload[: left - FRAME], payload[left - FRAME :]
            kind = (FULL if first else LAST) if not payload else (FIRST if first else MIDDLE)
            out += struct.pack("<IHB", zlib.crc32(chunk, zlib.crc32(bytes([kind]))), len(chunk), kind) + chunk
            first = False
            if not payload:
                break
    return bytes(out)


# --------------------------------------------------------------------------------------------
# machine paths
# --------------------------------------------------------------------------------------------
def scrub(text: str, roots: list[str]) -> str:
    """`text` with the paths under any of `roots` relative to it (the root itself '.'), then any other machine path
    cut to its last name."""
    for root in roots:
        text = re.sub(re.escape(root) + r"(/|(?![\w.-]))", lambda m: "" if m.group(1) else ".", text)

    def cut(m: re.Match) -> str:
        token = m.group()
        absolute = token.startswith("/") and "/" in token[1:]  # /opt/...: a URL starts with its scheme
        return re.split(r"[/\\]", token.rstrip("/\\"))[-1] if absolute or re.search(MACHINE_PATH, token) else token
    return PATH_TOKEN.sub(cut, text)


def scrub_message(message: Message, roots: list[str]) -> None:
    """Scrub every string of a protobuf message, in nested messages, lists and maps too, in place."""
    for field, value in message.ListFields():
        if isinstance(value, str):
            setattr(message, field.name, scrub(value, roots))
        elif isinstance(value, Message):
            scrub_message(value, roots)
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            for key in list(value):
                if isinstance(value[key], str):
                    value[key] = scrub(value[key], roots)
                elif isinstance(value[key], Message):
                    scrub_message(value[key], roots)
        elif field.message_type is not None:
            for item in value:
                scrub_message(item, roots)
        elif field.type == field.TYPE_STRING:
            value[:] = [scrub(v, roots) for v in value]


# what a run's records say of the machine and its user beyond paths: dropped from a published run (the GPU's model,
# count and CUDA version stay: gpu_type, gpu_count, cuda_version)
PRIVATE_FIELDS = {"environment": ("host", "username", "email", "docker", "disk", "gpu_nvidia", "gpu_amd", "slurm",
                                  "coreweave"),
                  "run": ("host",)}


def parse_records(payloads: list[bytes]) -> list[Message]:
    """The payloads as W&B `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    records = []
    from google.protobuf.message import DecodeError

    for payload in payloads:
        records.append(pb.Record())
        try:
            records[-1].ParseFromString(payload)
        except DecodeError as e:
            raise PublishError(f"a record of the .wandb file does not decode ({e}): a damaged run") from None
    return records


def scrub_records(payloads: list[bytes], roots: list[str]) -> list[bytes]:
    """The payloads with every string of every record scrubbed; a record with nothing to scrub is kept as it was
    (encoded again, its fields would come in another order)."""
    out = []
    for payload, record in zip(payloads, parse_records(payloads)):
        before = type(record)()
        before.CopyFrom(record)
        kind = record.WhichOneof("record_type")
        for name in PRIVATE_FIELDS.get(kind, ()):
            getattr(record, kind).ClearField(name)
        scrub_message(record, roots)
        out.append(payload if record == before else record.SerializeToString())
    return out


def roots_of(run: Path, root: Path, payloads: list[bytes]) -> list[str]:
    """`root` as this machine writes it, and as the machine that wrote the run did (from its W&B directory, the
    environment record's root, which is `root`/<the same folders> there): a run imported from another machine has
    its paths relative too. Longest first."""
    roots = {str(root.absolute()), str(root.resolve())}
    written = next((r.environment.root for r in parse_records(payloads)
                    if r.WhichOneof("record_type") == "environment" and r.environment.root), None)
    here = run.parent.parent.absolute()  # the directory W&B was given: <here>/wandb/offline-run-*
    if written and here.is_relative_to(root.absolute()):
        under, there = here.relative_to(root.absolute()).parts, PurePath(written).parts
        if len(there) > len(under) and there[len(there) - len(under):] == under:
            roots.add(str(PurePath(*there[: len(there) - len(under)])))
    return sorted(roots, key=len, reverse=True)


def scrub_file(data: bytes, roots: list[str]) -> bytes:
    """A text file scrubbed; a binary one (a NUL byte, or not UTF-8) as it is."""
    if b"\0" in data:
        return data
    try:
        return scrub(data.decode(), roots).encode()
    except UnicodeDecodeError:
        return data


# --------------------------------------------------------------------------------------------
# publishing
# --------------------------------------------------------------------------------------------
def newest_run(run_dir: Path) -> Path:
    """The newest offline run folder of a run directory (the names sort by their start time)."""
    runs = sorted(p for p in (run_dir / "wandb").glob("offline-run-*")
                  if p.is_dir() and not p.is_symlink() and len(list(p.glob("*.wandb"))) == 1)
    if not runs:
        raise PublishError(f"{run_dir / 'wandb'}: no W&B offline run (trained with logger=none, or online?)")
    return runs[-1]


def publish_run(run: Path, dest: Path, root: Path) -> Path:
    """Copy the offline run folder `run` into dest/wandb_offline/<its name>/ (dest: results/<subject>): its .wandb
    file and files/, machine paths rewritten (module docstring), those under `root` (here or where the run was
    written) relative to it. Returns the new folder. PublishError, with nothing written, for a run over RUN_BYTES or
    a binary file holding a machine path."""
    wandb_files = sorted(run.glob("*.wandb"))
    if not RUN_NAME.fullmatch(run.name) or len(wandb_files) != 1:
        raise PublishError(f"{run}: not a W&B offline run folder (offline-run-*/ with one .wandb file)")
    payloads = read_payloads(wandb_files[0].read_bytes(), str(wandb_files[0]))
    roots = roots_of(run, root, payloads)
    copies = {PurePath(wandb_files[0].name): frame_payloads(scrub_records(payloads, roots))}
    for path in sorted((run / "files").rglob("*")):
        if path.is_file() and not path.is_symlink():
            copies[path.relative_to(run)] = scrub_file(path.read_bytes(), roots)
    size = sum(len(data) for data in copies.values())
    if size > RUN_BYTES:
        raise PublishError(f"{run}: {size:,} bytes once copied, over the {RUN_BYTES:,} a published run may hold; "
                           f"publish a shorter run")
    for rel, data in copies.items():
        if m := re.search((MACHINE_DIRS if b"\0" in data else MACHINE_PATH).encode(), data):
            raise PublishError(f"{run / rel}: holds a machine path ({m.group().decode()!r}) that cannot be rewritten")
    target = dest / PUBLISHED_DIR / run.name
    staging = target.with_name(f".{run.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    for rel, data in copies.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target

"""Writing files so that a crash, a signal or a full disk never leaves half a file where a reader looks.

`atomic_write` writes into a hidden temp file beside the target (`.<name>.tmp-<host>-<pid>`), flushes it to
disk and renames it over the target in one step; on any failure (an exception, a signal's KeyboardInterrupt) the
temp file is removed and the old target is left as it was. OS errors become a `WriteError` whose message says
which file and why in words (disk full, permission denied). Only SIGKILL or a power cut can leave a temp file
behind; `remove_stale_temps` clears those of dead processes of this host when the next run starts or saves.
"""
from __future__ import annotations

import errno
import os
import re
import socket
from pathlib import Path
from typing import BinaryIO, Callable

_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?:(?P<host>.+)-)?(?P<pid>\d+)$")  # host absent: written by an older minigpt


class WriteError(RuntimeError):
    """A file could not be written; the message names it and says why."""


def os_error_reason(e: OSError) -> str:
    """An OSError in plain words; 'disk full' for the errors a full disk or quota gives."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "disk full (no space left on the device)"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if e.errno == errno.EROFS:
        return "read-only file system"
    return e.strerror or str(e)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Call write(f) on a temp file beside `path`, fsync it, and rename it to `path`; all or nothing."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise WriteError(f"cannot write {path}: {os_error_reason(e)}") from e
        raise
    return path


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (also another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temps(directory: str | Path, say: Callable[[str], None] = print) -> list[Path]:
    """Remove the temp files of atomic writes in `directory` whose writer is gone (a process of this host that no
    longer runs, or this process, which is not writing while it calls this); says one line per file removed.

    Temp files of other hosts (a shared file system) are left alone: their process cannot be checked from here.
    """
    directory, host, removed = Path(directory), socket.gethostname(), []
    if not directory.is_dir():
        return removed
    for p in directory.iterdir():
        m = _TEMP.match(p.name)
        if not m or not p.is_file() or (m["host"] is not None and m["host"] != host):
            continue
        pid = int(m["pid"])
        if pid != os.getpid() and process_alive(pid):
            continue
        p.unlink(missing_ok=True)
        removed.append(p)
        say(f"removed {p}: the temporary file of a write of {m['name']} that never finished (process {pid} is gone)")
    return removed


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode()))


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    """A GitHub markdown table; None cells print as '–'. The one table writer of the project."""
    def cell(x: object) -> str:
        return "–" if x is None else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"

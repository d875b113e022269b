"""Writing files so that a crash, a signal or a full disk never leaves half a file where a reader looks.

`atomic_write` writes into a hidden temp file beside the target, flushes it to disk and renames it over the
target in one step; on any failure the temp file is removed and the old target is left as it was. OS errors
become a `WriteError` whose message says which file and why in words (disk full, permission denied).
"""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import BinaryIO, Callable


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
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
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


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode()))


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    """A GitHub markdown table; None cells print as '–'. The one table writer of the project."""
    def cell(x: object) -> str:
        return "–" if x is None else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"

"""One run directory, one run: an exclusive lock file, `run.lock`, held while a run lives in the directory.

    check_free(run_dir)        ConfigError (one line, exit 2) if a live run holds it; writes nothing
    lock(run_dir)              take it (ConfigError if a live run holds it)
    (both take `key`, the setting their advice names, and `subject`, what the line is about: a multirun's job
    folder is chosen by hydra.sweep.dir, not hydra.run.dir)
    reclaimed(run_dir)         the dead owner of a lock file that lock() took over, else None
    unlock(run_dir)            give it back (the file is removed)

The lock is `fcntl.flock` on `run.lock`, which holds the owner's pid, host and start time as JSON. The kernel drops
a flock when its process dies, whatever killed it (SIGKILL, the out-of-memory killer), so a lock file whose flock
is free belongs to a dead run: it is reclaimed, and the caller says so. A lock file of another host is not
reclaimed (its process cannot be checked from here, and flock over a network file system is not to be trusted):
that is refused with the advice to remove the file once that run is gone. A process may take the lock of a
directory it already holds (the CLI takes it before Hydra writes there, the run again): the lock counts.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minigpt.config import ConfigError

LOCK_FILE = "run.lock"


@dataclass(frozen=True)
class Holder:
    pid: int | None
    host: str | None
    started: str | None

    @classmethod
    def read(cls, fd: int) -> Holder:
        try:
            data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
            return cls(int(data["pid"]), str(data["host"]), data.get("started"))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return cls(None, None, None)  # empty or torn: its writer died while writing it

    def __str__(self) -> str:
        since = f", since {self.started}" if self.started else ""
        return f"pid {self.pid} on {self.host}{since}" if self.pid else "an unknown process"


_held: dict[Path, list[Any]] = {}  # lock path -> [fd, times taken, reclaimed Holder | None] of this process


def _path(run_dir: str | Path) -> Path:
    return Path(run_dir).expanduser().absolute() / LOCK_FILE


def _refusal(run_dir: str | Path, path: Path, holder: Holder, live: bool, key: str, subject: str | None
             ) -> ConfigError:
    subject = subject or f"{key}={run_dir}"
    if live:
        return ConfigError(f"{subject}: in use by another run ({holder}); wait until it ends, or choose another {key}")
    return ConfigError(f"{subject}: locked by {holder}, which cannot be checked from this host; if that run has ended, "
                       f"remove {path} and start again")


def check_free(run_dir: str | Path, key: str = "hydra.run.dir", subject: str | None = None) -> None:
    """ConfigError if another live run (or a run of another host) holds run_dir's lock. Reads only."""
    path = _path(run_dir)
    if path in _held:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        holder = Holder.read(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _refusal(run_dir, path, holder, True, key, subject) from None
        if holder.host not in (None, socket.gethostname()):
            raise _refusal(run_dir, path, holder, False, key, subject)
    finally:
        os.close(fd)


def lock(run_dir: str | Path, key: str = "hydra.run.dir", subject: str | None = None) -> None:
    """Take run_dir's lock (creating run_dir); ConfigError if a live run holds it. A stale lock (its process of this
    host is gone) is taken over: reclaimed() names its owner."""
    path = _path(run_dir)
    if path in _held:
        _held[path][1] += 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        created = False
        try:
            fd = os.open(path, os.O_RDWR)  # an existing lock is not written unless this process gets it
        except FileNotFoundError:
            try:
                fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                continue
        holder = Holder.read(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _refusal(run_dir, path, holder, True, key, subject) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # its owner removed it between our open and flock: take the new one
            os.close(fd)
            continue
        if holder.host not in (None, socket.gethostname()):
            os.close(fd)
            raise _refusal(run_dir, path, holder, False, key, subject)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        _held[path] = [fd, 1, None if created else holder]
        return


def reclaimed(run_dir: str | Path) -> Holder | None:
    held = _held.get(_path(run_dir))
    return held[2] if held else None


def unlock(run_dir: str | Path) -> None:
    """Give back a lock this process took (the last of its takes removes the file)."""
    path = _path(run_dir)
    if path not in _held:
        return
    _held[path][1] -= 1
    if _held[path][1] > 0:
        return
    fd = _held.pop(path)[0]
    path.unlink(missing_ok=True)  # while still holding it: a waiting process then finds no file, or a new one
    os.close(fd)

"""Stop signals, and child processes that never outlive their parent.

    with StopSignals() as stop: ...     SIGINT, SIGTERM, SIGHUP: the first one raises Interrupted at once while
                                         `stop.immediate` (nothing to finish yet), else it is recorded (`stop.signum`)
                                         for the caller to act on, with `stop.note` printed; later ones print a note
    Popen(..., **own_group())            the child leads its own process group; on Linux the kernel sends it SIGTERM
                                         when this process dies, even by SIGKILL (PR_SET_PDEATHSIG)
    stop_group(proc, signum, grace_s)    signum to that group, SIGKILL after grace_s: the child and all of its own

A SIGHUP that the parent ignores (`nohup`) stays ignored. A stop signal that the parent blocked (some CI runners and
process supervisors start their children so) is unblocked where it is handled and in the children started with
own_group(): otherwise it would wait, pending, for ever, and a stopped run would only end by SIGKILL, with no summary. Interrupted is a BaseException, like KeyboardInterrupt,
so no `except Exception` (Hydra's, a library's) swallows it on its way to the code that says what happened.
"""
from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
from typing import Any

PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Interrupted(BaseException):
    """A stop signal arrived while there was nothing to finish: stop now."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


class StopSignals:
    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, note: str = "stopping", again: str = "already stopping; please wait",
                 exiting: bool = False) -> None:
        """exiting: a command's outermost context, whose process ends once it closes: after a stop signal the stop
        signals stay ignored (interpreter shutdown included). Otherwise (the Python API: `minigpt.run.run`, the
        tests) the handlers found on entry come back, so a notebook or test process is left as it was."""
        self.signum: int | None = None
        self.exiting = exiting
        self.immediate = True
        self.note, self.again = note, again
        self._previous: dict[int, Any] = {}
        self._outer: StopSignals | None = None

    _active: list[StopSignals] = []

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python only delivers signals there
            for s in self.SIGNALS:
                previous = signal.getsignal(s)
                if s == signal.SIGHUP and previous == signal.SIG_IGN:  # nohup: the user asked to outlive the terminal
                    continue
                self._previous[s] = signal.signal(s, self._handle)
            unblock(self._previous)
        self._outer = self._active[-1] if self._active else None
        self._active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._active.remove(self)
        if self.signum is not None:  # on its way out with 128 + signum: the code around this one stops too
            if self._outer is not None and self._outer.signum is None:
                self._outer.signum = self.signum
            if self.exiting:  # the process ends: ignore later signals, also during interpreter shutdown
                for s in self._previous:
                    signal.signal(s, signal.SIG_IGN)
                return
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            print(f"\n{name} again: {self.again}", file=sys.stderr, flush=True)
            return
        self.signum = signum
        if self.immediate:
            raise Interrupted(signum)
        print(f"\n{name}: {self.note}", file=sys.stderr, flush=True)


def unblock(signals: Any) -> None:
    """Let these signals arrive in this thread (and in the processes it starts), if something above us blocked them."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(signals))


def _die_with_parent(prctl: Any, parent: int) -> None:
    """In the child, before exec: the stop signals unblocked, and SIGTERM when the parent dies (also if it already
    has)."""
    unblock(StopSignals.SIGNALS)
    prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def own_group() -> dict[str, Any]:
    """Popen keyword arguments: a new process group (and session), and on Linux death with the parent."""
    kwargs: dict[str, Any] = {"start_new_session": True}
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded here: the child runs no imports before exec
            kwargs["preexec_fn"] = functools.partial(_die_with_parent, prctl, os.getpid())
        except (OSError, AttributeError):
            pass
    return kwargs


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc: subprocess.Popen, signum: int = signal.SIGTERM, grace_s: float = 30.0) -> int:
    """Send `signum` to the process group `proc` leads (own_group), SIGKILL it if proc still runs after grace_s, and
    SIGKILL whatever of the group is left once proc has ended; returns proc's exit code."""
    _signal_group(proc, signum)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
    _signal_group(proc, signal.SIGKILL)  # its own children that outlived it
    return proc.returncode

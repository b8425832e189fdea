"""Process lifecycle of the recorders: atexit and SIGTERM/SIGINT flush every live recorder, and a forked
child never writes its parent's.

A crash or Ctrl-C mid-run must leave a readable run directory: on SIGINT the recorders flush and the
KeyboardInterrupt goes on; on SIGTERM with no handler of the program's own they are sealed, then the process
ends with the default action (and exit status).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Protocol


class Recorder(Protocol):
    """What the lifecycle needs of a recorder (a protocol, so this module does not import the recorder)."""

    tag: str
    _owner: int | None
    _closed: bool

    def flush(self) -> None: ...
    def _close(self, reason: str) -> None: ...
    def _finish(self, *, reason: str, drain: bool) -> None: ...


_live: weakref.WeakSet[Recorder] = weakref.WeakSet()
_lifecycle_lock = threading.Lock()
_installed: dict[int, object] = {}  # signal number -> previous handler
_atexit_registered = False


def register(rec: Recorder) -> None:
    global _atexit_registered
    with _lifecycle_lock:
        _live.add(rec)
        if not _atexit_registered:
            atexit.register(_close_all, "atexit")
            _atexit_registered = True
    install_signal_handlers()


def unregister(rec: Recorder) -> None:
    _live.discard(rec)


def _close_all(reason: str) -> None:
    for rec in list(_live):
        try:
            if reason == "atexit" and threading.get_ident() == rec._owner:
                rec._close("atexit")
            else:  # another thread owns it (or we are about to die): write what is complete, then seal
                rec._finish(reason=reason, drain=False)
        except Exception as e:  # never let a measurement tool turn an exit into a traceback storm
            print(f"overshoot: could not flush recorder {rec.tag}: {e}", file=sys.stderr)


def _after_fork_in_child() -> None:
    # The parent's recorders, buffers and open files are not the child's: never write them from here.
    for rec in list(_live):
        rec._closed = True
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def install_signal_handlers() -> bool:
    """Flush all recorders on SIGTERM/SIGINT, then run the previous handler (or the default action).
    Only possible from the main thread; returns whether handlers are installed."""
    if threading.current_thread() is not threading.main_thread():
        return bool(_installed)
    for signum in (signal.SIGTERM, signal.SIGINT):
        if signum in _installed:
            continue
        try:
            _installed[signum] = signal.getsignal(signum)
            signal.signal(signum, _on_signal)
        except (ValueError, OSError):  # e.g. embedded interpreters
            _installed.pop(signum, None)
    return bool(_installed)


def _flush_all() -> None:
    for rec in list(_live):
        try:
            rec.flush()
        except Exception:  # a signal handler must not raise on the recorder's behalf
            pass


def _on_signal(signum: int, frame) -> None:
    previous = _installed.get(signum)
    if callable(previous):
        _flush_all()  # the process may go on (graceful shutdown): flush, do not seal
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    if signum == signal.SIGINT:
        _flush_all()
        raise KeyboardInterrupt
    _close_all(signal.Signals(signum).name)
    # Default action (terminate) with the right exit status.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@contextlib.contextmanager
def sigterm_deferred() -> Iterator[None]:
    """A SIGTERM arriving inside the block is delivered when it ends (main thread only; elsewhere a no-op).

    For closing a recorder at an engine's shutdown: vLLM's engine core restores the default SIGTERM action
    before its teardown and its process manager sends a second SIGTERM, which would otherwise kill the
    process halfway through writing the last chunk.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: pending.append(signum))
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if pending:
            os.kill(os.getpid(), signal.SIGTERM)

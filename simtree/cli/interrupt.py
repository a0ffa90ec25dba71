"""SIGINT / SIGTERM as one line: a command stops where it is, cleans up, says what it left.

    try:
        with stop_on_signals() as stop:
            ...                     # SIGINT or SIGTERM raises Interrupted here
            stop.check()            # (at a safe point: raises one that Python dropped)
    except Interrupted as exc:
        exit_interrupted(exc, "plan stopped after ...; rerun the same command to continue")

Without a handler SIGTERM ends Python at once (no ``finally`` runs: a run's staged traces stay
behind) and typer turns Ctrl-C into exit 130 without a word.  ``Interrupted`` is a
KeyboardInterrupt, so code that cleans up on KeyboardInterrupt (``except BaseException``,
``finally``) does so for both signals; the exit code is 128 + the signal's number (130, 143).

The handler raises in whatever Python code runs when the signal arrives; where that is a
weakref callback or a finalizer (a lazy import's caches, garbage collection), Python prints
"Exception ignored" with a traceback and carries on, and the command would finish as if no
signal came.  So the handler also records the signal, and :meth:`Stop.check` raises it at a
safe point (a command's progress callback: its loop between two pieces of work); the dropped
exception is not printed (``sys.unraisablehook``, inside the block).  One dropped after the
last safe point lets the work finish: its files are whole, and the command ends as it would
have without the signal.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading

import typer

__all__ = ["Interrupted", "Stop", "stop_on_signals", "say_interrupted", "exit_interrupted"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A command stopped by a signal; ``signal_name`` (SIGINT, SIGTERM) and ``exit_code``."""

    def __init__(self, signum: int):
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + int(signum)
        super().__init__(self.signal_name)


class Stop:
    """The signal a block received (``signum``, None before one) and :meth:`check`."""

    def __init__(self):
        self.signum = None

    def _raise(self, signum, frame):
        self.signum = signum      # kept: the exception below may be dropped (module docstring)
        raise Interrupted(signum)

    def check(self) -> None:
        """Raise :class:`Interrupted` where a signal came (and its exception was dropped)."""
        if self.signum is not None:
            raise Interrupted(self.signum)

    def _unraisable(self, hook):
        """``hook`` (the ``sys.unraisablehook`` before the block) but silent on the handler's own
        dropped exception: :meth:`check` raises it again."""
        def unraisable(info) -> None:
            if not (isinstance(info.exc_value, Interrupted) and self.signum is not None):
                hook(info)
        return unraisable


@contextlib.contextmanager
def stop_on_signals():
    """Inside, SIGINT and SIGTERM raise :class:`Interrupted` (main thread only: elsewhere
    signal handlers cannot be set, and the defaults stay); yields the block's :class:`Stop`."""
    stop = Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    old = {s: signal.signal(s, stop._raise) for s in SIGNALS}
    hook, sys.unraisablehook = sys.unraisablehook, stop._unraisable(sys.unraisablehook)
    try:
        yield stop
    finally:
        sys.unraisablehook = hook
        for s, handler in old.items():
            signal.signal(s, handler)


def say_interrupted(exc: Interrupted, what: str) -> None:
    """Print ``interrupted (SIGNAL): what`` on stderr (the command's last line)."""
    typer.echo(f"interrupted ({exc.signal_name}): {what}", err=True)


def exit_interrupted(exc: Interrupted, what: str) -> None:
    """:func:`say_interrupted`, then exit 128 + the signal's number (from inside a command)."""
    say_interrupted(exc, what)
    raise typer.Exit(exc.exit_code)

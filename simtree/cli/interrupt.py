"""SIGINT / SIGTERM as one line: a command stops where it is, cleans up, says what it left.

    with stop_on_signals():
        ...                         # SIGINT or SIGTERM raises Interrupted here
    except Interrupted as exc:
        exit_interrupted(exc, "plan stopped after ...; rerun the same command to continue")

Without a handler SIGTERM ends Python at once (no ``finally`` runs: a run's staged traces stay
behind) and typer turns Ctrl-C into exit 130 without a word.  ``Interrupted`` is a
KeyboardInterrupt, so code that cleans up on KeyboardInterrupt (``except BaseException``,
``finally``) does so for both signals; the exit code is 128 + the signal's number (130, 143).
"""
from __future__ import annotations

import contextlib
import signal
import threading

import typer

__all__ = ["Interrupted", "stop_on_signals", "exit_interrupted"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A command stopped by a signal; ``signal_name`` (SIGINT, SIGTERM) and ``exit_code``."""

    def __init__(self, signum: int):
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + int(signum)
        super().__init__(self.signal_name)


def _raise(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def stop_on_signals():
    """Inside, SIGINT and SIGTERM raise :class:`Interrupted` (main thread only: elsewhere
    signal handlers cannot be set, and the defaults stay)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def exit_interrupted(exc: Interrupted, what: str) -> None:
    """Print ``interrupted (SIGNAL): what`` on stderr and exit 128 + the signal's number."""
    typer.echo(f"interrupted ({exc.signal_name}): {what}", err=True)
    raise typer.Exit(exc.exit_code)

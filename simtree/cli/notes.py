"""Warnings as one-line notes: what the CLI commands print on stderr before their result."""
from __future__ import annotations

import os
import time

import typer
from rich.console import Console
from rich.markup import escape

from simtree.errors import captured_warnings  # noqa: F401  (the commands import it from here)


def print_notes(notes, console=None) -> None:
    """Each distinct note once, one line each (warnings or strings): through ``console`` (a
    rich Console, markup escaped) or plain on stderr."""
    for note in dict.fromkeys(" ".join(str(getattr(n, "message", n)).split()) for n in notes):
        if console is None:
            typer.echo(f"note: {note}", err=True)
        else:
            console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)


PIPED_WIDTH = 1000   # columns of a Console writing to a file or pipe: wider than any table printed


def output_console(stderr: bool = False) -> Console:
    """A rich Console on stdout (or stderr); writing to a file or pipe, it is PIPED_WIDTH wide
    (unless COLUMNS says otherwise) instead of rich's 80 columns, which cut table cells
    ("work…")."""
    console = Console(stderr=stderr)
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(stderr=stderr, width=PIPED_WIDTH)


class ProgressLines:
    """Progress as lines on stderr where no bar is drawn (output that is not a terminal):
    :meth:`say` one line now; :meth:`update` at most one line every ``every_s`` seconds (and
    at the end, where a line came before: work done within ``every_s`` says nothing), with the
    time left estimated from the rate so far."""

    def __init__(self, prefix: str, enabled: bool, every_s: float = 5.0):
        self.prefix, self.enabled, self.every_s = prefix, enabled, every_s
        self._t0 = self._last = time.monotonic()
        self._said = False

    def say(self, line: str) -> None:
        self._last = time.monotonic()
        self._said = True
        if self.enabled:
            typer.echo(f"{self.prefix}: {line} ({self._last - self._t0:.0f} s)", err=True)

    def update(self, done: int, total: int, what: str, since: float | None = None) -> None:
        """``done`` of ``total`` ``what``; the estimate counts from ``since`` (a time.monotonic()
        value; default: the start)."""
        now = time.monotonic()
        if now - self._last < self.every_s and (done < total or not self._said):
            return
        start = self._t0 if since is None else since
        left = (now - start) / done * (total - done) if 0 < done < total else None
        self.say(f"{done} of {total} {what}" + ("" if left is None else f", about {left:.0f} s left"))

"""Warnings as one-line notes: what the CLI commands print on stderr before their result."""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import typer
from rich.markup import escape


@contextmanager
def captured_warnings():
    """The warnings raised inside (every one, not once per code location), as a list."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def print_notes(notes, console=None) -> None:
    """Each distinct note once, one line each (warnings or strings): through ``console`` (a
    rich Console, markup escaped) or plain on stderr."""
    for note in dict.fromkeys(" ".join(str(getattr(n, "message", n)).split()) for n in notes):
        if console is None:
            typer.echo(f"note: {note}", err=True)
        else:
            console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)

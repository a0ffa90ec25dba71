"""Warnings as one-line notes: what the CLI commands print on stderr before their result."""
from __future__ import annotations

import typer
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

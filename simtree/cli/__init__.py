"""The ``simtree`` command line: thin typer commands over library functions.

Each command lives in its own module ``simtree.cli.<name>`` that defines
``register(app: typer.Typer)``.  A command whose module is missing is still listed and
exits non-zero saying it is not built yet: it never prints made-up output.
"""
from __future__ import annotations

import importlib
import sys

import typer

from simtree.errors import SimtreeError

COMMANDS = {
    "profile": "Measure verify and draft latencies on this machine's GPU (or CPU) into a profile table.",
    "fit": "Fit monotone cost models C_v(n, l, batch) and C_d (convex, or flagged MoE saturation) to a profile table.",
    "plan": "Choose tree on/off, shape and budget per batch size and workload; write a policy and report.",
    "simulate": "Predict decode throughput of one policy for a model, workload and batch size.",
    "run": "Decode live with a policy and report measured against predicted throughput.",
    "report": "Render a report (markdown + PNG) from saved plans, fits or runs.",
    "train": "Train the small target and draft models that the runtime ships.",
    "sglang": "Print SGLang server arguments (static EAGLE tree) for a planned policy.",
}

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="simtree: does tree speculative decoding pay off on this GPU, model and load?")


def _stub(name: str):
    def command() -> None:
        typer.echo(f"simtree {name}: not built yet in this version", err=True)
        raise typer.Exit(1)
    command.__doc__ = COMMANDS[name] + " (not built yet)"
    return command


def _register_all() -> None:
    for name, help_line in COMMANDS.items():
        try:
            module = importlib.import_module(f"simtree.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"simtree.cli.{name}":
                raise
            app.command(name, help=help_line + " (not built yet)")(_stub(name))
            continue
        module.register(app)


_register_all()


def main() -> None:
    try:
        app()
    except SimtreeError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)

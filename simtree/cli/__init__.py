"""The ``simtree`` command line: thin typer commands over library functions.

Each command lives in its own module ``simtree.cli.<name>`` that defines
``register(app: typer.Typer)``; ``COMMANDS`` lists them with their one-line help.
"""
from __future__ import annotations

import importlib
import logging
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
    "train-drafter": "Train a block drafter (DFlash-style block, DSpark) for a trained target folder, the target frozen.",
    "sglang": "Print SGLang server arguments (static EAGLE tree) for a planned policy.",
    "export": "Write a planned policy as what SGLang or vLLM takes (launch flags, adaptive config, SPS table).",
    "import-metrics": "Read the acceptance a vLLM or SGLang server measured into an acceptance file for plan.",
    "bench-serve": "Serve arrival traces in the simulator: none, static, threshold, SGLang's own policies, controller.",
}

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="simtree: does tree speculative decoding pay off on this GPU, model and load?")


def _register_all() -> None:
    for name in COMMANDS:
        importlib.import_module(f"simtree.cli.{name.replace('-', '_')}").register(app)


_register_all()


def main() -> None:
    """Run the CLI; every user-side failure ends in one ``error: ...`` line on stderr, exit 2:
    a SimtreeError from a command, a usage error (bad option value, unknown option), or a
    file the operating system refuses (a folder where a file goes, no permission)."""
    try:   # typer vendors click as typer._click in newer releases
        from typer._click import exceptions as click_exc
    except ImportError:
        from click import exceptions as click_exc

    from simtree.cli.interrupt import Interrupted, stop_on_signals

    # matplotlib's font lookup logs a warning for every font it cannot find (a font cache left
    # by another installation's deleted fonts): noise on stderr, where simtree says one line
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    try:
        # a command without its own handling (simulate, bench-serve, ...) stopped by SIGINT or
        # SIGTERM: typer turns it into exit 130 without a word (SIGTERM ended Python at once)
        with stop_on_signals() as stop:
            rc = app(standalone_mode=False)
        # rc 130: the signal's exception reached typer (a signal whose exception Python dropped in a
        # finalizer lets a command without a safe-point check run on to its end and exit 0)
        if stop.signum is not None and rc == 130:
            _stopped(Interrupted(stop.signum))
    except SimtreeError as exc:
        _fail(str(exc))
    except Interrupted as exc:   # a signal outside the command itself (while typer builds it or after it returned)
        _stopped(exc)
    except click_exc.NoArgsIsHelpError as exc:
        exc.show()   # the help text, as a bare `simtree` prints it
        sys.exit(2)
    except click_exc.UsageError as exc:
        cmd = exc.ctx.command_path if exc.ctx is not None else "simtree"
        _fail(f"{exc.format_message()} (see {cmd} --help)")
    except click_exc.ClickException as exc:
        _fail(exc.format_message())
    except typer.Abort as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, Interrupted):   # click turns an interrupt that lands while it parses into Abort
            _stopped(cause)
        typer.echo("aborted", err=True)
        sys.exit(1)
    except OSError as exc:
        _fail(_os_error_line(exc))
    sys.exit(rc if isinstance(rc, int) else 0)


def _stopped(exc) -> None:
    """A signal stopped the command outside its own handling: one line, exit 128 + its number."""
    from simtree.cli.interrupt import say_interrupted
    say_interrupted(exc, f"simtree {' '.join(sys.argv[1:2])} stopped before it finished")
    sys.exit(exc.exit_code)


def _fail(message: str) -> None:
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    sys.exit(2)


def _os_error_line(exc: OSError) -> str:
    """``[Errno 21] Is a directory: 'x'`` -> ``x: is a directory``."""
    what = (exc.strerror or type(exc).__name__).lower()
    names = [str(f) for f in (exc.filename, exc.filename2) if f is not None]
    return f"{' -> '.join(names)}: {what}" if names else what

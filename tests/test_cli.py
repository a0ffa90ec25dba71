import re
import subprocess
import sys

from typer.testing import CliRunner

from simtree.cli import COMMANDS, app


def test_every_command_is_registered_with_help():
    registered = {c.name: c for c in app.registered_commands}
    assert set(registered) == set(COMMANDS)
    for name in COMMANDS:
        result = CliRunner().invoke(app, [name, "--help"])
        assert result.exit_code == 0, name
        assert re.search(rf"Usage: \S+ {name} ", result.output), name   # its own usage line


def test_the_eagle_flags_help_gives_the_defaults_they_take(monkeypatch):
    """--steps / --topk left out take EAGLE_FLAG_DEFAULTS (params_from_flags); simulate's and run's
    help say those, whatever they are."""
    import typer
    from simtree.cli import run, simulate
    from simtree.planning.modes import EAGLE_FLAG_DEFAULTS, params_from_flags
    monkeypatch.setitem(EAGLE_FLAG_DEFAULTS, "steps", 5)
    monkeypatch.setitem(EAGLE_FLAG_DEFAULTS, "topk", 4)
    spec = params_from_flags("eagle", None, None, 9)
    assert (spec.num_steps, spec.topk) == (5, 4)
    for module, steps, topk in ((simulate, "eagle: draft steps s", "eagle: top-k"),
                                (run, "eagle: draft steps", "eagle: top-k per step")):
        one = typer.Typer()
        module.register(one)
        one.command("other")(lambda: None)     # two commands: the help is the command's, by name
        result = CliRunner().invoke(one, [module.__name__.rsplit(".", 1)[1], "--help"], terminal_width=400,
                                    env={"COLUMNS": "400"})
        text = " ".join(re.sub(r"[│\s]+", " ", result.output).split())
        assert f"{steps} (default 5)" in text and f"{topk} (default 4)" in text, module.__name__


def test_bad_input_is_one_line_exit_2(tmp_path):
    # A SimtreeError raised by any command becomes "error: ..." with exit code 2.
    code = ("import sys, typer; from simtree import cli; from simtree.errors import SimtreeError\n"
            "def boom(): raise SimtreeError('budget must be >= 1, got 0')\n"
            "cli.app.command('boom')(boom); sys.argv=['simtree','boom']; cli.main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: budget must be >= 1, got 0"


def _main(*args, cwd=None):
    code = "import sys; from simtree import cli; sys.argv = ['simtree', *sys.argv[1:]]; cli.main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd)


def test_usage_errors_and_os_errors_are_one_line_exit_2(tmp_path):
    for args, match in ((["simulate", "--batch-size", "x"], "error: Invalid value for '--batch-size'"),
                        (["plan", "--bogus"], "error: No such option: --bogus"),
                        (["fit", str(tmp_path)], f"error: profile table expected, got a folder: {tmp_path}")):
        proc = _main(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith(match) and proc.stderr.count("\n") == 1, (args, proc.stderr)


def test_os_error_line_names_the_file():
    from simtree.cli import _os_error_line

    assert _os_error_line(IsADirectoryError(21, "Is a directory", "/x/y")) == "/x/y: is a directory"
    assert _os_error_line(PermissionError(13, "Permission denied")) == "permission denied"

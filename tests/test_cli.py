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


def test_bad_input_is_one_line_exit_2(tmp_path):
    # A SimtreeError raised by any command becomes "error: ..." with exit code 2.
    code = ("import sys, typer; from simtree import cli; from simtree.errors import SimtreeError\n"
            "def boom(): raise SimtreeError('budget must be >= 1, got 0')\n"
            "cli.app.command('boom')(boom); sys.argv=['simtree','boom']; cli.main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: budget must be >= 1, got 0"

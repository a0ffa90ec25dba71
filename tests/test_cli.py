import subprocess
import sys

from typer.testing import CliRunner

from simtree.cli import COMMANDS, app


def test_help_lists_every_command():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in COMMANDS:
        assert name in result.output


def test_bad_input_is_one_line_exit_2(tmp_path):
    # A SimtreeError raised by any command becomes "error: ..." with exit code 2.
    code = ("import sys, typer; from simtree import cli; from simtree.errors import SimtreeError\n"
            "def boom(): raise SimtreeError('budget must be >= 1, got 0')\n"
            "cli.app.command('boom')(boom); sys.argv=['simtree','boom']; cli.main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: budget must be >= 1, got 0"

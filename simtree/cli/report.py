"""`simtree report`: re-render a plan folder's markdown + PNG report, or (--summary) the
headline results of the committed reports."""
from __future__ import annotations

import json

import typer

from simtree.errors import SimtreeError


def register(app: typer.Typer) -> None:
    @app.command("report", help="Render a report (markdown + PNG) from a saved plan folder, or from every "
                                "plan folder under it (one per model).  Example: simtree report reports/plan\n\n"
                                "--summary prints the headline results table read from the data files under "
                                "reports/ (README.md holds a copy); --write also refreshes README.md's copy and "
                                "reports/README.md.  Example: simtree report --summary --write")
    def report_command(
        plan_dir: str = typer.Argument("reports/plan", help="folder written by `simtree plan`"),
        as_json: bool = typer.Option(False, "--json", help="print the written paths as JSON"),
        summary: bool = typer.Option(False, "--summary", help="print the headline table of the committed reports"),
        write: bool = typer.Option(False, "--write", help="with --summary: rewrite README.md's table and "
                                                          "reports/README.md"),
        root: str = typer.Option(".", "--root", help="with --summary: the repository checkout to read"),
    ) -> None:
        """simtree report reports/plan"""
        if write and not summary:
            raise SimtreeError("--write rewrites README.md's results table: give it with --summary")
        if summary:
            from simtree.reporting.summary import headlines, summary_table, write_summary

            if write:
                paths = write_summary(root)
                typer.echo(json.dumps([str(p) for p in paths]) if as_json else
                           "wrote " + " and ".join(str(p) for p in paths))
            elif as_json:
                typer.echo(json.dumps([{"folder": f.path, "result": f.result, "headline": h}
                                       for f, h in headlines(root)], indent=1))
            else:
                typer.echo(summary_table(root), nl=False)
            return
        from simtree.reporting.plan_report import render_plan_dir

        outputs = render_plan_dir(plan_dir)
        if as_json:
            typer.echo(json.dumps([{k: str(v) for k, v in paths.items()} for paths in outputs]))
            return
        for paths in outputs:
            typer.echo(f"report: {paths['markdown']} ({paths['heatmap'].name}, {paths['throughput'].name})")

"""`simtree report`: re-render a plan folder's markdown + PNG report."""
from __future__ import annotations

import json

import typer


def register(app: typer.Typer) -> None:
    @app.command("report", help="Render a report (markdown + PNG) from a saved plan folder, or from every "
                                "plan folder under it (one per model).  Example: simtree report reports/plan")
    def report_command(
        plan_dir: str = typer.Argument("reports/plan", help="folder written by `simtree plan`"),
        as_json: bool = typer.Option(False, "--json", help="print the written paths as JSON"),
    ) -> None:
        """simtree report reports/plan"""
        from simtree.reporting.plan_report import render_plan_dir

        outputs = render_plan_dir(plan_dir)
        if as_json:
            typer.echo(json.dumps([{k: str(v) for k, v in paths.items()} for paths in outputs]))
            return
        for paths in outputs:
            typer.echo(f"report: {paths['markdown']} ({paths['heatmap'].name}, {paths['throughput'].name})")

"""`simtree import-metrics`: the acceptance a vLLM or SGLang server measured, as a file that
`simtree plan --workload` takes."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List

import typer


def register(app: typer.Typer) -> None:
    @app.command("import-metrics", help="Read the acceptance a vLLM or SGLang server measured (Prometheus "
                                        "/metrics text, SGLang /server_info or per-request meta_info JSON) into "
                                        "DIR/acceptance.json for `simtree plan --workload DIR/acceptance.json`. "
                                        "Two scrapes (earlier first) take the window between them.  Example: "
                                        "simtree import-metrics http://127.0.0.1:8000/metrics --engine vllm --out m")
    def import_metrics_command(
        sources: List[str] = typer.Argument(..., help="metrics file or http:// URL; two for a window"),
        engine: str = typer.Option(..., "--engine", help="vllm or sglang"),
        out: str = typer.Option(..., "--out", help="output folder (acceptance.json)"),
    ) -> None:
        from simtree.acceptance.engine_file import engine_acceptance_model
        from simtree.engines.metrics import import_metrics
        from simtree.fileio import write_text_atomic

        result = import_metrics(list(sources), engine)
        data = result.to_dict()
        target = Path(out) / "acceptance.json"
        engine_acceptance_model(data, str(target))   # refuse before writing what plan could not read
        write_text_atomic(target, json.dumps(data, indent=1, allow_nan=False) + "\n")
        se = "" if result.mean_accepted_tokens_se is None else f" +- {result.mean_accepted_tokens_se:.3f}"
        drafts = "an unknown number of" if result.num_drafts is None else f"{result.num_drafts}"
        typer.echo(f"{engine}: mean accepted tokens {result.mean_accepted_tokens:.3f}{se} per verify (bonus "
                   f"included), draft length {result.draft_len or '?'}, from {drafts} drafts -> {target}")
        for note in result.notes:
            typer.echo(f"note: {note}", err=True)

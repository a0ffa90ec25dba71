"""`simtree export sglang|vllm POLICY`: a planned policy as what the engine takes today."""
from __future__ import annotations

from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command("export", help="Write a planned policy as what SGLang (launch flags, --speculative-adaptive-config "
                                "JSON, DSpark SPS table) or vLLM (speculative_config with per-batch-size lengths) "
                                "takes, and what each loses in predicted throughput.  Example: simtree export "
                                "sglang reports/h200/plan/qwen3.6-27b_NVIDIA_H200 --out exported")
    def export_command(
        engine: str = typer.Argument(..., help="sglang or vllm"),
        policy: str = typer.Argument(..., help="folder written by `simtree plan`, or its policy.json"),
        out: str = typer.Option(..., "--out", help="output folder"),
        workload: Optional[str] = typer.Option(None, "--workload", help="workload in the policy (default sharegpt)"),
        batch_size: int = typer.Option(1, "--batch-size", min=1, help="batch size of the static SGLang launch"),
        model_path: Optional[str] = typer.Option(None, "--model-path", help="the engine's model path (default: "
                                                 "the policy's model name)"),
        costs: Optional[str] = typer.Option(None, "--costs", help="cost bundle for the SPS table and simtree's "
                                            "controller (default: the shipped one of the policy's model and deployment)"),
        acceptance: Optional[str] = typer.Option(None, "--acceptance", help="what simtree's controller in SGLang "
                                                 "ranks with: a preset, traces.jsonl or an acceptance.json (default: "
                                                 "the workload's preset)"),
    ) -> None:
        from simtree.cli.notes import captured_warnings, print_notes
        from simtree.engines.export import export_policy

        with captured_warnings() as caught:
            m = export_policy(engine, policy, out, workload=workload, batch_size=batch_size,
                              model_path=model_path, costs=costs, acceptance=acceptance)
        print_notes(caught)
        for t in m["tiers"]:
            typer.echo(f"batch {t['batch_min']}-{t['batch_max']}: planned {t['planned']} {t['planned_tok_s']:.0f} "
                       f"tok/s; {engine} runs {t['exported']} {t['exported_tok_s']:.0f} tok/s "
                       f"(-{t['loss']:.1%} predicted)")
        if "static" in m:
            s = m["static"]
            typer.echo(f"static launch at batch {s['batch_size']}: {s['exported']} (-{s['loss']:.1%} vs planned)")
            typer.echo(f"SPS table fit: max relative error {m['sps_table']['max_rel_error']:.1%}")
        typer.echo(f"lost: {m['lost']}")
        c = m.get("controller")
        if c and c["written"]:
            typer.echo(f"controller: {c['config']} (steps {', '.join(map(str, c['steps']))}, priced at context "
                       f"{c['context_len']:.0f}): SGLang runs simtree's controller with launch_controller.txt where "
                       "simtree is installed in its environment (else its own adaptive steps)")
        elif c:
            typer.echo(f"controller: not written: {c['why']}")
        typer.echo(f"wrote {out}/export.json")

"""``simtree profile``: run a profile sweep (GPU, or the torch references on CPU), with the
runtime's own steps (variant runtime_tiny) handed to the profiler's sweep."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from simtree.errors import SimtreeError

HELP = """Measure verify and draft latencies into a profile table (CSV + .meta.json).

Example:

  simtree profile --sweep default_gpu.yaml --out my_gpu/profile.csv

--sweep takes a YAML file or the name of a shipped sweep (default_gpu, quick_cpu, runtime_cpu,
runtime_gpu: the last two time the runtime's own models; collectives_gpu, collectives_dryrun,
collectives_cpu: NCCL / gloo collectives, one process per rank).

--deployment times each model's rank of a deployment (its shard shape: heads and MLP columns
per tensor-parallel rank, local experts under expert parallelism) on this one GPU:

  simtree profile --sweep default_gpu.yaml --model deepseek-v4-flash --deployment ep=8 --out my_gpu/ep8/profile.csv
 Without --sweep it runs
default_gpu.yaml when a CUDA GPU is visible, else quick_cpu.yaml (tiny shapes, torch
references, device "cpu"). Rerunning resumes: measured points are kept.
"""


def register(app: typer.Typer) -> None:
    @app.command("profile", help=HELP)
    def profile(
        sweep: Optional[Path] = typer.Option(None, "--sweep", help="sweep YAML (default: by device)"),
        out: Path = typer.Option(Path("reports/profile/profile.csv"), "--out", "-o", help="profile table CSV"),
        device: Optional[str] = typer.Option(None, "--device", help="cuda | cpu (default: the sweep's)"),
        max_minutes: Optional[float] = typer.Option(None, "--max-minutes", help="stop between points after this"),
        only_stage: Optional[str] = typer.Option(None, "--only-stage", help="run these stages only (comma-separated)"),
        model: Optional[list[str]] = typer.Option(None, "--model", help="restrict to these models"),
        retry_failed: bool = typer.Option(False, "--retry-failed", help="retry points logged as failed/oom"),
        remeasure: bool = typer.Option(False, "--remeasure",
                                       help="measure the selected points again (their rows are dropped first)"),
        as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
        deployment: Optional[str] = typer.Option(None, "--deployment",
                                                 help="time one rank of this deployment (tp=2, ep=8; default: "
                                                      "the sweep's, else one GPU)"),
    ) -> None:
        """Run or resume a sweep; one-line summary at the end."""
        from simtree.profiler.sweep import run_sweep
        from simtree.runtime.profile_steps import step_builders

        echo = (lambda s: None) if as_json else (lambda s: typer.echo(s, err=True))
        # the runtime's own steps (variant runtime_tiny) time the checkpoint folder given, else the tiny default
        folders = [m for m in model or [] if Path(m).expanduser().is_dir()]
        if len(folders) > 1:
            raise SimtreeError(f"--model: one checkpoint folder per sweep, got {len(folders)}: {', '.join(folders)}")
        res = run_sweep(sweep, out, device=device, max_minutes=max_minutes, only_stage=only_stage,
                        models=model or None, retry_failed=retry_failed, remeasure=remeasure,
                        progress=not as_json, echo=echo, builders=step_builders(folders[0] if folders else None),
                        deployment=deployment)
        if as_json:
            typer.echo(json.dumps({"table": str(res.table), "measured": res.measured,
                                   "already_done": res.skipped_done,
                                   "skipped_logged": res.skipped_logged, "failed": res.failed, "oom": res.oom,
                                   "unavailable": res.unavailable, "not_run": res.not_run,
                                   "stopped": res.stopped, "elapsed_s": round(res.elapsed_s, 1),
                                   "checks": res.checks, "compose": res.compose}, indent=2))
        else:
            _print_table(res)
        if res.exit_code:
            raise typer.Exit(res.exit_code)


def _print_table(res) -> None:
    from rich.table import Table

    from simtree.cli.notes import output_console

    console = output_console()
    if res.checks:
        t = Table(title="correctness checks")
        t.add_column("model/stage/variant")
        t.add_column("verdict")
        for k, v in res.checks.items():
            t.add_row(k, v)
        console.print(t)
    stacks = (res.compose or {}).get("stack_validation", {})
    if stacks:
        t = Table(title="composition vs measured layer stacks")
        for c in ("stack", "points", "median |err|", "max |err|"):
            t.add_column(c)
        for k, v in stacks.items():
            fmt = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
            t.add_row(k, str(len(v["points"])), fmt(v["median_abs_rel_err"]), fmt(v["max_abs_rel_err"]))
        console.print(t)
    console.print(res.summary())

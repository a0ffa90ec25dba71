"""`simtree bench-serve`: arrival traces through continuous batching in the simulator, every
speculation policy side by side (SGLang's own adaptive and DSpark planners included)."""
from __future__ import annotations

from typing import List, Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command("bench-serve", help="Serve Poisson and bursty arrival traces (ShareGPT lengths) through "
                                     "continuous batching on the shipped measured costs: none, best_static, "
                                     "threshold, sglang_adaptive (SGLang's AdaptiveStepSlot, default and simtree's "
                                     "config), sglang_dspark and simtree's controller; writes DIR/bench.csv and "
                                     "DIR/bench.png.  Example: simtree bench-serve --out reports/bench_serve")
    def bench_serve_command(
        out: str = typer.Option(..., "--out", help="output folder"),
        costs: Optional[List[str]] = typer.Option(None, "--costs", help="cost bundle (repeatable; default: each "
                                                  "shipped model family's default deployment)"),
        loads: str = typer.Option("0.1,0.4,0.8,1.5", "--loads", help="request rates as multiples of plain "
                                  "decoding's capacity at batch 64 (comma-separated)"),
        arrivals: str = typer.Option("poisson,bursty", "--arrivals", help="poisson, bursty or both"),
        requests: int = typer.Option(300, "--requests", min=1, help="requests per trace"),
        workload: str = typer.Option("sharegpt", "--workload", help="acceptance: preset, trace .jsonl or an "
                                     "engine acceptance file (simtree import-metrics)"),
        seed: int = typer.Option(0, "--seed", help="arrivals' seed; acceptance seeds seed .. seed + replicas - 1"),
        replicas: int = typer.Option(4, "--replicas", min=1, help="acceptance seeds every policy serves each "
                                     "trace under (the same for all: tok/s is their mean, TPOT pools them)"),
        threshold_tiers: Optional[str] = typer.Option(None, "--threshold-tiers", help="a vLLM speculative_config "
                                                      "JSON with num_speculative_tokens_per_batch_size for the "
                                                      "threshold policy (default: simtree's export vllm tiers)"),
        out_of_sample: str = typer.Option("", "--out-of-sample", help="more arrivals seeds (comma-separated), "
                                          "served the same way into DIR/bench_oos.csv (column seed): the controller's "
                                          "settings were chosen on --seed, the README counts the targets on each"),
        keep_configs: bool = typer.Option(False, "--keep-configs", help="also keep the SGLang / vLLM files the "
                                          "engines' policies ran on (DIR/configs)"),
    ) -> None:
        import shlex
        import sys
        from simtree.cli.notes import captured_warnings, print_notes
        from simtree.errors import SimtreeError
        from simtree.serving.bench import run_bench
        from simtree.serving.bench_report import summary_lines, target_lines

        try:
            load_values = tuple(float(x) for x in loads.split(",") if x.strip())
        except ValueError:
            raise SimtreeError(f"--loads {loads!r}: give comma-separated numbers") from None
        if not load_values or not all(0 < x < float("inf") for x in load_values):   # NaN included
            raise SimtreeError(f"--loads {loads!r}: every load must be a finite number > 0")
        kinds = tuple(a.strip() for a in arrivals.split(",") if a.strip())
        try:
            oos = tuple(int(x) for x in out_of_sample.split(",") if x.strip())
        except ValueError:
            raise SimtreeError(f"--out-of-sample {out_of_sample!r}: give comma-separated integer seeds") from None
        with captured_warnings() as caught:
            df, lengths = run_bench(out, models=costs or None, loads=load_values, arrivals=kinds, num_requests=requests,
                           workload=workload, seed=seed, progress=lambda s: typer.echo(f"  {s}", err=True),
                           keep_configs=keep_configs, threshold_tiers=threshold_tiers, replicas=replicas, out_of_sample=oos,
                           command=shlex.join(["simtree", *sys.argv[1:]]))
        print_notes(caught)
        typer.echo(f"lengths: {lengths}")
        for line in summary_lines(df) + target_lines(df):
            typer.echo(line)
        typer.echo(f"wrote {out}/bench.csv, {out}/bench.png, {out}/README.md"
                   + (f", {out}/bench_oos.csv" if oos else ""))

"""`simtree plan`: choose tree on/off, shape and budget per workload and batch size."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.progress import Progress
from rich.table import Table

from simtree.cli.interrupt import Interrupted, exit_interrupted, stop_on_signals
from simtree.cli.notes import ProgressLines, captured_warnings, output_console, print_notes
from simtree.errors import SimtreeError
from simtree.costs.synthetic import SYNTHETIC_LABEL


def parse_batch_sizes(text: str, option: str = "--batch-sizes") -> list[int]:
    """A comma list of batch sizes, each checked; ``option`` names the flag in the errors."""
    from simtree.planning.modes import check_batch_size

    fields = [x.strip() for x in text.split(",")]
    if not text.strip() or any(not f for f in fields):
        raise SimtreeError(f"{option} must be comma-separated integers with no empty entry, got {text!r}")
    try:
        sizes = [int(f) for f in fields]
    except ValueError:
        raise SimtreeError(f"{option} must be comma-separated integers, got {text!r}") from None
    return [check_batch_size(b, f"{option} entry {b}") for b in sizes]


def plan_and_write(*args, **kwargs) -> list[dict]:
    """What `simtree plan` does: plan every bundle and save its policy file
    (:func:`simtree.planning.bundles.plan_bundles`, whose arguments these are), then render its
    report (:func:`simtree.reporting.plan_report.write_plan_reports`).  One dict per bundle:
    result, bands, policy, policy_data, folder, report."""
    from simtree.planning.bundles import PARTIAL_MARKER, plan_bundles
    from simtree.reporting.plan_report import write_bundle_report, write_plan_index, write_plan_reports

    done: list[dict] = []

    def finish(output: dict) -> None:
        write_bundle_report(output)
        done.append(output)

    try:
        return write_plan_reports(plan_bundles(*args, finish=finish, **kwargs))
    except KeyboardInterrupt:   # the finished folders listed, the index marked partial (PARTIAL.md says which)
        out_dir = Path(kwargs.get("out_dir", args[3] if len(args) > 3 else "reports/plan"))
        if done and done[0]["folder"] != out_dir:   # a folder per bundle: their index
            write_plan_index(out_dir, done, [f"partial: interrupted, see {PARTIAL_MARKER}"])
        raise


def register(app: typer.Typer) -> None:
    @app.command("plan", help="Choose tree on/off, shape and budget per batch size and workload; "
                              "write a policy and report.  Example: simtree plan --workload sharegpt "
                              "--batch-sizes 1,8,64 --out reports/plan.  A shipped model at one "
                              "deployment: simtree plan --model qwen3.6-27b --deployment tp=2 (a deployment "
                              "whose weights and caches do not fit its GPUs is refused, naming the shortfall).  Another "
                              "machine's defaults: simtree plan --machine h100")
    def plan_command(
        costs: Optional[List[str]] = typer.Option(None, "--costs", help="CostBundle JSON (repeatable); "
                                                  "default: the shipped bundles of --machine, else SYNTHETIC"),
        machine: Optional[str] = typer.Option(None, "--machine", help="plan this machine's shipped default "
                                              "bundles (simtree/data/costs/<machine>_*.json; a machine of "
                                              "simtree/data/deployments.yaml, default h200)"),
        workload: Optional[List[str]] = typer.Option(None, "--workload", help="preset (gsm8k, mbpp, sharegpt) "
                                                     "or acceptance trace .jsonl or DRAFTS.jsonl@TRACES.jsonl (a workload's "
                                                     "drafter confidences calibrated on another's traces) (repeatable); "
                                                     "default: all presets"),
        batch_sizes: str = typer.Option("1,2,4,8,16,32,64", "--batch-sizes", help="comma-separated"),
        out: str = typer.Option("reports/plan", "--out", help="output folder (policy.json, plan.md, PNGs)"),
        prompt_len: Optional[float] = typer.Option(None, "--prompt-len", help="override mean prompt length"),
        output_len: Optional[int] = typer.Option(None, "--output-len", help="override tokens generated per sequence"),
        as_json: bool = typer.Option(False, "--json", help="print the chosen policies as JSON"),
        band_models: Optional[int] = typer.Option(None, "--band-models", min=0, help="bootstrap acceptance models "
                                                  "per workload for each choice's uncertainty band (default 16; "
                                                  "0: no bands)"),
        model: Optional[str] = typer.Option(None, "--model", help="plan this model's bundles only (e.g. "
                                            "deepseek-v4-flash)"),
        deployment: Optional[str] = typer.Option(None, "--deployment", help="plan this deployment only: tp=N, "
                                                 "ep=N (experts over N GPUs, attention data-parallel), ep=N,tp=T"),
        modes: Optional[str] = typer.Option(None, "--modes", help="comma-separated families to search (plain "
                                            "decoding always is), e.g. linear,eagle (default: every mode simtree "
                                            "run builds: none, linear, eagle, best_first, cost_aware, batch_alloc; "
                                            "no other may be named)"),
        comm: Optional[str] = typer.Option(None, "--comm", help="communication model (.comm.json from `simtree "
                                           "fit` of a collectives profile) instead of the bundles' own"),
    ) -> None:
        """Plan on the embedded default:  simtree plan"""
        from simtree.planning.bands import BAND_MODELS
        from simtree.planning.modes import TREE_MODES
        from simtree.planning.planner import SearchSpace
        from simtree.fileio import check_out_folder
        from simtree.planning.bundles import PARTIAL_MARKER

        sizes = parse_batch_sizes(batch_sizes)
        check_out_folder(out)
        space = SearchSpace() if modes is None else \
            SearchSpace(modes=tuple(m.strip() for m in modes.split(",") if m.strip()))
        console = output_console(stderr=as_json)
        # a progress bar on a terminal; piped output gets progress lines on stderr instead
        lines = ProgressLines("plan", enabled=not console.is_terminal and not as_json)
        folders = {"count": 0, "finished": 0, "since": None}

        def started(folder: str, index: int, count: int) -> None:
            folders.update(count=count, finished=index, since=time.monotonic())
            lines.say(f"planning {folder} ({index + 1} of {count})")

        with Progress(console=console, transient=True, disable=not console.is_terminal) as bar, \
                captured_warnings() as caught:
            task = bar.add_task("planning", total=None)
            plan_notes: list = []

            def progress(done: int, total: int) -> None:
                stop.check()     # a signal whose exception Python dropped stops the plan here
                bar.update(task, completed=done, total=total)
                lines.update(done, total, "(workload, batch size) entries searched" +
                             ("; then bootstrap bands and the report" if done == total else ""), folders["since"])

            try:
                with stop_on_signals() as stop:
                    outputs = plan_and_write(costs or (), workload or (), sizes, out, prompt_len, output_len,
                                             progress=progress, model=model, deployment=deployment, comm=comm,
                                             notes=plan_notes, space=space, started=started, machine=machine,
                                             band_models=BAND_MODELS if band_models is None else band_models)
            except Interrupted as exc:
                bar.stop()
                marker = Path(out) / PARTIAL_MARKER
                done = f"{folders['finished']} of {folders['count']}"
                exit_interrupted(exc, f"plan stopped with {done} plan folders finished; {out} is marked partial "
                                      f"({marker} says which); rerun the same command to complete it"
                                 if marker.is_file() else f"plan stopped before writing to {out}; rerun the same "
                                                          "command to plan")
        print_notes(caught, console)   # the plan's own notes (extrapolated costs) follow its table
        print_notes(plan_notes, console)
        if as_json:
            for o in outputs:
                print_notes(o["result"].notes, console)
            typer.echo(json.dumps([{"policy_file": str(o["policy"]), "synthetic": o["result"].synthetic,
                                    "communication": (o["result"].communication or {}).get("label"),
                                    **o["policy_data"].to_dict()} for o in outputs], indent=1))
            return
        for o in outputs:
            res = o["result"]
            if res.synthetic:
                console.print(f"[bold red]SYNTHETIC COSTS[/]: {SYNTHETIC_LABEL} - predictions are not measurements")
            flagged = bool(res.chosen["within_model_error"].any())
            caption = (f"* within model error: gain over linear < the verify fit's held-out median error "
                       f"({100 * res.model_error:.1f}%)" if flagged and res.model_error else None)
            comm = res.communication
            if comm is not None and comm.get("assumed"):
                console.print(f"[bold yellow]COMMUNICATION ASSUMED[/]: the collectives of {res.deployment} come from "
                              "the default alpha-beta model (docs/deployments.md), not from measurements")
            table = Table(title=f"plan: {res.model} at {res.deployment} on {res.device}"
                                + (f" ({comm['label']})" if comm else ""), caption=caption)
            for col in ("workload", "batch", "policy", "tree", "tok/round", "tok/s", "vs linear", "vs none"):
                table.add_column(col, no_wrap=col == "policy")
            for r in res.chosen.itertuples():
                on = "on" if r.mode in TREE_MODES else "off"
                on += "*" if r.within_model_error else ""
                table.add_row(r.workload, str(r.batch_size), r.policy, on, f"{r.tokens_per_round:.2f}",
                              f"{r.tok_s:.0f}", f"{r.gain_vs_linear:.3f}", f"{r.gain_vs_none:.2f}")
            console.print(table)
            print_notes(res.notes, console)
            console.print(f"policy: {o['policy']}  report: {o['report']['markdown']}")


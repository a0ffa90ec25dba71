"""`simtree simulate`: predicted decode throughput of one policy."""
from __future__ import annotations

import json
import warnings
from typing import Optional

import typer
from rich.table import Table

from simtree.cli.notes import ProgressLines, captured_warnings, output_console, print_notes
from simtree.errors import SimtreeError
from simtree.costs.synthetic import SYNTHETIC_LABEL
from simtree.planning.modes import EAGLE_FLAG_DEFAULTS


def register(app: typer.Typer) -> None:
    @app.command("simulate", help="Predict decode throughput of one policy for a model, workload and batch "
                                  "size.  Example: simtree simulate --model qwen3.6-27b --workload sharegpt "
                                  "--batch-size 8 --policy-mode eagle --steps 4 --topk 2 --budget 5 "
                                  "--monte-carlo 200.  "
                                  "Budgets up to 1024 nodes, steps / top-k / draft depth / width up to 64 "
                                  "(simtree.planning.simulate.MAX_TREE_NODES, MAX_DRAFT_STEPS)")
    def simulate_command(
        costs: Optional[str] = typer.Option(None, "--costs", help="CostBundle JSON (default: shipped, else SYNTHETIC)"),
        model: Optional[str] = typer.Option(None, "--model", help="which shipped bundle (e.g. qwen3.6-27b); "
                                            "needed when several ship and --costs is not given"),
        workload: str = typer.Option("sharegpt", "--workload", help="preset or acceptance trace .jsonl"),
        batch_size: int = typer.Option(1, "--batch-size"),
        policy_mode: str = typer.Option("eagle", "--policy-mode",
                                        help="none | linear | eagle | best_first | cost_aware | batch_alloc"),
        steps: Optional[int] = typer.Option(None, "--steps",
                                            help=f"eagle: draft steps s (default {EAGLE_FLAG_DEFAULTS['steps']})"),
        topk: Optional[int] = typer.Option(None, "--topk",
                                           help=f"eagle: top-k (default {EAGLE_FLAG_DEFAULTS['topk']})"),
        budget: int = typer.Option(4, "--budget", help="nodes incl. root (linear, eagle, best_first); "
                                   "max budget for cost_aware / batch_alloc"),
        width: int = typer.Option(1, "--width", help="best_first: heap pops per step"),
        draft_depth: Optional[int] = typer.Option(None, "--draft-depth", help="marginal modes: drafted positions"),
        policy: Optional[str] = typer.Option(None, "--policy", help="policy JSON: use its entry for workload/batch"),
        monte_carlo: int = typer.Option(0, "--monte-carlo", help="Monte-Carlo replications (0 = analytic)"),
        prompt_len: Optional[float] = typer.Option(None, "--prompt-len"),
        output_len: Optional[int] = typer.Option(None, "--output-len"),
        seed: int = typer.Option(0, "--seed"),
        as_json: bool = typer.Option(False, "--json"),
        deployment: Optional[str] = typer.Option(None, "--deployment", help="which deployment's bundle (tp=2, "
                                                 "ep=8); refused when its weights and caches do not fit"),
        comm: Optional[str] = typer.Option(None, "--comm", help="communication model (.comm.json) instead of "
                                           "the bundle's own"),
        machine: Optional[str] = typer.Option(None, "--machine", help="whose shipped bundles (h200, h100; default "
                                              "the --policy's GPU, else h200)"),
    ) -> None:
        """simtree simulate --workload gsm8k --batch-size 16 --policy-mode linear --budget 4"""
        from rich.progress import Progress

        err = output_console(stderr=True)
        lines = ProgressLines("monte-carlo", enabled=monte_carlo > 0 and not err.is_terminal, every_s=10.0)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done)
            lines.update(done, total, "replications")

        with Progress(console=err, transient=True, disable=monte_carlo == 0 or not err.is_terminal) as bar, \
                captured_warnings() as caught:
            task = bar.add_task("monte-carlo", total=monte_carlo or None)
            result = simulate_command_run(costs, workload, batch_size, policy_mode, steps, topk, budget, width,
                                          draft_depth, policy, monte_carlo, prompt_len, output_len, seed,
                                          progress=progress,
                                          model=model, deployment=deployment, comm=comm, machine=machine)
        # warnings (out-of-range costs, a clamped policy) and the result's notes: one line each
        print_notes(list(caught) + list(result.notes), err)
        if as_json:
            typer.echo(json.dumps(result.to_dict(), indent=1))
            return
        console = output_console()
        if result.synthetic:
            console.print(f"[bold red]SYNTHETIC COSTS[/]: {SYNTHETIC_LABEL}")
        if result.communication:
            console.print(f"[bold yellow]{result.communication.upper()}[/]: the collectives come from the default "
                          "alpha-beta model (docs/deployments.md)" if "assumed" in result.communication else
                          f"{result.communication}")
        table = Table(title=f"{result.model} at {result.deployment} | {result.policy} | {result.workload} | "
                            f"batch {result.batch_size} | {result.method}")
        table.add_column("metric")
        table.add_column("value")
        ci = result.ci95
        rows = [("accepted tokens / round (incl. bonus)", f"{result.accepted_tokens_per_round:.3f}"
                 + (" [%.3f, %.3f]" % tuple(ci["accepted_tokens_per_round"]) if ci else "")),
                ("nodes / sequence", f"{result.mean_nodes_per_seq:.2f}"),
                ("round latency (us)", f"{result.round_latency_us:.1f}"),
                ("  draft / verify (us)", f"{result.draft_us:.1f} / {result.verify_us:.1f}"),
                ("throughput (tok/s, batch)", f"{result.throughput_tok_s:.1f}"
                 + (" [%.1f, %.1f]" % tuple(ci["throughput_tok_s"]) if ci else "")),
                ("throughput (tok/s, per seq)", f"{result.per_seq_tok_s:.1f}"),
                ("speedup vs plain decoding", f"{result.speedup_vs_none:.3f}"),
                (f"speedup vs linear D={result.linear_budget}", f"{result.speedup_vs_linear:.3f}")]
        for k, v in rows:
            table.add_row(k, v)
        console.print(table)


def pick_bundle(bundles: list, source: str):
    """The only bundle left, or a one-line error naming the choices when there are several."""
    if len(bundles) == 1:
        return bundles[0]
    names = [f"{b.meta.get('model')} at {b.meta.get('deployment') or 'tp=1'}" for b in bundles]
    raise SimtreeError(f"{len(bundles)} cost bundles in {source} ({', '.join(names)}): pick one with --model "
                       "and --deployment")


def simulate_command_run(costs_path, workload_spec: str, batch_size: int, mode: str, steps: int | None, topk: int | None,
                         budget: int, width: int = 1, draft_depth: int | None = None, policy_path=None,
                         mc_runs: int = 0, prompt_len=None, output_len=None, seed: int = 0,
                         progress=None, model: str | None = None, deployment: str | None = None, comm=None,
                         machine: str | None = None):
    """`simtree simulate`: resolve costs (path / the shipped bundle of ``model`` at
    ``deployment`` on ``machine`` - default the policy file's GPU, else the default machine - /
    SYNTHETIC; a deployment that cannot hold the batch's weights and caches is
    refused), the workload and the policy (flags, or the policy file's entry for this workload
    and batch size), simulate.  The result's ``communication`` says what the collectives rest on."""
    from simtree.acceptance.model import get_workload
    from simtree.deploy.select import select_costs
    from simtree.planning.modes import check_batch_size, params_from_flags
    from simtree.planning.simulate import simulate

    workload = get_workload(workload_spec, prompt_len, output_len)
    check_batch_size(batch_size)
    if policy_path:   # its model picks the shipped bundle unless --model says otherwise
        from simtree.planning.policy_file import Policy
        pol = Policy.load(policy_path)
        pol.check_served(f"--policy {policy_path}", "simulate it at its deployment")
        entry, note = pol.resolve(workload.name, batch_size)
        if note:
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        spec = entry.params
        if model and pol.model and model != pol.model:
            raise SimtreeError(f"--policy {policy_path} is a plan for {pol.model}, not {model} (--model)")
        model = model or pol.model
        deployment = deployment or pol.deployment
        if not costs_path and machine is None:   # a plan of the H100 defaults simulates on them
            from simtree.deploy.shipped import shipped_machine_for
            machine = shipped_machine_for(pol.device)
    else:
        spec = params_from_flags(mode, steps, topk, budget, width, draft_depth)
    if model and not deployment and not costs_path:   # a shipped model named alone: its default deployment
        from simtree.deploy.shipped import DEFAULT_MACHINE, default_deployment
        deployment = default_deployment(model, machine or DEFAULT_MACHINE).name
    bundles, _ = select_costs([costs_path] if costs_path else [], model, deployment, batch_size,
                              workload.mean_prompt_len + workload.output_len, comm, machine)
    costs = pick_bundle(bundles, costs_path or "simtree/data/costs")
    return simulate(costs, workload, batch_size, spec, mc_runs=mc_runs, seed=seed, progress=progress)

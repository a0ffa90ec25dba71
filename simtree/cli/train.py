"""``simtree train``: train the shipped target and draft models on CPU."""
from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("train", help="Train the small target and draft models that the runtime ships.\n\n"
                               "Example: simtree train --target-steps 250 --draft-steps 600 --out simtree/data/models")
    def train(
        out: Path = typer.Option(None, help="output folder (gets target/ and draft/); default: the shipped models"),
        target_steps: int = typer.Option(250, help="optimizer steps for the target"),
        draft_steps: int = typer.Option(600, help="optimizer steps for the draft model"),
        batch_size: int = typer.Option(16, help="windows per step"),
        seq_len: int = typer.Option(96, help="tokens (bytes) per window"),
        lr: float = typer.Option(3e-3, help="peak learning rate"),
        seed: int = typer.Option(0, help="random seed (deterministic for a given seed and step count)"),
        max_seconds: float = typer.Option(600.0, help="stop a model's training early after this many seconds"),
        only: str = typer.Option(None, help="train only 'target' or 'draft'"),
        resume: bool = typer.Option(False, help="continue from the checkpoints already in --out"),
        json_out: bool = typer.Option(False, "--json", help="print the summary as JSON"),
    ) -> None:
        """Example: simtree train --target-steps 250 --draft-steps 600"""
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        from simtree.runtime.loading import DEFAULT_MODELS_DIR
        from simtree.runtime.train import TrainConfig, train_models

        from simtree.errors import SimtreeError

        if only not in (None, "target", "draft"):
            raise SimtreeError(f"--only must be 'target' or 'draft', got {only!r}")
        cfg = TrainConfig(target_steps=target_steps, draft_steps=draft_steps, batch_size=batch_size,
                          seq_len=seq_len, lr=lr, seed=seed, max_seconds=max_seconds,
                          models=(only,) if only else ("target", "draft"), resume=resume)
        out = out or DEFAULT_MODELS_DIR
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(),
                      disable=json_out, transient=False) as bar:
            totals = {"target": target_steps, "draft": draft_steps}
            tasks = {n: bar.add_task(n, total=totals[n], loss=float("nan")) for n in cfg.models}

            def progress(name: str, step: int, loss: float) -> None:
                bar.update(tasks[name], completed=step, loss=loss)

            summary = train_models(out, cfg, progress)
        if json_out:
            typer.echo(json.dumps(summary, indent=2))
            return
        done = ", ".join(f"{n} ({summary[n]['steps']} steps, loss {summary[n]['final_loss']:.3f}, "
                         f"{summary[n]['seconds']} s)" for n in cfg.models)
        Console().print(f"trained {done} -> {out}")

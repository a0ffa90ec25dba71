"""``simtree train``: train the runtime's small target and draft models on CPU (resumable)."""
from __future__ import annotations

import json
from pathlib import Path

import typer

HELP = ("Train the small target and draft models that the runtime ships.\n\n"
        "Checkpoints go to OUT/checkpoints every --checkpoint-every steps and on Ctrl-C; running the "
        "same command again continues an interrupted job (same final weights as an uninterrupted run) "
        "and skips models already finished. --extend trains finished models on to the given step "
        "counts; --restart starts over. The shipped models (simtree/data/models) are only replaced "
        "with --overwrite-shipped.\n\n"
        "Example: simtree train --target-steps 250 --draft-steps 600 --out simtree_models  "
        "(then: simtree run --models simtree_models)\n\n"
        "--arch qwen3_5_text trains a Qwen3.5-architecture target with its MTP layer and a BPE "
        "tokenizer instead (one bounded call, a Hugging Face folder: simtree run --model OUT). "
        "Example: simtree train --arch qwen3_5_text --size cpu --target-steps 2000 --out qwen-tiny")


def register(app: typer.Typer) -> None:
    @app.command("train", help=HELP)
    def train(
        out: Path = typer.Option(Path("simtree_models"), help="output folder (gets target/, draft/ and, while "
                                                              "training, checkpoints/)"),
        target_steps: int = typer.Option(250, help="optimizer steps for the target (in total)"),
        draft_steps: int = typer.Option(600, help="optimizer steps for the draft model (in total)"),
        batch_size: int = typer.Option(16, help="windows per step"),
        seq_len: int = typer.Option(96, help="tokens (bytes) per window (at most 2048)"),
        lr: float = typer.Option(3e-3, help="peak learning rate"),
        seed: int = typer.Option(0, help="random seed (deterministic for a given seed and step count)"),
        max_seconds: float = typer.Option(600.0, help="stop a model's training early after this many seconds "
                                                      "(checkpointed: rerun to continue)"),
        only: str = typer.Option(None, help="train only 'target' or 'draft'"),
        checkpoint_every: int = typer.Option(25, help="steps between checkpoints"),
        extend: bool = typer.Option(False, help="train models already finished in --out on until they have "
                                                "--target-steps / --draft-steps steps in total (a new session: "
                                                "fresh optimizer, warm-up and cosine over the added steps)"),
        restart: bool = typer.Option(False, help="discard the checkpoints in --out and train from scratch "
                                                 "(replaces the models there)"),
        overwrite_shipped: bool = typer.Option(False, help="allow --out to be the shipped models' folder "
                                                           "(replaces the models `simtree run` uses by default)"),
        resume: bool = typer.Option(False, hidden=True),
        json_out: bool = typer.Option(False, "--json", help="print the summary as JSON"),
        arch: str = typer.Option("byte", help="byte (the runtime's byte-level target and draft) or "
                                              "qwen3_5_text (a Qwen3.5-architecture target + MTP layer)"),
        size: str = typer.Option("cpu", help="qwen3_5_text: test | cpu | gpu (runtime/target_model.py PRESETS)"),
        vocab_size: int = typer.Option(2048, help="qwen3_5_text: BPE vocabulary"),
        tokenizer: Path = typer.Option(None, help="qwen3_5_text: reuse this tokenizer.json (else trained)"),
        device: str = typer.Option("cpu", help="qwen3_5_text: cpu or cuda"),
        conversations: int = typer.Option(2000, help="qwen3_5_text: ShareGPT records x 2 read (even ones train)"),
        overwrite: bool = typer.Option(False, help="qwen3_5_text: replace a non-empty --out"),
    ) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        from simtree.errors import SimtreeError
        from simtree.runtime.train import TrainConfig, TrainingInterrupted, train_models

        if arch == "qwen3_5_text":
            _train_target(out, size, target_steps, batch_size, seq_len, lr, seed, max_seconds, vocab_size,
                          tokenizer, device, conversations, overwrite, json_out)
            return
        if arch != "byte":
            raise SimtreeError(f"--arch must be 'byte' or 'qwen3_5_text', got {arch!r}")
        if resume:
            raise SimtreeError("--resume is gone: rerunning the same command continues an interrupted job; "
                               "--extend trains finished models on to more steps")
        if only not in (None, "target", "draft"):
            raise SimtreeError(f"--only must be 'target' or 'draft', got {only!r}")
        cfg = TrainConfig(target_steps=target_steps, draft_steps=draft_steps, batch_size=batch_size,
                          seq_len=seq_len, lr=lr, seed=seed, max_seconds=max_seconds,
                          models=(only,) if only else ("target", "draft"), checkpoint_every=checkpoint_every,
                          extend=extend, restart=restart)   # train_models validates it
        # the bar starts with the first step (an error before it prints no empty bar lines)
        bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                       TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(),
                       disable=json_out, transient=False, console=Console(stderr=True))
        tasks = {}

        def progress(name: str, step: int, loss: float) -> None:
            if not tasks:
                bar.start()
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=cfg.steps_for(name),
                                           loss=float("nan"))
            bar.update(tasks[name], completed=step, loss=loss)

        def events(line: str) -> None:
            if not json_out:
                bar.console.print(line, highlight=False, markup=False, soft_wrap=True)

        try:
            summary = train_models(out, cfg, progress, events, overwrite_shipped=overwrite_shipped)
        except TrainingInterrupted as exc:
            if tasks:
                bar.stop()
                tasks.clear()
            typer.echo(str(exc), err=True)
            raise typer.Exit(130) from None
        finally:
            if tasks:
                bar.stop()
        if json_out:
            typer.echo(json.dumps(summary, indent=2, allow_nan=False))
            return
        parts = []
        for n in cfg.models:
            s = summary[n]
            loss = "-" if s.get("final_loss") is None else f"{s['final_loss']:.3f}"
            if s["status"] == "skipped":
                parts.append(f"{n} (skipped: {s['why']})")
            else:
                parts.append(f"{n} ({s['status']}: {s['total_steps']}/{s['planned_steps']} steps, "
                             f"{s['steps']} this run, loss {loss}, {s['seconds']} s)")
        typer.echo(f"{', '.join(parts)} -> {out}")
        if any(summary[n]["status"] == "stopped" for n in cfg.models):
            typer.echo("stopped early by --max-seconds: rerun the same command to continue")


def _train_target(out, size, steps, batch_size, seq_len, lr, seed, max_seconds, vocab_size, tokenizer, device,
                  conversations, overwrite, json_out) -> None:
    from simtree.runtime.target_train import TargetTrainConfig, train_target

    cfg = TargetTrainConfig(size=size, steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed,
                            max_seconds=max_seconds, vocab_size=vocab_size, device=device,
                            conversations=conversations, tokenizer=None if tokenizer is None else str(tokenizer))
    say = None if json_out else (lambda line: typer.echo(line, err=True))
    rec = train_target(out, cfg, overwrite=overwrite, events=say)
    if json_out:
        typer.echo(json.dumps(rec, indent=2, allow_nan=False))
        return
    typer.echo(f"target ({rec['parameters']} parameters): {rec['steps']}/{rec['planned_steps']} steps, held-out loss "
               f"{rec['heldout_lm_loss']:.3f} (MTP {rec['heldout_mtp_loss']:.3f}), {rec['train_seconds']} s -> {out}")

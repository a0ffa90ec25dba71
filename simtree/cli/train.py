"""``simtree train``: train a small Qwen3.5-architecture target with its MTP layer (resumable)."""
from __future__ import annotations

import json
from pathlib import Path

import typer

HELP = ("Train a Qwen3.5-architecture target with its MTP layer and a BPE tokenizer on the packaged "
        "text, written as a Hugging Face folder that `simtree run --model OUT` decodes.\n\n"
        "The job's state is checkpointed to OUT/checkpoint.safetensors every --checkpoint-every steps "
        "and on Ctrl-C; --resume continues it (the same weights as an uninterrupted run). --max-seconds "
        "publishes an unfinished folder that --resume also continues.\n\n"
        "Example: simtree train --size cpu --target-steps 2000 --out qwen-tiny")


def run_job(train, json_out: bool, summary) -> None:
    """A training command's job: ``train(events)`` -> its record, progress lines on stderr (none
    with --json); an interruption's one line (where the checkpoint is, how to resume) and exit
    130; then the record as JSON, or ``summary(record, done)``'s line (``done``: the note of a
    job stopped early)."""
    from simtree.runtime.train_state import TrainingInterrupted

    say = None if json_out else (lambda line: typer.echo(line, err=True))
    try:
        rec = train(say)
    except TrainingInterrupted as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(130) from None
    if json_out:
        typer.echo(json.dumps(rec, indent=2, allow_nan=False))
        return
    typer.echo(summary(rec, "" if rec["complete"] else " (stopped early: --resume continues)"))


def register(app: typer.Typer) -> None:
    @app.command("train", help=HELP)
    def train(
        out: Path = typer.Option(..., help="output folder (a Hugging Face folder when training ends)"),
        target_steps: int = typer.Option(2000, help="optimizer steps (0: as many as fit --max-seconds)"),
        batch_size: int = typer.Option(16, help="windows per step"),
        seq_len: int = typer.Option(128, help="tokens per window"),
        lr: float = typer.Option(2e-3, help="peak learning rate"),
        seed: int = typer.Option(0, help="random seed (deterministic on CPU for a given seed and step count)"),
        max_seconds: float = typer.Option(1200.0, help="stop early after this many seconds of training and "
                                                       "publish the model as is (--resume continues it)"),
        checkpoint_every: int = typer.Option(100, help="steps between checkpoints"),
        resume: bool = typer.Option(False, help="continue the interrupted or stopped job whose checkpoint --out "
                                                "holds (same settings)"),
        overwrite: bool = typer.Option(False, help="replace a non-empty --out (training from scratch)"),
        json_out: bool = typer.Option(False, "--json", help="print the record as JSON"),
        arch: str = typer.Option("qwen3_5_text", help="model architecture (qwen3_5_text)"),
        size: str = typer.Option("cpu", help="test | cpu | gpu (runtime/target_model.py PRESETS)"),
        vocab_size: int = typer.Option(2048, help="BPE vocabulary"),
        tokenizer: Path = typer.Option(None, help="reuse this tokenizer.json (else trained)"),
        device: str = typer.Option("cpu", help="cpu or cuda"),
        conversations: int = typer.Option(2000, help="ShareGPT records x 2 read (even ones train)"),
    ) -> None:
        from simtree.errors import SimtreeError
        from simtree.runtime.target_train import TargetTrainConfig, train_target

        if arch != "qwen3_5_text":
            raise SimtreeError(f"--arch must be 'qwen3_5_text', got {arch!r}")
        cfg = TargetTrainConfig(size=size, steps=target_steps, batch_size=batch_size, seq_len=seq_len, lr=lr,
                                seed=seed, max_seconds=max_seconds, checkpoint_every=checkpoint_every,
                                vocab_size=vocab_size, device=device, conversations=conversations,
                                tokenizer=None if tokenizer is None else str(tokenizer))
        run_job(lambda say: train_target(out, cfg, overwrite=overwrite, events=say, resume=resume), json_out,
                lambda rec, done: f"target ({rec['parameters']} parameters): {rec['steps']}/{rec['planned_steps']} "
                                  f"steps{done}, held-out loss {rec['heldout_lm_loss']:.3f} (MTP "
                                  f"{rec['heldout_mtp_loss']:.3f}), {rec['train_seconds']} s -> {out}")

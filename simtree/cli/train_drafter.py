"""``simtree train-drafter``: train a block drafter for a trained target folder (resumable)."""
from __future__ import annotations

from pathlib import Path

import typer

HELP = ("Train a block drafter (block: DFlash-style parallel marginals; dspark: DSpark with its Markov and "
        "confidence heads; tfm: a TfM adapter over a trained block drafter, its backbone kept) for a target folder written by `simtree train`, the target frozen, on the target's "
        "own greedy continuations of the training text (docs/drafters.md \"Trained drafters\").  Written to "
        "MODEL/drafters/FAMILY, which `simtree run --model MODEL --mode FAMILY` loads.\n\n"
        "Checkpointed every --checkpoint-every steps and on Ctrl-C; --resume continues it (the same weights "
        "as an uninterrupted run); --max-seconds publishes an unfinished folder that --resume also continues.\n\n"
        "Example: simtree train-drafter --model simtree/data/models/qwen3.5-tiny-sharegpt --drafter block")


def register(app: typer.Typer) -> None:
    @app.command("train-drafter", help=HELP)
    def train_drafter_cmd(
        model: Path = typer.Option(..., help="the target folder (simtree train's output)"),
        drafter: str = typer.Option("block", help="block | dspark | tfm"),
        out: Path = typer.Option(None, help="output folder (default MODEL/drafters/DRAFTER)"),
        steps: int = typer.Option(300, help="optimizer steps"),
        batch_size: int = typer.Option(16, help="greedy sequences per step"),
        prefix_len: int = typer.Option(32, help="training-text tokens before each greedy continuation"),
        gen_len: int = typer.Option(96, help="greedy tokens of the target per sequence"),
        anchors: int = typer.Option(32, help="blocks drawn per sequence"),
        block_len: int = typer.Option(7, help="rows of one drafter forward (depths drafted)"),
        layers: int = typer.Option(2, help="draft layers"),
        markov_rank: int = typer.Option(64, help="DSpark's Markov head rank"),
        cand_k: int = typer.Option(64, help="TfM: candidates per position the adapter scores"),
        adapter_dim: int = typer.Option(64, help="TfM: the adapter's width"),
        init_from: Path = typer.Option(None, help="TfM: the trained block drafter it adapts (default "
                                                  "MODEL/drafters/block)"),
        lr: float = typer.Option(2e-3, help="peak learning rate"),
        seed: int = typer.Option(0, help="random seed (deterministic for a given seed and step count)"),
        max_seconds: float = typer.Option(1200.0, help="stop early after this many seconds and publish as is "
                                                       "(--resume continues it)"),
        checkpoint_every: int = typer.Option(50, help="steps between checkpoints"),
        conversations: int = typer.Option(2000, help="ShareGPT records x 2 read (even ones train)"),
        resume: bool = typer.Option(False, help="continue the job whose checkpoint --out holds (same settings)"),
        overwrite: bool = typer.Option(False, help="replace a non-empty --out (training from scratch)"),
        json_out: bool = typer.Option(False, "--json", help="print the record as JSON"),
    ) -> None:
        from simtree.runtime.drafter_train import DrafterTrainConfig, train_drafter

        from simtree.cli.train import run_job

        cfg = DrafterTrainConfig(family=drafter, steps=steps, batch_size=batch_size, prefix_len=prefix_len,
                                 gen_len=gen_len, anchors=anchors, block_len=block_len, layers=layers,
                                 markov_rank=markov_rank, cand_k=cand_k, adapter_dim=adapter_dim,
                                 init_from=None if init_from is None else str(init_from), lr=lr, seed=seed, max_seconds=max_seconds,
                                 checkpoint_every=checkpoint_every, conversations=conversations)
        run_job(lambda say: train_drafter(model, cfg, out=out, overwrite=overwrite, resume=resume, events=say),
                json_out,
                lambda rec, done: f"{rec['family']} drafter ({rec['parameters']} parameters): {rec['steps']} "
                                  f"steps{done}, held-out depth-1 top-1 {rec['heldout_top1_depth1']:.3f}, chain "
                                  f"{rec['heldout_chain_accept']:.2f} accepted a block, {rec['train_seconds']} s -> "
                                  f"{rec['out']}")

"""Train the shipped target and draft models on CPU from the packaged text.

Next-byte cross-entropy on random windows of the concatenated training documents
(``data.training_text``; documents separated by BOS), AdamW with linear warm-up and cosine
decay, gradient clipping 1.0.  Deterministic for a given seed and step count (torch and the
window sampler are seeded; one thread keeps float reductions in a fixed order).  Each model
is written atomically (``loading.save_model``) as soon as it finishes.

``resume``: continue from the checkpoint already in the output folder (weights only: the
optimizer restarts with a fresh warm-up and cosine over the new steps; the steps of every
session are summed in config.json's ``simtree_training``).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from simtree.errors import SimtreeError
from simtree.runtime.data import training_text
from simtree.runtime.loading import load_model, save_model
from simtree.runtime.model import HybridLM, ModelConfig
from simtree.runtime.tokenizer import BOS

__all__ = ["TrainConfig", "train_models", "target_config", "draft_config", "token_stream"]


def target_config() -> ModelConfig:
    """4 layers [GDN, GDN, GDN, attention], d 128: Qwen3.6's pattern scaled down."""
    return ModelConfig()


def draft_config() -> ModelConfig:
    """2 attention layers, d 128, MLP 256: about 3x cheaper per token than the target."""
    return ModelConfig(layer_types=["full_attention"] * 2, intermediate_size=256)


@dataclass
class TrainConfig:
    target_steps: int = 250
    draft_steps: int = 600
    batch_size: int = 16
    seq_len: int = 96
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0
    max_seconds: float = 600.0   # safety bound per model; steps stop early if exceeded
    sharegpt_conversations: int = 1500
    models: tuple = ("target", "draft")
    resume: bool = False


def token_stream(docs: list[str]) -> np.ndarray:
    """All documents as one uint16 stream of byte tokens, each document preceded by BOS."""
    parts = []
    for d in docs:
        parts += [np.array([BOS], np.uint16), np.frombuffer(d.encode("utf-8"), np.uint8).astype(np.uint16)]
    return np.concatenate(parts)


def _train_one(model: HybridLM, stream: np.ndarray, steps: int, cfg: TrainConfig, seed: int,
               on_step=None) -> dict:
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    model.train()
    t0, losses, done = time.perf_counter(), [], 0
    for step in range(steps):
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / max(steps, 1)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = rng.integers(0, stream.shape[0] - cfg.seq_len - 1, cfg.batch_size)
        win = torch.from_numpy(np.stack([stream[s:s + cfg.seq_len + 1] for s in starts]).astype(np.int64))
        logits = model(win[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), win[:, 1:].reshape(-1))
        if not torch.isfinite(loss):
            raise SimtreeError(f"training diverged at step {step} (loss {loss.item()}): lower the learning rate")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        done = step + 1
        if on_step is not None:
            on_step(loss.item())
        if time.perf_counter() - t0 > cfg.max_seconds:
            break
    model.eval()
    tail = losses[-20:]
    return {"steps": done, "final_loss": float(np.mean(tail)), "seconds": round(time.perf_counter() - t0, 1)}


def train_models(out_dir, cfg: TrainConfig | None = None, progress=None) -> dict:
    """Train target then draft; write ``out_dir/target`` and ``out_dir/draft`` checkpoints.

    ``progress(model_name, step, loss)`` is called after every step.  Returns a summary dict.
    """
    cfg = cfg or TrainConfig()
    if cfg.target_steps < 1 or cfg.draft_steps < 1 or cfg.seq_len < 2 or cfg.batch_size < 1:
        raise SimtreeError("steps, batch size and seq_len must be positive (seq_len >= 2)")
    torch.set_num_threads(1)
    stream = token_stream(training_text(cfg.sharegpt_conversations))
    summary = {"tokens_in_corpus": int(stream.shape[0]), "train_config": asdict(cfg)}
    for name, mcfg, steps, seed in (("target", target_config(), cfg.target_steps, cfg.seed),
                                    ("draft", draft_config(), cfg.draft_steps, cfg.seed + 1)):
        if name not in cfg.models:
            continue
        folder = Path(out_dir) / name
        prior = {}
        if cfg.resume and (folder / "model.safetensors").exists():
            model = load_model(folder).train()
            prior = json.loads((folder / "config.json").read_text()).get("simtree_training", {})
            seed += 1000 * int(prior.get("sessions", 1))  # fresh windows for the new session
        else:
            torch.manual_seed(seed)
            model = HybridLM(mcfg)
        counter = iter(range(1, steps + 1))
        hook = None if progress is None else (lambda loss, n=name: progress(n, next(counter), loss))
        stats = _train_one(model, stream, steps, cfg, seed, hook)
        summary[name] = stats
        before = int(prior.get("total_steps", prior.get("steps", 0)))
        total = {"seed": seed, **stats, "total_steps": before + stats["steps"],
                 "sessions": int(prior.get("sessions", 1 if prior else 0)) + 1}
        save_model(model, folder, extra=total)
    return summary

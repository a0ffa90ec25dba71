"""Train a block drafter (``block`` or ``dspark``) for a trained target folder, the target frozen.

    simtree train-drafter --model simtree/data/models/qwen3.5-tiny-sharegpt --drafter block
    (same command + --resume after an interruption)

Distillation on the target's own greedy text: each step draws ``batch_size`` windows of
``prefix_len`` tokens from the training text (:func:`simtree.runtime.data.training_docs`: the
even-indexed ShareGPT conversations and HumanEval 0..131; the odd-indexed conversations, whose
human turns are the prompts of ``simtree run`` and of the acceptance tables, are never read),
continues each with ``gen_len`` greedy tokens of the target, and runs the target once over the
whole sequence for the tapped layers' outputs (:func:`.drafter_model.target_features`: the
features the runtime's round feeds the drafter).  Every anchor p in the generated part whose
next ``block_len`` tokens are the target's greedy ones is a block: row j learns the target's
token at depth j + 1 (cross-entropy weighted ``depth_decay`` ** j: the early positions decide
acceptance).  ``anchors`` blocks per sequence are drawn at random.  DSpark's Markov head learns
with the rows (teacher-forced), and its confidence head learns whether each position is
accepted given that the ones before it were (binary cross-entropy over those positions).

The job writes ``out`` (default ``MODEL/drafters/<family>``) as :mod:`simtree.runtime.target_train`
does (:class:`.train_state.TrainingJob`): a checkpoint every ``checkpoint_every`` steps and on
SIGINT / SIGTERM (``resume`` continues it bit-exactly), ``max_seconds`` stops early and publishes
the folder with the checkpoint inside; the folder is written beside ``out`` and moved over it.
``training.json`` records the settings, the held-out chain acceptance (mean leading top-1 matches
of a block on held-out text) and the seconds; ``training_log.csv`` every step.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from simtree.errors import SimtreeError, check_int

from .data import training_docs
from .drafter_model import TRAINABLE, BlockDrafterModule, read_drafter, save_drafter, target_features
from .train_state import TrainingJob, check_run_numbers, job_settings

__all__ = ["DrafterTrainConfig", "train_drafter", "drafter_dir"]

# the settings `simtree train-drafter` names otherwise, or takes no option for (a refusal to resume names them so)
OPTIONS = {"family": "--drafter", "warmup": None, "depth_decay": None}
LOG_HEADER = "step,lr,loss,top1_depth1,chain_accept,conf_loss,seconds"
EVAL_SEED = 12345


@dataclass
class DrafterTrainConfig:
    family: str = "block"
    steps: int = 300
    batch_size: int = 16
    prefix_len: int = 32
    gen_len: int = 96
    anchors: int = 32
    block_len: int = 7
    layers: int = 2
    markov_rank: int = 64
    cand_k: int = 64
    adapter_dim: int = 64
    init_from: str | None = None      # tfm: the trained block drafter whose backbone it adapts (default: MODEL's)
    lr: float = 2e-3
    warmup: int = 20
    depth_decay: float = 0.8
    seed: int = 0
    conversations: int = 2000
    max_seconds: float = 1200.0
    checkpoint_every: int = 50

    def validate(self) -> "DrafterTrainConfig":
        if self.family not in TRAINABLE:
            raise SimtreeError(f"--drafter {self.family!r}: expected one of {', '.join(TRAINABLE)}")
        check_int(self.steps, "--steps", 1)
        check_int(self.batch_size, "--batch-size", 1, 4096)
        check_int(self.prefix_len, "--prefix-len", 1, 4096)
        check_int(self.block_len, "--block-len", 1, 64)
        check_int(self.gen_len, "--gen-len", self.block_len + 2, 4096)
        check_int(self.anchors, "--anchors", 1, 4096)
        check_int(self.layers, "--layers", 1, 64)
        check_int(self.markov_rank, "--markov-rank", 1, 4096)
        check_int(self.cand_k, "--cand-k", 1, 1 << 20)
        check_int(self.adapter_dim, "--adapter-dim", 1, 4096)
        check_int(self.conversations, "--conversations", 1)
        check_int(self.checkpoint_every, "--checkpoint-every", 1)
        check_run_numbers(self)
        if not 0 < self.depth_decay <= 1:
            raise SimtreeError(f"--depth-decay must be in (0, 1], got {self.depth_decay}")
        return self


def drafter_dir(model_dir, family: str) -> Path:
    """Where a target folder's trained drafter of ``family`` lives."""
    return Path(model_dir) / "drafters" / family


def _load_target(model_dir: Path):
    from simtree.models import get_model

    from .bpe import BpeTokenizer
    from .full.block_engine import feature_layers
    from .target_model import load_folder

    if not (model_dir / "model.safetensors").is_file() or not (model_dir / "tokenizer.json").is_file():
        raise SimtreeError(f"--model {model_dir}: not a trained target folder (model.safetensors and tokenizer.json "
                           "expected: simtree train writes one)")
    target = load_folder(model_dir).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    taps = feature_layers(target.config.num_hidden_layers)
    return target, BpeTokenizer.from_file(str(model_dir / "tokenizer.json")), get_model(str(model_dir)), taps


class _Blocks:
    """A step's batch: sequences of the target's greedy text, their features and block anchors."""

    def __init__(self, target, taps, stream: np.ndarray, cfg: DrafterTrainConfig, rng: np.random.Generator):
        P, G, L = cfg.prefix_len, cfg.gen_len, cfg.block_len
        starts = rng.integers(0, stream.size - P, cfg.batch_size)
        prefix = torch.from_numpy(np.stack([stream[s:s + P] for s in starts]).astype(np.int64))
        with torch.no_grad():
            ids = target.lm.generate(prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=G,
                                     min_new_tokens=G, do_sample=False, pad_token_id=0)
        self.ids = ids
        self.feats, greedy = target_features(target, ids, taps)
        T = ids.shape[1]
        ok = torch.zeros_like(ids, dtype=torch.bool)
        ok[:, 1:] = ids[:, 1:] == greedy[:, :-1]        # the target's own greedy token (EOS handling: not)
        ok[:, :P] = False
        # anchors p in [P, T - L - 1]: the anchor and its L labels greedy
        self.anchors = torch.from_numpy(rng.integers(P, T - L, (cfg.batch_size, cfg.anchors)).astype(np.int64))
        span = self.anchors[..., None] + torch.arange(L + 1)
        self.valid = ok.gather(1, span.flatten(1)).view(span.shape).all(-1)
        self.labels = ids.gather(1, (span[..., 1:]).flatten(1)).view(cfg.batch_size, cfg.anchors, L)


def _losses(drafter: BlockDrafterModule, blocks: _Blocks, cfg: DrafterTrainConfig):
    logits, conf = drafter(blocks.feats, blocks.ids, blocks.anchors, blocks.labels)
    L = cfg.block_len
    valid = blocks.valid.float()
    labels = blocks.labels
    if cfg.family == "tfm":     # the adapter's conditional over the row's candidates; the target's token among them
        match = conf == labels[..., None]
        labels, conf = match.float().argmax(-1), None
        valid = valid[..., None] * match.any(-1).float()
    else:
        valid = valid[..., None].expand(-1, -1, L)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
    wdepth = cfg.depth_decay ** torch.arange(L, dtype=torch.float32)
    blocks_ok = blocks.valid.float()
    n = blocks_ok.sum().clamp(min=1.0)
    loss = (ce * wdepth * valid).sum() / (n * wdepth.sum())
    hit = (logits.argmax(-1) == labels).float() * valid
    lead = hit.cumprod(-1)                                      # every position up to j accepted
    stats = {"top1_depth1": float((hit[..., 0] * blocks_ok).sum() / n),
             "chain_accept": float((lead.sum(-1) * blocks_ok).sum() / n), "conf_loss": 0.0}
    if conf is not None:    # position j's acceptance given that the ones before it were
        before = torch.cat([torch.ones_like(lead[..., :1]), lead[..., :-1]], -1) * valid
        bce = F.binary_cross_entropy_with_logits(conf, hit, reduction="none")
        conf_loss = (bce * before).sum() / before.sum().clamp(min=1.0)
        loss = loss + conf_loss
        stats["conf_loss"] = float(conf_loss.detach())
    stats["loss"] = float(loss.detach())
    return loss, stats


def train_drafter(model_dir, cfg: DrafterTrainConfig | None = None, out=None, overwrite: bool = False,
                  resume: bool = False, events=None, progress=None) -> dict:
    """Train (module docstring) and write the drafter folder; returns training.json's dict.
    ``progress(step, loss)`` after every step (as :func:`.target_train.train_target`'s)."""
    from .target_train import corpus

    cfg = (cfg or DrafterTrainConfig()).validate()
    model_dir = Path(model_dir)
    out = Path(out) if out is not None else drafter_dir(model_dir, cfg.family)
    job = TrainingJob(out, job_settings(cfg, model=str(model_dir.resolve())), overwrite=overwrite, resume=resume,
                      options=OPTIONS, events=events)
    say = job.say
    t_start = time.perf_counter()
    torch.set_num_threads(1)
    target, tok, shape, taps = _load_target(model_dir)
    from simtree.kernels.layers.drafters import drafter_config

    extra = {"dspark": {"markov_rank": cfg.markov_rank}, "tfm": {"cand_k": cfg.cand_k, "adapter_dim": cfg.adapter_dim},
             "block": {}}[cfg.family]
    dcfg = drafter_config(shape, cfg.family, block_len=cfg.block_len, layers=cfg.layers, target_layers=len(taps),
                          **extra)
    train_docs, held_docs = training_docs(cfg.conversations)
    stream, held = corpus(tok, train_docs), corpus(tok, held_docs)
    torch.manual_seed(cfg.seed)
    emb = target.lm.model.embed_tokens.weight
    drafter = BlockDrafterModule(dcfg, emb, target.lm.lm_head.weight, seed=cfg.seed)
    if cfg.family == "tfm":     # the adapter over a trained block drafter, whose backbone stays as it is
        base = Path(cfg.init_from) if cfg.init_from else drafter_dir(model_dir, "block")
        if not (base / "config.json").is_file():
            raise SimtreeError(f"--drafter tfm adapts a trained block drafter: {base} holds none (train "
                               "--drafter block first, or pass --init-from)")
        drafter.load_backbone(read_drafter(base, "block", taps=taps)[1], base)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=0.01)
    state = job.start(drafter, opt, cfg.seed, cfg.steps)
    n_params = sum(p.numel() for p in drafter.parameters())
    say(f"{cfg.family} drafter: {n_params} parameters, {len(taps)} tapped target layers {list(taps)}; "
        f"{stream.size} training tokens ({time.perf_counter() - t_start:.0f}s)")

    def one_step(step: int, lr: float):
        loss, stats = _losses(drafter, _Blocks(target, taps, stream, cfg, job.rng), cfg)
        if not math.isfinite(stats["loss"]):
            raise SimtreeError(f"drafter training diverged at step {step} (loss {stats['loss']}): lower --lr")
        return loss, stats

    def log_row(step: int, steps: int, lr: float, stats: dict, seconds: float, stopped: bool) -> list[str]:
        if step % 10 == 0 or step == steps:
            say(f"step {step}/{steps}: loss {stats['loss']:.3f}, depth-1 top-1 {stats['top1_depth1']:.3f}, "
                f"chain {stats['chain_accept']:.2f}, {seconds:.0f}s")
        if progress is not None:
            progress(step, stats["loss"])
        return [f"{stats[k]:.4f}" for k in ("loss", "top1_depth1", "chain_accept", "conf_loss")]

    stopped = job.run(one_step, log_row, lr=cfg.lr, warmup=cfg.warmup, max_seconds=cfg.max_seconds,
                      checkpoint_every=cfg.checkpoint_every)
    step = state["step"]
    heldout = _heldout(drafter, target, taps, held, cfg)
    tail = state["tail"]
    record = {"schema": "simtree.drafter_training/1", "family": cfg.family, "target": str(model_dir),
              "trainable_parameters": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
              "settings": asdict(cfg), "parameters": n_params, "taps": list(taps), "steps": step,
              "complete": not stopped, "final_loss": float(np.mean([t["loss"] for t in tail])),
              "final_chain_accept": float(np.mean([t["chain_accept"] for t in tail])), **heldout,
              "train_seconds": round(state["seconds"], 1), "total_seconds": round(time.perf_counter() - t_start, 1),
              "torch": torch.__version__, "device": "cpu"}
    job.publish(record, LOG_HEADER, lambda staging, files: save_drafter(staging, drafter, taps, files), stopped)
    record["out"] = str(out)
    return record


@torch.no_grad()
def _heldout(drafter, target, taps, held: np.ndarray, cfg: DrafterTrainConfig) -> dict:
    """Chain acceptance and depth-1 top-1 on held-out text (fixed windows)."""
    blocks = _Blocks(target, taps, held, cfg, np.random.default_rng(EVAL_SEED))
    _, stats = _losses(drafter, blocks, cfg)
    return {"heldout_loss": stats["loss"], "heldout_top1_depth1": stats["top1_depth1"],
            "heldout_chain_accept": stats["chain_accept"], "heldout_conf_loss": stats["conf_loss"]}


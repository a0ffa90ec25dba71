"""Train the Qwen3.5-architecture target and its MTP layer on the packaged text (CPU or GPU).

    simtree train --size cpu --target-steps 2000 --out DIR
    simtree train --size cpu --target-steps 2000 --out DIR --resume     (after an interruption)

A BPE tokenizer (:mod:`.bpe`, or ``--tokenizer`` to reuse one) over the training text, then
:class:`.target_model.TargetWithMTP` trained on random windows of its token stream (next-token +
MTP loss), AdamW with linear warm-up and cosine decay, gradient clipping 1.0.  Deterministic on
CPU for a given seed and step count (one thread, seeded windows and initialisation).
``steps`` 0 sets the step count from the pace of the first ``AUTO_PROBE`` steps so that the
cosine schedule ends within 90% of ``max_seconds`` (a bounded GPU run).  Before any work the
step's memory is checked (:mod:`.train_memory`).

Text: the split of :mod:`simtree.runtime.data` (even-indexed ShareGPT conversations of the
first ``conversations`` x 2 records, HumanEval problems 0..131 train), documents joined by the
tokenizer's ``<|endoftext|>``.  Held-out loss: fixed windows of the odd-indexed ShareGPT
conversations (the prompts' side of the split), every ``eval_every`` steps and at the end.

An interruption loses at most ``checkpoint_every`` steps: the job's whole state (weights, AdamW
state, step, RNG states, tokenizer, log; :mod:`.train_state`) is written atomically to
``out/checkpoint.safetensors`` every ``checkpoint_every`` steps and on SIGINT / SIGTERM (the
current step finishes, then :class:`TrainingInterrupted`).  ``resume`` continues it, refusing a
checkpoint of other settings (``max_seconds`` and ``checkpoint_every`` may change); the result
is bit-identical to an uninterrupted run's.  ``max_seconds`` stops early and publishes what it
has (``complete`` false in the record) with the checkpoint inside, so ``resume`` continues that
too.

The folder (written beside ``out`` and moved over it when training ends; a folder already there
is refused unless ``overwrite``): ``config.json`` + ``model.safetensors``
(:func:`.target_model.save_folder`), ``tokenizer.json`` + ``tokenizer_config.json``,
``training.json`` (settings, losses, seconds) and ``training_log.csv`` (step, lr, lm_loss,
mtp_loss, heldout_lm_loss, heldout_mtp_loss, seconds).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from simtree.errors import SimtreeError, check_int
from simtree.machine.metadata import require_device

from .bpe import VOCAB_RANGE, BpeTokenizer, train_tokenizer, write_tokenizer
from .data import training_docs
from .target_model import PRESETS, TargetWithMTP, hf_config, save_folder
from .train_memory import check_training_memory
from .train_state import TrainingInterrupted, TrainingJob, check_run_numbers, job_settings

__all__ = ["TargetTrainConfig", "TrainingInterrupted", "train_target", "corpus"]

# the settings `simtree train` names otherwise, or takes no option for (a refusal to resume names them so)
OPTIONS = {"steps": "--target-steps", "warmup": None, "eval_every": None}
LOG_HEADER = "step,lr,lm_loss,mtp_loss,heldout_lm_loss,heldout_mtp_loss,seconds"

EVAL_WINDOWS = 32
AUTO_PROBE = 20     # steps timed before an automatic step count is set
AUTO_STEPS = 10 ** 9    # the step count until then


@dataclass
class TargetTrainConfig:
    size: str = "cpu"
    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 2e-3
    warmup: int = 50
    seed: int = 0
    vocab_size: int = 2048
    conversations: int = 2000
    max_seconds: float = 1200.0
    eval_every: int = 250
    checkpoint_every: int = 100
    device: str = "cpu"
    tokenizer: str | None = None

    def validate(self) -> "TargetTrainConfig":
        if self.size not in PRESETS:
            raise SimtreeError(f"--size {self.size!r}: expected one of {', '.join(PRESETS)}")
        check_int(self.steps, "--target-steps", 0)
        check_int(self.batch_size, "--batch-size", 1, 4096)
        check_int(self.seq_len, "--seq-len", 8, 4096)
        check_int(self.conversations, "--conversations", 1)
        check_int(self.eval_every, "eval_every", 1)
        check_int(self.checkpoint_every, "--checkpoint-every", 1)
        check_int(self.vocab_size, "--vocab-size", *VOCAB_RANGE)
        check_run_numbers(self)
        require_device(self.device)
        return self


def corpus(tok: BpeTokenizer, docs: list[str]) -> np.ndarray:
    """One int32 stream: each document after an ``<|endoftext|>``."""
    ids = []
    for enc in tok.tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.append(tok.bos_id)
        ids.extend(enc.ids)
    return np.asarray(ids, np.int32)


def _windows(stream: np.ndarray, starts, seq_len: int, device) -> torch.Tensor:
    return torch.from_numpy(np.stack([stream[s:s + seq_len + 1] for s in starts]).astype(np.int64)).to(device)


@torch.no_grad()
def _heldout(model: TargetWithMTP, batches: list[torch.Tensor], autocast) -> dict:
    model.eval()
    parts = []
    for win in batches:
        with autocast():
            parts.append(model.loss(win)[1])
    model.train()
    return {k: float(np.mean([p[k] for p in parts])) for k in ("lm", "mtp")}


def train_target(out, cfg: TargetTrainConfig | None = None, overwrite: bool = False, progress=None,
                 events=None, resume: bool = False) -> dict:
    """Train (module docstring) and write the folder ``out``; returns training.json's dict.
    ``resume`` continues the job whose checkpoint ``out`` holds; SIGINT / SIGTERM checkpoint
    after the current step and raise :class:`TrainingInterrupted`."""
    cfg = (cfg or TargetTrainConfig()).validate()
    out = Path(out)
    job = TrainingJob(out, job_settings(cfg), overwrite=overwrite, resume=resume, options=OPTIONS, events=events)
    say = job.say
    t_start = time.perf_counter()
    cuda = cfg.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)
    if job.resumed_state is not None:
        from tokenizers import Tokenizer
        tok = BpeTokenizer(Tokenizer.from_str(job.resumed_state["tokenizer"]))
    elif cfg.tokenizer:
        tok = BpeTokenizer.from_file(cfg.tokenizer)
    else:
        tok = None
    config = hf_config(cfg.size, tok.vocab_size if tok else cfg.vocab_size, max_positions=max(4096, 2 * cfg.seq_len))
    check_training_memory(config, cfg.batch_size, cfg.seq_len, device=cfg.device)   # before any work
    train_docs, held_docs = training_docs(cfg.conversations)
    if tok is None:
        tok = BpeTokenizer(train_tokenizer(train_docs, cfg.vocab_size))
        config = hf_config(cfg.size, tok.vocab_size, max_positions=max(4096, 2 * cfg.seq_len))
    stream, held = corpus(tok, train_docs), corpus(tok, held_docs)
    if min(stream.size, held.size) <= cfg.seq_len + 1:
        raise SimtreeError(f"--seq-len {cfg.seq_len} is too long for the text ({stream.size} training tokens, "
                           f"{held.size} held out)")
    say(f"tokenizer: {tok.vocab_size} tokens; corpus {stream.size} training tokens, {held.size} held out "
        f"({time.perf_counter() - t_start:.0f}s)")
    torch.manual_seed(cfg.seed)
    model = TargetWithMTP(config).to(cfg.device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    held_rng = np.random.default_rng(cfg.seed + 1)
    eval_batches = [_windows(held, held_rng.integers(0, held.size - cfg.seq_len - 1, min(cfg.batch_size, 16)),
                             cfg.seq_len, cfg.device) for _ in range(max(EVAL_WINDOWS // min(cfg.batch_size, 16), 1))]
    # steps 0: as many as fit max_seconds at the pace of the first AUTO_PROBE steps (a GPU run)
    state = job.start(model, opt, cfg.seed, cfg.steps or AUTO_STEPS, tokenizer=tok.to_json(), held_loss=None)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def retarget(step: int, ran: int, elapsed_s: float):
        if cfg.steps or state["steps"] != AUTO_STEPS or ran != AUTO_PROBE:   # this run's first steps
            return None
        pace = elapsed_s / AUTO_PROBE
        steps = max(step + 1, int(0.9 * cfg.max_seconds / pace))
        say(f"{pace * 1e3:.0f} ms per step: {steps} steps fit {cfg.max_seconds:g} s")
        return steps

    def one_step(step: int, lr: float):
        win = _windows(stream, job.rng.integers(0, stream.size - cfg.seq_len - 1, cfg.batch_size), cfg.seq_len,
                       cfg.device)
        with autocast():
            loss, parts = model.loss(win)
        if not math.isfinite(parts["lm"]):
            raise SimtreeError(f"training diverged at step {step} (loss {parts['lm']}): lower --lr")
        return loss, parts

    def log_row(step: int, steps: int, lr: float, parts: dict, seconds: float, stopped: bool) -> list[str]:
        row = [f"{parts['lm']:.4f}", f"{parts['mtp']:.4f}", "", ""]
        if step % cfg.eval_every == 0 or step == steps or stopped:
            held_loss = state["held_loss"] = _heldout(model, eval_batches, autocast)
            row[2:4] = [f"{held_loss['lm']:.4f}", f"{held_loss['mtp']:.4f}"]
            say(f"step {step}/{steps}: loss {parts['lm']:.3f} (mtp {parts['mtp']:.3f}), held-out "
                f"{held_loss['lm']:.3f} (mtp {held_loss['mtp']:.3f}), {seconds:.0f}s")
        if progress is not None:
            progress(step, parts["lm"])
        return row

    stopped = job.run(one_step, log_row, lr=cfg.lr, warmup=cfg.warmup, max_seconds=cfg.max_seconds,
                      checkpoint_every=cfg.checkpoint_every, retarget=retarget)
    step, steps = state["step"], state["steps"]
    tail, held_loss = state["tail"], state["held_loss"]
    record = {"schema": "simtree.target_training/1", "settings": asdict(cfg), "parameters": n_params,
              "steps": step, "planned_steps": steps, "complete": not stopped, "tokens_in_corpus": int(stream.size),
              "heldout_tokens": int(held.size), "tokens_seen": step * cfg.batch_size * cfg.seq_len,
              "final_lm_loss": float(np.mean([p["lm"] for p in tail])),
              "final_mtp_loss": float(np.mean([p["mtp"] for p in tail])),
              "heldout_lm_loss": held_loss["lm"], "heldout_mtp_loss": held_loss["mtp"],
              "train_seconds": round(state["seconds"], 1),
              "total_seconds": round(time.perf_counter() - t_start, 1), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if cuda else "cpu"}

    def write(staging: Path, files: dict) -> None:
        write_tokenizer(tok.tokenizer, staging)
        save_folder(model.float().cpu(), staging, dtype=torch.bfloat16 if cuda else torch.float32, extra_files=files)
    job.publish(record, LOG_HEADER, write, stopped)
    record["out"] = str(out)
    return record

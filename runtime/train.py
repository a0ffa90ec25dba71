"""Train the shipped target and draft models on CPU from the packaged text.

Next-byte cross-entropy on random windows of the concatenated training documents
(``data.training_text``; documents separated by BOS), AdamW with linear warm-up and cosine
decay, gradient clipping 1.0.  Deterministic for a given seed and step count (torch and the
window sampler are seeded; one thread keeps float reductions in a fixed order).

Interruptions lose at most ``checkpoint_every`` steps.  While a model trains, its state lives
in ``out/checkpoints/<name>.safetensors``: weights, AdamW state, the step, the window
sampler's and torch's RNG states and the job's settings, in ONE file replaced atomically, so a
checkpoint is always whole.  It is written every ``checkpoint_every`` steps, when the process
gets SIGINT / SIGTERM (Ctrl-C: the current step finishes, the checkpoint is written and
:class:`TrainingInterrupted` is raised; a second Ctrl-C aborts at once) and when
``max_seconds`` stops a model early.  Running the same job again (same settings, same folder)
continues from the checkpoint: the final weights are bit-identical to an uninterrupted run's.
A model that finished is published to ``out/<name>/`` (config.json + model.safetensors;
``loading.save_model`` stamps both with one save id, which ``load_model`` checks) before its
checkpoint is deleted, and a later run of the same job skips it.

Other cases are explicit: a model or checkpoint in the folder from other settings is an error
(naming the first difference); ``restart`` discards checkpoints and trains from scratch;
``extend`` trains a finished model on until it has the requested number of steps in total (a
new session: fresh optimizer, warm-up and cosine over the added steps; rerunning the same
``extend`` command is a no-op once the total is reached).
"""
from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from simtree.errors import SimtreeError, check_int
from simtree.fileio import write_atomic
from simtree.runtime.data import training_text
from simtree.runtime.loading import (DEFAULT_MODELS_DIR, load_model, model_weights, read_save_ids,
                                    save_model, saves_disagree)
from simtree.runtime.model import HybridLM, ModelConfig
from simtree.runtime.tokenizer import BOS
from simtree.runtime.train_memory import check_training_memory

__all__ = ["TrainConfig", "TrainingInterrupted", "train_models", "target_config", "draft_config",
           "token_stream", "checkpoint_path", "CHECKPOINT_SCHEMA"]

CHECKPOINT_SCHEMA = "simtree.train_checkpoint/1"
CHECKPOINT_DIR = "checkpoints"
LOSS_TAIL = 20   # final_loss = mean of the last LOSS_TAIL step losses of the session


def target_config() -> ModelConfig:
    """4 layers [GDN, GDN, GDN, attention], d 128: Qwen3.6's pattern scaled down."""
    return ModelConfig()


def draft_config() -> ModelConfig:
    """2 attention layers, d 128, MLP 256: about 3x cheaper per token than the target."""
    return ModelConfig(layer_types=["full_attention"] * 2, intermediate_size=256)


MODELS = {"target": (target_config, 0), "draft": (draft_config, 1)}   # name -> (config, seed offset)


class TrainingInterrupted(Exception):
    """Training stopped on SIGINT / SIGTERM after writing a checkpoint; ``str()`` is one line
    saying where and how to resume."""

    def __init__(self, message: str, model: str, step: int, total: int, checkpoint: Path):
        super().__init__(message)
        self.model, self.step, self.total, self.checkpoint = model, step, total, checkpoint


@dataclass
class TrainConfig:
    target_steps: int = 250
    draft_steps: int = 600
    batch_size: int = 16
    seq_len: int = 96
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0
    max_seconds: float = 600.0   # bound per model and run: stops early (checkpointed, resumable)
    sharegpt_conversations: int = 1500
    models: tuple = ("target", "draft")
    checkpoint_every: int = 25   # steps between periodic checkpoints
    extend: bool = False         # train finished models on to target_steps / draft_steps in total
    restart: bool = False        # discard checkpoints (and models) in the folder: train from scratch

    def steps_for(self, name: str) -> int:
        return self.target_steps if name == "target" else self.draft_steps

    def validate(self) -> "TrainConfig":
        """One-line SimtreeError naming the first bad setting (the CLI's option names)."""
        models = tuple(self.models)
        if not models or any(m not in MODELS for m in models) or len(set(models)) != len(models):
            raise SimtreeError(f"models must be 'target' and/or 'draft', got {list(models)}")

        for name in models:
            check_int(self.steps_for(name), f"--{name}-steps", 1)
        check_int(self.batch_size, "--batch-size", 1)
        check_int(self.seq_len, "--seq-len", 2)
        check_int(self.warmup, "warmup", 1)
        check_int(self.seed, "--seed", 0, 2 ** 63 - 1)
        check_int(self.sharegpt_conversations, "sharegpt_conversations", 0)
        check_int(self.checkpoint_every, "--checkpoint-every", 1)
        for value, flag, what in ((self.lr, "--lr", "a finite number > 0"),
                                  (self.max_seconds, "--max-seconds", "a number > 0 (inf: no bound)")):
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0
                    or (flag == "--lr" and not math.isfinite(value))):
                raise SimtreeError(f"{flag} must be {what}, got {value!r}")
        limit = min(target_config().max_position_embeddings, draft_config().max_position_embeddings)
        if self.seq_len > limit:
            raise SimtreeError(f"--seq-len {self.seq_len} exceeds the models' max_position_embeddings ({limit})")
        if self.extend and self.restart:
            raise SimtreeError("--extend and --restart exclude each other: --restart trains from scratch")
        return self


def token_stream(docs: list[str]) -> np.ndarray:
    """All documents as one uint16 stream of byte tokens, each document preceded by BOS."""
    parts = []
    for d in docs:
        parts += [np.array([BOS], np.uint16), np.frombuffer(d.encode("utf-8"), np.uint8).astype(np.uint16)]
    return np.concatenate(parts)


def checkpoint_path(out_dir, name: str) -> Path:
    return Path(out_dir) / CHECKPOINT_DIR / f"{name}.safetensors"


# ---- signals ---------------------------------------------------------------------------------

class _StopOnSignal:
    """SIGINT / SIGTERM set ``requested`` (the loop checkpoints after the current step); a
    second one raises KeyboardInterrupt at once.  Only in the main thread (elsewhere signals
    are not ours to take); previous handlers come back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested, self._old = None, {}

    def _handle(self, signum, frame):
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)


# ---- checkpoints -----------------------------------------------------------------------------

def _save_checkpoint(path: Path, model: HybridLM, opt, rng: np.random.Generator, state: dict) -> None:
    """Everything needed to continue bit-exactly, in one safetensors file (atomic replace)."""
    from safetensors.torch import save_file

    tensors = {f"model.{k}": v for k, v in model_weights(model).items()}
    sd = opt.state_dict()
    for i, st in sd["state"].items():
        for key, t in st.items():
            tensors[f"optim.{i}.{key}"] = t.detach().contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    meta = {"schema": CHECKPOINT_SCHEMA, "state": json.dumps(state),
            "numpy_rng": json.dumps(rng.bit_generator.state), "param_groups": json.dumps(groups)}
    write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=meta))


def _read_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    """-> (state, tensors, metadata); a one-line error for an unreadable file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        if meta.get("schema") != CHECKPOINT_SCHEMA:
            raise SimtreeError(f"schema {meta.get('schema')!r} is not {CHECKPOINT_SCHEMA!r}")
        return json.loads(meta["state"]), tensors, meta
    except (OSError, SafetensorError, KeyError, json.JSONDecodeError, SimtreeError) as exc:
        raise SimtreeError(f"training checkpoint {path} is unreadable ({' '.join(str(exc).split())}): "
                           "pass --restart to discard it") from None


def _restore(tensors: dict, meta: dict, model: HybridLM, opt, path: Path) -> np.random.Generator:
    weights = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise SimtreeError(f"training checkpoint {path} does not match the model (missing "
                           f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}): "
                           "pass --restart to discard it")
    groups = json.loads(meta["param_groups"])
    for g in groups:
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
    opt_state: dict = {}
    for key, t in tensors.items():
        if key.startswith("optim."):
            _, i, name = key.split(".", 2)
            opt_state.setdefault(int(i), {})[name] = t
    opt.load_state_dict({"state": opt_state, "param_groups": groups})
    torch.set_rng_state(tensors["rng.torch"])
    rng = np.random.default_rng()
    rng.bit_generator.state = json.loads(meta["numpy_rng"])
    return rng


# ---- what to do with one model ---------------------------------------------------------------

def _settings(cfg: TrainConfig, name: str, mcfg: ModelConfig) -> dict:
    """What makes two runs the same job (max_seconds and checkpoint_every do not change results)."""
    return {"total_steps": cfg.steps_for(name), "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
            "lr": cfg.lr, "warmup": cfg.warmup, "seed": cfg.seed,
            "sharegpt_conversations": cfg.sharegpt_conversations, "architecture": asdict(mcfg)}


_FLAGS = {"total_steps": "--{name}-steps", "batch_size": "--batch-size", "seq_len": "--seq-len", "lr": "--lr",
          "seed": "--seed"}


def _difference(have: dict, want: dict, name: str) -> str | None:
    """The first setting that differs, as '{flag} X (this run asks for Y)'."""
    for key in want:
        if have.get(key) != want[key]:
            flag = _FLAGS.get(key, key).format(name=name)
            if key == "architecture":
                return "another architecture"
            return f"{flag} {have.get(key)!r} (this run asks for {want[key]!r})"
    return None


def _finished_record(folder: Path) -> dict | None:
    """config.json's ``simtree_training`` of a published model, {} when it has none, None when
    there is no model; a folder whose two files come from different saves is an error."""
    if not (folder / "config.json").exists() and not (folder / "model.safetensors").exists():
        return None
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raw = None
    ids = read_save_ids(folder, raw) if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or ids is None or saves_disagree(ids):
        raise SimtreeError(f"{folder} holds an incomplete or inconsistent model (config.json and "
                           "model.safetensors do not belong together): pass --restart to train it again")
    rec = raw.get("simtree_training")
    return rec if isinstance(rec, dict) else {}


def _plan(cfg: TrainConfig, out: Path, name: str, mcfg: ModelConfig) -> dict:
    """How to handle one model: {"action": "resume" | "fresh" | "extend" | "skip", ...}."""
    want = _settings(cfg, name, mcfg)
    ckpt = checkpoint_path(out, name)
    if ckpt.exists():
        state, tensors, meta = _read_checkpoint(ckpt)
        diff = _difference(state["settings"], want, name)
        if diff:
            raise SimtreeError(f"{name}: the checkpoint {ckpt} is from a run with {diff}: rerun with that "
                               "run's settings to finish it, or pass --restart to discard it")
        return {"action": "resume", "state": state, "tensors": tensors, "meta": meta}
    rec = _finished_record(out / name)
    if rec is None:
        return {"action": "fresh"}
    total = int(rec.get("total_steps", rec.get("steps", 0)) or 0)
    same = rec.get("settings") == want
    if same and rec.get("complete") and total == want["total_steps"]:
        return {"action": "skip", "record": rec, "why": f"already trained ({total} steps)"}
    if cfg.extend:
        if total >= want["total_steps"]:
            return {"action": "skip", "record": rec,
                    "why": f"already has {total} steps (>= {want['total_steps']} asked for --extend)"}
        return {"action": "extend", "record": rec, "base_total": total}
    if not rec.get("settings"):
        what = f"a model whose training settings are not recorded ({total} steps)"
    elif not same:
        what = f"a model trained with {_difference(rec['settings'], want, name)}"
    else:
        what = f"an unfinished model ({total} of {want['total_steps']} steps) without its checkpoint"
    raise SimtreeError(f"{out / name} holds {what}: pass --extend to train it on to "
                       f"{want['total_steps']} steps, --restart to train from scratch, or choose another --out")


# ---- the training loop -----------------------------------------------------------------------

def _lr(cfg: TrainConfig, step: int, steps: int) -> float:
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / max(steps, 1)))


def _train_model(name: str, out: Path, cfg: TrainConfig, plan: dict, stream: np.ndarray, stop: _StopOnSignal,
                 progress=None, events=None) -> dict:
    mcfg = MODELS[name][0]()
    ckpt = checkpoint_path(out, name)
    folder = out / name
    if plan["action"] == "resume":
        state = plan["state"]
        model = HybridLM(mcfg)   # weights and torch RNG state come from the checkpoint
    else:
        rec = plan.get("record") or {}
        base_total = plan.get("base_total", 0)
        sessions = int(rec.get("sessions", 1 if rec else 0))
        seed = cfg.seed + MODELS[name][1]
        if plan["action"] == "extend":
            seed += 1000 * max(sessions, 1)   # fresh windows for the new session
        state = {"settings": _settings(cfg, name, mcfg), "kind": plan["action"], "session_seed": seed,
                 "base_total_steps": base_total, "base_sessions": sessions,
                 "session_steps": cfg.steps_for(name) - base_total, "step": 0, "losses": [], "seconds": 0.0}
        if plan["action"] == "extend":
            model = load_model(folder)
            if asdict(model.config) != asdict(mcfg):
                raise SimtreeError(f"{folder}: --extend needs this runtime's {name} architecture")
        else:
            torch.manual_seed(seed)
            model = HybridLM(mcfg)
        torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    if plan["action"] == "resume":
        rng = _restore(plan["tensors"], plan["meta"], model, opt, ckpt)
    else:
        rng = np.random.default_rng(state["session_seed"])
    steps, base, start = state["session_steps"], state["base_total_steps"], state["step"]
    total = base + steps
    if events is not None:
        how = {"resume": f"resuming at step {base + start}/{total} from {ckpt}",
               "extend": f"extending from {base} to {total} steps (a new session)",
               "fresh": f"training {total} steps"}[plan["action"]]
        events(f"{name}: {how}")

    def save():
        _save_checkpoint(ckpt, model, opt, rng, state)

    def publish(complete: bool):
        model.eval()
        tail = state["losses"][-LOSS_TAIL:]
        record = {"seed": state["session_seed"], "steps": state["step"],
                  "final_loss": float(np.mean(tail)) if tail else None, "seconds": round(state["seconds"], 1),
                  "total_steps": base + state["step"], "sessions": state["base_sessions"] + 1,
                  "complete": complete, "settings": state["settings"]}
        save_model(model, folder, extra=record)
        model.train()
        return record

    high = stream.shape[0] - cfg.seq_len - 1
    t0, seconds0 = time.perf_counter(), state["seconds"]
    step, status = start, "trained" if start == 0 else "resumed"
    while step < steps:
        if stop.requested:
            state["seconds"] = seconds0 + time.perf_counter() - t0
            save()
            raise TrainingInterrupted(
                f"interrupted ({stop.requested}): {name} checkpoint saved at step {base + step}/{total} in "
                f"{ckpt}; rerun the same command to continue", name, base + step, total, ckpt)
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step, steps)
        starts = rng.integers(0, high, cfg.batch_size)
        win = torch.from_numpy(np.stack([stream[s:s + cfg.seq_len + 1] for s in starts]).astype(np.int64))
        logits = model(win[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), win[:, 1:].reshape(-1))
        loss_value = loss.item()   # the step's one host sync
        if not math.isfinite(loss_value):
            raise SimtreeError(f"{name}: training diverged at step {base + step} (loss {loss_value}): "
                               "lower the learning rate (--lr) and pass --restart")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        state["step"] = step
        state["losses"] = (state["losses"] + [loss_value])[-LOSS_TAIL:]
        state["seconds"] = seconds0 + time.perf_counter() - t0
        if progress is not None:
            progress(name, base + step, loss_value)
        if step < steps and time.perf_counter() - t0 > cfg.max_seconds:
            save()
            publish(complete=False)
            status = "stopped"
            if events is not None:
                events(f"{name}: stopped by --max-seconds {cfg.max_seconds:g} at step {base + step}/{total}; "
                       f"published as is, checkpoint kept: rerun the same command to continue")
            break
        if step < steps and step % cfg.checkpoint_every == 0:
            save()
    if step == steps:
        save()                  # a crash while publishing finds the finished state here
        publish(complete=True)
        ckpt.unlink()
    tail = state["losses"][-LOSS_TAIL:]
    return {"status": status, "steps": step - start, "start_step": base + start, "total_steps": base + step,
            "planned_steps": total, "final_loss": float(np.mean(tail)) if tail else None,
            "seconds": round(time.perf_counter() - t0, 1), "checkpoint": str(ckpt) if ckpt.exists() else None}


def _check_out(out: Path, overwrite_shipped: bool) -> Path:
    """Refuse the shipped models' folder (unless asked) and an --out that cannot hold folders,
    before any training."""
    resolved = out.resolve()
    shipped = DEFAULT_MODELS_DIR.resolve()
    if (resolved == shipped or shipped in resolved.parents) and not overwrite_shipped:
        raise SimtreeError(f"--out {out} is {'' if resolved == shipped else 'inside '}the shipped models' folder "
                           f"({shipped}) that `simtree run` uses by default: "
                           "pass --overwrite-shipped to replace them, or choose another --out")
    if out.exists() and not out.is_dir():
        raise SimtreeError(f"--out {out} is a file, not a folder")
    for sub in ("target", "draft", CHECKPOINT_DIR):
        if (out / sub).exists() and not (out / sub).is_dir():
            raise SimtreeError(f"{out / sub} is a file: the trainer writes a folder there")
    out.mkdir(parents=True, exist_ok=True)
    probe = out / f".simtree-write-probe-{os.getpid()}"
    probe.write_bytes(b"")   # an OSError here (no permission, read-only) is the CLI's one line
    probe.unlink()
    return out


def train_models(out_dir, cfg: TrainConfig | None = None, progress=None, events=None,
                 overwrite_shipped: bool = False) -> dict:
    """Train target then draft into ``out_dir/target`` and ``out_dir/draft``, resuming from
    ``out_dir/checkpoints`` and skipping finished models (see the module docstring).

    ``progress(model_name, step, loss)``: after every step (``step`` counts the model's total
    steps); ``events(line)``: one line per decision (skip, resume, stop).  Returns a summary
    dict; raises :class:`TrainingInterrupted` after checkpointing on SIGINT / SIGTERM."""
    cfg = (cfg or TrainConfig()).validate()
    torch.set_num_threads(1)
    # memory before the folder: a step that cannot fit is refused with nothing written
    check_training_memory({name: MODELS[name][0]() for name in cfg.models}, cfg.batch_size, cfg.seq_len)
    out = _check_out(Path(out_dir), overwrite_shipped)
    if cfg.restart:
        for name in cfg.models:
            checkpoint_path(out, name).unlink(missing_ok=True)
    plans = {}
    for name in cfg.models:   # every decision (and error) before any training
        mcfg = MODELS[name][0]()
        plans[name] = {"action": "fresh"} if cfg.restart else _plan(cfg, out, name, mcfg)
    summary = {"out": str(out), "train_config": asdict(cfg)}
    todo = [n for n in cfg.models if plans[n]["action"] != "skip"]
    for name in cfg.models:
        if plans[name]["action"] == "skip":
            rec = plans[name]["record"]
            summary[name] = {"status": "skipped", "steps": 0, "total_steps": rec.get("total_steps"),
                             "final_loss": rec.get("final_loss"), "seconds": 0.0, "why": plans[name]["why"]}
            if events is not None:
                events(f"{name}: {plans[name]['why']} in {out / name}, skipped")
    if not todo:
        return summary
    stream = token_stream(training_text(cfg.sharegpt_conversations))
    summary["tokens_in_corpus"] = int(stream.shape[0])
    if stream.shape[0] - cfg.seq_len - 1 <= 0:
        raise SimtreeError(f"--seq-len {cfg.seq_len} is too long for the training text "
                           f"({stream.shape[0]} tokens): at most {stream.shape[0] - 2}")
    with _StopOnSignal() as stop:
        for name in todo:
            summary[name] = _train_model(name, out, cfg, plans[name], stream, stop, progress, events)
    ckdir = out / CHECKPOINT_DIR
    if ckdir.is_dir() and not any(ckdir.iterdir()):
        ckdir.rmdir()
    return summary

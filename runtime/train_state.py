"""A training job's state in one file, and stopping on a signal after the current step.

    job = TrainingJob(out, job_settings(cfg), overwrite=..., resume=..., options=..., events=say)  # refusals
    job.start(model, opt, seed, steps)                 # fresh, or the checkpoint's state restored
    stopped = job.run(one_step, log_row, lr=..., warmup=..., max_seconds=..., checkpoint_every=...)
    job.publish(record, LOG_HEADER, write, stopped)    # the folder beside out, moved over it

Underneath (the job's own steps, not exported):

    save_checkpoint(path, model, opt, rng, state)      # one safetensors file, replaced atomically
    state, tensors, meta = read_checkpoint(path)
    rng = restore(tensors, meta, model, opt, path)     # weights, AdamW state, torch + numpy RNG

A checkpoint holds everything a run needs to continue bit-exactly: the weights (each storage
once: a tied head is its embedding), AdamW's state and parameter groups, torch's and the
window sampler's RNG states, and ``state`` (JSON: the step, the settings that make two runs
the same job, whatever the loop keeps).  It is written to a temp file and moved over the last
one, so a checkpoint on disk is always whole.
"""
from __future__ import annotations

import json
import math
import shlex
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from simtree.errors import SEED_MAX, SimtreeError, check_int, check_real
from simtree.fileio import check_out_folder, write_atomic

__all__ = ["TrainingJob", "TrainingInterrupted", "checkpoint_path", "job_settings", "setting_text"]

CHECKPOINT_FILE = "checkpoint.safetensors"    # inside a job's output folder

CHECKPOINT_SCHEMA = "simtree.train_checkpoint/2"

FREE_SETTINGS = ("max_seconds", "checkpoint_every")   # a resumed run may change these: the result does not


def job_settings(cfg, **extra) -> dict:
    """The settings that make two runs the same job: the fields of ``cfg`` (a trainer's config
    dataclass) but FREE_SETTINGS, and ``extra``."""
    return {k: v for k, v in asdict(cfg).items() if k not in FREE_SETTINGS} | extra


def setting_text(key: str, value, options: dict | None = None) -> str:
    """A setting as its command line gives it: ``--key-with-dashes VALUE`` (shell-quoted), ``no
    --option`` for None; ``options`` {key: option} where the option is named otherwise, or None
    for a setting no option takes (then ``key=VALUE``)."""
    options = options or {}
    option = options.get(key, f"--{key.replace('_', '-')}")
    if option is None:
        return f"{key}={value!r}"
    return f"no {option}" if value is None else f"{option} {shlex.quote(str(value))}"


def check_run_numbers(cfg) -> None:
    """The settings every training job shares: ``lr`` a positive number, ``seed`` an integer
    numpy and torch take (>= 0), ``max_seconds`` a finite time >= 0 (0: stop after the first
    step); one-line errors naming the option otherwise (a negative seed was numpy's traceback, a
    negative limit passed as 0 did, NaN never stopped)."""
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise SimtreeError(f"--lr must be a positive number, got {cfg.lr}")
    check_int(cfg.seed, "--seed", 0, SEED_MAX)
    check_real(cfg.max_seconds, "--max-seconds", 0, "number of seconds")


def checkpoint_path(folder) -> Path:
    """The training checkpoint's file in a job's output (or staging) folder."""
    return Path(folder) / CHECKPOINT_FILE


def warmup_cosine_lr(lr: float, warmup: int, step: int, steps: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``steps``."""
    return lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step / steps, 1.0)))


def optimizer_step(opt, params, loss: torch.Tensor, lr: float) -> None:
    """One step of ``opt`` at ``lr`` on ``loss``, gradients clipped to norm 1 over ``params``."""
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


class TrainingInterrupted(Exception):
    """Training stopped on SIGINT / SIGTERM after writing a checkpoint; ``str()`` is one line
    saying where and how to resume."""

    def __init__(self, message: str, step: int, total: int, checkpoint: Path):
        super().__init__(message)
        self.step, self.total, self.checkpoint = step, total, checkpoint


class StopOnSignal:
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


def begin_job(out: Path, job: dict, overwrite: bool, resume: bool, options: dict | None = None) -> tuple | None:
    """The checkpoint (state, tensors, meta) of ``out`` to continue (``resume``), else None;
    every refusal before any work: --resume with --overwrite, no checkpoint, a checkpoint of
    another job (``job``: the settings that make two runs the same, named as
    :func:`setting_text` with ``options`` gives them), a non-empty ``out`` without --overwrite."""
    check_out_folder(out)   # a file is no folder to replace, --overwrite or not (rmtree failed after the training)
    ckpt = checkpoint_path(out)
    if resume:
        if overwrite:
            raise SimtreeError("--resume and --overwrite exclude each other: --overwrite trains from scratch")
        if not ckpt.is_file():
            raise SimtreeError(f"--resume: {out} holds no training checkpoint ({CHECKPOINT_FILE}): "
                               "start the job without --resume")
        state, tensors, meta = read_checkpoint(ckpt)
        for key, want in job.items():
            have = state["settings"].get(key)
            if have != want:
                raise SimtreeError(f"--resume: the checkpoint in {out} is from a run with "
                                   f"{setting_text(key, have, options)} (this run asks for "
                                   f"{setting_text(key, want, options)}): resume with that run's settings")
        return state, tensors, meta
    if out.exists() and any(out.iterdir()) and not overwrite:
        unfinished = " (an unfinished run: pass --resume to continue it)" if ckpt.is_file() else ""
        raise SimtreeError(f"--out {out} already holds files{unfinished}: pass --overwrite to replace them, "
                           "or choose another")
    return None


def publish_folder(out: Path, write, checkpoint=None) -> None:
    """``write(folder)`` fills a folder beside ``out`` (with ``checkpoint(path)``'s training state
    inside: an unfinished job), which then replaces ``out``."""
    import shutil

    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if checkpoint is not None:
        checkpoint(checkpoint_path(staging))
    write(staging)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)


class TrainingJob:
    """The loop both training commands run around their own step: the refusals before any
    work (:func:`begin_job`), a fresh start or the checkpoint's state restored, a checkpoint
    every ``checkpoint_every`` steps and on SIGINT / SIGTERM (then :class:`TrainingInterrupted`),
    ``max_seconds`` stopping early, the log, and the folder published atomically (with the
    checkpoint inside when stopped early, so ``resume`` continues it).

    ``state`` (kept in the checkpoint): ``settings``, ``step``, ``steps``, ``log`` (CSV rows),
    ``tail`` (the last 20 steps' stats), ``seconds`` of training, and what the job adds."""

    TAIL = 20

    def __init__(self, out, settings: dict, *, overwrite: bool, resume: bool, options: dict | None = None,
                 events=None):
        """``settings``: :func:`job_settings`; ``options``: how the command line names them
        (:func:`setting_text`)."""
        self.out, self.settings = Path(out), settings
        self.ckpt = checkpoint_path(self.out)
        self.begun = begin_job(self.out, settings, overwrite, resume, options)
        self.say = events or (lambda line: None)
        self.state = self.rng = self.model = self.opt = None

    @property
    def resumed_state(self) -> dict | None:
        """The checkpoint's ``state`` when resuming (before :meth:`start`), else None."""
        return None if self.begun is None else self.begun[0]

    def start(self, model: torch.nn.Module, opt, seed: int, steps: int, **fresh) -> dict:
        """A fresh state (``fresh`` added; the window sampler seeded with ``seed``), or the
        checkpoint's restored into ``model`` and ``opt``; returns the state."""
        self.model, self.opt = model, opt
        if self.begun is None:
            self.rng = np.random.default_rng(seed)
            self.state = {"settings": self.settings, "step": 0, "steps": steps, "log": [], "tail": [],
                          "seconds": 0.0, **fresh}
        else:
            state, tensors, meta = self.begun
            self.rng = restore(tensors, meta, model, opt, self.ckpt)
            self.state = state
            state.setdefault("steps", steps)
            self.say(f"resuming at step {state['step']}/{state['steps']} from {self.ckpt}")
        return self.state

    def save(self, path=None) -> None:
        save_checkpoint(self.ckpt if path is None else path, self.model, self.opt, self.rng, self.state)

    def run(self, one_step, log_row, *, lr: float, warmup: int, max_seconds: float, checkpoint_every: int,
            retarget=None) -> bool:
        """Train from the state's step to its ``steps``: ``one_step(step, lr)`` -> (loss, stats)
        (the optimizer steps on the loss, gradients clipped), ``log_row(step, steps, lr, stats,
        seconds, stopped)`` -> the log row's columns between lr and seconds; ``retarget(step,
        ran, elapsed_s)`` may set a new step count (None: keep).  True where ``max_seconds``
        stopped it early."""
        state = self.state
        t0, seconds0 = time.perf_counter(), state["seconds"]
        start = step = state["step"]
        steps, stopped = state["steps"], False
        with StopOnSignal() as stop:
            while step < steps:
                if stop.requested:
                    self.save()
                    raise TrainingInterrupted(f"interrupted ({stop.requested}): checkpoint saved at step {step}/"
                                              f"{steps} in {self.ckpt}; rerun with --resume to continue", step, steps,
                                              self.ckpt)
                if retarget is not None:
                    new = retarget(step, step - start, time.perf_counter() - t0)
                    if new is not None:
                        steps = state["steps"] = new
                rate = warmup_cosine_lr(lr, warmup, step, steps)
                loss, stats = one_step(step, rate)
                optimizer_step(self.opt, self.model.parameters(), loss, rate)
                step = state["step"] = step + 1
                state["tail"] = (state["tail"] + [stats])[-self.TAIL:]
                state["seconds"] = seconds = seconds0 + time.perf_counter() - t0
                stopped = time.perf_counter() - t0 > max_seconds and step < steps
                cols = log_row(step, steps, rate, stats, seconds, stopped)
                state["log"].append(",".join([str(step), f"{rate:.6g}", *cols, f"{seconds:.1f}"]))
                if stopped:
                    self.say(f"stopped by max_seconds {max_seconds:g} at step {step}/{steps}: published as is; "
                             "rerun with --resume to continue")
                    break
                if step < steps and step % checkpoint_every == 0:
                    self.save()
        return stopped

    def publish(self, record: dict, log_header: str, write, stopped: bool) -> None:
        """``write(folder, files)`` fills the folder with the job's output and ``files``
        ({name: text}: training.json, the record, and training_log.csv, the log); the training
        state goes in too where ``stopped`` (an unfinished folder: --resume continues it)."""
        files = {"training.json": json.dumps(record, indent=1) + "\n",
                 "training_log.csv": "\n".join([log_header, *self.state["log"]]) + "\n"}
        publish_folder(self.out, lambda staging: write(staging, files), self.save if stopped else None)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name: tensor} of the state dict, each storage once (a tied head is left to its embedding)."""
    seen, out = set(), {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out[name] = t.detach().contiguous()
    return out


def save_checkpoint(path: Path, model: torch.nn.Module, opt, rng: np.random.Generator, state: dict) -> None:
    """Everything needed to continue bit-exactly, in one safetensors file (atomic replace)."""
    from safetensors.torch import save_file

    tensors = {f"model.{k}": v.cpu() for k, v in _weights(model).items()}
    sd = opt.state_dict()
    for i, st in sd["state"].items():
        for key, t in st.items():
            tensors[f"optim.{i}.{key}"] = t.detach().cpu().contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    meta = {"schema": CHECKPOINT_SCHEMA, "state": json.dumps(state),
            "numpy_rng": json.dumps(rng.bit_generator.state), "param_groups": json.dumps(groups)}
    write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=meta))


def read_checkpoint(path: Path) -> tuple[dict, dict, dict]:
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
        raise SimtreeError(f"training checkpoint {path} is unreadable ({' '.join(str(exc).split())[:160]}): "
                           "pass --overwrite to train from scratch") from None


def restore(tensors: dict, meta: dict, model: torch.nn.Module, opt, path: Path) -> np.random.Generator:
    """Load a checkpoint's weights, optimizer and torch RNG into ``model`` / ``opt``; returns
    the window sampler's generator."""
    weights = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if set(missing) - set(model.state_dict()).difference(_weights(model)) or unexpected:
        raise SimtreeError(f"training checkpoint {path} does not match the model (missing {sorted(missing)[:3]}, "
                           f"unexpected {sorted(unexpected)[:3]}): pass --overwrite to train from scratch")
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

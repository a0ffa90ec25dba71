"""Bookkeeping around a sweep: the per-point log, the hard deadline, the progress bar."""
from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["points_log", "read_log_skips", "log_point", "one_line", "Deadline", "hard_deadline",
           "cuda_alive", "progress_bar", "advance"]


def points_log(table: Path) -> Path:
    from simtree.costs.profile_table import side_path

    return side_path(table, "points.jsonl")


def read_log_skips(table: Path) -> set:
    log = points_log(table)
    skips = set()
    if not log.exists():
        return skips
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line from a killed run
        if not isinstance(rec, dict) or not isinstance(rec.get("key"), list):
            continue  # not a record this module wrote: it skips nothing
        if rec.get("status") in ("failed", "oom", "unavailable"):
            skips.add(tuple(rec["key"]))
    return skips


def log_point(table: Path, rec: dict) -> None:
    with open(points_log(table), "a") as fh:
        fh.write(json.dumps(rec, default=str) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


class Deadline(BaseException):
    """Raised by SIGALRM when one point overruns the sweep's time budget (e.g. autotuning)."""


def hard_deadline(seconds: float):
    """Arm a SIGALRM that interrupts a point still running ``seconds`` from now (main thread,
    POSIX only; Python-level work such as Triton autotuning stops, a running kernel finishes).
    Returns the disarm function."""
    import signal
    import threading

    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        return lambda: None

    def fire(signum, frame):
        raise Deadline()
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))

    def disarm():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return disarm


def cuda_alive() -> bool:
    import torch
    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def progress_bar(enabled: bool, total: int):
    if not enabled or total == 0:
        return None
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    bar.start()
    return bar


def advance(bar, task) -> None:
    if bar is not None:
        bar.advance(task)

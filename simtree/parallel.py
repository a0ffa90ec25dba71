"""A deployment: how one model is split over GPUs, written the way serving engines spell it.

    dep = parse_deployment("ep=8")          # experts over 8 GPUs, attention data-parallel
    dep.gpus, dep.tp, dep.ep, dep.dp        # 8, 1, 8, 8
    dep.rank_batch(64)                      # 8 sequences per rank (data-parallel attention)
    dep.sglang_args()                       # ('--tp-size', '8', '--ep-size', '8', '--enable-dp-attention', '--dp-size', '8')

Strings: ``tp=T`` (tensor parallel over T GPUs: attention heads and MLP columns split T ways,
an all-reduce after attention and after the MLP), ``ep=E`` (expert parallel over E GPUs: each
rank holds E-th of the routed experts and the whole attention, run data-parallel over its own
share of the batch; an all-to-all dispatch and combine around every MoE layer) and
``ep=E,tp=T`` (attention tensor-parallel within groups of T, E / T such groups; T divides E).
``tp=1`` is one GPU.  Keys may come in any order; "tp=1,ep=1" and "" mean one GPU too.

The split follows SGLang and vLLM (docs/deployments.md): SGLang's ``--tp-size`` is the number
of GPUs, ``--ep-size`` splits the experts within it and ``--enable-dp-attention --dp-size D``
runs attention data-parallel in D groups; vLLM's ``--enable-expert-parallel`` makes the
expert group its data-parallel x tensor-parallel ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from simtree.errors import SimtreeError

__all__ = ["Deployment", "parse_deployment", "SINGLE_GPU", "DEFAULT_DEPLOYMENT"]

DEFAULT_DEPLOYMENT = "tp=1"   # rows, bundles and policies that name none were measured on one GPU
_KEYS = ("tp", "ep")


@dataclass(frozen=True)
class Deployment:
    """``tp`` tensor-parallel ranks of attention (and of the MLP where ``ep`` is 1); ``ep``
    expert-parallel ranks of the routed experts (1: no expert parallelism)."""

    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for key in _KEYS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SimtreeError(f"deployment: {key} must be an integer >= 1, got {value!r}")
        if self.ep > 1 and self.ep % self.tp:
            raise SimtreeError(f"deployment ep={self.ep},tp={self.tp}: tp must divide ep (attention runs in "
                               f"ep / tp data-parallel groups of tp GPUs)")

    @property
    def gpus(self) -> int:
        """GPUs of the deployment: the expert group under expert parallelism, else the TP group."""
        return self.ep if self.ep > 1 else self.tp

    @property
    def dp(self) -> int:
        """Data-parallel attention groups: each runs attention over its own share of the batch."""
        return self.gpus // self.tp

    @property
    def name(self) -> str:
        """Canonical string, the one profile rows, bundles and policies record: "tp=2", "ep=8",
        "ep=8,tp=2"."""
        if self.ep == 1:
            return f"tp={self.tp}"
        return f"ep={self.ep}" if self.tp == 1 else f"ep={self.ep},tp={self.tp}"

    @property
    def tag(self) -> str:
        """The name without punctuation, for file and folder names: "tp2", "ep8", "ep8tp2"."""
        return self.name.replace("=", "").replace(",", "")

    def __str__(self) -> str:
        return self.name

    def rank_batch(self, batch_size):
        """Sequences one rank's attention runs for a deployment batch of ``batch_size``: all of
        them under tensor parallelism, ceil(b / dp) under data-parallel attention (the busiest
        rank: every rank runs each layer's collectives in step, idle or not)."""
        if self.dp == 1:
            return batch_size
        if isinstance(batch_size, (int, float)):
            return math.ceil(batch_size / self.dp)
        return np.ceil(np.asarray(batch_size, np.float64) / self.dp)

    def sglang_args(self) -> tuple[str, ...]:
        """SGLang server arguments of this deployment (empty for one GPU)."""
        if self.gpus == 1:
            return ()
        args = ("--tp-size", str(self.gpus))
        if self.ep > 1:
            args += ("--ep-size", str(self.ep))
        if self.dp > 1:
            args += ("--enable-dp-attention", "--dp-size", str(self.dp))
        return args

    def vllm_args(self) -> tuple[str, ...]:
        """vLLM serve arguments of this deployment (empty for one GPU)."""
        if self.gpus == 1:
            return ()
        args = ("--tensor-parallel-size", str(self.tp)) if self.tp > 1 else ()
        if self.dp > 1:
            args += ("--data-parallel-size", str(self.dp))
        if self.ep > 1:
            args += ("--enable-expert-parallel",)
        return args


SINGLE_GPU = Deployment()


def parse_deployment(text: "str | Deployment | None") -> Deployment:
    """A :class:`Deployment` from "tp=2", "ep=8", "ep=8,tp=2" (a Deployment is returned as is;
    None or "" is one GPU); one-line SimtreeError naming what is wrong otherwise."""
    if isinstance(text, Deployment):
        return text
    if text is None:
        return SINGLE_GPU
    if not isinstance(text, str):
        raise SimtreeError(f"deployment must be a string such as 'tp=2' or 'ep=8', got {text!r}")
    fields = [f.strip() for f in text.replace(" ", "").split(",")] if text.strip() else []
    values: dict[str, int] = {}
    for field in fields:
        key, sep, value = field.partition("=")
        key = key.lower()
        if not sep or key not in _KEYS:
            raise SimtreeError(f"deployment {text!r}: each part is tp=N or ep=N (e.g. 'tp=2', 'ep=8', "
                               f"'ep=8,tp=2'), got {field!r}")
        if key in values:
            raise SimtreeError(f"deployment {text!r}: {key} given twice")
        if not value.isdigit() or int(value) < 1:
            raise SimtreeError(f"deployment {text!r}: {key} must be a whole number >= 1, got {value!r}")
        values[key] = int(value)
    return Deployment(**values)

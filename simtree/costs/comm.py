"""Communication of a deployment's step: an alpha-beta model of each collective, and the
collectives one rank's verify and draft steps issue.

    comm = load_comm(data_path("comm", "h200_nvlink.json"))   # or fit_comm(profile rows)
    comm.time_us("all_reduce", group=2, message_bytes=1 << 20)
    calls = step_collectives(get_model("qwen3.6-27b"), parse_deployment("tp=2"), tokens=64)
    comm.calls_us(calls)                                       # one verify step's communication

Model: t(collective, g, S) = alpha_us + f(g) * S / busbw, with S the message size as
nccl-tests counts it (the buffer each rank reduces for all-reduce, the gathered output for
all-gather, each rank's send buffer for all-to-all), busbw the bus bandwidth and f the bytes
each rank moves per byte of S: 2 (g - 1) / g for all-reduce (ring), (g - 1) / g for all-gather
and all-to-all (uniform routing keeps 1 / g at home).  g = 1 costs nothing.

Collectives of one rank's step, T = the rank's tokens (its batch share x nodes), activations at
the model's dtype (docs/deployments.md): under tensor parallelism over t an all-reduce of
T x hidden after every attention block and every MLP block, one after the vocabulary-parallel
embedding and an all-gather of the T x vocab logits of the LM head; under expert parallelism
over e a dispatch and a combine all-to-all of T x experts_per_token x hidden around every MoE
layer (plus, with t > 1, the shared expert's all-reduce).  The draft layer issues the same per
drafting step.

File schema ``simtree.comm/1`` (JSON): {"schema", "machine", "measured": bool, "source",
"collectives": {name: {"<g>": {"alpha_us", "busbw_gb_s"}}}, "fit": {...} when measured}.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from simtree.parallel import Deployment, parse_deployment
from simtree.errors import SimtreeError
from simtree.fileio import read_json, write_text_atomic
from simtree.models import DTYPE_BYTES, ModelShape

__all__ = ["COLLECTIVES", "COMM_SCHEMA", "COMM_STAGES", "AlphaBeta", "CommModel", "Call", "load_comm",
           "traffic_factor", "step_collectives", "draft_collectives", "fit_comm", "fit_comm_profile", "ASSUMED_LABEL"]

COMM_SCHEMA = "simtree.comm/1"
COLLECTIVES = ("all_reduce", "all_gather", "all_to_all")
COMM_STAGES = {c: f"comm_{c}" for c in COLLECTIVES}   # profile-table stage of each collective
ASSUMED_LABEL = "communication assumed"


def traffic_factor(collective: str, group: int) -> float:
    """Bytes each rank sends per byte of the message (see the module docstring)."""
    if collective not in COLLECTIVES:
        raise SimtreeError(f"unknown collective {collective!r} (known: {', '.join(COLLECTIVES)})")
    share = (group - 1) / group
    return 2 * share if collective == "all_reduce" else share


@dataclass(frozen=True)
class AlphaBeta:
    alpha_us: float
    busbw_gb_s: float

    def time_us(self, collective: str, group: int, message_bytes):
        # GB/s = 1e3 bytes per microsecond
        return self.alpha_us + traffic_factor(collective, group) * np.asarray(message_bytes, np.float64) / (
            self.busbw_gb_s * 1e3)


@dataclass(frozen=True)
class Call:
    """``count`` calls of ``collective`` over ``group`` ranks, each moving ``message_bytes``."""

    collective: str
    group: int
    message_bytes: float
    count: int
    what: str = ""


@dataclass
class CommModel:
    collectives: dict            # {collective: {group: AlphaBeta}}
    measured: bool = False
    machine: str = ""
    source: object = ""
    fit: dict = field(default_factory=dict)

    @property
    def assumed(self) -> bool:
        return not self.measured

    @property
    def label(self) -> str:
        """"communication assumed" or "communication measured", what plans and reports print."""
        return ASSUMED_LABEL if self.assumed else "communication measured"

    def params(self, collective: str, group: int) -> AlphaBeta:
        """The group's parameters; a group size without any: those of the nearest larger one
        (the next larger measured group moves at least as much), else of the largest."""
        table = self.collectives.get(collective)
        if not table:
            raise SimtreeError(f"communication model has no {collective} (has: {', '.join(self.collectives)})")
        larger = sorted(g for g in table if g >= group)
        return table[larger[0] if larger else max(table)]

    def time_us(self, collective: str, group: int, message_bytes):
        """Microseconds of one call (numpy broadcasting over ``message_bytes``); 0 for one rank."""
        if group <= 1:
            return np.zeros_like(np.asarray(message_bytes, np.float64))
        return self.params(collective, group).time_us(collective, group, message_bytes)

    def calls_us(self, calls: Iterable[Call]):
        """Total microseconds of ``calls`` (message sizes may be arrays of the same shape)."""
        total = 0.0
        for c in calls:
            total = total + c.count * self.time_us(c.collective, c.group, c.message_bytes)
        return total

    def to_dict(self) -> dict:
        out = {"schema": COMM_SCHEMA, "machine": self.machine, "measured": self.measured, "source": self.source,
               "collectives": {c: {str(g): {"alpha_us": p.alpha_us, "busbw_gb_s": p.busbw_gb_s}
                                   for g, p in sorted(t.items())} for c, t in self.collectives.items()}}
        if self.fit:
            out["fit"] = self.fit
        return out

    def save(self, path: str | os.PathLike) -> Path:
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")

    @classmethod
    def from_dict(cls, d, where: str = "communication model") -> "CommModel":
        if not isinstance(d, dict) or d.get("schema") != COMM_SCHEMA:
            got = d.get("schema") if isinstance(d, dict) else type(d).__name__
            raise SimtreeError(f"{where}: not a simtree communication model (schema {got!r}, expected {COMM_SCHEMA!r})")
        if not isinstance(d.get("measured"), bool):
            raise SimtreeError(f"{where}: measured must be true or false")
        table = d.get("collectives")
        if not isinstance(table, dict) or not table:
            raise SimtreeError(f"{where}: collectives must map collective names to group sizes")
        out: dict = {}
        for coll, groups in table.items():
            if coll not in COLLECTIVES:
                raise SimtreeError(f"{where}: unknown collective {coll!r} (known: {', '.join(COLLECTIVES)})")
            if not isinstance(groups, dict) or not groups:
                raise SimtreeError(f"{where}: {coll} must map group sizes to {{alpha_us, busbw_gb_s}}")
            for g, p in groups.items():
                w = f"{where}: {coll} group {g}"
                if not str(g).isdigit() or int(g) < 2:
                    raise SimtreeError(f"{w}: group sizes are integers >= 2")
                vals = [p.get(k) if isinstance(p, dict) else None for k in ("alpha_us", "busbw_gb_s")]
                if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in vals) \
                        or vals[0] < 0 or vals[1] <= 0:
                    raise SimtreeError(f"{w}: needs alpha_us >= 0 and busbw_gb_s > 0, got {p!r}")
                out.setdefault(coll, {})[int(g)] = AlphaBeta(float(vals[0]), float(vals[1]))
        return cls(out, d["measured"], str(d.get("machine", "")), d.get("source", ""), d.get("fit") or {})


def load_comm(path: str | os.PathLike) -> CommModel:
    return CommModel.from_dict(read_json(path, "communication model"), f"communication model {path}")


# ---- the collectives of one rank's step ----------------------------------------------------------
def _layer_calls(shape: ModelShape, dep: Deployment, tokens, layers: int, mlp: dict, act: int) -> list[Call]:
    """Collectives of ``layers`` blocks (attention + MLP) at ``tokens`` tokens of one rank."""
    h, t, e = shape.hidden, dep.tp, dep.ep
    row = np.asarray(tokens, np.float64) * h * act
    calls = []
    if t > 1:
        calls.append(Call("all_reduce", t, row, layers, "attention output"))
    if e > 1 and mlp.get("kind") == "moe":
        k = int(mlp["experts_per_token"])
        calls += [Call("all_to_all", e, row * k, layers, "MoE dispatch"), Call("all_to_all", e, row * k, layers,
                                                                               "MoE combine")]
        if t > 1 and mlp.get("shared_intermediate"):
            calls.append(Call("all_reduce", t, row, layers, "shared expert output"))
    elif t > 1:
        calls.append(Call("all_reduce", t, row, layers, "MLP output"))
    return calls


def _ends(shape: ModelShape, dep: Deployment, tokens, act: int) -> list[Call]:
    """The vocabulary-parallel embedding's all-reduce and the LM head's logits all-gather."""
    if dep.tp <= 1:
        return []
    t = np.asarray(tokens, np.float64)
    vocab = shape.vocab * (dep.tp if shape.ranks > 1 else 1)   # a rank's shape holds a tp-th of it
    return [Call("all_reduce", dep.tp, t * shape.hidden * act, 1, "embedding"),
            Call("all_gather", dep.tp, t * vocab * act, 1, "LM head logits")]


def step_collectives(shape: ModelShape, deployment, tokens) -> list[Call]:
    """The collectives one rank issues in a verify step of ``tokens`` tokens (its share)."""
    dep = parse_deployment(deployment)
    if dep.gpus == 1:
        return []
    act = DTYPE_BYTES.get(shape.dtype, 2)
    return _layer_calls(shape, dep, tokens, shape.num_layers, shape.mlp, act) + _ends(shape, dep, tokens, act)


def draft_collectives(shape: ModelShape, deployment, tokens) -> list[Call]:
    """The collectives of one drafting step at ``tokens`` tokens (the draft layers, the
    embedding and the LM head); none for a model without a draft layer."""
    dep = parse_deployment(deployment)
    d = shape.draft or {}
    if dep.gpus == 1 or not d.get("attention"):
        return []
    act = DTYPE_BYTES.get(shape.dtype, 2)
    mlp = {"kind": "dense"} if "intermediate" in d else shape.mlp
    return _layer_calls(shape, dep, tokens, int(d.get("layers", 1)), mlp, act) + _ends(shape, dep, tokens, act)


# ---- fitting measured collectives ------------------------------------------------------------------
def fit_comm(rows, source=None, machine: str = "") -> CommModel:
    """Alpha-beta parameters per (collective, group size) from profile rows of the collectives
    stages (``COMM_STAGES``; ``message_bytes`` column, group = the row's deployment's GPUs):
    non-negative least squares of latency_us_median on [1, f(g) * message_bytes], so alpha >= 0
    and the time never falls with the message.  Groups of one rank (a dry run) are left out."""
    from scipy.optimize import nnls

    stage_of = {s: c for c, s in COMM_STAGES.items()}
    rows = rows[rows["stage"].isin(stage_of)]
    if rows.empty:
        raise SimtreeError(f"no collective rows (stages {', '.join(COMM_STAGES.values())})")
    table: dict = {}
    fit: dict = {}
    groups = rows.assign(group=[parse_deployment(d).gpus for d in rows["deployment"]],
                         collective=[stage_of[s] for s in rows["stage"]])
    for (coll, g), sub in groups.groupby(["collective", "group"]):
        if g < 2:
            continue
        size = sub["message_bytes"].to_numpy(np.float64)
        lat = sub["latency_us_median"].to_numpy(np.float64)
        if len(np.unique(size)) < 2:
            raise SimtreeError(f"{coll} over {g} ranks: measured at {len(np.unique(size))} message size(s); the "
                               "alpha-beta fit needs two or more")
        x = traffic_factor(coll, int(g)) * size
        w = 1.0 / lat   # relative residuals: small messages count as much as large ones
        (alpha, slope), _ = nnls(np.stack([w, x * w], 1), np.ones_like(lat))
        slope = max(slope, 1e-9)   # flat data (a loopback): bandwidth capped, never infinite
        pred = alpha + x * slope
        err = np.abs(pred / lat - 1)
        table.setdefault(coll, {})[int(g)] = AlphaBeta(float(alpha), float(1.0 / slope / 1e3))
        fit.setdefault(coll, {})[str(int(g))] = {
            "points": int(len(sub)), "message_bytes": [float(size.min()), float(size.max())],
            "median_rel_err": round(float(np.median(err)), 4), "max_rel_err": round(float(err.max()), 4)}
    if not table:
        raise SimtreeError("the collective rows hold groups of one rank only (a dry run): nothing to fit")
    return CommModel(table, True, machine, source or {}, fit)


def fit_comm_profile(path: str | os.PathLike) -> CommModel:
    """:func:`fit_comm` of a profile table's collective rows, its source the table (path and
    sha256) and its machine the one the rows' device names (machine table)."""
    from simtree.costs.profile_table import load_profile, profile_hash
    from simtree.machine.machines import machine_for_device

    df = load_profile(path)
    rows = df[df["stage"].isin(COMM_STAGES.values())]
    devices = sorted(rows["device"].unique())
    if len(devices) > 1:
        raise SimtreeError(f"{Path(path).name}: collective rows of several devices ({', '.join(devices)}): one per fit")
    machine = machine_for_device(devices[0]) if devices else None
    return fit_comm(rows, {"profile": str(path), "sha256": profile_hash(path)},
                    machine.key if machine is not None else (devices[0] if devices else ""))

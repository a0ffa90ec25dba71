"""The policy file (contract 3): which speculation mode to run per workload and batch size.

JSON::

    {"schema": "simtree.policy/1", "model": str, "device": str, "created": iso-time,
     "deployment": str,          # e.g. "tp=2", "ep=8" (an addition; absent: "tp=1", one GPU), or
                                 # "ep=8 rank": one rank of ep=8 planned alone (below)
     "source": {...},            # cost bundle meta (synthetic flag, communication), planner settings
     "entries": [{"workload": str, "batch_min": int, "batch_max": int,
                  "mode": "none"|"linear"|"eagle"|"best_first"|"cost_aware"|"batch_alloc"|
                          "block"|"tfm"|"dspark",
                  "params": {...}, "tree_on": bool, "predicted_tok_s": float,
                  "gain_vs_linear": float, "gain_vs_none": float,
                  "within_model_error": bool,     # optional (default false)
                  # optional, written by `simtree plan` when it draws bootstrap models:
                  "predicted_tok_s_band": [lo, hi], "band_models": int,
                  "runner_up": {"policy": str, "advantage_band": [lo, hi]},
                  "within_band": bool}]}

A deployment ending in " rank" (e.g. "ep=8 rank", an addition) marks a plan of one rank of that
deployment alone (``simtree.deploy.costs.one_rank``): batch b is the b sequences on the rank and no
collectives are priced - what a run of the rank on one GPU measures, not the deployment's batch b
(ceil(b / dp) sequences a rank under data-parallel attention, plus the collectives).  Such a plan is
refused where a deployment is served (``simtree sglang``, ``simtree export``, ``simtree simulate``).

``tree_on`` is true exactly for the tree modes (eagle, best_first, cost_aware, batch_alloc,
block, tfm).
``within_model_error`` (an addition) is true when a tree was chosen for a predicted gain over
the best linear / plain alternative smaller than the verify cost model's held-out median error:
the choice is a coin toss within what the fit can resolve.  Each entry is planned at its
``batch_max`` (the planner's batch sizes are the ranges' upper ends).

The band fields (additions, :mod:`simtree.planning.bands`): the 10th-90th percentile of the
predicted tok/s over ``band_models`` bootstrap acceptance models, the runner-up (the best
policy of another family) with the band of the chosen policy's relative advantage over it
(paired, per model), and ``within_band``: the runner-up is at least as fast under at least 10%
of the models.  Readers that do not know them may ignore them.

params: linear {"budget"}; eagle {"num_steps", "topk", "budget"}; best_first {"budget",
"width", "draft_depth"}; cost_aware {"max_budget", "draft_depth"}; batch_alloc
{"max_budget_per_seq", "draft_depth"}; block {"budget", "block_len"}; tfm {"budget", "width",
"block_len"}; dspark {"block_len", "threshold" (optional, a number in [0, 1]; absent: the
load schedule)}.  ``draft_depth`` (positions of top-K marginals the drafter produces) is an
addition; readers that do not know it may ignore it.  The block-drafter modes are additions
(docs/drafters.md).  In memory an entry's ``params`` is the typed
:class:`~simtree.planning.modes.PolicySpec` of its mode.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from simtree.parallel import DEFAULT_DEPLOYMENT, parse_deployment
from simtree.errors import SimtreeError, check_int, check_real
from simtree.fileio import write_text_atomic
from simtree.planning.modes import MODES, PolicySpec

__all__ = ["SCHEMA", "PolicyEntry", "Policy", "RANK_SUFFIX", "deployment_label", "rank_collectives"]

SCHEMA = "simtree.policy/1"
RANK_SUFFIX = " rank"     # "ep=8 rank": one rank of ep=8 planned alone (module docstring)
_ENTRY_FIELDS = ("workload", "batch_min", "batch_max", "mode", "params", "tree_on", "predicted_tok_s",
                 "gain_vs_linear", "gain_vs_none")


@dataclass(frozen=True)
class PolicyEntry:
    """The policy for ``workload`` at batch sizes [batch_min, batch_max], planned at batch_max."""

    workload: str
    batch_min: int
    batch_max: int
    params: PolicySpec
    predicted_tok_s: float
    gain_vs_linear: float
    gain_vs_none: float
    within_model_error: bool = False
    tok_s_band: tuple[float, float] | None = None          # predicted tok/s, 10th-90th percentile
    runner_up: tuple[str, tuple[float, float]] | None = None   # (policy, band of the advantage over it)
    within_band: bool = False
    band_models: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.params, PolicySpec):
            raise SimtreeError(f"policy entry for {self.workload!r}: params must be a PolicySpec "
                               f"(e.g. EagleParams), got {type(self.params).__name__}")

    @property
    def mode(self) -> str:
        return self.params.mode

    @property
    def tree_on(self) -> bool:
        return self.params.tree_on

    def to_dict(self) -> dict:
        """The entry as the policy file holds it (band fields only where a band was drawn)."""
        out = {"workload": self.workload, "batch_min": self.batch_min, "batch_max": self.batch_max,
               "mode": self.mode, "params": self.params.to_dict(), "tree_on": self.tree_on,
               "predicted_tok_s": self.predicted_tok_s, "gain_vs_linear": self.gain_vs_linear,
               "gain_vs_none": self.gain_vs_none, "within_model_error": self.within_model_error}
        if self.tok_s_band is not None:
            out.update(predicted_tok_s_band=list(self.tok_s_band), band_models=self.band_models,
                       within_band=self.within_band)
            if self.runner_up is not None:
                out["runner_up"] = {"policy": self.runner_up[0], "advantage_band": list(self.runner_up[1])}
        return out

    @classmethod
    def from_dict(cls, obj, where: str) -> "PolicyEntry":
        if not isinstance(obj, dict):
            raise SimtreeError(f"{where}: a policy entry must be an object")
        missing = [k for k in _ENTRY_FIELDS if k not in obj]
        if missing:
            raise SimtreeError(f"{where}: policy entry lacks {missing[0]!r}")
        batch_min, batch_max = (check_int(obj[key], f"{where}: {key}") for key in ("batch_min", "batch_max"))
        if batch_min > batch_max:
            raise SimtreeError(f"{where}: batch_min {batch_min} > batch_max {batch_max}")
        if obj["mode"] not in MODES:
            raise SimtreeError(f"{where}: unknown mode {obj['mode']!r} (use one of {', '.join(MODES)})")
        try:
            params = PolicySpec.from_dict(obj["mode"], obj["params"])
        except SimtreeError as exc:
            raise SimtreeError(f"{where}: {exc}") from None
        if not isinstance(obj["tree_on"], bool):
            raise SimtreeError(f"{where}: tree_on must be true or false, got {obj['tree_on']!r}")
        if obj["tree_on"] != params.tree_on:
            raise SimtreeError(f"{where}: tree_on is {str(obj['tree_on']).lower()} but mode {obj['mode']!r} "
                               f"{'verifies a tree' if params.tree_on else 'verifies no tree'}")
        within = obj.get("within_model_error", False)
        if not isinstance(within, bool):
            raise SimtreeError(f"{where}: within_model_error must be true or false, got {within!r}")
        for key in ("predicted_tok_s", "gain_vs_linear", "gain_vs_none"):
            check_real(obj[key], f"{where}: {key}", 0)
        return cls(str(obj["workload"]), batch_min, batch_max, params, float(obj["predicted_tok_s"]),
                   float(obj["gain_vs_linear"]), float(obj["gain_vs_none"]), within, **_band_fields(obj, where))


def _interval(value, what: str, where: str, low: float | None) -> tuple[float, float]:
    ok = (isinstance(value, list) and len(value) == 2
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value))
    if not ok or value[0] > value[1] or (low is not None and value[0] < low):
        raise SimtreeError(f"{where}: {what} must be [lo, hi], two finite numbers with lo <= hi"
                           + (f" and lo >= {low:g}" if low is not None else "") + f", got {value!r}")
    return float(value[0]), float(value[1])


def _band_fields(obj: dict, where: str) -> dict:
    """The optional band fields of an entry, checked (an entry without them has no band)."""
    if "predicted_tok_s_band" not in obj:
        return {}
    band = _interval(obj["predicted_tok_s_band"], "predicted_tok_s_band", where, 0.0)
    models = check_int(obj.get("band_models"), f"{where}: band_models")
    within = obj.get("within_band", False)
    if not isinstance(within, bool):
        raise SimtreeError(f"{where}: within_band must be true or false, got {within!r}")
    runner = obj.get("runner_up")
    if runner is not None:
        if not isinstance(runner, dict) or not isinstance(runner.get("policy"), str):
            raise SimtreeError(f"{where}: runner_up must be an object with a policy name")
        runner = (runner["policy"], _interval(runner.get("advantage_band"), "runner_up.advantage_band", where, -1.0))
    return {"tok_s_band": band, "runner_up": runner, "within_band": within, "band_models": models}


def deployment_label(text) -> str:
    """The canonical deployment of a policy: a deployment's name ("ep=8"), or "<deployment> rank"
    for one rank of a deployment of several GPUs planned alone; a one-line error otherwise."""
    text = str(text or DEFAULT_DEPLOYMENT).strip()
    head, _, tail = text.rpartition(" ")
    if tail != RANK_SUFFIX.strip() or not head.strip():
        return parse_deployment(text).name
    dep = parse_deployment(head)
    return dep.name if dep.gpus == 1 else dep.name + RANK_SUFFIX    # one GPU: the rank is the deployment


def rank_collectives(label) -> str | None:
    """What a "<deployment> rank" run alone leaves out, for the words beside the label (the label
    itself stays :func:`deployment_label`'s): "all-to-all" (expert-parallel), "all-reduce"
    (tensor-parallel); None for a label that is not a rank."""
    text = deployment_label(label)
    if not text.endswith(RANK_SUFFIX):
        return None
    return "all-to-all" if parse_deployment(text[: -len(RANK_SUFFIX)]).ep > 1 else "all-reduce"


@dataclass
class Policy:
    model: str
    device: str
    entries: list[PolicyEntry]
    source: dict = field(default_factory=dict)
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    deployment: str = DEFAULT_DEPLOYMENT

    def __post_init__(self) -> None:
        self.deployment = deployment_label(self.deployment)
        seen: dict[str, list[tuple[int, int]]] = {}
        for e in self.entries:
            for lo, hi in seen.get(e.workload, []):
                if e.batch_min <= hi and lo <= e.batch_max:
                    raise SimtreeError(f"policy: workload {e.workload!r} has overlapping batch ranges "
                                       f"[{lo}, {hi}] and [{e.batch_min}, {e.batch_max}]")
            seen.setdefault(e.workload, []).append((e.batch_min, e.batch_max))

    @property
    def rank_of(self) -> str | None:
        """The deployment whose one rank was planned alone ("ep=8" of "ep=8 rank"), else None."""
        return self.deployment[: -len(RANK_SUFFIX)] if self.deployment.endswith(RANK_SUFFIX) else None

    def check_served(self, where: str, what: str = "serve it") -> None:
        """One-line error where a plan of one rank alone would be taken for its deployment's
        (``where``: the file, ``what``: what the caller does with it)."""
        if self.rank_of is not None:
            raise SimtreeError(f"{where} plans one rank of {self.rank_of} alone (batch b = b sequences on the rank, "
                               f"no collectives), not the {self.rank_of} deployment: to {what}, plan the deployment "
                               f"(simtree plan --deployment {self.rank_of})")

    def check_rank_run(self, where: str) -> None:
        """One-line error where a plan of a deployment's batch would be measured on one rank with
        the same batch (the full runtime runs one rank on one GPU: b sequences on the rank, no
        collectives): a deployment with data-parallel attention (dp > 1) plans ceil(b / dp) sequences
        a rank plus its collectives at batch b.  A rank planned alone ("ep=8 rank") passes."""
        dep = parse_deployment(self.rank_of or self.deployment)
        if self.rank_of is None and dep.dp > 1:
            raise SimtreeError(f"{where} plans the {dep} deployment's batch (b sequences over {dep.dp} ranks, "
                               f"ceil(b / {dep.dp}) a rank, plus its collectives), but the full runtime runs one "
                               "rank with b sequences and no collectives: measure a plan of the rank alone "
                               "(simtree.deploy.costs.one_rank; without --policy the run plans it from the bundle)")

    @property
    def workloads(self) -> list[str]:
        return sorted({e.workload for e in self.entries})

    def lookup(self, workload: str, batch_size: int, clamp: bool = True) -> PolicyEntry:
        """The entry whose [batch_min, batch_max] holds ``batch_size``; with ``clamp`` a batch
        outside every range takes the nearest range's entry."""
        entries = sorted((e for e in self.entries if e.workload == workload), key=lambda e: e.batch_min)
        if not entries:
            raise SimtreeError(f"policy has no entry for workload {workload!r} (has {', '.join(self.workloads)})")
        for e in entries:
            if e.batch_min <= batch_size <= e.batch_max:
                return e
        if not clamp:
            raise SimtreeError(f"policy has no entry for workload {workload!r} at batch size {batch_size}")
        return min(entries, key=lambda e: min(abs(batch_size - e.batch_min), abs(batch_size - e.batch_max)))

    def resolve(self, workload: str, batch_size: int) -> tuple[PolicyEntry, str | None]:
        """(``lookup(workload, batch_size)``, one line when ``batch_size`` lies outside every
        planned range of ``workload`` and the lookup clamped it to the nearest entry, else
        None): what every caller of a policy at a batch size needs, looked up once."""
        entry = self.lookup(workload, batch_size)
        if entry.batch_min <= batch_size <= entry.batch_max:
            return entry, None
        side, edge = ("largest", entry.batch_max) if batch_size > entry.batch_max else ("smallest", entry.batch_min)
        return entry, (f"batch size {batch_size} is outside the policy's planned range for {workload!r}: clamped "
                       f"to its {side} planned batch size {edge} ({entry.mode}, planned at batch {entry.batch_max})")

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "model": self.model, "device": self.device, "deployment": self.deployment,
                "created": self.created, "source": self.source, "entries": [e.to_dict() for e in self.entries]}

    def save(self, path: str | Path) -> Path:
        """Write atomically (temp file + os.replace)."""
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Policy":
        path = Path(path)
        if not path.is_file():
            raise SimtreeError(f"policy file {path} does not exist")
        try:
            obj = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SimtreeError(f"policy file {path} is not valid JSON ({getattr(exc, 'msg', exc)})") from None
        if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
            found = obj.get("schema") if isinstance(obj, dict) else type(obj).__name__
            raise SimtreeError(f"policy file {path}: schema {found!r} is not {SCHEMA!r}")
        for key in ("model", "device", "entries"):
            if key not in obj:
                raise SimtreeError(f"policy file {path}: missing {key!r}")
        if not isinstance(obj["entries"], list) or not obj["entries"]:
            raise SimtreeError(f"policy file {path}: 'entries' must be a non-empty list")
        entries = [PolicyEntry.from_dict(e, f"policy file {path}: entry {i}") for i, e in enumerate(obj["entries"])]
        try:
            deployment = deployment_label(obj.get("deployment"))
            meta = obj["source"].get("costs") if isinstance(obj.get("source"), dict) else None
            rank_of = meta.get("rank_of") if isinstance(meta, dict) else None
            if rank_of and deployment == DEFAULT_DEPLOYMENT:   # written as "tp=1" before the label said rank
                deployment = deployment_label(f"{rank_of}{RANK_SUFFIX}")
        except SimtreeError as exc:
            raise SimtreeError(f"policy file {path}: {exc}") from None
        return cls(str(obj["model"]), str(obj["device"]), entries, obj.get("source", {}) or {},
                   str(obj.get("created", "")), deployment)

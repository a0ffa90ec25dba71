"""Turn a planned policy into SGLang server arguments (the engine a user scales out on).

SGLang's EAGLE path takes a static tree per server: ``--speculative-num-steps`` (s),
``--speculative-eagle-topk`` (k) and ``--speculative-num-draft-tokens`` (D, nodes including the
root, the same budget convention as simtree). Linear speculation is k = 1, s = D - 1.
Per-round adaptive budgets (cost_aware, batch_alloc) and best-first trees have no SGLang flag:
for those the best *static* candidate the planner scored for the same workload at the batch size
the policy entry was planned at (the entry's ``batch_max``; ``candidates.csv`` beside the
policy file) is exported instead, and the loss is reported at that one batch size.

The policy's deployment comes first, as SGLang spells it (``--tp-size``, ``--ep-size``,
``--enable-dp-attention --dp-size``; :meth:`simtree.deploy.Deployment.sglang_args`).
"""
from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from simtree.parallel import parse_deployment
from simtree.errors import SimtreeError
from simtree.planning.modes import EagleParams, LinearParams, NoneParams, PolicySpec, check_batch_size
from simtree.planning.planner import read_candidates
from simtree.planning.policy_file import Policy

__all__ = ["STATIC_MODES", "SGLangExport", "server_args", "export"]

STATIC_MODES = ("none", "linear", "eagle")


@dataclass(frozen=True)
class SGLangExport:
    workload: str
    batch_size: int
    planned_policy: str          # what simtree plan chose
    exported_policy: str         # what the arguments express
    args: tuple[str, ...]        # server arguments (empty: run without speculation)
    predicted_tok_s: float       # of the exported policy
    loss_vs_planned: float       # 1 - exported / planned predicted throughput (0 when exact)
    planned_batch_size: int = 0  # the batch size both throughputs are predicted at
    deployment: str = "tp=1"     # the policy's deployment
    deployment_args: tuple[str, ...] = ()   # its SGLang parallelism arguments (empty: one GPU)

    def command_line(self) -> str:
        spec = " ".join(self.args) if self.args else "(no speculative arguments: plain decoding)"
        return " ".join(self.deployment_args + (spec,)) if self.deployment_args else spec


def server_args(spec: PolicySpec) -> tuple[str, ...]:
    """SGLang arguments for a static policy; SimtreeError for modes SGLang cannot express."""
    if isinstance(spec, NoneParams):
        return ()
    if not isinstance(spec, (LinearParams, EagleParams)):
        raise SimtreeError(f"SGLang has no flag for mode {spec.mode!r}; only {', '.join(STATIC_MODES)} are static")
    steps, topk = spec.draft_shape()   # linear: D - 1 steps of top-1
    if steps < 1:
        return ()
    return ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(steps),
            "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens", str(spec.budget))


def export(policy_path: str | Path, workload: str, batch_size: int, deployment: str | None = None) -> SGLangExport:
    """The SGLang arguments for ``workload`` at ``batch_size`` from a ``simtree plan`` folder.

    The policy entry that holds ``batch_size`` was planned at its ``batch_max``: a static
    substitute comes from the candidates scored at that same batch size, so the reported loss
    compares two predictions at one batch size.  A batch size outside every planned range
    warns (RuntimeWarning) that the policy is clamped to the nearest planned one.  ``deployment``
    must be the one the policy was planned for (its costs are that deployment's)."""
    check_batch_size(batch_size)
    policy = Policy.load(policy_path)
    policy.check_served(str(policy_path), "serve it with SGLang")
    if deployment is not None and parse_deployment(deployment).name != policy.deployment:
        raise SimtreeError(f"{policy_path} was planned for {policy.model} at {policy.deployment}, not at "
                           f"{parse_deployment(deployment).name}: plan that deployment (simtree plan --deployment)")
    dep = parse_deployment(policy.deployment)
    result = _export(policy, policy_path, workload, batch_size)
    return dataclasses.replace(result, deployment=dep.name, deployment_args=dep.sglang_args())


def _export(policy: Policy, policy_path, workload: str, batch_size: int) -> SGLangExport:
    entry, note = policy.resolve(workload, batch_size)
    if note:
        warnings.warn(note, RuntimeWarning, stacklevel=2)
    planned_b = entry.batch_max
    if entry.mode in STATIC_MODES:
        planned = entry.params.name
        return SGLangExport(workload, batch_size, planned, planned, server_args(entry.params),
                            entry.predicted_tok_s, 0.0, planned_b)
    cand_path = Path(policy_path).with_name("candidates.csv")
    if not cand_path.exists():
        raise SimtreeError(f"policy chose {entry.mode!r}, which SGLang cannot express, and {cand_path} "
                           "(the planner's scored candidates) is missing to pick the best static one")
    cands = read_candidates(cand_path, policy)
    rows = cands[(cands["workload"] == workload) & (cands["batch_size"] == planned_b)
                 & cands["mode"].isin(STATIC_MODES)]
    if rows.empty:
        raise SimtreeError(f"{cand_path} has no static candidate for workload {workload!r} at the planned "
                           f"batch size {planned_b}")
    best = rows.sort_values("tok_s", ascending=False, kind="stable").iloc[0]
    static = PolicySpec.from_dict(best["mode"], json.loads(best["params"]))
    return SGLangExport(workload, batch_size, f"{entry.mode} {json.dumps(entry.params.to_dict(), sort_keys=True)}",
                        static.name, server_args(static), float(best["tok_s"]),
                        1.0 - float(best["tok_s"]) / entry.predicted_tok_s, planned_b)

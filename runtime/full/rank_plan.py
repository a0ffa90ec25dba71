"""The plan of what a run of one rank measures: the rank alone, b sequences on it, no collectives.

    if plans_rank_alone(deployment):         # ep=8: the deployment's batch b is ceil(b / 8) a rank
        path, res = plan_rank(costs, get_workload("gsm8k"), [1, 4, 16, 64], out / "plan")

The full runtime runs one rank of a deployment on one GPU (the V4 ep=8 rank: attention over the
batch's own b sequences, the all-to-all not run).  A plan of the deployment prices batch b as
ceil(b / dp) sequences a rank plus the collectives, so its choice at b is not a choice for what the
rank runs at b: the runs measure a plan of the rank alone (:func:`simtree.deploy.costs.one_rank`),
made from the run's bundle over the run's batch sizes and written beside its results
(``policy.json`` with deployment "ep=8 rank", ``candidates.csv``).
"""
from __future__ import annotations

from pathlib import Path

from simtree.fileio import write_text_atomic
from simtree.parallel import parse_deployment

__all__ = ["plans_rank_alone", "plan_rank"]


def plans_rank_alone(deployment) -> bool:
    """Whether a run of one rank of ``deployment`` measures another batch than the deployment's
    plan prices: under data-parallel attention (dp > 1) a rank holds ceil(b / dp) of batch b."""
    return parse_deployment(deployment).dp > 1


def plan_rank(costs, workload, batch_sizes, out: Path, say=None):
    """(policy.json path, PlanResult): ``costs`` (a bundle or its path) planned as the rank alone
    over ``batch_sizes`` for ``workload`` (a :class:`~simtree.acceptance.model.Workload`), written
    under ``out`` (policy.json, candidates.csv); ``say(line)`` gets what was planned."""
    from simtree.costs.model import load_costs
    from simtree.deploy.costs import one_rank
    from simtree.planning.planner import plan

    bundle = costs if hasattr(costs, "verify") else load_costs(costs)
    res = plan(one_rank(bundle), [workload], list(batch_sizes))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = res.to_policy().save(out / "policy.json")
    write_text_atomic(out / "candidates.csv", res.candidates.to_csv(index=False))
    if say is not None:
        source = costs if isinstance(costs, (str, Path)) else "the bundle"
        say(f"planned the rank alone ({res.deployment}: b sequences on the rank, no collectives) from {source} "
            f"-> {path}")
        for row in res.chosen.itertuples():
            say(f"plan batch {row.batch_size}: {row.policy} ({row.tok_s:.0f} tok/s predicted)")
    return path, res

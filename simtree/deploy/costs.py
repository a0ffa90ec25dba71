"""A deployment's cost model: one rank's measured step composed with its communication.

    costs = deployment_costs(load_costs("h200_deepseek-v4-flash_ep8.json"))
    costs.verify.predict(n, l, b)     # C_v of the deployment for a batch of b sequences
    costs.meta["communication"]       # the alpha-beta model it rests on ("assumed" or measured)

A cost bundle fitted to a rank's profile (rows measured at the rank's shard shape,
``meta["deployment"]``) predicts that rank's compute for the sequences it runs.  For a batch of
b sequences of the deployment the rank runs ``rank_batch(b)`` of them (all under tensor
parallelism, ceil(b / dp) under data-parallel attention), so

    C_v(n, l, b) = C_rank(n, l, rank_batch(b)) + comm(verify collectives at rank_batch(b) * n tokens)
    C_d(s, k, b) = C_d,rank(s, k, rank_batch(b)) + s * comm(draft collectives at rank_batch(b) * k tokens)

(:mod:`simtree.costs.comm`).  Communication adds terms affine in n (k), so C_v stays
non-decreasing and convex in n wherever the rank's model is.  A bundle of one GPU is returned
as it is: nothing to add.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from simtree.costs.model import Costs, DraftCost, VerifyCost
from simtree.costs.comm import CommModel, draft_collectives, load_comm, step_collectives
from simtree.parallel import DEFAULT_DEPLOYMENT, Deployment, parse_deployment
from simtree.machine.machines import machine_for_device
from simtree.errors import SimtreeError
from simtree.models import ModelShape, get_model

__all__ = ["DeploymentCosts", "DeploymentVerify", "DeploymentDraft", "DeploymentDrafter", "deployment_costs",
           "bundle_deployment", "communication_of", "one_rank", "rank_batch_of"]


def bundle_deployment(costs: Costs) -> Deployment:
    """The deployment a bundle's rows timed (``meta["deployment"]``; one GPU when absent)."""
    return parse_deployment(str(costs.meta.get("deployment") or DEFAULT_DEPLOYMENT))


def _batch_range(rng: Mapping, dep: Deployment) -> dict:
    out = dict(rng)
    if "batch_size" in out and dep.dp > 1:
        lo, hi = out["batch_size"]
        out["batch_size"] = (float(lo), float(hi) * dep.dp)   # rank batches lo..hi <- deployment batches
    return out


@dataclass(frozen=True)
class DeploymentVerify:
    rank: VerifyCost
    deployment: Deployment
    shape: ModelShape
    comm: CommModel

    def comm_us(self, nodes_per_seq, batch_size):
        tokens = np.asarray(self.deployment.rank_batch(batch_size), np.float64) * np.asarray(nodes_per_seq, np.float64)
        return self.comm.calls_us(step_collectives(self.shape, self.deployment, tokens))

    def predict(self, nodes_per_seq, context_len, batch_size):
        rb = self.deployment.rank_batch(batch_size)
        out = self.rank.predict(nodes_per_seq, context_len, rb) + self.comm_us(nodes_per_seq, batch_size)
        return float(out) if np.ndim(out) == 0 else out

    @property
    def convex_in_n(self) -> bool:
        return self.rank.convex_in_n

    @property
    def valid_range(self) -> Mapping:
        return _batch_range(self.rank.valid_range, self.deployment)

    @property
    def heldout_median_error(self) -> float | None:
        return self.rank.heldout_median_error


@dataclass(frozen=True)
class DeploymentDraft:
    rank: DraftCost
    deployment: Deployment
    shape: ModelShape
    comm: CommModel

    def predict(self, num_steps, topk, batch_size):
        rb = self.deployment.rank_batch(batch_size)
        tokens = np.asarray(rb, np.float64) * np.asarray(topk, np.float64)
        per_step = self.comm.calls_us(draft_collectives(self.shape, self.deployment, tokens))
        out = self.rank.predict(num_steps, topk, rb) + np.asarray(num_steps, np.float64) * per_step
        return float(out) if np.ndim(out) == 0 else out

    @property
    def valid_range(self) -> Mapping:
        return _batch_range(self.rank.valid_range, self.deployment)


@dataclass(frozen=True)
class DeploymentDrafter:
    """A block drafter's C_d in a deployment: the rank's model (:class:`~simtree.costs.model.DrafterCostModel`)
    asked at ``rank_batch(b)``, the sequences one rank drafts for (under data-parallel attention
    ceil(b / dp) of the deployment's b), as C_v and the MTP layer's C_d are; the drafter is dense,
    so no collectives."""

    rank: Any
    deployment: Deployment

    def predict(self, x, y, batch_size, context_len=None):
        return self.rank.predict(x, y, self.deployment.rank_batch(batch_size), context_len)

    @property
    def family(self) -> str:
        return self.rank.family

    @property
    def info(self) -> Mapping:
        return self.rank.info

    @property
    def block_len(self):
        return self.rank.block_len

    def check_block_len(self, block_len: int) -> int:
        return self.rank.check_block_len(block_len)

    @property
    def valid_range(self) -> Mapping:
        return _batch_range(self.rank.valid_range, self.deployment)


@dataclass(frozen=True)
class DeploymentCosts:
    """The :class:`~simtree.costs.model.Costs` of a deployment: ``rank`` (the bundle of one
    rank) with its collectives.  ``meta``: the rank's, with "deployment" and "communication"
    ({"assumed": bool, "label", "machine", "source"}) set."""

    rank: Costs
    deployment: Deployment
    comm: CommModel
    verify: DeploymentVerify
    draft: DeploymentDraft
    meta: Mapping[str, Any]

    @property
    def drafters(self) -> dict:
        """The block drafters' C_d of the deployment: the rank's at the rank's batch (a dense
        drafter runs on each rank's own sequences, no collectives)."""
        rank = getattr(self.rank, "drafters", None) or {}
        return {fam: DeploymentDrafter(m, self.deployment) for fam, m in rank.items()}

    def drafter(self, family: str):
        """The deployment's C_d of drafter ``family`` (one line where the bundle has none)."""
        getter = getattr(self.rank, "drafter", None)
        if getter is None:
            raise SimtreeError(f"the cost bundle of {self.meta.get('model', '?')} has no cost for drafter {family!r} "
                               "(drafters with costs: none)")
        return DeploymentDrafter(getter(family), self.deployment)


def communication_of(costs: Costs, comm: CommModel | str | None = None) -> CommModel:
    """The communication model for a bundle: ``comm`` (a model or a JSON path), else the one
    the bundle records (``meta["communication"]``), else the default of the machine its rows
    were measured on; a one-line error when there is none."""
    if isinstance(comm, CommModel):
        return comm
    if comm is not None:
        return load_comm(comm)
    recorded = costs.meta.get("communication")
    if isinstance(recorded, dict):
        return CommModel.from_dict(recorded, f"{costs.meta.get('model', '?')} bundle's communication model")
    device = str(costs.meta.get("device", ""))
    machine = machine_for_device(device)
    if machine is None:
        raise SimtreeError(f"{costs.meta.get('model', '?')} at {bundle_deployment(costs)}: no communication model "
                           f"(the bundle records none and no machine table describes device {device!r}); give one "
                           "with --comm")
    return load_comm(machine.comm_path)


def deployment_costs(costs: Costs, comm: CommModel | str | None = None) -> Costs:
    """The deployment's costs of a bundle fitted to one rank (see the module docstring); a
    bundle of one GPU, or costs composed already, unchanged."""
    dep = bundle_deployment(costs)
    if dep.gpus == 1 or isinstance(costs, DeploymentCosts):
        return costs
    model = comm_model = communication_of(costs, comm)
    name = str(costs.meta.get("model", ""))
    try:
        shape = get_model(name)
    except SimtreeError:
        raise SimtreeError(f"cost bundle of {name!r} at {dep}: the model registry does not know {name!r}, so its "
                           "collectives cannot be sized") from None
    meta = {**dict(costs.meta), "deployment": dep.name,
            "communication": {"assumed": model.assumed, "label": model.label, "machine": model.machine,
                              "source": model.source, "model": model.to_dict()}}
    return DeploymentCosts(costs, dep, comm_model, DeploymentVerify(costs.verify, dep, shape, model),
                           DeploymentDraft(costs.draft, dep, shape, model), meta)


def one_rank(costs: Costs) -> Costs:
    """A rank's bundle planned as the rank alone: batch b is the b sequences on the rank, no
    collectives - what a run of one rank measures (the full runtime's V4 rank: the all-to-all is
    not run), where :func:`deployment_costs` plans the deployment's batch (ceil(b / dp) a rank, plus
    the communication).  ``meta["rank_of"]`` keeps the deployment; a one-GPU bundle is returned as it is."""
    rank = costs.rank if isinstance(costs, DeploymentCosts) else costs
    dep = bundle_deployment(rank)
    if dep.gpus == 1:
        return rank
    return dataclasses.replace(rank, meta={**dict(rank.meta), "deployment": DEFAULT_DEPLOYMENT, "rank_of": dep.name})


def rank_batch_of(costs: Costs, batch_size: int) -> int:
    """The sequences one rank runs of a batch of ``batch_size`` priced by ``costs``: ceil(b / dp)
    for a deployment's costs under data-parallel attention (:class:`DeploymentCosts`), else b
    (a bundle of one GPU, or a rank planned alone)."""
    dep = costs.deployment if isinstance(costs, DeploymentCosts) else None
    return int(dep.rank_batch(int(batch_size))) if dep is not None else int(batch_size)

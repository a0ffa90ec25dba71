"""Deployments: what each rank of a model split over GPUs holds, and what the split costs.

The split itself (``Deployment``, ``parse_deployment``: the strings users know, "tp=2",
"ep=8") is :mod:`simtree.parallel`, below the registry, which shards a model by it
(:meth:`simtree.models.ModelShape.shard`); the machine tables (GPU memory and links) are
:mod:`simtree.machine.machines` and the alpha-beta model of the collectives
:mod:`simtree.costs.comm`.  Here: :mod:`.memory` refuses a deployment whose weights and caches
do not fit (with the mode's drafter: :mod:`.drafter_memory`); :mod:`.costs` composes a rank's
measured step with the collectives into the deployment's cost model; :mod:`.select` picks a
deployment; :mod:`.shipped` lists the shipped ones; :mod:`.check` compares a composed rank step
with the runtime's measured one.
Re-exported here: the split's names.
"""
from simtree.parallel import DEFAULT_DEPLOYMENT, SINGLE_GPU, Deployment, parse_deployment

__all__ = ["Deployment", "parse_deployment", "SINGLE_GPU", "DEFAULT_DEPLOYMENT"]

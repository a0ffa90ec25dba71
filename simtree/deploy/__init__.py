"""Deployments: how a model is split over GPUs, what each rank holds, and what the split costs.

:mod:`.deployment` parses the strings users know ("tp=2", "ep=8"); the registry's
:meth:`simtree.models.ModelShape.shard` gives one rank's shape; :mod:`.machines` knows GPU
memory and links; :mod:`.memory` refuses a deployment whose weights and caches do not fit;
:mod:`.comm` is the alpha-beta model of the collectives; :mod:`.costs` composes a rank's
measured step with them into the deployment's cost model; :mod:`.check` compares a composed
rank step with the runtime's measured one.  Re-exported here: the names that import nothing
above the registry (the others are imported from their modules).
"""
from simtree.deploy.deployment import DEFAULT_DEPLOYMENT, SINGLE_GPU, Deployment, parse_deployment

__all__ = ["Deployment", "parse_deployment", "SINGLE_GPU", "DEFAULT_DEPLOYMENT"]

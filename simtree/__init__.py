"""simtree: profile, model, plan and run tree-structured speculative decoding.

The core, in the order of the loop (each subpackage's docstring says more):

    simtree.trees        the draft tree, its builders, greedy acceptance
    simtree.costs        profile table -> fitted cost models (C_v, C_d) and their protocols
    simtree.acceptance   acceptance models and a tree's expected accepted length
    simtree.planning     policies per mode, the throughput simulator, the planner, the policy file
    simtree.reporting    plan and closed-loop reports
    simtree.machine      facts about the machine a profile or run happened on
    simtree.data         package data (model shapes, checkpoints, cost bundles, sweeps)

with ``errors``, ``fileio``, ``models`` (model shapes) and ``probs`` beside them.  Above the core:
``simtree.kernels`` (Triton kernels), then ``simtree.runtime`` (models and the speculative
engine) and ``simtree.profiler`` (timing sweeps), which never import each other, then
``simtree.cli``.  tests/test_dependencies.py holds these rules.
"""
from simtree.errors import SimtreeError, TreeError
from simtree.trees.tree import DraftTree, TreeBatch

__version__ = "0.1.0"
__all__ = ["DraftTree", "TreeBatch", "SimtreeError", "TreeError", "__version__"]

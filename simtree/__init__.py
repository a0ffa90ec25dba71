"""simtree: profile, model, plan and run tree-structured speculative decoding.

The core, in the order of the loop (each subpackage's docstring says more):

    simtree.trees        the draft tree, its builders, greedy acceptance
    simtree.costs        profile table -> fitted cost models (C_v, C_d), the collectives' model
    simtree.acceptance   acceptance models and a tree's expected accepted length
    simtree.planning     policies per mode, the throughput simulator, the planner, the policy file
    simtree.deploy       what a rank of a multi-GPU deployment holds, whether it fits, what it costs
    simtree.reporting    plan and closed-loop reports, rendered from what planning and runs made
    simtree.machine      the machine tables, facts about the machine a profile or run happened on
    simtree.checkpoints  Hugging Face checkpoint folders: config -> model shape, checked weights
    simtree.engines      SGLang / vLLM in and out: metrics imported, policies exported
    simtree.control      the online controller an engine's scheduler calls each step
    simtree.serving      the load benchmark: arrival traces through continuous batching
    simtree.data         package data (model shapes, checkpoints, cost bundles, sweeps)

with modules beside them: simtree.models (model shapes, the registry), simtree.parallel (how a
model is split over GPUs: tp, ep), simtree.quant (expert formats), simtree.drafters (drafter
sizes), simtree.errors, simtree.fileio and simtree.probs.  Above the
core: simtree.kernels (kernels/: simtree.kernels.gdn and simtree.kernels.v4, the Triton and
CUDA kernels; simtree.kernels.layers, the models' layers built from them), then
simtree.runtime (runtime/: tiny models and the speculative engine; simtree.runtime.full, the
full-size models on the kernel layers) and simtree.profiler (profiler/: timing sweeps;
simtree.profiler.bench, kernel benchmarks and tuning), which never import each other, then
simtree.cli, the command line.  tests/test_dependencies.py holds these rules.
"""
from simtree.errors import SimtreeError, TreeError
from simtree.trees.tree import DraftTree, TreeBatch

__version__ = "0.1.0"
__all__ = ["DraftTree", "TreeBatch", "SimtreeError", "TreeError", "__version__"]

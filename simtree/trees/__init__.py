"""Draft trees: the data type (:class:`DraftTree`, a batch of them :class:`TreeBatch`: parent
arrays, tokens, draft scores and the views every kernel reads), the builders that grow a tree
from a drafter's proposals (linear, EAGLE top-k, best-first, cost-aware stop) and greedy
acceptance of a verified tree against the target's picks.  numpy only.
"""
from simtree.trees.builders import (BestFirstOrder, batched_best_first_tree, best_first_order, best_first_tree,
                                    cost_aware_budget, cost_aware_tree, eagle_max_nodes, eagle_tree,
                                    eagle_tree_positional, linear_tree)
from simtree.trees.greedy import AcceptResult, BatchAcceptResult, greedy_accept, greedy_accept_batch
from simtree.trees.tree import DraftTree, TreeBatch

__all__ = ["DraftTree", "TreeBatch", "linear_tree", "eagle_tree", "eagle_tree_positional", "eagle_max_nodes", "BestFirstOrder",
           "best_first_order", "best_first_tree", "batched_best_first_tree", "cost_aware_budget", "cost_aware_tree",
           "AcceptResult", "BatchAcceptResult", "greedy_accept", "greedy_accept_batch"]

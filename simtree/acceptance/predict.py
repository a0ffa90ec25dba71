"""Expected accepted tokens per round of a fixed-shape policy under an acceptance model.

Trees are built per level as the runtime builds them - from the drafter's probabilities
(``AcceptanceModel.draft_probs``) - and scored with the level's acceptance table (a node's
token is its rank id, its column there); the result
is averaged over the policy's rounds (``AcceptanceModel.round_weights``: a policy spends fewer
rounds in the text states where it gains more per round) and counts the bonus token.  Modes and parameters are those of
``simtree run`` (none, linear {budget}, eagle {num_steps, topk, budget}, best_first {budget,
width, draft_depth}).
"""
from __future__ import annotations

import numpy as np

from simtree.acceptance.mixture import AcceptanceModel
from simtree.acceptance.phi import expected_accepted_ranked
from simtree.errors import SimtreeError
from simtree.trees.builders import batched_best_first_tree, eagle_tree_positional
from simtree.trees.tree import DraftTree

__all__ = ["level_trees", "accepted_per_round"]


def level_trees(acc: AcceptanceModel, mode: str, params: dict) -> list[DraftTree]:
    """One tree per level of ``acc`` for the policy (mode, params)."""
    p, trees = params, []
    for level in range(acc.num_levels):
        if mode == "none":
            trees.append(DraftTree.chain(1))
        elif mode == "linear":
            trees.append(DraftTree.chain(int(p["budget"])))
        elif mode == "eagle":
            trees.append(eagle_tree_positional(acc.draft_table(level, p["num_steps"]), p["num_steps"], p["topk"],
                                               p["budget"]))
        elif mode == "best_first":
            toks, probs = acc.draft_marginals(level, p["draft_depth"])
            trees.append(batched_best_first_tree(toks, probs, p["budget"], p.get("width", 1))[0])
        else:
            raise SimtreeError(f"mode {mode!r} has no fixed round shape: expected none, linear, eagle or best_first")
    return trees


def accepted_per_round(acc: AcceptanceModel, mode: str, params: dict | None = None) -> float:
    """Mean tokens a sequence gains per round (accepted drafts + the bonus token)."""
    trees = level_trees(acc, mode, params or {})
    chain = acc.scores_chain(mode)
    g = 1.0 + np.array([expected_accepted_ranked(t, acc.table(i, max(t.max_depth, 1)), chain)
                        for i, t in enumerate(trees)])
    return float(acc.round_weights(g) @ g)

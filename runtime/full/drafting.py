"""Draft trees built on the device from the MTP layer's top-k (EAGLE-style), in static shapes.

    rs = round_shape(PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 2, "budget": 6}))
    draft_tree(model, draft_state, rs, roots, first_logp, first_ids, first_hidden, tree, own_bits)

The round's first distribution (children of the root) comes from the MTP layer's catch-up of
the previous round.  Step i = 1..s-1 runs the MTP layer on the k frontier nodes of depth i of
each sequence (each sees the MTP cache and its frontier ancestors, kept in scratch rows), takes
the top-k of each, scores the k*k children by cumulative log-probability and keeps the best k as
the next frontier.  Every child scored at any step is a candidate (k + (s-1) k^2 of them); the
tree is the root plus the D-1 best candidates.  The candidates are sorted by score with a
stable sort, so a child whose score ties its parent's comes after it: the selection is closed
under parents, and sorting the selected candidates' indices (steps in order) gives the tree in
topological order - the flat form of ``simtree.trees.tree`` (parents local, -1 at the root).
Linear D is the same with k = 1 and s = D - 1 (a chain); plain decoding drafts nothing.
The marginal modes (best_first, cost_aware, batch_alloc) draft a top-1 chain and keep each
position's top-K as its marginal; their trees are best-first over those (:mod:`.best_first`).

Nodes past the budget, up to the bucket's ``nodes``, are padding: leaves under the root that
are never accepted (``valid`` False), so no real node sees them.  The tree buffers and their
layout (``TreeBuffers``, ``lay_out``, ``pad_tree``) are ``simtree.kernels.layers.device_trees``,
which the profiler's drafter stages time too.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from simtree.errors import SimtreeError
from simtree.kernels.layers.device_trees import TreeBuffers, lay_out, pad_tree
from simtree.kernels.layers.drafters.round import MARGINAL_TOPK
from simtree.kernels.layers.head import topk_logp
from simtree.planning.modes import RUNTIME_MODES, PolicySpec

__all__ = ["RoundShape", "round_shape", "TreeBuffers", "topk_logp", "own_row_bits", "draft_tree",
           "accepted_path", "lay_out", "pad_tree", "pad_round", "RUNTIME_MODES", "MARGINAL_TOPK"]


@dataclass(frozen=True)
class RoundShape:
    """A round's static shape, ``budget`` nodes verified per sequence (the root included; the
    most a round may choose where ``alloc`` decides per round), padded to ``nodes`` (the
    CUDA-graph bucket).  ``tree`` "eagle": ``num_steps`` x top-``topk`` drafting (EAGLE, linear
    at k = 1); "best_first": a top-1 chain of ``num_steps`` positions, top-``topk`` marginals at
    each, the best-first tree over them.  ``alloc``: "fixed", or the per-round rule of
    cost_aware / batch_alloc (:mod:`.allocation`).  ``drafter``: "mtp" (the MTP layer), or a
    block drafter (:mod:`.block_engine`): "block" (best-first over its ``num_steps`` = block
    length marginals), "tfm" (``tree`` "tfm": its adapter's tree, ``width`` expansions a step),
    "dspark" (``tree`` "chain": the Markov head's chain, each sequence's verified prefix cut at
    ``threshold``, or by batch_alloc's rule over the confidence head's survivals where None).
    ``padded_from``: the bucket before :func:`pad_round` padded it to a cheaper verify bucket
    (0: not padded); the trees stay capped by it."""

    num_steps: int
    topk: int
    budget: int
    nodes: int
    tree: str = "eagle"
    alloc: str = "fixed"
    drafter: str = "mtp"
    width: int = 1
    threshold: float | None = None
    padded_from: int = 0

    @property
    def block_drafter(self) -> bool:
        return self.drafter != "mtp"

    @property
    def plain(self) -> bool:
        return self.budget == 1

    @property
    def marginal(self) -> bool:
        return self.tree == "best_first"

    @property
    def frontier(self) -> int:
        """Nodes the drafter runs on per step (the marginal chain: one)."""
        return 1 if self.marginal else self.topk

    @property
    def tree_nodes(self) -> int:
        """The most nodes a sequence's tree holds: the budget, or a smaller bucket that caps
        cost_aware's / batch_alloc's per-round budgets (the bucket before padding, where padded)."""
        return min(self.budget, self.padded_from or self.nodes)

    @property
    def candidates(self) -> int:
        if self.tree in ("tfm", "chain"):          # the nodes the tree can hold past the root
            return self.tree_nodes - 1
        if not self.marginal:
            return self.topk + (self.num_steps - 1) * self.topk ** 2
        total = width = self.topk                 # depth d keeps its best tree_nodes - 1 (module .best_first)
        for _ in range(1, self.num_steps):
            width = min(width, self.tree_nodes - 1) * self.topk
            total += width
        return total

    @property
    def max_depth(self) -> int:
        return self.num_steps

    @property
    def path_rows(self) -> int:
        """Rows of the accepted path (root included) a round can commit."""
        return self.max_depth + 1

    @property
    def scratch_rows(self) -> int:
        return max((self.num_steps - 1) * self.frontier, self.path_rows, 1)

    @property
    def spec(self) -> PolicySpec:
        """The policy this shape runs."""
        if self.plain:
            return PolicySpec.from_dict("none")
        if self.drafter == "block":
            return PolicySpec.from_dict("block", {"budget": self.budget, "block_len": self.num_steps})
        if self.drafter == "tfm":
            return PolicySpec.from_dict("tfm", {"budget": self.budget, "width": self.width, "block_len": self.num_steps})
        if self.drafter == "dspark":
            return PolicySpec.from_dict("dspark", {"block_len": self.num_steps, "threshold": self.threshold})
        if self.marginal:
            size = "budget" if self.alloc == "fixed" else "max_budget" if self.alloc == "cost_aware" \
                else "max_budget_per_seq"
            mode = "best_first" if self.alloc == "fixed" else self.alloc
            return PolicySpec.from_dict(mode, {size: self.budget, "draft_depth": self.num_steps})
        if self.topk == 1 and self.num_steps == self.budget - 1:
            return PolicySpec.from_dict("linear", {"budget": self.budget})
        return PolicySpec.from_dict("eagle", {"num_steps": self.num_steps, "topk": self.topk, "budget": self.budget})

    @property
    def name(self) -> str:
        if self.plain or self.marginal or self.block_drafter:
            return self.spec.name
        if self.topk == 1 and self.num_steps == self.budget - 1:
            return f"linear_d{self.budget}"
        return f"eagle_s{self.num_steps}_k{self.topk}_d{self.budget}"


def round_shape(spec, nodes: int | None = None) -> RoundShape:
    """The static shape of a policy (a PolicySpec, or a policy entry: its ``params``);
    ``nodes``: the bucket (default: the budget; cost_aware and batch_alloc may take a smaller
    one, which caps each round's budgets, e.g. :func:`.acceptance.adaptive_bucket`)."""
    spec = getattr(spec, "params", spec)
    mode, p = spec.mode, spec.to_dict()
    if mode == "none":
        rs = RoundShape(0, 0, 1, 1)
    elif mode == "linear":
        rs = RoundShape(p["budget"] - 1, 1, p["budget"], p["budget"])
    elif mode == "eagle":
        rs = RoundShape(p["num_steps"], p["topk"], p["budget"], p["budget"])
    elif mode == "best_first":
        if p["width"] != 1:
            raise SimtreeError(f"{spec.name}: the full runtime builds best-first trees of width 1 (one pop per "
                               f"step: the order every prefix of which is the best tree), not width {p['width']}")
        rs = RoundShape(p["draft_depth"], MARGINAL_TOPK, p["budget"], p["budget"], "best_first")
    elif mode in ("cost_aware", "batch_alloc"):
        rs = RoundShape(p["draft_depth"], MARGINAL_TOPK, spec.max_nodes, spec.max_nodes, "best_first", mode)
    elif mode == "block":
        rs = RoundShape(p["block_len"], MARGINAL_TOPK, p["budget"], p["budget"], "best_first", drafter="block")
    elif mode == "tfm":
        rs = RoundShape(p["block_len"], 1, p["budget"], p["budget"], "tfm", drafter="tfm", width=p["width"])
    elif mode == "dspark":
        L, thr = p["block_len"], p.get("threshold")
        rs = RoundShape(L, 1, L + 1, L + 1, "chain", "fixed" if thr is not None else "batch_alloc",
                        drafter="dspark", threshold=thr)
    else:
        raise SimtreeError(f"mode {mode}: the full runtime builds {', '.join(RUNTIME_MODES)} on the device")
    if not (rs.marginal or rs.block_drafter) and rs.budget > 1 and rs.budget - 1 > rs.candidates:
        raise SimtreeError(f"{rs.name}: budget {rs.budget} exceeds the {1 + rs.candidates} nodes its steps draft")
    if nodes is not None:   # cost_aware, batch_alloc, dspark: a smaller bucket caps the round
        if nodes < (2 if rs.alloc != "fixed" or rs.drafter == "dspark" else rs.budget):
            raise SimtreeError(f"bucket of {nodes} nodes is smaller than the budget {rs.budget}"
                               if rs.alloc == "fixed" and rs.drafter != "dspark"
                               else f"bucket of {nodes} nodes: {rs.name} needs at least 2")
        rs = dataclasses.replace(rs, nodes=int(nodes))
    return rs


def pad_round(rs: RoundShape, batch_size: int, costs) -> RoundShape:
    """``rs`` verified in the cost bundle's cheaper bucket at ``batch_size``: where the bundle's pad
    map (:mod:`simtree.costs.verify_pad`, ``costs.verify.padded_nodes``) sends the round's
    ``nodes`` to n' > nodes, the bucket is n' (``padded_from`` keeps the old one, which still caps
    the trees: the extra nodes are padding leaves, never accepted).  Every drafter's rounds (the
    MTP layer's fixed shapes and adaptive buckets, the block drafters' trees and chains, whose
    engine lays its trees in ``tree_nodes`` and pads the rest: C_v is fitted on the padded
    envelope for all of them); plain decoding and a bundle without a pad map (or no bundle)
    keep ``rs``."""
    pad = getattr(getattr(costs, "verify", None), "padded_nodes", None)
    if pad is None or rs.plain or rs.padded_from:
        return rs
    nodes = int(pad(rs.nodes, batch_size))
    return rs if nodes <= rs.nodes else dataclasses.replace(rs, nodes=nodes, padded_from=rs.nodes)


def own_row_bits(rs: RoundShape, device) -> list[torch.Tensor]:
    """Per draft step i = 1..s-1: int64 [frontier, W], the scratch-row bit of each frontier node."""
    W = (rs.scratch_rows + 63) // 64
    out = []
    for i in range(1, rs.num_steps):
        bits = torch.zeros(rs.frontier, W, dtype=torch.int64)
        for j in range(rs.frontier):
            row = (i - 1) * rs.frontier + j
            bits[j, row // 64] = (1 << (row % 64)) if row % 64 < 63 else -(1 << 63)
        out.append(bits.to(device))
    return out


def draft_tree(model, ds, rs: RoundShape, roots, first_logp, first_ids, first_hidden, out: TreeBuffers,
               own_bits: list[torch.Tensor], rescore=None) -> None:
    """Draft every sequence's tree into ``out`` (see the module docstring); no host sync.
    ``rescore(step, logp)``: the log-probabilities that score step ``step``'s children in place
    of the MTP layer's (replays: an acceptance model's, ``acceptance.DraftScores``)."""
    B, k, D = roots.shape[0], rs.topk, rs.budget
    dev = roots.device
    h = first_hidden.shape[-1]
    ranks = torch.arange(k, device=dev)
    if rescore is not None:
        first_logp = rescore(0, first_logp)
    scores, toks, parent, rank, depth = [first_logp], [first_ids], [torch.full_like(first_ids, -1)], \
        [ranks.expand(B, k)], [torch.ones_like(first_ids)]
    f_tok, f_score, f_cand = first_ids, first_logp, ranks.expand(B, k)
    f_hidden = first_hidden[:, None].expand(B, k, h)
    f_bits = torch.zeros(B, k, own_bits[0].shape[1] if own_bits else 1, dtype=torch.int64, device=dev)
    offset = k
    for i in range(1, rs.num_steps):
        rows = (i - 1) * k + ranks.expand(B, k)
        bits = f_bits | own_bits[i - 1]
        pos = (ds.lengths[:, None] + (i - 1)).expand(B, k)   # depth-i node's MTP entry: position L + i - 1
        hid = model.draft_forward(ds, f_tok, f_hidden, pos, rows, bits)
        lp, ids = topk_logp(model.draft_logits(hid), k)                     # [B, k, k]
        if rescore is not None:
            lp = rescore(i, lp)
        cum = (f_score[:, :, None] + lp).reshape(B, k * k)
        ids = ids.reshape(B, k * k)
        scores.append(cum)
        toks.append(ids)
        parent.append(f_cand.repeat_interleave(k, dim=1))
        rank.append(ranks.repeat(k).expand(B, k * k))
        depth.append(torch.full_like(ids, i + 1))
        f = torch.sort(cum, dim=1, descending=True, stable=True).indices[:, :k]   # ties: earlier first
        f_score = cum.gather(1, f)
        par = f // k
        f_tok = ids.gather(1, f)
        f_hidden = hid.gather(1, par[..., None].expand(B, k, h))
        f_bits = bits.gather(1, par[..., None].expand(-1, -1, bits.shape[-1]))
        f_cand = offset + f
        offset += k * k
    cand = tuple(torch.cat(x, 1) for x in (scores, toks, parent, rank, depth))
    best = torch.sort(cand[0], dim=1, descending=True, stable=True).indices[:, :D - 1]
    lay_out(out, roots, cand, best, k)


def accepted_path(parents: torch.Tensor, depth: torch.Tensor, accepted: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [B, rows]: column t = the node at depth t on the root path to ``accepted`` [B]
    (columns past its depth are 0)."""
    B = parents.shape[0]
    path = torch.zeros(B, rows, dtype=torch.int64, device=parents.device)
    cur = accepted[:, None]
    for _ in range(rows):
        path.scatter_(1, depth.gather(1, cur).clamp(max=rows - 1), cur)
        cur = parents.gather(1, cur).clamp(min=0)
    return path

"""Where a round's accepted path comes from: the target (live) or a replayed acceptance.

* :class:`Live` - greedy: node j is accepted when its token is the target's argmax at its
  parent and its parent is accepted (lossless).
* :class:`TraceReplay` - the accepted depth of each sequence per round from a JSONL trace
  (``simtree.acceptance.model.read_traces``: the depth of each record's accepted node, in file
  order, B per round, wrapping around), the path to the best-scored node at that depth (the
  tree's depth where it is shallower).  The depths are uploaded once; a round reads its row
  by a device counter, so no host work happens per round.
* :class:`ModelReplay` - sampled on the device from a positional acceptance model
  (``simtree.acceptance.model.AcceptanceModel``: a level per sequence per round, drawn as the
  policy's rounds spread over the levels (``AcceptanceModel.round_weights`` of the tokens its
  trees gain at each level, as the simulator weighs them), then at each depth d one uniform u;
  the rank-r child of an accepted parent is accepted when u falls in
  [sum_{r'<r} P(d, r'), sum_{r'<=r} P(d, r')) - disjoint ranks).
* :class:`StratifiedReplay` - what ``simtree run`` uses (``--sampling iid``: ModelReplay): the
  same model, the run's (level, accepted depth) pairs drawn up front, one per stratum of the
  unit interval (:func:`stratified_draws`) from their joint distribution under the trees the
  simulator scores (``accepted_length_pmf``), ordered by depth, read as TraceReplay reads its
  depths: the mean accepted depth of the ``N = rows x B`` draws is then the model's within
  (deepest depth) / N, where independent draws err by (the depth's spread) / sqrt(N).

``accept(tree, target_next, rs)`` -> accepted node (LOCAL index, int64 [B]); no host sync.
Replays decide the path with meaningless tokens: the round still drafts, verifies every tree
and commits the chosen path, exactly a real round's work.  They also decide the tree's shape
(``scores``, :class:`DraftScores`): a random-weight MTP layer's top-k log-probabilities are
nearly flat, so its trees would be breadth-first whatever the policy; a replay scores the
drafted candidates as the drafter of its acceptance model does (log of the drafter's
probability of rank r at depth d in the round's level, ``AcceptanceModel.draft_table``: the
numbers the simulator builds its positional EAGLE and best-first trees from), so a round builds
the tree the simulator scores.  cost_aware and batch_alloc decide their trees per round from the
cost bundle: their replays weigh the levels and draw the stratified depths under the trees the
simulator's analytic decision (``AdaptiveRounds.decide``) gives at the run's context
(:func:`replay_rounds`); the device's own allocation then builds each round's trees.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from simtree.acceptance.model import AcceptanceModel, fit_positional, read_traces
from simtree.acceptance.phi import accepted_length_pmf, node_accept_probs_ranked
from simtree.errors import SimtreeError
from simtree.planning.adaptive import AdaptiveRounds
from simtree.planning.drafter_candidates import stand_in
from simtree.planning.adaptive import adaptive_bucket as planned_bucket
from simtree.planning.simulate import static_round

from .drafting import RoundShape, TreeBuffers

__all__ = ["Live", "TraceReplay", "ModelReplay", "StratifiedReplay", "ShapeSources", "DraftScores", "level_weights", "deepest_on_chain", "node_at_depth",
           "stratified_draws", "joint_depth_pmf", "replay_rounds", "adaptive_bucket", "SAMPLINGS"]

SAMPLINGS = ("stratified", "iid")
PROB_FLOOR = 1e-300                  # a draft probability of 0, as a finite log-prob
LOG_ZERO = float(np.log(PROB_FLOOR))


def deepest_on_chain(ok: torch.Tensor, tree: TreeBuffers, max_depth: int) -> torch.Tensor:
    """Deepest node whose root path is all ``ok`` (ok [B, n], the root counts as ok)."""
    ok = ok.clone()
    ok[:, 0] = True
    par = tree.parents.clamp(min=0)
    acc = ok
    for _ in range(max_depth):
        acc = ok & acc.gather(1, par)
    return torch.where(acc, tree.depth, -1).argmax(1)


def node_at_depth(tree: TreeBuffers, want: torch.Tensor) -> torch.Tensor:
    """The best-scored valid node at depth ``want`` [B] (the tree's deepest where shallower)."""
    deepest = torch.where(tree.valid, tree.depth, 0).amax(1)
    want = torch.minimum(want, deepest)
    key = torch.where(tree.valid & (tree.depth == want[:, None]), tree.score, float("-inf"))
    return key.argmax(1)


def replay_rounds(model: AcceptanceModel, rs: RoundShape, batch_size: int = 1, costs=None,
                  context_len: float | None = None) -> tuple:
    """(trees [L], acceptance tables [L], the share of the policy's rounds at each level [L]) as
    the simulator builds and weighs them: ``static_round`` for a fixed shape; for cost_aware and
    batch_alloc the analytic decision at ``context_len`` for ``batch_size`` under ``costs``."""
    spec = rs.spec
    if rs.block_drafter:     # the built-in policy whose trees the simulator scores for it
        sr = static_round(model, stand_in(spec))
        return sr.trees, sr.tables, sr.weights
    if rs.alloc == "fixed":
        sr = static_round(model, spec)
        return sr.trees, sr.tables, sr.weights
    if costs is None or context_len is None:
        raise SimtreeError(f"a replay of {spec.name} needs the cost bundle and context its rounds decide with")
    ad = AdaptiveRounds(model, spec, costs, batch_size)
    nodes, weights = ad.decide(float(context_len))
    return tuple(ad.tree(lv, int(n)) for lv, n in enumerate(nodes)), ad.tables, weights


def adaptive_bucket(model: AcceptanceModel, rs: RoundShape, batch_size: int, costs, context_len: float) -> int:
    """The CUDA-graph bucket of a cost_aware / batch_alloc run of round shape ``rs``: the
    planner's own (:func:`simtree.planning.adaptive.adaptive_bucket`, the bucket the simulator
    prices).  Every round verifies that many nodes per sequence; it caps a round's budgets where
    its real marginals ask for more."""
    if costs is None:
        raise SimtreeError(f"the bucket of {rs.spec.name} needs the cost bundle its rounds decide with")
    return planned_bucket(model, rs.spec, costs, batch_size, context_len)


def level_weights(model: AcceptanceModel, rs: RoundShape, **decide) -> np.ndarray:
    """[L]: the share of the policy's rounds at each level (``AcceptanceModel.round_weights`` of
    the tokens per round its trees gain there, as the simulator builds and scores them;
    ``decide``: :func:`replay_rounds`' batch_size, costs, context_len)."""
    return replay_rounds(model, rs, **decide)[2]


def joint_depth_pmf(model: AcceptanceModel, rs: RoundShape, **decide) -> np.ndarray:
    """[depth + 1, L]: P(a round is at level lv and accepts exactly d draft tokens), the trees
    and level shares as :func:`replay_rounds` builds and weighs them (their mean depth is the
    simulator's accepted tokens per round, bonus excluded)."""
    trees, tables, weights = replay_rounds(model, rs, **decide)
    built = stand_in(rs.spec) if rs.block_drafter else rs.spec     # the policy replay_rounds built them for
    chain = model.scores_chain(built.mode)
    pmfs = [accepted_length_pmf(t, node_accept_probs_ranked(t, tb, chain)) for t, tb in zip(trees, tables)]
    out = np.zeros((max(p.size for p in pmfs), len(pmfs)))
    for lv, p in enumerate(pmfs):
        out[:p.size, lv] = weights[lv] * p
    return out


def stratified_draws(pmf: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """int64 [n]: outcomes 0..len(pmf)-1, one per stratum [i/n, (i+1)/n) of the unit interval
    (a uniform point in each, the strata in random order) through the inverse CDF: each
    outcome comes up n x P times give or take 2, and a quantity monotone in the outcome index
    averages to its mean within (its range) / n."""
    p = np.asarray(pmf, np.float64).reshape(-1)
    if n < 1 or p.size == 0 or not np.all(np.isfinite(p)) or np.any(p < 0) or p.sum() <= 0:
        raise SimtreeError("stratified draws need n >= 1 and a non-negative pmf with positive mass")
    cdf = np.cumsum(p) / p.sum()
    u = (rng.permutation(n) + rng.random(n)) / n
    return np.minimum(np.searchsorted(cdf, u, side="right"), p.size - 1).astype(np.int64)


class DraftScores:
    """Draft scores under an acceptance model: log of the drafter's probability of rank r at
    depth d per level (``AcceptanceModel.draft_table``), [L, P, K] on the device; ``draw(B)``
    picks each sequence's level for the round (by :func:`level_weights` of the round shape
    ``rs``), ``rescore(step, lp)`` replaces the MTP layer's log-probs of step ``step``'s
    children (lp [B, ..., k]) with that level's row; ``rescore_at(depth, lp)`` those of the
    children of nodes at their own depths (a TfM adapter's tree: depth [B, n], lp [B, n, k])."""

    def __init__(self, model: AcceptanceModel, rs: RoundShape, device, gen=None, fixed=None, weights=None):
        """``fixed``: (levels [rows, B] on the device, the round counter [1]): row ``counter %
        rows`` is each round's levels instead of a draw (a stratified replay's table);
        ``weights``: the levels' shares (default :func:`level_weights` of a fixed shape)."""
        self.fixed = fixed
        P = max(rs.max_depth, 1)
        probs = np.stack([model.draft_table(lv, P) for lv in range(model.num_levels)])
        probs = np.concatenate([probs, np.zeros(probs.shape[:2] + (max(0, 32 - probs.shape[2]),))], -1)
        self.logp = torch.as_tensor(np.log(np.maximum(probs, PROB_FLOOR)), dtype=torch.float32, device=device)
        weights = level_weights(model, rs) if weights is None else weights
        self.level_cum = torch.as_tensor(np.cumsum(weights)[:-1], dtype=torch.float32, device=device)
        self.device, self.gen, self.level = torch.device(device), gen, None

    def draw(self, B: int) -> torch.Tensor:
        if self.fixed is not None:
            table, counter = self.fixed
            level = table.index_select(0, counter % table.shape[0])[0]
        else:
            level = (torch.rand(B, 1, device=self.device, generator=self.gen) > self.level_cum[None, :]).sum(1)
        if self.level is None:
            self.level = level
        else:
            self.level.copy_(level)
        return self.level

    def rescore(self, step: int, lp: torch.Tensor) -> torch.Tensor:
        k = lp.shape[-1]
        row = self.logp[self.level, min(step, self.logp.shape[1] - 1), :k]         # [B, k]
        return row.view(row.shape[0], *([1] * (lp.dim() - 2)), k).expand_as(lp)

    def rescore_at(self, depth: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        """lp [B, n, k] of the children (by rank) of nodes at ``depth`` [B, n] -> row ``depth``
        of each sequence's level (ranks past the table: probability 0); no host read."""
        k, (P, K) = lp.shape[-1], self.logp.shape[1:]
        logp = self.logp if k <= K else F.pad(self.logp, (0, k - K), value=LOG_ZERO)
        return logp[self.level[:, None], depth.clamp(0, P - 1), :k]


class Live:
    kind = label = "live"
    scores = None

    def accept(self, tree: TreeBuffers, target_next: torch.Tensor, rs: RoundShape) -> torch.Tensor:
        ok = tree.valid & (tree.tokens == target_next.gather(1, tree.parents.clamp(min=0)))
        return deepest_on_chain(ok, tree, rs.max_depth)

    def prediction_model(self):
        return None


class _DepthTable:
    """A replay whose accepted depth per sequence per round sits in a [rows, B] table on the
    device, read by a device counter (wrapping; :meth:`rewind` starts it again), on the
    best-scored node at that depth (``node_at_depth``): no host work per round."""
    kind = "replay"

    def _set_table(self, depths: np.ndarray, device) -> None:
        self.table = torch.as_tensor(depths, device=device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)

    def rewind(self) -> None:
        self.counter.zero_()

    def accept(self, tree: TreeBuffers, target_next: torch.Tensor, rs: RoundShape) -> torch.Tensor:
        want = self.table.index_select(0, self.counter % self.table.shape[0])[0]
        self.counter += 1
        return node_at_depth(tree, want)


class TraceReplay(_DepthTable):
    def __init__(self, path, batch_size: int, device, workload: str | None = None):
        self.records = read_traces(path, workload)
        depths = np.array([int(r.tree.depth[r.accepted_node]) for r in self.records], np.int64)
        rows = -(-depths.size // batch_size)
        self._set_table(np.resize(depths, rows * batch_size).reshape(rows, batch_size), device)
        self.label = f"replay ({path})"
        self.workload = self.records[0].workload
        self.scores = None

    def score_trees(self, rs: RoundShape, device, **decide) -> "TraceReplay":
        """Shape the trees of round shape ``rs`` by the trace's positional fit (``prediction_model``);
        ``decide``: :func:`replay_rounds`' batch_size, costs, context_len (cost_aware, batch_alloc)."""
        model = self.prediction_model()
        self.scores = DraftScores(model, rs, device, weights=level_weights(model, rs, **decide))
        return self

    @classmethod
    def fixed(cls, depth: int, batch_size: int, device) -> "TraceReplay":
        """Every sequence asks for ``depth`` every round, trees as the MTP layer scores them (the
        profiler's steps: a fixed commit)."""
        src = cls.__new__(cls)
        src._set_table(np.full((1, batch_size), int(depth), np.int64), device)
        src.records, src.label, src.workload, src.scores = [], f"replay (depth {depth})", "fixed", None
        return src

    def prediction_model(self) -> AcceptanceModel:
        """The positional fit of the trace (the table as wide as its widest sibling set)."""
        width = max(int(r.tree.num_children.max()) for r in self.records)
        return fit_positional(self.records, self.workload, topk=max(width, 1))


class StratifiedReplay(_DepthTable):
    """``rows`` rounds of ``batch_size`` (level, accepted depth) draws made up front from an
    acceptance model (module docstring): the levels shape the trees (``DraftScores`` reading
    the same row), the depths are committed."""

    def __init__(self, model: AcceptanceModel, rs: RoundShape, device, batch_size: int, rows: int, seed: int = 0,
                 costs=None, context_len: float | None = None):
        """``costs``, ``context_len``: what cost_aware and batch_alloc decide with (:func:`replay_rounds`)."""
        if batch_size < 1 or rows < 1:
            raise SimtreeError(f"stratified replay needs a batch and a round, got batch {batch_size}, {rows} rounds")
        joint = joint_depth_pmf(model, rs, batch_size=batch_size, costs=costs, context_len=context_len)  # [depth+1, L]
        draw = stratified_draws(joint.reshape(-1), rows * batch_size, np.random.default_rng(seed))
        depth, level = np.divmod(draw, joint.shape[1])
        self._set_table(depth.reshape(rows, batch_size), device)
        self.levels = torch.as_tensor(level.reshape(rows, batch_size), device=device)
        self.scores = DraftScores(model, rs, device, fixed=(self.levels, self.counter), weights=joint.sum(0))
        self.model, self.label = model, f"replay (acceptance model {model.name}, stratified)"

    def prediction_model(self) -> AcceptanceModel:
        return self.model


class ModelReplay:
    kind = "replay"

    def __init__(self, model: AcceptanceModel, rs: RoundShape, device, seed: int = 0, batch_size: int = 1, costs=None,
                 context_len: float | None = None):
        """``batch_size``, ``costs``, ``context_len``: what cost_aware and batch_alloc decide with."""
        self.model = model
        tables = np.stack([model.table(lv, max(rs.max_depth, 1)) for lv in range(model.num_levels)])   # [L, P, K]
        cum = np.concatenate([np.zeros(tables.shape[:2] + (1,)), np.cumsum(tables, -1)], -1)
        self.cum = torch.as_tensor(cum, dtype=torch.float32, device=device)              # [L, P, K + 1]
        self.device = torch.device(device)
        # the default CUDA generator is the one CUDA graphs record; on the host a private one
        self.gen = None if self.device.type == "cuda" else torch.Generator().manual_seed(seed)
        if self.gen is None:
            torch.cuda.manual_seed(seed)
        weights = level_weights(model, rs, batch_size=batch_size, costs=costs, context_len=context_len)
        self.scores = DraftScores(model, rs, device, self.gen, weights=weights)
        self.label = f"replay (acceptance model {model.name})"

    def accept(self, tree: TreeBuffers, target_next: torch.Tensor, rs: RoundShape) -> torch.Tensor:
        """Rank intervals of the level the round's drafting drew (the drafter knows its level);
        a level of its own where the tree was not drafted (plain decoding never gets here)."""
        B = tree.tokens.shape[0]
        L, P, K1 = self.cum.shape
        u = torch.rand(B, P, device=self.device, generator=self.gen)
        level = self.scores.level if self.scores.level is not None else self.scores.draw(B)
        d = (tree.depth - 1).clamp(0, P - 1)
        r = tree.rank.clamp(max=K1 - 1)
        lv = level[:, None].expand_as(d)
        lo = self.cum[lv, d, r]
        hi = self.cum[lv, d, (r + 1).clamp(max=K1 - 1)]
        ud = u.gather(1, d)
        return deepest_on_chain(tree.valid & (ud >= lo) & (ud < hi), tree, rs.max_depth)

    def prediction_model(self) -> AcceptanceModel:
        return self.model


class ShapeSources:
    """One acceptance source per round shape of an engine that switches shapes (an online
    controller's tiers, :meth:`.engine.FullEngine.use`): a replay's tables and tree scores are
    made for one shape, so each shape's rounds (and captured graphs) read their own.  Plain
    shapes need none (their rounds accept nothing)."""

    def __init__(self, sources: dict):
        if not sources:
            raise SimtreeError("ShapeSources needs a source for at least one round shape")
        self.sources = dict(sources)
        self.current = next(iter(self.sources.values()))

    def use(self, rs: RoundShape) -> None:
        """The source of shape ``rs``'s rounds (a plain shape keeps the last: it reads none); a
        drafted shape without one is refused (its rounds would read another shape's table)."""
        if rs.plain:
            return
        if rs not in self.sources:
            raise SimtreeError(f"no acceptance source for the round shape {rs}: one per drafted shape")
        self.current = self.sources[rs]

    @property
    def scores(self):
        return getattr(self.current, "scores", None)

    def accept(self, tree: TreeBuffers, target_next: torch.Tensor, rs: RoundShape) -> torch.Tensor:
        return self.current.accept(tree, target_next, rs)

    def rewind(self) -> None:
        for src in self.sources.values():
            rewind = getattr(src, "rewind", None)
            if rewind is not None:
                rewind()

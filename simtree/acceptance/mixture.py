"""The acceptance model the simulator reads: a mixture of per-round levels.

Each level is a table ``accept_table [P, K]``: ``accept_table[d, r]`` = P(the rank-r child at
depth d+1 is accepted | its parent was accepted), rank by draft score among siblings (0 =
best); ranks are disjoint events, so rows sum to <= 1 (the positional model of
:mod:`simtree.acceptance.phi`).  A level is drawn per sequence per round with probability
``weights[l]``.  Beside it, ``draft_probs [L, P, K]`` are the drafter's own probabilities of
those candidates (its draft scores): trees are built from them, as the drafter builds them,
and scored with the acceptance table.  A calibrated drafter has ``draft_probs == tables``
(the default).

Constructors here: :func:`calibrate_linear` (a geometric model from one linear number) and
:func:`from_marginals` (block-drafter marginals, one level per round).  Fits from traces are
in :mod:`simtree.acceptance.fit`, the shipped presets in :mod:`simtree.acceptance.presets`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from simtree.acceptance.phi import expected_accepted_positional
from simtree.errors import SimtreeError
from simtree.probs import check_prob_rows
from simtree.trees.tree import DraftTree

# the policies whose trees are built from a drafter's per-position marginals (draft_depth positions)
MARGINAL_MODES = ("best_first", "cost_aware", "batch_alloc")

__all__ = ["AcceptanceModel", "MARGINAL_MODES", "calibrate_linear", "from_marginals", "ALPHA_MAX", "DEFAULT_DEPTH", "DEFAULT_TOPK"]

DEFAULT_DEPTH, DEFAULT_TOPK = 16, 4
ALPHA_MAX = 0.98    # no depth accepts more surely than this (a finite sample never shows certainty)
_LEVEL_FACTORS, _LEVEL_WEIGHTS = np.array([-1.0, 0.0, 1.0]), np.array([0.25, 0.5, 0.25])


def _frozen_tables(values, name: str, what: str) -> np.ndarray:
    tables = np.asarray(values, np.float64)
    if tables.ndim == 2:
        tables = tables[None]
    if tables.ndim != 3 or tables.size == 0:
        raise SimtreeError(f"acceptance model {name!r}: {what} {tables.shape} must be [L, P, K]")
    check_prob_rows(tables, f"acceptance model {name!r}: {what}", axis=2)  # row [level, depth]
    tables.setflags(write=False)
    return tables


@dataclass(frozen=True, eq=False)
class AcceptanceModel:
    """Mixture of per-round acceptance tables.

    tables      float64 [L, P, K]  accept_table per level (rows sum <= 1)
    weights     float64 [L]        level probabilities per round (sum 1), as the rounds the
                                   model was fitted from were spread over the levels
    draft_probs float64 [L, P, K]  the drafter's probability of each candidate (its draft
                                   score); None: the drafter is calibrated (= tables)
    state       int64 [L]          the text state of each level (None: one state).  A state
                                   lasts over many rounds (an easy stretch of code, a hard
                                   one); levels are drawn per round within their state
    state_share float64 [S]        the share of the text (tokens) in each state
    chain_marginals bool           the drafter reads its marginals along its own top-1 chain
                                   (MTP): in the marginal modes a node below an off-chain node
                                   is never accepted (``phi.node_accept_probs_ranked``)
    off_chain_scale float64 [K]    with ``chain_marginals``: such a node is accepted with this
                                   share of its table entry per rank instead (None: never;
                                   :func:`simtree.acceptance.off_chain.fit_off_chain_scale`)

    With several states, a policy that gains more tokens per round in a state spends fewer
    rounds there: its rounds are spread as :meth:`round_weights` says, not as ``weights``.
    """

    name: str
    tables: np.ndarray
    weights: np.ndarray
    source: str = ""
    meta: dict = field(default_factory=dict)
    draft_probs: np.ndarray | None = None
    state: np.ndarray | None = None
    state_share: np.ndarray | None = None
    chain_marginals: bool = False
    off_chain_scale: np.ndarray | None = None

    @property
    def chain_scoring(self):
        """How a chain drafter's marginal tree is scored below an off-chain node (the
        ``chain_marginals`` argument of :func:`simtree.acceptance.phi.node_accept_probs_ranked`):
        False (not a chain drafter), True (never accepted) or the share per rank."""
        if not self.chain_marginals:
            return False
        return True if self.off_chain_scale is None else self.off_chain_scale

    def scores_chain(self, mode: str):
        """:attr:`chain_scoring` for a ``mode`` policy: a chain drafter's marginals
        (``chain_marginals``) under a marginal mode (:data:`MARGINAL_MODES`), else False."""
        return self.chain_scoring if mode in MARGINAL_MODES else False

    def __post_init__(self) -> None:
        tables = _frozen_tables(self.tables, self.name, "table")
        weights = np.asarray(self.weights, np.float64).reshape(-1)
        if tables.shape[0] != weights.shape[0]:
            raise SimtreeError(f"acceptance model {self.name!r}: tables {tables.shape} and weights "
                               f"{weights.shape} must be [L, P, K] and [L]")
        check_prob_rows(weights, f"acceptance model {self.name!r}: level weights")
        if abs(weights.sum() - 1) > 1e-6:
            raise SimtreeError(f"acceptance model {self.name!r}: level weights sum to {weights.sum():.6g} "
                               "(must sum to 1)")
        weights.setflags(write=False)
        draft = tables if self.draft_probs is None else _frozen_tables(self.draft_probs, self.name, "draft_probs")
        if draft.shape != tables.shape:
            raise SimtreeError(f"acceptance model {self.name!r}: draft_probs {draft.shape} and tables "
                               f"{tables.shape} differ in shape")
        state = np.zeros(tables.shape[0], np.int64) if self.state is None else np.asarray(self.state, np.int64)
        share = np.ones(1) if self.state_share is None else np.asarray(self.state_share, np.float64).reshape(-1)
        if state.shape != weights.shape or state.min() < 0 or state.max() >= share.shape[0]:
            raise SimtreeError(f"acceptance model {self.name!r}: state must give each of the {weights.shape[0]} "
                               f"levels one of the {share.shape[0]} states")
        check_prob_rows(share, f"acceptance model {self.name!r}: state shares")
        if abs(share.sum() - 1) > 1e-6 or np.bincount(state, minlength=share.shape[0]).min() == 0:
            raise SimtreeError(f"acceptance model {self.name!r}: state shares must sum to 1, every state with a level")
        if self.off_chain_scale is not None:
            scale = np.asarray(self.off_chain_scale, np.float64).reshape(-1)
            if scale.size == 0 or not np.all((scale >= 0) & (scale <= 1)):
                raise SimtreeError(f"acceptance model {self.name!r}: off_chain_scale must hold shares in [0, 1]")
            scale.setflags(write=False)
            object.__setattr__(self, "off_chain_scale", scale)
        for name, value in (("tables", tables), ("weights", weights), ("draft_probs", draft), ("state", state),
                            ("state_share", share)):
            value.setflags(write=False)
            object.__setattr__(self, name, value)

    @property
    def num_levels(self) -> int:
        return int(self.tables.shape[0])

    @property
    def num_states(self) -> int:
        return int(self.state_share.shape[0])

    def round_weights(self, tokens_per_round) -> np.ndarray:
        """[L]: how a policy's rounds spread over the levels, given the tokens it gains per round
        at each level ``tokens_per_round [L]`` (bonus included).

        Within a state, levels keep their relative weights (drawn per round); a state holds
        ``state_share`` of the text and a policy gaining g_s tokens per round there spends a
        share of its rounds proportional to state_share / g_s.  Mean tokens per round is then
        ``round_weights(g) @ g = 1 / sum_s state_share_s / g_s``.  One state: ``weights``.
        """
        g = np.asarray(tokens_per_round, np.float64).reshape(-1)
        if g.shape != self.weights.shape or not np.all(g >= 1.0 - 1e-9):
            raise SimtreeError(f"tokens per round must be [{self.num_levels}] values >= 1 (one per level)")
        if self.num_states == 1:
            return self.weights
        within = self.weights / np.bincount(self.state, self.weights)[self.state]
        per_state = np.bincount(self.state, within * g, minlength=self.num_states)
        rounds = self.state_share / per_state
        return within * rounds[self.state] / rounds.sum()

    @property
    def depth(self) -> int:
        return int(self.tables.shape[1])

    @property
    def topk(self) -> int:
        return int(self.tables.shape[2])

    @staticmethod
    def _rows(t: np.ndarray, depth: int | None) -> np.ndarray:
        if depth is None or depth <= t.shape[0]:
            return t if depth is None else t[:depth]
        return np.vstack([t, np.repeat(t[-1:], depth - t.shape[0], axis=0)])

    def table(self, level: int, depth: int | None = None) -> np.ndarray:
        """[depth, K] acceptance table of one level; rows beyond P repeat the deepest row."""
        return self._rows(self.tables[level], depth)

    def draft_table(self, level: int, depth: int | None = None) -> np.ndarray:
        """[depth, K] draft probabilities of one level (trees are built from these)."""
        return self._rows(self.draft_probs[level], depth)

    @staticmethod
    def _sorted(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(-probs, axis=1, kind="stable")
        return order.astype(np.int64), np.take_along_axis(probs, order, axis=1)

    def marginals(self, level: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
        """Synthetic block-drafter marginals from the acceptance table: (tokens [P, K], probs
        [P, K] sorted desc), each token the rank id (column of :meth:`table`) of its candidate:
        the best-first tree of highest expected acceptance."""
        return self._sorted(self.table(level, positions))

    def draft_marginals(self, level: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
        """The drafter's own marginals: (tokens [P, K], probs [P, K] sorted desc), each token the
        rank id (column of :meth:`table`) of its candidate.  The best-first tree a runtime builds
        from its drafter; a node with token r at depth d is accepted with ``table[d - 1, r]``
        given its parent (a row whose ranks are not in draft-probability order keeps each
        candidate's own acceptance)."""
        return self._sorted(self.draft_table(level, positions))

    def expected_accepted(self, tree: DraftTree) -> float:
        """Phi(tree) per round, the same tree at every level (draft tokens, bonus excluded)."""
        phi = np.array([expected_accepted_positional(tree, self.table(i, max(tree.max_depth, 1)))
                        for i in range(self.num_levels)])
        return float(self.round_weights(1.0 + phi) @ phi)

    def linear_accepted(self, budget: int) -> float:
        """Mean accepted draft tokens per round of a chain of ``budget`` nodes (bonus excluded)."""
        phi = chain_phi(self.tables, budget)
        return float(self.round_weights(1.0 + phi) @ phi)

    def summary(self) -> dict:
        return {"name": self.name, "source": self.source, "levels": self.num_levels,
                "depth": self.depth, "topk": self.topk,
                "linear_accepted_tokens_d4": 1.0 + self.linear_accepted(4), **self.meta}


def chain_phi(tables: np.ndarray, budget: int) -> np.ndarray:
    """[L]: Phi of a chain of ``budget`` nodes per level: sum_i prod_{d<i} table[d, 0]."""
    steps = max(int(budget) - 1, 0)
    top1 = np.concatenate([tables[:, :, 0], np.repeat(tables[:, -1:, 0], max(steps - tables.shape[1], 0), 1)], 1)
    return np.cumprod(top1[:, :steps], axis=1).sum(axis=1)


def _level_tables(alphas: np.ndarray, depth: int, topk: int, sibling_share: float) -> np.ndarray:
    """[L, P, K]: rank 0 = alpha, rank r >= 1 = share of the mass left by ranks < r (capped
    at rank r-1's probability)."""
    left = 1.0 - alphas
    cols = [alphas]
    for _ in range(1, topk):  # capped by the rank above: a lower rank never beats a higher one
        cols.append(np.minimum(left * sibling_share, cols[-1]))
        left = left - cols[-1]
    row = np.stack(cols, axis=1)  # [L, K]
    return np.repeat(row[:, None, :], depth, axis=1)


def calibrate_linear(mean_accepted_tokens: float, budget: int = 4, *, name: str = "calibrated",
                     depth: int = DEFAULT_DEPTH, topk: int = DEFAULT_TOPK, sibling_share: float = 0.35,
                     spread: float = 0.25, source: str = "") -> AcceptanceModel:
    """Geometric positional model whose chain of ``budget`` nodes accepts ``mean_accepted_tokens``
    per round including the bonus token.

    Assumption that extends the one number to trees: every depth accepts the drafter's top-1
    with the same alpha, each lower-ranked sibling catches a share ``sibling_share`` of the
    probability left by the ranks above it, and rounds come in three difficulty levels
    alpha (1 -+ ``spread``) with weights 1/4, 1/2, 1/4; alpha is solved so that the chain
    reproduces the number exactly.  A quick synthetic model (tests, what-ifs); the shipped
    presets are :mod:`simtree.acceptance.presets`.
    """
    if not math.isfinite(mean_accepted_tokens) or not 1.0 < mean_accepted_tokens < budget:
        raise SimtreeError(f"mean accepted tokens {mean_accepted_tokens} must lie in (1, {budget}) for a "
                           f"linear budget of {budget} (it counts the bonus token)")
    if not 0.0 <= spread < 1.0 or not 0.0 <= sibling_share <= 1.0:
        raise SimtreeError(f"spread {spread} must be in [0, 1) and sibling_share {sibling_share} in [0, 1]")
    factors = 1.0 + spread * _LEVEL_FACTORS if spread > 0 else np.ones(1)
    weights = _LEVEL_WEIGHTS if spread > 0 else np.ones(1)

    def chain(alpha: float) -> float:
        a = np.minimum(alpha * factors, ALPHA_MAX)
        return float(weights @ chain_phi(a[:, None, None], budget))

    target = mean_accepted_tokens - 1.0
    if chain(1.0 / factors.min()) < target:
        raise SimtreeError(f"mean accepted tokens {mean_accepted_tokens} is above what budget {budget} "
                           f"reaches with alpha <= {ALPHA_MAX} and spread {spread}")
    lo, hi = 0.0, 1.0 / factors.min()
    for _ in range(60):  # bisection: chain() is increasing in alpha
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if chain(mid) < target else (lo, mid)
    alphas = np.minimum(0.5 * (lo + hi) * factors, ALPHA_MAX)
    tables = _level_tables(alphas, depth, topk, sibling_share)
    meta = {"alpha_levels": [round(float(a), 4) for a in alphas], "sibling_share": sibling_share,
            "spread": spread, "calibrated_to": {"mean_accepted_tokens": mean_accepted_tokens,
                                                "linear_budget": budget}}
    return AcceptanceModel(name, tables, weights, source or "calibrate_linear", meta)


def from_marginals(marginal_probs: Sequence | np.ndarray, name: str = "marginals",
                   weights: Sequence[float] | None = None, source: str = "marginals") -> AcceptanceModel:
    """Levels from per-round block-drafter marginals: [P, K] or [L, P, K] (each row sorted desc
    here; assumed calibrated: P(target = rank-r candidate) = its marginal prob)."""
    probs = np.asarray(marginal_probs, np.float64)
    if probs.ndim == 2:
        probs = probs[None]
    if probs.ndim != 3:
        raise SimtreeError(f"marginals must be [P, K] or [L, P, K], got shape {probs.shape}")
    w = np.full(probs.shape[0], 1.0 / probs.shape[0]) if weights is None else np.asarray(weights, np.float64)
    return AcceptanceModel(name, -np.sort(-probs, axis=2), w / max(w.sum(), 1e-300), source)

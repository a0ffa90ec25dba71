"""The fixed-shape policies an engine runs per step (plain decoding, chains, EAGLE trees) with
their numbers under one acceptance model: what the controller ranks and what the serving
simulator runs as a static tier."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simtree.acceptance.mixture import AcceptanceModel
from simtree.acceptance.phi import accepted_length_pmf, node_accept_probs_ranked
from simtree.planning.modes import EagleParams, LinearParams, NoneParams, PolicySpec
from simtree.planning.simulate import static_round

__all__ = ["Tier", "tier_shape", "chain_spec", "DEFAULT_TIERS"]

DEFAULT_TIERS: tuple[PolicySpec, ...] = (
    (NoneParams(),) + tuple(LinearParams(d) for d in range(2, 8))
    + tuple(EagleParams(s, k, d) for s, k, d in [(2, 2, 4), (2, 2, 5), (2, 2, 6), (2, 2, 7), (3, 2, 6), (3, 2, 8),
                                                  (4, 2, 8)]))


@dataclass(frozen=True, eq=False)
class Tier:
    """A fixed-shape policy with its numbers under one acceptance model: nodes verified per
    sequence [L], expected accepted drafts [L] and the CDF of accepted drafts [L, depth + 1],
    per acceptance level; ``weights`` [L] the share of rounds at each level."""

    spec: PolicySpec
    nodes: np.ndarray
    accepted: np.ndarray
    cdf: np.ndarray
    weights: np.ndarray
    index: int = 0
    same_nodes: bool = False   # every level verifies as many nodes (chains, full EAGLE trees)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def expected_accepted(self) -> float:
        return float(self.weights @ self.accepted)

    @property
    def nodes_per_seq(self) -> float:
        return float(self.weights @ self.nodes)

    def short_reply_penalties(self, max_rounds: int, power: float = 1.0) -> np.ndarray:
        """[max_rounds] how much slower per token a reply of 1, 2, ... ``max_rounds`` rounds runs than
        the mean says (>= 1): E[tokens of a round] * M[h / tokens of h rounds] for h rounds, M the power
        mean E[x ** power] ** (1 / power) (power 1 the average, 2 the root mean square: its spread
        counted)."""
        pmf = self.weights @ np.diff(self.cdf, axis=1, prepend=0.0)   # accepted drafts per round
        tokens = np.concatenate([[0.0], pmf])                            # P(tokens = j), j >= 1
        mean = float(tokens @ np.arange(tokens.size))
        total, out = np.array([1.0]), np.empty(max_rounds)
        for h in range(1, max_rounds + 1):
            total = np.convolve(total, tokens)
            x = h / np.arange(1, total.size)          # rounds a token
            out[h - 1] = mean * (total[1:] @ x ** power) ** (1.0 / power)
        return out

    @property
    def accepted_var(self) -> float:
        """Variance of one sequence-round's accepted drafts under the acceptance model."""
        pmf = self.weights @ np.diff(self.cdf, axis=1, prepend=0.0)
        j = np.arange(pmf.size)
        return float(pmf @ j ** 2 - (pmf @ j) ** 2)

    def draft_us(self, costs, batch_size: int) -> float:
        s, k = self.spec.draft_shape()
        return 0.0 if s == 0 else float(costs.draft.predict(s, k, batch_size))


def chain_spec(drafts: int) -> PolicySpec:
    """The policy of a chain of ``drafts`` draft tokens (0: plain decoding): linear D = drafts + 1
    nodes, an engine's ``drafts`` draft steps (SGLang's speculative_num_steps, vLLM's K)."""
    return NoneParams() if drafts == 0 else LinearParams(drafts + 1)


def tier_shape(acc: AcceptanceModel, spec: PolicySpec, index: int = 0) -> Tier:
    shape = static_round(acc, spec)
    depth = max(t.max_depth for t in shape.trees)
    cdf = np.ones((acc.num_levels, depth + 1))
    chain = acc.scores_chain(spec.mode)     # as static_round scores them
    for level, (tree, table) in enumerate(zip(shape.trees, shape.tables)):
        pmf = accepted_length_pmf(tree, node_accept_probs_ranked(tree, table, chain))
        cdf[level, :pmf.size] = np.cumsum(pmf)
    cdf[:, -1] = 1.0
    return Tier(spec, shape.nodes, shape.accepted, cdf, np.asarray(acc.weights), index,
                bool(np.all(shape.nodes == shape.nodes[0])))

"""Acceptance models fitted from traces (:mod:`simtree.acceptance.traces`).

- :func:`fit_confidence` - the depth x rank x confidence model, from traces that log the
  drafter's top-K along its chain (version 2 linear runs): P(node accepted | parent accepted,
  depth, rank, draft probability) and the distribution of the drafter's confidence at each
  depth, as confidence levels the simulator draws per round.  docs/acceptance.md states the
  model and its assumptions.
- :func:`fit_positional` - counts per (depth, sibling rank) from the drafted trees of any run
  (version 1 traces included); no confidence.
- :func:`fit_marginals` - one level per round from logged block-drafter marginals.
"""
from __future__ import annotations

import itertools
from typing import Callable, Iterable, Sequence

import numpy as np
from scipy.special import expit, logit

from simtree.acceptance.mixture import ALPHA_MAX, DEFAULT_DEPTH, DEFAULT_TOPK, AcceptanceModel, from_marginals
from simtree.acceptance.phi import sibling_rank
from simtree.acceptance.text_state import fit_text_terms
from simtree.acceptance.traces import TraceRecord, Trials, chain_trials, sequence_ids
from simtree.errors import SimtreeError, check_whole

__all__ = ["fit_confidence", "fit_positional", "fit_marginals", "fit_calibration", "has_topk", "CONFIDENCE_EDGES",
           "isotonic_increasing", "ease_groups", "ChainCalibration", "lookup_states", "LOOKUP_NONE", "LOOKUP_THIS",
           "LOOKUP_OTHER", "trial_states", "trial_logits"]

# Bins of the drafter's probability of a candidate (its confidence).  Narrow near 0, where
# lower ranks live, and near 1, where the top-1 of easy tokens lives.
CONFIDENCE_EDGES = np.array([0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9,
                             0.95, 1.0 + 1e-9])
_RANK_GROUPS = 3            # ranks 0, 1 and 2+ get calibration curves and depth offsets of their own
_CLIP = 1e-4                # calibrated probabilities stay in [_CLIP, 1 - _CLIP] (finite logits)
# what the context lookup says of a candidate (:func:`lookup_states`)
LOOKUP_NONE, LOOKUP_THIS, LOOKUP_OTHER = 0, 1, 2


def has_topk(records: Sequence[TraceRecord]) -> bool:
    """True when some record logs the drafter's top-K and the target's tokens (version 2)."""
    return any(r.topk_tokens is not None and r.target_tokens is not None for r in records)


def isotonic_increasing(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit of ``y`` (pool adjacent violators)."""
    vals, wts, sizes = [], [], []
    for yi, wi in zip(np.asarray(y, np.float64), np.asarray(w, np.float64)):
        vals.append(yi), wts.append(wi), sizes.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            w2 = wts[-2] + wts[-1]
            v = (vals[-2] * wts[-2] + vals[-1] * wts[-1]) / max(w2, 1e-300)
            size = sizes[-2] + sizes[-1]
            del vals[-1], wts[-1], sizes[-1]
            vals[-1], wts[-1], sizes[-1] = v, w2, size
    return np.repeat(vals, sizes)


def lookup_states(match_rank, rank, width: int) -> np.ndarray:
    """int64, the shape of ``match_rank`` and ``rank`` broadcast: what the context lookup says of
    the drafter's rank-``rank`` candidate, given ``match_rank`` (the rank among the drafter's
    ``width`` candidates of the lookup's token, ``width``: none of them; ``context_match``):
    ``LOOKUP_THIS`` (it proposes this candidate), ``LOOKUP_OTHER`` (it proposes another of the
    drafter's candidates: evidence against this one) or ``LOOKUP_NONE`` (no lookup token among
    them).  The last two are distinct text: pooled, their mix differs between the positions where
    rounds begin and the rest (docs/acceptance.md, section 5)."""
    match_rank, rank = np.asarray(match_rank, np.int64), np.asarray(rank, np.int64)
    return np.where(match_rank == rank, LOOKUP_THIS, np.where(match_rank < width, LOOKUP_OTHER, LOOKUP_NONE))


def _bin(q: np.ndarray) -> np.ndarray:
    return np.clip(np.searchsorted(CONFIDENCE_EDGES, q, side="right") - 1, 0, CONFIDENCE_EDGES.size - 2)


def _calibration(q: np.ndarray, hit: np.ndarray) -> np.ndarray:
    """[bins]: P(hit | draft prob in bin), pooled over depths; one pseudo-trial at the bin's mean
    draft prob (a calibrated drafter) keeps empty bins defined; non-decreasing in the draft
    prob (a candidate the drafter trusts more is not accepted less often)."""
    nb = CONFIDENCE_EDGES.size - 1
    b = _bin(q)
    n = np.bincount(b, minlength=nb).astype(np.float64)
    hits = np.bincount(b, hit.astype(np.float64), minlength=nb)
    mid = 0.5 * (CONFIDENCE_EDGES[:-1] + np.minimum(CONFIDENCE_EDGES[1:], 1.0))
    mean_q = np.where(n > 0, np.bincount(b, q, minlength=nb) / np.maximum(n, 1), mid)
    return np.clip(isotonic_increasing((hits + mean_q) / (n + 1.0), n + 1.0), _CLIP, 1 - _CLIP)


def _offset(base_logit: np.ndarray, hits: float) -> float:
    """delta with sum(expit(base_logit + delta)) == hits (bisection; the sum rises with delta)."""
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if expit(base_logit + mid).sum() < hits else (lo, mid)
    return 0.5 * (lo + hi)


class ChainCalibration:
    """a(d, r, q) = expit(logit f_g(bin(q)) + delta_g[d]) for rank group g = min(r, rank_groups - 1): the
    acceptance of a drafted candidate of draft probability q and rank r at depth d, given its
    parent was accepted (:func:`fit_confidence`, step 3).  With ``match`` (per trial, what a
    lookup of the context says of the candidate: :func:`lookup_states`; a bool is read as
    this candidate / none), a curve per group and lookup state: f_{g,m}(q), the depth effects
    shared."""

    def __init__(self, trials: Trials, depth: int, prior_trials: float, match: np.ndarray | None = None,
                 rank_groups: int = _RANK_GROUPS):
        groups = np.minimum(trials.rank, rank_groups - 1)
        m = np.zeros(trials.size, np.int64) if match is None else np.asarray(match, np.int64)
        self.matched = match is not None
        self.curves = np.zeros((rank_groups, 3 if self.matched else 1, CONFIDENCE_EDGES.size - 1))
        self.offsets = np.zeros((rank_groups, depth))
        for g in range(rank_groups):
            sel = groups == g
            for v in range(self.curves.shape[1]):
                self.curves[g, v] = _calibration(trials.draft_prob[sel & (m == v)], trials.hit[sel & (m == v)])
            prev = 0.0
            for d in range(depth):   # the depth effect, shrunk towards the shallower depth where thin
                at = sel & (trials.depth == d + 1)
                n = int(at.sum())
                if n:   # half a trial short of all / none: a finite sample never shows certainty
                    hits = min(max(float(trials.hit[at].sum()), 0.5), n - 0.5)
                    fitted = _offset(logit(self.curves[g, m[at], _bin(trials.draft_prob[at])]), hits)
                    prev = (n * fitted + prior_trials * prev) / (n + prior_trials)
                self.offsets[g, d] = prev

    text_terms: np.ndarray | None = None   # [rank groups, 2]: logit + b0 + b1 * text feature (fit_calibration)

    def logits(self, depth: np.ndarray, q: np.ndarray, match: np.ndarray | None = None,
               text: np.ndarray | None = None) -> np.ndarray:
        """[R, K] the logit of :meth:`__call__`."""
        if self.matched and match is None:
            raise SimtreeError("this calibration depends on the context lookup: the drafts carry no context_match")
        if self.text_terms is not None and text is None:
            raise SimtreeError("this calibration reads the context's text state: give each row's feature (text=)")
        g = np.minimum(np.arange(q.shape[1]), self.curves.shape[0] - 1)
        v = np.zeros(q.shape, np.int64) if not self.matched else np.asarray(match, np.int64)
        d = np.minimum(depth, self.offsets.shape[1]) - 1
        z = logit(self.curves[g[None, :], v, _bin(q)]) + self.offsets[g[None, :], d[:, None]]
        if self.text_terms is not None:
            t = np.asarray(text, np.float64).reshape(-1, 1)
            z = z + self.text_terms[g, 0][None, :] + self.text_terms[g, 1][None, :] * t
        return z

    def __call__(self, depth: np.ndarray, q: np.ndarray, match: np.ndarray | None = None,
                 text: np.ndarray | None = None) -> np.ndarray:
        """[R, K] acceptance of rows ``q [R, K]`` at depths ``depth [R]`` (1-based); ``match``
        [R, K] lookup states (:func:`lookup_states`; a calibration with lookup curves needs it);
        ``text`` [R] each row's text feature (a calibration with ``text_terms`` needs it,
        :mod:`simtree.acceptance.text_state`; others ignore it)."""
        return expit(self.logits(depth, q, match, text))


def fit_calibration(records: Iterable[TraceRecord], *, topk: int = DEFAULT_TOPK, depth: int = DEFAULT_DEPTH,
                    prior_trials: float = 20.0, context: bool | None = None, rank_groups: int | None = None,
                    text: Callable[[TraceRecord], float] | None = None) -> ChainCalibration:
    """One :class:`ChainCalibration` pooled over every record that logs the drafter's top-K and
    the target's tokens (linear runs, version 2): how often the target takes a candidate the
    drafter gave probability q, by depth and rank (a curve and depth effects per rank below
    ``rank_groups``, the rest pooled: by default (None) every rank of the call's ``topk`` its
    own, the ranks past it with the last - a tree's rank-2 node is taken more often than a
    rank-5 one of the same probability); and by what a lookup of the context says of it
    (``context_match``: this candidate, another of the drafter's, none; :func:`lookup_states`)
    when ``context`` (default: every record carries it).  ``text``: each record's text feature
    at its round's start (:mod:`simtree.acceptance.text_state`); the calibration then moves its
    logit with it, an intercept and slope per rank group fitted on the same trials
    (``text_terms``)."""
    records = [r for r in records if r.topk_tokens is not None and r.target_tokens is not None]
    if not records:
        raise SimtreeError("traces carry no drafter top-K with the target's tokens (version 2 linear runs): "
                           "nothing to calibrate the drafter's confidence on")
    if context is None:
        context = all(r.context_match is not None for r in records)
    if context and any(r.context_match is None for r in records):
        raise SimtreeError("some trace records carry no context_match: the context calibration needs it on every one")
    trials = chain_trials(records, topk)
    if trials.size == 0:
        raise SimtreeError("traces hold no drafted position under an accepted node: nothing to calibrate")
    match = trial_states(records, trials) if context else None
    groups = topk if rank_groups is None else check_whole(rank_groups, "rank_groups", 1)
    cal = ChainCalibration(trials, depth, prior_trials, match, groups)
    if text is not None:
        feature = np.array([float(text(r)) for r in records])[trials.round_id]
        g, base = trial_logits(cal, trials, match)
        cal.text_terms = fit_text_terms(base, trials.hit, g, feature, groups)
    return cal


def trial_states(records: Sequence[TraceRecord], trials: Trials) -> np.ndarray:
    """The context lookup's state (:func:`lookup_states`) at each of ``trials`` (``chain_trials`` of
    ``records``, every one carrying ``context_match``)."""
    return lookup_states([records[i].context_match[d - 1] for i, d in zip(trials.round_id, trials.depth)],
                         trials.rank, [records[i].topk_tokens.shape[1] for i in trials.round_id])


def trial_logits(cal: ChainCalibration, trials: Trials, states=None) -> tuple[np.ndarray, np.ndarray]:
    """(rank groups, the calibration's logit) at each of ``trials``: its rank group's curve at its
    lookup state (``states``; None: the calibration's one state) and its draft probability's bin,
    plus the group's depth offset."""
    g = np.minimum(trials.rank, cal.curves.shape[0] - 1)
    s = 0 if states is None else np.asarray(states, np.int64)
    d = np.minimum(trials.depth, cal.offsets.shape[1]) - 1
    return g, logit(cal.curves[g, s, _bin(trials.draft_prob)]) + cal.offsets[g, d]


def _rows(trials: Trials, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """Chain trials as rows: depth [R] and draft probs [R, topk] (one row per drafted position
    whose parent was accepted; chain_trials emits ``topk`` ranks per row, in order)."""
    k = int(trials.rank.max()) + 1
    if trials.size % k or np.any(trials.rank.reshape(-1, k) != np.arange(k)):
        raise SimtreeError("chain trials are not whole rows of ranks 0..K-1: the top-K lists are too short")
    q = trials.draft_prob.reshape(-1, k)
    if k < topk:   # the runs logged fewer candidates than the model's width
        q = np.hstack([q, np.zeros((q.shape[0], topk - k))])
    return trials.depth.reshape(-1, k)[:, 0], q


def ease_groups(log_ease: np.ndarray, weight: np.ndarray, groups: int) -> list[np.ndarray]:
    """Sequences split into ``groups`` runs of their sorted ``log_ease`` minimising the
    within-group weighted sum of squares (exact 1-D k-means by dynamic programming over the
    sorted values; ``weight`` = each sequence's rounds), so that an easy and a hard kind of
    request never share a group where the data separate them.  Returns index arrays."""
    order = np.argsort(log_ease, kind="stable")
    x, w = log_ease[order], weight[order].astype(np.float64)
    n = x.size
    groups = min(groups, n)
    cw, cx, cxx = (np.concatenate([[0.0], np.cumsum(v)]) for v in (w, w * x, w * x * x))

    def sse(i, j):   # values i..j-1; vectorised over i
        ww = cw[j] - cw[i]
        return cxx[j] - cxx[i] - (cx[j] - cx[i]) ** 2 / np.maximum(ww, 1e-300)

    cost = np.full((groups + 1, n + 1), np.inf)
    cost[0, 0] = 0.0
    back = np.zeros((groups + 1, n + 1), np.int64)
    for g in range(1, groups + 1):
        for j in range(g, n + 1):
            i = np.arange(g - 1, j)
            total = cost[g - 1, i] + sse(i, j)
            k = int(np.argmin(total))
            cost[g, j], back[g, j] = total[k], i[k]
    cuts, j = [], n
    for g in range(groups, 0, -1):
        cuts.append((int(back[g, j]), j))
        j = int(back[g, j])
    return [order[i:j] for i, j in reversed(cuts)]


def _state_levels(records: list[TraceRecord], topk: int, depth: int, bins: int, enumerated_depths: int,
                  prior_trials: float, min_rows: int) -> tuple:
    """Levels of one text state: (acceptance [L, P, K], draft probs [L, P, K], weights [L], curve)."""
    trials = chain_trials(records, topk)
    curve = ChainCalibration(trials, depth, prior_trials)
    row_depth, q = _rows(trials, topk)
    accept = curve(row_depth, q)
    per_depth, last = [], None
    for d in range(1, depth + 1):
        sel = np.flatnonzero(row_depth == d)
        if sel.size >= min_rows or last is None:
            last = sel
        sel = last   # thin or unobserved depths reuse the deepest well-observed one
        c = max(1, min(bins, sel.size // min_rows))
        order = sel[np.argsort(q[sel, 0], kind="stable")]
        parts = [p for p in np.array_split(order, c) if p.size]
        per_depth.append([(p.size / order.size, q[p].mean(0), accept[p].mean(0)) for p in parts])
    weights, acc_tables, draft_tables = [], [], []
    for combo in itertools.product(*[range(len(per_depth[d])) if d < enumerated_depths else [None]
                                     for d in range(depth)]):
        w, acc_rows, draft_rows = 1.0, [], []
        for d, c in enumerate(combo):
            if c is None:   # deeper than the enumerated depths: the depth's mean row
                f = np.array([p[0] for p in per_depth[d]])
                draft_rows.append(f @ np.array([p[1] for p in per_depth[d]]))
                acc_rows.append(f @ np.array([p[2] for p in per_depth[d]]))
            else:
                f, qrow, arow = per_depth[d][c]
                w *= f
                draft_rows.append(qrow), acc_rows.append(arow)
        weights.append(w), acc_tables.append(acc_rows), draft_tables.append(draft_rows)
    acc_tables, draft_tables = np.array(acc_tables), np.array(draft_tables)
    # ranks are disjoint: a row sums to <= 1.  No hard cap below 1: the calibration's
    # pseudo-trial already keeps every probability short of certainty, by as little as the
    # trials allow (text a drafter copies for 15 tokens at a time is accepted ~always)
    acc_tables /= np.maximum(acc_tables.sum(2, keepdims=True), 1.0)
    draft_tables /= np.maximum(draft_tables.sum(2, keepdims=True), 1.0)
    return acc_tables, draft_tables, np.array(weights) / np.sum(weights), curve, trials


def fit_confidence(records: Iterable[TraceRecord], name: str | None = None, *, topk: int = DEFAULT_TOPK,
                   depth: int = DEFAULT_DEPTH, states: int = 3, bins: int = 2, enumerated_depths: int = 3,
                   prior_trials: float = 20.0, min_rows: int = 10, min_state_sequences: int = 4) -> AcceptanceModel:
    """The depth x rank x confidence model from traces with the drafter's top-K (version 2).

    1. Text states: the generated sequences are grouped by their tokens per round in the
       traces into ``states`` groups (:func:`ease_groups`; fewer where a group would hold fewer
       than ``min_state_sequences`` sequences on average; one where records do not say their
       round and sequence).  Requests differ - a code completion that repeats itself, a hard chat turn -
       and a sequence keeps its kind over its rounds; a state's share of the text is the tokens
       its records gained.
    2. Per state, trials (:func:`~simtree.acceptance.traces.chain_trials`): every candidate of
       rank < topk at every depth whose parent was accepted.
    3. Acceptance of a candidate: a(d, r, q) = expit(logit f_g(q) + delta_g(d)), g = min(r, 2):
       f_g is the calibration curve of the drafter's probability q (binned in
       ``CONFIDENCE_EDGES``, pooled over depths, non-decreasing in q), delta_g(d) the depth
       effect, set so that the expected hits at depth d equal the observed ones, shrunk towards
       depth d-1 with ``prior_trials`` pseudo-trials where trials are thin.
    4. Confidence per depth: the drafted positions whose parent was accepted, split into
       ``bins`` equal-count bins of the top-1 draft prob (fewer where a depth has fewer than
       ``bins * min_rows`` positions); each bin's rows are the mean draft probs and the mean
       acceptance of its positions.  Depths never reached repeat the deepest one observed.
    5. Levels: every combination of bins over the first ``enumerated_depths`` depths (drawn
       independently per round and depth, weight = product of bin frequencies); deeper depths
       take the mean over all their positions.  Per level, ``tables`` holds the acceptance and
       ``draft_probs`` the draft probabilities (trees are built from these); ``weights`` are
       the traced rounds, ``state`` / ``state_share`` the text states.
    """
    records = [r for r in records if r.topk_tokens is not None and r.target_tokens is not None]
    if not records:
        raise SimtreeError("traces carry no drafter top-K (topk_tokens / topk_probs, version 2 linear runs): "
                           "the confidence fit needs them; fit_positional reads any trace")
    tokens = np.array([r.num_accepted + 1 for r in records], np.float64)
    if any(r.round_index is None or r.seq is None for r in records):
        seq, n_seq = np.zeros(len(records), np.int64), 1
    else:
        seq = sequence_ids(records)
        n_seq = int(seq.max()) + 1
    n_states = max(1, min(states, n_seq // min_state_sequences))
    rounds = np.bincount(seq, minlength=n_seq)
    groups = ease_groups(np.log(np.bincount(seq, tokens, n_seq) / rounds), rounds, n_states)
    tables, drafts, weights, level_state, text, meta_states, all_trials = [], [], [], [], [], [], 0
    for s, group in enumerate(groups):
        rows = np.flatnonzero(np.isin(seq, group))
        part = [records[i] for i in rows]
        acc_t, draft_t, w, curve, trials = _state_levels(part, topk, depth, bins, enumerated_depths, prior_trials,
                                                         min_rows)
        if trials.size == 0:
            raise SimtreeError("traces hold no drafted position under an accepted node: nothing to fit")
        tables.append(acc_t), drafts.append(draft_t), weights.append(w * rows.size / len(records))
        level_state.append(np.full(w.shape[0], s)), text.append(tokens[rows].sum())
        all_trials += trials.size
        meta_states.append({"sequences": int(group.size), "round_share": round(rows.size / len(records), 4),
                            "tokens_per_round": round(float(tokens[rows].mean()), 4),
                            "calibration": {f"rank{g}" + ("+" if g == _RANK_GROUPS - 1 else ""):
                                            [round(float(v), 4) for v in c[0]] for g, c in enumerate(curve.curves)}})
    share = np.array(text) / np.sum(text)
    for m, sh in zip(meta_states, share):
        m["text_share"] = round(float(sh), 4)
    meta = {"records": len(records), "trials": all_trials, "sequences": n_seq,
            "observed_depth": min(int(max(r.num_accepted for r in records)) + 1, depth),
            "states": meta_states, "bins": bins, "enumerated_depths": enumerated_depths,
            "mean_accepted_tokens": float(tokens.mean()),
            "calibration_edges": [round(float(e), 4) for e in CONFIDENCE_EDGES[:-1]]}
    weights = np.concatenate(weights)
    return AcceptanceModel(name or records[0].workload, np.concatenate(tables), weights / weights.sum(),
                           "fit_confidence(traces with drafter top-K)", meta, np.concatenate(drafts),
                           np.concatenate(level_state), share)


def fit_positional(records: Iterable[TraceRecord], name: str | None = None, *, topk: int = DEFAULT_TOPK,
                   depth: int = DEFAULT_DEPTH, prior_strength: float = 5.0,
                   unobserved_share: float = 0.35) -> AcceptanceModel:
    """Positional table from the drafted trees: for every accepted node, each child is a trial
    at (its depth - 1, its sibling rank), a success if it is on the accepted path.

    Sparse cells shrink towards the shallower row (empirical Bayes, ``prior_strength`` pseudo
    trials); depths never observed repeat the deepest observed one.  Ranks never drafted in
    any trace (e.g. ranks >= 1 of chain traces) carry no evidence: they get
    ``unobserved_share`` of the mass the observed ranks leave free in their row (capped at the
    rank above), so they never take mass from the observed ranks.  ``meta["imputed_ranks"]``
    lists them.
    """
    records = list(records)
    if not 0.0 <= unobserved_share <= 1.0:
        raise SimtreeError(f"unobserved_share {unobserved_share} must be in [0, 1]")
    trials, hits = np.zeros((depth, topk)), np.zeros((depth, topk))
    for rec in records:
        tree, rank = rec.tree, sibling_rank(rec.tree)
        on_path = np.zeros(tree.num_nodes, bool)
        on_path[tree.path_to(rec.accepted_node)] = True
        child = np.flatnonzero((np.arange(tree.num_nodes) > 0) & on_path[np.maximum(tree.parents, 0)])
        child = child[(rank[child] < topk) & (tree.depth[child] <= depth)]
        np.add.at(trials, (tree.depth[child] - 1, rank[child]), 1.0)
        np.add.at(hits, (tree.depth[child] - 1, rank[child]), on_path[child].astype(float))
    if trials[0, 0] == 0:
        raise SimtreeError("traces hold no draft node under an accepted node: nothing to fit")
    seen = trials.sum(0) > 0  # a suffix of ranks is unseen: rank r exists only if r-1 does
    prior = np.where(seen, hits.sum(0) / np.maximum(trials.sum(0), 1e-12), 0.0)
    table = np.zeros((depth, topk))
    for d in range(depth):
        table[d] = np.where(seen, (hits[d] + prior_strength * prior) / (trials[d] + prior_strength), 0.0)
        prior = table[d]
    # Observed rates are conditional on the sibling existing, so rows can exceed 1 by sampling
    # noise when parents had different numbers of children: rescale observed ranks only then.
    # No depth is certain either: a row above ALPHA_MAX (e.g. traces where every draft was
    # accepted) is scaled down to it (a finite sample never shows that the next draft cannot
    # be rejected).
    capped = np.flatnonzero(table.sum(1) > ALPHA_MAX)
    table /= np.maximum(table.sum(1, keepdims=True) / ALPHA_MAX, 1.0)
    for r in np.flatnonzero(~seen):
        free = np.maximum(1.0 - table[:, :r].sum(1), 0.0)
        table[:, r] = np.minimum(unobserved_share * free, table[:, r - 1]) if r else 0.0
    observed = int(np.flatnonzero(trials[:, 0] > 0).max()) + 1
    meta = {"records": len(records), "observed_depth": observed,
            "imputed_ranks": [int(r) for r in np.flatnonzero(~seen)],
            "capped_depths": [int(d) + 1 for d in capped],
            "mean_accepted_tokens": 1.0 + float(np.mean([r.num_accepted for r in records]))}
    return AcceptanceModel(name or records[0].workload, table, np.ones(1), "fit_positional(traces)", meta)


def fit_marginals(records: Iterable[TraceRecord], name: str | None = None, max_levels: int = 32) -> AcceptanceModel:
    """Levels from the ``marginal_probs`` of trace records (an even subsample of <= max_levels)."""
    records = [r for r in records if r.marginal_probs is not None]
    if not records:
        raise SimtreeError("traces carry no marginal_probs: use the positional fit instead")
    shapes = {r.marginal_probs.shape for r in records}
    if len(shapes) != 1:
        raise SimtreeError(f"trace marginal_probs have different shapes {sorted(shapes)[:4]}")
    pick = np.linspace(0, len(records) - 1, min(max_levels, len(records))).round().astype(int)
    return from_marginals(np.stack([records[i].marginal_probs for i in pick]), name or records[0].workload,
                          source="fit_marginals(traces)")

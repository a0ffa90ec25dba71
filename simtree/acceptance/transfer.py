"""Acceptance on a workload from the drafter's confidences there, with no acceptance outcome.

    calibration = fit_calibration(read_traces("chat_linear.jsonl"))   # outcomes of one workload
    drafts = read_drafts("code_drafts.jsonl")                           # the drafter alone, on another
    model = transfer_model(calibration, drafts)                         # what plan / simulate read

A fit on one workload's acceptance cannot know that another workload's text is easier (code
that repeats itself) or harder.  What an engine holds before it verifies can: the drafter's
own probabilities, and whether its candidates continue an earlier stretch of the context
(:func:`context_match`).  So the outcome-bearing part is the *calibration* - P(the target takes
a candidate | its draft probability q, depth, rank, what the lookup proposes: this candidate,
another of the drafter's, none), :class:`~simtree.acceptance.fit.ChainCalibration`, fitted on
linear traces of any workload -
and the workload's own part is the *distribution of those quantities*, measured on its prompts
by a drafting pass that records what the drafter computed and nothing else.

Drafts file (JSONL, schema ``simtree.drafts/1``), one record per position of the generated
text (the target's greedy output, which a speculative run reproduces token for token):

    schema       "simtree.drafts/1"
    workload     str
    seq          int   the sequence (prompt) of the batch
    position     int   the generated position the chain is drafted from (0 = after the first token)
    topk_probs   [[float]] [P][K]: the drafter's top-K probabilities (rows sorted desc) at each
                 position 1..P of its greedy chain drafted from there
    context_len  int   optional: the context at that position
    drafter      str   optional: the drafter family
    context_match [int] optional [P]: the rank among the chain's top-K of the token a lookup of
                 the context proposes at each position (K: none; :func:`context_match`)

It never holds the target's tokens nor which candidate was accepted; a record with such a
field (``target_tokens``, ``accepted_node``, ``num_accepted``) is refused.

The model (:func:`transfer_model`): every position's chain is a candidate round start; the
calibration turns its top-K probabilities into acceptance rows a[d, r] (rank r at depth d,
given its parent); a round begins at a position with the probability of the chain's renewal
process (:func:`round_starts`); the text is cut into windows of ``window`` positions per sequence, grouped
into ``states`` by the predicted tokens per round of their chains (a stretch of copied code, a
hard chat turn; :func:`~simtree.acceptance.fit.ease_groups`), each state's share of the text
its positions; within a state the positions are split into ``levels`` equal groups by their
chain's gain under the drafter's own probabilities (what a round's decision reads), and a group's acceptance row at depth d is its positions' rows
weighted by the predicted chance of reaching depth d (so a chain's expected accepted length
in the group is exactly its positions' mean; the ranks are then made disjoint events).  Trees
are built from the group's mean draft probabilities, as the drafter builds them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from simtree.acceptance.fit import ChainCalibration, ease_groups, lookup_states
from simtree.acceptance.mixture import DEFAULT_TOPK, AcceptanceModel
from simtree.errors import SimtreeError, check_whole
from simtree.fileio import read_jsonl
from simtree.probs import check_prob_rows

__all__ = ["DRAFTS_SCHEMA", "DrafterConfidences", "parse_drafts", "read_drafts", "is_drafts_file",
           "transfer_model", "round_starts", "context_match", "uses_lookup", "split_spec", "transfer_from_spec", "transfer_bootstrap",
           "OUTCOME_FIELDS"]

DRAFTS_SCHEMA = "simtree.drafts/1"
OUTCOME_FIELDS = ("target_tokens", "accepted_node", "accepted_path", "num_accepted", "marginal_ranks")


@dataclass(frozen=True, eq=False)
class DrafterConfidences:
    """The drafter's confidences on one workload, one row per generated position:
    seq int64 [N], position int64 [N], probs float64 [N, P, K] (its chain's top-K per depth),
    context_len int64 [N] (0 where unknown), context_match int64 [N, P] or None (the rank of the
    context lookup's token among the chain's top-K per depth, K: none; :func:`context_match`),
    text float64 [N] or None (the context's text state at each position, read before any
    verification: :func:`simtree.acceptance.text_state.context_nonword_share`)."""

    workload: str
    seq: np.ndarray
    position: np.ndarray
    probs: np.ndarray
    context_len: np.ndarray
    context_match: np.ndarray | None = None
    text: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(self.seq.shape[0])


def parse_drafts(objs: Iterable[dict], where: str = "drafts", workload: str | None = None) -> DrafterConfidences:
    """Drafts records (dicts, the module docstring's format) checked; ``workload`` keeps one."""
    seq, pos, probs, ctx, names, match = [], [], [], [], set(), []
    for i, obj in enumerate(objs, 1):
        at = f"{where}:{i}"
        if not isinstance(obj, dict) or obj.get("schema") != DRAFTS_SCHEMA:
            raise SimtreeError(f"{at}: not a {DRAFTS_SCHEMA} record")
        leaked = [k for k in OUTCOME_FIELDS if k in obj]
        if leaked:
            raise SimtreeError(f"{at}: a drafts record holds no acceptance outcome, found {', '.join(leaked)}")
        for key in ("workload", "seq", "position", "topk_probs"):
            if key not in obj:
                raise SimtreeError(f"{at}: drafts record lacks the field {key!r}")
        if not isinstance(obj["workload"], str) or not obj["workload"]:
            raise SimtreeError(f"{at}: workload {obj['workload']!r} must be a non-empty string")
        if workload is not None and obj["workload"] != workload:
            continue
        names.add(obj["workload"])
        try:
            p = np.asarray(obj["topk_probs"], np.float64)
        except (TypeError, ValueError, OverflowError):
            raise SimtreeError(f"{at}: topk_probs is not a [P][K] table of numbers") from None
        if p.ndim != 2 or p.size == 0:
            raise SimtreeError(f"{at}: topk_probs must be a non-empty [P][K] table, got shape {p.shape}")
        check_prob_rows(p, f"{at}: topk_probs", axis=1)
        if np.any(np.diff(p, axis=1) > 1e-9):
            raise SimtreeError(f"{at}: topk_probs rows must be sorted in descending order (rank 0 first)")
        if probs and p.shape != probs[0].shape:
            raise SimtreeError(f"{at}: topk_probs {p.shape} differs in shape from the first record's {probs[0].shape}")
        seq.append(check_whole(obj["seq"], f"{at}: seq", 0))
        pos.append(check_whole(obj["position"], f"{at}: position", 0))
        c = obj.get("context_len")
        ctx.append(0 if c is None else check_whole(c, f"{at}: context_len", 1))
        probs.append(p)
        cm = obj.get("context_match")
        if cm is not None:
            if not isinstance(cm, list) or len(cm) != p.shape[0] or any(
                    isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= p.shape[1] for v in cm):
                raise SimtreeError(f"{at}: context_match must hold one rank in 0..{p.shape[1]} per chain position")
            match.append(cm)
    if not probs:
        raise SimtreeError(f"{where}: no drafts records" + (f" for workload {workload!r}" if workload else ""))
    if len(names) > 1:
        raise SimtreeError(f"{where} holds workloads {', '.join(sorted(names))}: pick one")
    if len(set(zip(seq, pos))) != len(seq):
        raise SimtreeError(f"{where}: a (seq, position) appears twice: one record per generated position")
    if match and len(match) != len(probs):
        raise SimtreeError(f"{where}: context_match on some records only")
    return DrafterConfidences(names.pop(), np.array(seq, np.int64), np.array(pos, np.int64), np.stack(probs),
                              np.array(ctx, np.int64), np.array(match, np.int64) if match else None)


def is_drafts_file(path) -> bool:
    """True when the first record of the JSONL file ``path`` is a drafts record."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    return json.loads(line).get("schema") == DRAFTS_SCHEMA
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, RecursionError):
        return False
    return False


def read_drafts(path, workload: str | None = None) -> DrafterConfidences:
    """A drafts JSONL file (module docstring), checked."""
    path = Path(path)
    return parse_drafts([obj for _, obj in read_jsonl(path, "drafts file")], str(path), workload)


def context_match(context, chain_topk: np.ndarray, ngrams: tuple[int, ...] = (3,)) -> np.ndarray:
    """int64 [P]: at each position d of a drafted chain, the rank among its candidates
    ``chain_topk [P, K]`` (token ids) of the token a lookup of the context proposes (K: none).
    The context at d is ``context`` (the text before the round: prompt and generated tokens)
    then the chain's own top-1 tokens before d - what the engine holds before verifying; the
    lookup finds the latest earlier occurrence of the context's last n tokens (the first n of
    ``ngrams`` that occurs) and proposes the token that followed it (prompt-lookup decoding).
    A target that repeats itself - code, quoted text - is accepted where this agrees."""
    toks = np.asarray(chain_topk, np.int64)
    ctx = np.concatenate([np.asarray(context, np.int64).reshape(-1), toks[:-1, 0]])
    base = len(ctx) - toks.shape[0] + 1
    out = np.full(toks.shape[0], toks.shape[1], np.int64)
    for d in range(toks.shape[0]):
        seen = ctx[:base + d]
        for n in ngrams:
            if seen.size <= n:
                continue
            win = np.lib.stride_tricks.sliding_window_view(seen[:-1], n)   # windows followed by a token
            hit = np.flatnonzero((win == seen[-n:]).all(1))
            if hit.size:
                r = np.flatnonzero(toks[d] == seen[hit[-1] + n])
                out[d] = r[0] if r.size else toks.shape[1]
                break
    return out


def _acceptance_rows(calibration: ChainCalibration, drafts: DrafterConfidences, topk: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(calibrated acceptance [N, P, topk], draft probs [N, P, topk]) of the drafts' chains."""
    q = drafts.probs[:, :, :topk]
    if q.shape[2] < topk:
        q = np.concatenate([q, np.zeros((*q.shape[:2], topk - q.shape[2]))], 2)
    n, p, k = q.shape
    depth = np.tile(np.arange(1, p + 1), n)
    match = None
    if calibration.matched:
        if drafts.context_match is None:
            raise SimtreeError(f"the calibration depends on the context lookup; the drafts of {drafts.workload} "
                               "carry no context_match")
        match = lookup_states(drafts.context_match[:, :, None], np.arange(k), drafts.probs.shape[2]).reshape(n * p, k)
    text = None
    if calibration.text_terms is not None:
        if drafts.text is None:
            raise SimtreeError(f"the calibration reads the context's text state; the drafts of {drafts.workload} "
                               "carry none")
        text = np.repeat(drafts.text, p)
    a = calibration(depth, q.reshape(n * p, k), match, text).reshape(n, p, k)
    return np.where(q > 0, a, 0.0), q      # a candidate the drafter never proposed is never accepted


def _disjoint(rows: np.ndarray) -> np.ndarray:
    """Rows [..., K] made disjoint events: each rank takes at most what the ranks above it leave
    (the top-1, whose calibration rests on the most trials and alone decides a chain, keeps its
    own).  Applied to a level's averaged rows, not to each position's: a calibrated value is a
    mean over positions like it, and capping each position's would bias the lower ranks low."""
    above = np.concatenate([np.zeros((*rows.shape[:-1], 1)), np.cumsum(rows, -1)[..., :-1]], -1)
    return np.minimum(rows, np.maximum(1.0 - np.minimum(above, 1.0), 0.0))


def round_starts(drafts: DrafterConfidences, survive: np.ndarray) -> np.ndarray:
    """[N]: the probability that a round of the drafted chain (its full depth P) begins at each
    position, each sequence's first position beginning one: from position t a round accepts k
    drafts with P(k) = S_k (1 - a_{k+1}) (S_P for all P; ``survive`` [N, P] = S_1..S_P, the
    calibrated chance the chain holds to depth d) and the next begins at t + k + 1.  Rounds begin
    right after a rejected draft, where the text differs from a random position (a rejected
    token often starts a word or a phrase whose rest is easy): the levels weigh positions so."""
    n, p = survive.shape
    s0 = np.concatenate([np.ones((n, 1)), survive], 1)                       # S_0..S_P
    pmf = s0 - np.concatenate([survive, np.zeros((n, 1))], 1)                # S_k - S_{k+1}
    seqs, seq = np.unique(drafts.seq, return_inverse=True)
    seq = seq.reshape(-1)
    first = np.full(seqs.size, np.iinfo(np.int64).max)
    np.minimum.at(first, seq, drafts.position)
    pos = drafts.position - first[seq]
    span = int(pos.max()) + 1
    at = np.full((seqs.size, span), -1)
    at[seq, pos] = np.arange(n)
    visit = np.zeros((seqs.size, span + p + 1))
    visit[:, 0] = 1.0
    for t in range(span):
        rows = at[:, t]
        has = rows >= 0
        if has.any():
            visit[has, t + 1:t + p + 2] += visit[has, t, None] * pmf[rows[has]]
    return visit[seq, pos]


def transfer_model(calibration: ChainCalibration, drafts: DrafterConfidences, name: str | None = None, *,
                   topk: int = DEFAULT_TOPK, states: int = 4, levels: int = 8, window: int = 16,
                   min_state_units: int = 4, off_chain_scale: np.ndarray | None = None) -> AcceptanceModel:
    """The acceptance model of ``drafts``' workload: ``calibration`` (fitted elsewhere) applied to
    the drafter's confidences there (module docstring).  Reads no acceptance outcome of the
    workload: ``drafts`` holds none.  ``off_chain_scale`` [K]: the share of its row a marginal
    tree's node below an off-chain node keeps (None: never accepted;
    :func:`simtree.acceptance.off_chain.fit_off_chain_scale`, from the calibrating linear runs)."""
    if window < 1 or states < 1 or levels < 1:
        raise SimtreeError(f"window {window}, states {states} and levels {levels} must be >= 1")
    a, q = _acceptance_rows(calibration, drafts, topk)
    survive = np.cumprod(np.minimum(a[:, :, 0], 1.0), 1)
    reach = np.concatenate([np.ones((a.shape[0], 1)), survive[:, :-1]], 1)    # P(depth d's parent accepted)
    gain = 1.0 + survive.sum(1)                                                # chain tokens per round
    # levels split a state by the drafter's own chain confidence - what a round's decision reads
    # (the adaptive modes give nodes where the drafter is sure) - not by the calibrated gain: with
    # the lookup in the calibration, levels by gain would pair the decision's nodes with acceptance
    # the drafter never saw (docs/acceptance.md, section 5)
    drafter_gain = 1.0 + np.cumprod(q[:, :, 0], 1).sum(1)
    start = round_starts(drafts, survive)
    _, unit = np.unique(np.stack([drafts.seq, drafts.position // window], 1), axis=0, return_inverse=True)
    unit = unit.reshape(-1)
    rows = np.bincount(unit).astype(np.float64)
    ease = np.log(np.bincount(unit, gain) / rows)
    groups = ease_groups(ease, rows, max(1, min(states, rows.size // min_state_units)))
    tables, draft, weights, state, share, meta_states = [], [], [], [], [], []
    for s, g in enumerate(groups):
        at = np.flatnonzero(np.isin(unit, g))
        order = at[np.argsort(drafter_gain[at], kind="stable")]
        share_of = at.size / drafts.size
        parts = [p for p in np.array_split(order, min(levels, order.size)) if p.size]
        for part in parts:
            w = (start[part, None] * reach[part])[:, :, None]
            tables.append(_disjoint((w * a[part]).sum(0) / np.maximum(w.sum(0), 1e-300)))
            draft.append(np.tensordot(start[part], q[part], 1) / max(start[part].sum(), 1e-300))
            weights.append(share_of * start[part].sum() / max(start[at].sum(), 1e-300))
            state.append(s)
        share.append(at.size / drafts.size)
        meta_states.append({"windows": int(g.size), "position_share": round(at.size / drafts.size, 4),
                            "chain_tokens_per_round": round(float(gain[at].mean()), 4)})
    meta = {"positions": drafts.size, "sequences": int(np.unique(drafts.seq).size), "window": window,
            "chain_depth": int(a.shape[1]), "states": meta_states,
            "predicted_chain_tokens_per_round": round(float(gain.mean()), 4)}
    return AcceptanceModel(name or drafts.workload, np.array(tables), np.array(weights),
                           f"transfer_model(calibrated drafter confidences on {drafts.workload})", meta,
                           np.array(draft), np.array(state), np.array(share), chain_marginals=True,
                           off_chain_scale=off_chain_scale)


def uses_lookup(records, drafts: DrafterConfidences) -> bool:
    """Whether the calibration of ``drafts`` from ``records`` reads the context lookup: wherever
    both carry its ranks (``context_match``), within a workload as across workloads.  It carries
    what the drafter's probability does not - a target that repeats its context, more on some
    prompts than on others (docs/acceptance.md, sections 2.3 and 5)."""
    return drafts.context_match is not None and all(r.context_match is not None for r in records)


def split_spec(spec: str) -> tuple[str, str] | None:
    """(drafts file, calibration traces) of a workload spec ``DRAFTS.jsonl@TRACES.jsonl`` (each
    may end in ``#workload``), or None when ``spec`` is not of that form."""
    drafts, at, calibration = str(spec).rpartition("@")
    if not at or not drafts or not calibration or not is_drafts_file(drafts.partition("#")[0]):
        return None
    return drafts, calibration


def _calibration_records(calibration: str):
    from simtree.acceptance.traces import read_traces
    path, _, only = calibration.partition("#")
    records = read_traces(path, only or None)
    names = sorted({r.workload for r in records})
    if len(names) > 1:
        raise SimtreeError(f"{path} holds workloads {', '.join(names)}: pick one as {path}#<workload>")
    return records


def transfer_from_spec(spec: str) -> tuple[AcceptanceModel, DrafterConfidences]:
    """The model of a ``DRAFTS.jsonl@TRACES.jsonl`` workload spec: the drafter's confidences of
    the drafts file under the calibration fitted on the traces (linear runs with top-K)."""
    from simtree.acceptance.fit import fit_calibration
    parts = split_spec(spec)
    if parts is None:
        raise SimtreeError(f"{spec!r} is not DRAFTS.jsonl@TRACES.jsonl (a drafts file, then the traces that "
                           "calibrate the drafter)")
    drafts_path, calibration = parts
    path, _, only = drafts_path.partition("#")
    drafts = read_drafts(path, only or None)
    records = _calibration_records(calibration)
    from simtree.acceptance.off_chain import fit_off_chain_scale
    cal = fit_calibration(records, context=uses_lookup(records, drafts))
    model = transfer_model(cal, drafts, off_chain_scale=fit_off_chain_scale(cal, records).scale)
    model.meta["calibrated_on"] = {"traces": calibration, "workload": records[0].workload, "records": len(records)}
    return model, drafts


def transfer_bootstrap(spec: str, n: int, rng: np.random.Generator) -> list[AcceptanceModel]:
    """``n`` models of a ``DRAFTS.jsonl@TRACES.jsonl`` spec, each from a resample of the
    calibration traces' sequences and of the drafts' sequences (whole sequences)."""
    from simtree.acceptance.fit import fit_calibration
    from simtree.acceptance.off_chain import fit_off_chain_scale
    from simtree.acceptance.traces import sequence_ids
    drafts_path, calibration = split_spec(spec) or (None, None)
    if drafts_path is None:
        raise SimtreeError(f"{spec!r} is not DRAFTS.jsonl@TRACES.jsonl")
    path, _, only = drafts_path.partition("#")
    drafts = read_drafts(path, only or None)
    records = _calibration_records(calibration)
    ids = sequence_ids(records)
    rec_groups = [np.flatnonzero(ids == s) for s in np.unique(ids)]
    seqs = np.unique(drafts.seq)
    out = []
    for k in range(n):
        pick = rng.integers(0, len(rec_groups), len(rec_groups))
        sample_records = [records[i] for g in pick for i in rec_groups[g]]
        cal = fit_calibration(sample_records, context=uses_lookup(records, drafts))
        chosen = rng.choice(seqs, seqs.size)
        rows = np.concatenate([np.flatnonzero(drafts.seq == s) for s in chosen])
        new_seq = np.repeat(np.arange(chosen.size), [int((drafts.seq == s).sum()) for s in chosen])
        sample = DrafterConfidences(drafts.workload, new_seq, drafts.position[rows], drafts.probs[rows],
                                    drafts.context_len[rows],
                                    None if drafts.context_match is None else drafts.context_match[rows],
                                    None if drafts.text is None else drafts.text[rows])
        # the share from every calibrating round (a resample repeats sequences, whose rounds repeat)
        acc = transfer_model(cal, sample, off_chain_scale=fit_off_chain_scale(cal, records).scale)
        out.append(AcceptanceModel(f"{drafts.workload}#b{k}", acc.tables, acc.weights, acc.source + " (bootstrap)",
                                   {**acc.meta, "bootstrap": k}, acc.draft_probs, acc.state, acc.state_share,
                                   acc.chain_marginals, acc.off_chain_scale))
    return out
